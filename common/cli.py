"""The `kvpack` command: inspect a store, print the config, and the operator tools.

    kvpack inspect DIR [--json]
    kvpack config [FILE]        # check FILE as engine start-up does; print the effective config
    kvpack host [drop NAME... | drop --unused]  # this user's host memory stores; give one's memory back
    kvpack usage [--config FILE] [--disk DIR] [--mooncake-http H:P] [--json]  # per tier, tenant and model
    kvpack clear --tenant T [--model M] [--tier T...] [--dry-run] [--config FILE] [--disk DIR] [--json]
    kvpack pin [--list | --unpin] [--tenant T] [--disk DIR] [--json]  # pinned prefixes (`kvpack.operate.pin_command`)
    kvpack bench NAME [ARGS...] # the benchmarks (`kvpack bench --help` lists them)
    kvpack demo | soak [ARGS...]
    kvpack proxy --prefill URL --decode URL [--port P]   # prefill/decode pair over one store

``inspect``, ``config``, ``host``, ``usage``, ``clear`` (`kvpack.operate.operating`) and ``pin`` are the core's own.
Every other subcommand is a tool (`kvpack.tools`, folder tools/) that registers itself in the ``kvpack.commands``
entry-point group (pyproject.toml): the core names no tool and never imports one;
a tool's module is imported only when it runs, so `kvpack inspect` works without
any engine installed. Everything after a tool's name, ``--help`` too, goes to the
tool; every ``--help`` exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import replace
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from .config.schema import HOST_NAME_RE, KVPackConfig
from .errors import ConfigError
from .identity.keys import validate_tenant
from .operate import pin_command
from .operate.inspect_store import format_summary, summarize
from .operate.operating import clear, format_usage, resolve_model, size, usage
from .policy.clearing import ClearScope
from .tiers.checks import check_tiers
from .tiers.host.stores import drop, host_stores, not_stores

if TYPE_CHECKING:
    from .config.schema import KVPackConfig

COMMAND_GROUP = "kvpack.commands"
"""Entry-point group of the tools' subcommands: ``name = "module:function"``, called with the argv after the name."""


def tool_commands() -> dict[str, EntryPoint]:
    """The installed tools' subcommands, by name."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _inspect(args: argparse.Namespace) -> int:

    root = Path(args.dir).expanduser()
    if not root.is_dir():
        print(f"kvpack inspect: {root} is not a directory", file=sys.stderr)
        return 2
    summary = summarize(root)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
    return 0


def _config(args: argparse.Namespace) -> int:
    """Print the effective config, or the one line of its ConfigError (exit 2).

    Runs every check engine start-up runs (`KVPackConfig.from_file`, then the tiers'
    `check_tiers`), creating nothing."""

    try:
        cfg = KVPackConfig.from_file(args.file) if args.file else KVPackConfig.from_dict({})
        check_tiers(cfg)
    except ConfigError as exc:
        print(str(exc) if not args.file or exc.source else str(exc.in_file(args.file)), file=sys.stderr)
        return 2
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _host(args: argparse.Namespace) -> int:
    """List this user's host stores, or drop some (`kvpack.tiers.host.stores`); exit 2 with one
    line per store that could not be dropped (a live user, a bad name)."""

    stores = host_stores()
    if args.action is None:
        for s in stores:
            print(f"{s.name}\t{s.held_bytes >> 20} MiB\t{s.users} live user(s)\t{s.path}")
        for line in not_stores():
            print(f"kvpack host: {line}", file=sys.stderr)
        return 0
    names = [s.name for s in stores if s.users == 0] if args.unused else args.names
    if not names and not args.unused:
        print("kvpack host drop: name a store (kvpack host lists them) or pass --unused", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        problem = None if re.fullmatch(HOST_NAME_RE, name) else f"{name[:80]!r} is not a host store name"
        problem = problem or drop(name)
        if problem is not None:
            print(f"kvpack host drop: {problem}", file=sys.stderr)
            failed += 1
        else:
            print(f"dropped {name}")
    return 2 if failed else 0


def _operator_config(args: argparse.Namespace, prog: str) -> KVPackConfig | None:
    """The config `usage` / `clear` act on (``--config``, ``--disk`` over it); None after one line."""

    try:
        cfg = KVPackConfig.from_file(args.config) if args.config else KVPackConfig.from_dict({})
    except ConfigError as exc:
        print(f"kvpack {prog}: {exc}", file=sys.stderr)
        return None
    if args.disk:
        cfg = replace(cfg, disk=replace(cfg.disk, enabled=True, path=str(Path(args.disk).expanduser())))
    return cfg


def _usage(args: argparse.Namespace) -> int:

    cfg = _operator_config(args, "usage")
    if cfg is None:
        return 2
    stores, hidden = usage(cfg, args.mooncake_http or "")
    if args.json:
        print(json.dumps({"stores": [s.to_dict() for s in stores], "not_visible": hidden}, indent=2))
    else:
        print(format_usage(stores, hidden))
    return 0


def _clear(args: argparse.Namespace) -> int:
    """Remove a tenant's objects (of one model) from every tier the config names (`kvpack.operate.operating`);
    exit 1 when a tier failed, 2 on bad input (one line)."""

    cfg = _operator_config(args, "clear")
    if cfg is None:
        return 2
    try:
        validate_tenant(args.tenant)
        fps = resolve_model(usage(cfg)[0], args.model) if args.model is not None else None
    except ValueError as exc:
        print(f"kvpack clear: {exc}", file=sys.stderr)
        return 2
    scope = ClearScope(tenants=frozenset({args.tenant}), fingerprints=fps, tiers=frozenset(args.tier or TIERS))
    quiet, level = logging.getLogger("kvpack"), logging.getLogger("kvpack").level
    quiet.setLevel(logging.ERROR)  # the tiers' start-up notes are not this command's
    try:
        results = clear(cfg, scope, args.dry_run, hosts=args.host)
    finally:
        quiet.setLevel(level)
    if args.json:
        rows = [
            {"tier": r.tier, "store": r.store, "objects": r.cleared.objects if r.cleared else None,
             "bytes": r.cleared.nbytes if r.cleared else None, "failed": r.failed or None}
            for r in results
        ]  # fmt: skip
        print(json.dumps({"dry_run": args.dry_run, "scope": scope.describe(), "stores": rows}, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for r in results:
            what = (
                f"FAILED: {r.failed}"
                if r.failed or r.cleared is None
                else (f"{verb} {r.cleared.objects} objects ({size(r.cleared.nbytes)})")
            )
            print(f"{r.tier:<8} {r.store}: {what}")
        if not results:
            print("no store in scope (kvpack usage lists the stores)")
    return 1 if any(r.failed for r in results) else 0


TIERS = ("host", "disk", "mooncake")
"""The tiers `kvpack clear` reaches (a per-process memory tier is inside its engine's process)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tools = tool_commands()
    if argv and argv[0] in tools and argv[0] not in ("inspect", "config", "host", "usage", "clear", "pin"):
        return int(tools[argv[0]].load()(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="kvpack", description="kvpack: KV-cache reuse for vLLM and SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="summarize a disk store per tenant and group")
    p_inspect.add_argument("dir")
    p_inspect.add_argument("--json", action="store_true")
    p_config = sub.add_parser("config", help="check a config file as start-up does and print the effective config")
    p_config.add_argument("file", nargs="?")
    p_host = sub.add_parser("host", help="list this user's host memory stores (memory.mode host), or drop some")
    p_host.add_argument("action", nargs="?", choices=["drop"])
    p_host.add_argument("names", nargs="*", help="stores to drop (the names `kvpack host` lists)")
    p_host.add_argument("--unused", action="store_true", help="drop every store no live process uses")
    p_usage = sub.add_parser("usage", help="objects and bytes per tier, tenant and model (reads the indexes only)")
    p_clear = sub.add_parser("clear", help="remove a tenant's objects (of one model) from every tier")
    p_clear.add_argument("--tenant", required=True)
    p_clear.add_argument("--model", help="a part of a model's name as kvpack usage shows it, or its fingerprint")
    p_clear.add_argument("--tier", action="append", choices=TIERS, help="only this tier (repeat for several)")
    p_clear.add_argument("--dry-run", action="store_true", help="count what would go, remove nothing")
    p_clear.add_argument(
        "--host", action="append", metavar="NAME", help="only this host store (repeat; default: every one of yours)"
    )
    p_usage.add_argument("--mooncake-http", help="a Mooncake master's HTTP address (its --metrics_port): list its keys")
    for p in (p_usage, p_clear):
        p.add_argument("--config", help="the engines' kvpack config file (default: the default config)")
        p.add_argument("--disk", help="the disk store folder (default: the config's disk.path)")
        p.add_argument("--json", action="store_true")

    pin_command.add_arguments(sub.add_parser("pin", help="list the pinned prefixes per tenant, or unpin a tenant's"))
    for name in sorted(tools):
        # no arguments of its own here: everything after the name, --help too, goes to the tool
        sub.add_parser(name, help=f"the {name} tool (`kvpack {name} --help` for its arguments)", add_help=False)
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "config":
        return _config(args)
    if args.command == "host":
        return _host(args)
    if args.command == "usage":
        return _usage(args)
    if args.command == "clear":
        return _clear(args)
    if args.command == "pin":
        return pin_command.run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
