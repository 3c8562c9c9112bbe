"""The `kvpack` command's tool subcommands: ``bench``, ``demo``, ``soak``, ``proxy``.

The core's command (`kvpack.cli`) names none of them: it finds these through the
``kvpack.commands`` entry-point group (pyproject.toml), so the dependency points from
the tools to the core only. Each tool's module is imported when it runs, so
`kvpack inspect` and `kvpack config` need no engine installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Tool = Callable[[list[str]], int | None]
"""A tool's ``main(argv)``: its exit status (None: 0)."""


def _tiers() -> Tool:
    from .bench import tiers_bench

    return tiers_bench.main


def _evict() -> Tool:
    from .bench import evict_bench

    return evict_bench.main


def _usage() -> Tool:
    from .bench import usage_bench

    return usage_bench.main


def _weights() -> Tool:
    from .bench import weights_bench

    return weights_bench.main


def _copy() -> Tool:
    from .bench import copy_bench

    return copy_bench.main


def _vllm() -> Tool:
    from .bench import vllm_bench

    return vllm_bench.main


def _mooncake() -> Tool:
    from .bench import mooncake_bench

    return mooncake_bench.main


def _sglang() -> Tool:
    from .bench import sglang_bench

    return sglang_bench.main


def _spec() -> Tool:
    from .bench import spec_bench

    return spec_bench.main


def _serve() -> Tool:
    from .bench import serve_bench

    return serve_bench.main


def _pair() -> Tool:
    from .bench import serve_pair

    return serve_pair.main


def _pd() -> Tool:
    from .bench import pd_bench

    return pd_bench.main


def _scale() -> Tool:
    from .bench import scale_bench

    return scale_bench.main


def _chat() -> Tool:
    from .bench import chat_bench

    return chat_bench.main


def _hostile() -> Tool:
    from .bench import hostile_bench

    return hostile_bench.main


def _demo() -> Tool:
    from . import demo

    return demo.main


def _soak() -> Tool:
    from . import soak

    return soak.main


def _proxy() -> Tool:
    from . import proxy

    return proxy.main


BENCHES: dict[str, Callable[[], Tool]] = {
    "tiers": _tiers,
    "copy": _copy,
    "evict": _evict,
    "vllm": _vllm,
    "mooncake": _mooncake,
    "sglang": _sglang,
    "spec": _spec,
    "serve": _serve,
    "pair": _pair,
    "pd": _pd,
    "scale": _scale,
    "chat": _chat,
    "hostile": _hostile,
    "usage": _usage,
    "weights": _weights,
}
"""`kvpack bench NAME`: each benchmark's ``main``, imported when it runs."""

RUNNERS: dict[str, Callable[[], Tool]] = {"demo": _demo, "soak": _soak, "proxy": _proxy}
"""The other tool subcommands (``kvpack.commands`` entry points of their own)."""


def _run(load: Callable[[], Tool], argv: list[str], name: str) -> int:
    try:
        tool = load()
    except ModuleNotFoundError as exc:
        print(f"kvpack: {name} is not available here ({exc}); is its engine installed?", file=sys.stderr)
        return 2
    return int(tool(argv) or 0)


def bench(argv: list[str]) -> int:
    """``kvpack bench NAME [ARGS...]``: everything after NAME, ``--help`` too, goes to the benchmark."""
    if argv and argv[0] in BENCHES:
        return _run(BENCHES[argv[0]], argv[1:], f"bench {argv[0]}")
    parser = argparse.ArgumentParser(
        prog="kvpack bench",
        usage="kvpack bench [-h] NAME [ARGS...]",
        description="run a benchmark",
        epilog="`kvpack bench NAME --help` shows the benchmark's own arguments.",
    )
    parser.add_argument("name", metavar="NAME", choices=sorted(BENCHES), help="the benchmark, one of: %(choices)s")
    parser.parse_args(argv)  # --help exits 0; no or an unknown NAME exits 2, naming NAME
    return 2


def demo(argv: list[str]) -> int:
    return _run(_demo, argv, "demo")


def soak(argv: list[str]) -> int:
    return _run(_soak, argv, "soak")


def proxy(argv: list[str]) -> int:
    return _run(_proxy, argv, "proxy")
