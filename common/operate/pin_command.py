"""``kvpack pin``: list the pinned prefixes of a store folder per tenant, or unpin a tenant's.

    kvpack pin [--list] [--tenant T] [--json] [--disk DIR | --config FILE]
    kvpack pin --unpin --tenant T [--disk DIR | --config FILE]

Pins are made by requests (``kv_transfer_params["kvpack_pin"]`` from a trusted front end:
`kvpack.store.pins`); this command reads the folder's pin list (``.kvpack-store.pins``) and nothing
else, and never creates one. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..config.schema import KVPackConfig
from ..errors import ConfigError
from ..identity.keys import validate_tenant
from ..store.pins import PINS_NAME, Pin, PinBook

PROG = "kvpack pin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="list the pins (the default)")
    parser.add_argument("--unpin", action="store_true", help="remove every pin of --tenant")
    parser.add_argument("--tenant", help="only this tenant's pins")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--disk", help="the disk store folder (default: the config's disk.path)")
    parser.add_argument("--config", help="the engines' kvpack config file (default: the default config)")


def _folder(args: argparse.Namespace) -> str | None:
    """The store folder the command acts on; None after one line on stderr."""

    if args.disk:
        return os.path.expanduser(args.disk)
    try:
        cfg = KVPackConfig.from_file(args.config) if args.config else KVPackConfig.from_dict({})
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return None
    return cfg.disk.path


def run(args: argparse.Namespace) -> int:

    if args.unpin and not args.tenant:
        print(f"{PROG}: --unpin needs --tenant T (the tenant whose pins go)", file=sys.stderr)
        return 2
    if args.tenant is not None:
        try:
            validate_tenant(args.tenant)
        except ValueError as exc:
            print(f"{PROG}: --tenant: {exc}", file=sys.stderr)
            return 2
    folder = _folder(args)
    if folder is None:
        return 2
    if not os.path.isdir(folder):
        print(f"{PROG}: {folder} is not a directory (a kvpack disk store folder)", file=sys.stderr)
        return 2
    if not os.path.lexists(os.path.join(folder, PINS_NAME)):
        pins: list[Pin] = []
        if args.unpin:
            print(f"unpinned 0 groups of tenant {args.tenant} (no pin list in {folder})")
            return 0
    else:
        try:
            book = PinBook(folder, 0)
        except ConfigError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        try:
            if args.unpin:
                print(f"unpinned {book.unpin(args.tenant)} groups of tenant {args.tenant}")
                return 0
            pins = book.pins(args.tenant)
        finally:
            book.close()
    print(json.dumps(summary(pins), indent=2) if args.json else format_pins(pins))
    return 0


def summary(pins: list[Pin]) -> dict[str, object]:
    """Pins per tenant (groups, bytes) and each pin, as JSON-ready data."""
    tenants: dict[str, dict[str, int]] = {}
    for p in pins:
        row = tenants.setdefault(p.group.tenant, {"groups": 0, "bytes": 0})
        row["groups"] += 1
        row["bytes"] += p.nbytes
    rows = [
        {"tenant": p.group.tenant, "fingerprint": p.group.fingerprint, "chunk": p.group.chunk, "bytes": p.nbytes}
        for p in pins
    ]
    return {"tenants": tenants, "pins": rows}


def format_pins(pins: list[Pin]) -> str:
    """A table of pinned bytes per tenant, then one line per pinned group."""
    if not pins:
        return "no pins"
    data = summary(pins)
    tenants = data["tenants"]
    assert isinstance(tenants, dict)
    lines = [f"{'tenant':<24} {'groups':>8} {'bytes':>14}"]
    lines += [f"{t:<24} {v['groups']:>8} {v['bytes']:>14}" for t, v in sorted(tenants.items())]
    lines.append("")
    lines += [f"{p.group.tenant}  {p.group.fingerprint[:16]}  {p.group.chunk}  {p.nbytes} bytes" for p in pins]
    return "\n".join(lines)
