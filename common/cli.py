"""The `kvpack` command: inspect a store, run benchmarks, the demo, the soak suite.

    kvpack inspect DIR [--json]
    kvpack bench {tiers,copy,vllm,mooncake,sglang,spec} [ARGS...]
    kvpack demo [ARGS...]
    kvpack soak [ARGS...]
    kvpack config [FILE]        # print the effective config (defaults filled in)

Subcommands import their module only when run, so `kvpack inspect` works
without any engine installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

BENCHES = {
    "tiers": "kvpack.bench.tiers_bench",
    "copy": "kvpack.bench.copy_bench",
    "vllm": "kvpack.bench.vllm_bench",
    "mooncake": "kvpack.bench.mooncake_bench",
    "sglang": "kvpack.bench.sglang_bench",
    "spec": "kvpack.bench.spec_bench",
}
RUNNERS = {"demo": "kvpack.demo", "soak": "kvpack.soak"}


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
    p_bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    p_bench.add_argument("name", choices=sorted(BENCHES))
    p_config = sub.add_parser("config", help="print the effective config")
    p_config.add_argument("file", nargs="?")
    for name in RUNNERS:
        sub.add_parser(name, help=f"run the {name}", add_help=False)
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
