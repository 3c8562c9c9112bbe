"""`kvpack bench weights`: what watching an engine's weights costs per engine step.

`kvpack.WeightsWatch.poll` runs once per vLLM step that has kvpack work (and once per SGLang
storage call). For models of `--params` parameter tensors (small linear layers: the cost is per
tensor, not per byte) it times `poll` over `--polls` calls, the modules re-walked every
`RELIST_EVERY` polls included, and in the same run one walk of the modules for their parameters
(what a poll would cost if it listed them each time) and one read of every parameter's version
counter and storage address. Prints microseconds per poll and per parameter, and the ratio of a
poll to a walk.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvpack import WeightsWatch
from kvpack.observe.weights import RELIST_EVERY, parameter_state


def _model(params: int) -> torch.nn.Module:
    return torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(params))


def _median_us(call: Callable[[], object], repeat: int) -> float:
    """Median of `repeat` timed calls, microseconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[200, 1000, 5000], help="parameter tensors")
    parser.add_argument("--polls", type=int, default=4 * RELIST_EVERY, help="polls timed per model")
    args = parser.parse_args(argv)
    print(f"{'params':>7} {'poll us':>9} {'us/param':>9} {'walk us':>9} {'read us':>9} {'poll/walk':>9}")
    for n in args.params:
        model = _model(n)
        watch = WeightsWatch("bench", "ckpt", lambda: [model])
        params = list(model.parameters())
        t = time.perf_counter()
        for _ in range(args.polls):
            watch.poll()
        poll = (time.perf_counter() - t) / args.polls * 1e6
        walk = _median_us(lambda: list(model.parameters()), 20)
        read = _median_us(lambda: parameter_state(params), 20)
        print(f"{n:>7} {poll:>9.1f} {poll / n:>9.3f} {walk:>9.1f} {read:>9.1f} {poll / walk:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
