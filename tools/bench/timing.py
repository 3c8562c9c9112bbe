"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass


def best_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Fastest of `repeats` runs after `warmup` runs (seconds). Fastest, because
    noise on a shared 2-core machine only ever adds time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write_report(path: str, title: str, command: str, table: str) -> None:
    """Write a benchmark's markdown report: title, exact command, machine, table."""
    from pathlib import Path

    Path(path).write_text(f"# {title}\n\nCommand: `{command.strip()}`\n\nMachine: {hardware()}\n\n{table}\n")
    print(f"wrote {path}")


def publish(bench: str, argv: list[str], title: str, table: str, out: str) -> None:
    """Print a server benchmark's result (its exact command, the machine, the table) and,
    with `out`, write it as a markdown report too."""
    import shlex

    command = f"kvpack bench {bench} " + " ".join(shlex.quote(a) for a in argv)
    print(f"\n{command}\n{hardware()}\n\n{table}")
    if out:
        write_report(out, title, command, table)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def hardware() -> str:
    """One line naming the CPU (and core count) this ran on."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


@dataclass(frozen=True)
class Row:
    """One measured line: what, GB/s, and the baseline it is compared with."""

    what: str
    gbps: float
    baseline: str
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps if self.baseline_gbps > 0 else float("nan")
