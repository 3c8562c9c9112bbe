"""The `kvpack` command: inspect a store, run benchmarks, the demo, the soak suite.

    kvpack inspect DIR [--json]
    kvpack bench {tiers,copy,vllm,mooncake,sglang,spec,serve} [ARGS...]
    kvpack demo [ARGS...]
    kvpack soak [ARGS...]
    kvpack proxy --prefill URL --decode URL [--port P]   # prefill/decode pair over one store
    kvpack config [FILE]        # print the effective config (defaults filled in)

Subcommands import their module only when run, so `kvpack inspect` works
without any engine installed. bench, demo and soak are operator tools in
`kvpack.tools` (folder tools/), reached here by module name only: the core
never imports them. `kvpack bench --help` lists the benchmarks and
`kvpack bench NAME --help` (or `kvpack demo --help`, ...) shows the tool's own
arguments; every `--help` exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

BENCHES = {
    "tiers": "kvpack.tools.bench.tiers_bench",
    "copy": "kvpack.tools.bench.copy_bench",
    "vllm": "kvpack.tools.bench.vllm_bench",
    "mooncake": "kvpack.tools.bench.mooncake_bench",
    "sglang": "kvpack.tools.bench.sglang_bench",
    "spec": "kvpack.tools.bench.spec_bench",
    "serve": "kvpack.tools.bench.serve_bench",
    "pd": "kvpack.tools.bench.pd_bench",
    "scale": "kvpack.tools.bench.scale_bench",
    "chat": "kvpack.tools.bench.chat_bench",
}
RUNNERS = {"demo": "kvpack.tools.demo", "soak": "kvpack.tools.soak", "proxy": "kvpack.tools.proxy"}


def _run_module(module: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        print(f"kvpack: {module} is not available here ({exc}); is its engine installed?", file=sys.stderr)
        return 2
    return int(mod.main(argv) or 0)


def _inspect(args: argparse.Namespace) -> int:
    from .inspect_store import format_summary, summarize

    root = Path(args.dir).expanduser()
    if not root.is_dir():
        print(f"kvpack inspect: {root} is not a directory", file=sys.stderr)
        return 2
    summary = summarize(root)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
    return 0


def _config(args: argparse.Namespace) -> int:
    from .config import KVPackConfig
    from .errors import ConfigError

    try:
        cfg = KVPackConfig.from_file(args.file) if args.file else KVPackConfig()
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvpack", description="kvpack: KV-cache reuse for vLLM and SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="summarize a disk store per tenant and group")
    p_inspect.add_argument("dir")
    p_inspect.add_argument("--json", action="store_true")
    p_bench = sub.add_parser(
        "bench",
        help="run a benchmark",
        usage="kvpack bench [-h] NAME [ARGS...]",
        epilog="`kvpack bench NAME --help` shows the benchmark's own arguments.",
    )
    p_bench.add_argument("name", metavar="NAME", choices=sorted(BENCHES), help="the benchmark, one of: %(choices)s")
    p_config = sub.add_parser("config", help="print the effective config")
    p_config.add_argument("file", nargs="?")
    for name in RUNNERS:
        # no arguments of its own here: everything after the name, --help too, goes to the tool
        sub.add_parser(name, help=f"run the {name} (`kvpack {name} --help` for its arguments)", add_help=False)
    if argv and argv[0] in RUNNERS:
        return _run_module(RUNNERS[argv[0]], argv[1:])
    if argv and argv[0] == "bench" and len(argv) >= 2 and argv[1] in BENCHES:
        return _run_module(BENCHES[argv[1]], argv[2:])
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "config":
        return _config(args)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
