"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvpack.tools.procfs import stat_fields


def best_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Fastest of `repeats` runs after `warmup` runs (seconds). Fastest, because
    noise from other work on the machine only ever adds time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used by this process so far: all of it, and by each kind of its threads
    named `prefix*` (a thread's name less a trailing ``-<number>``)."""

    total_s: float
    named: dict[str, float]

    @property
    def named_s(self) -> float:
        return sum(self.named.values())

    def __sub__(self, other: CpuSample) -> CpuSample:
        kinds = self.named.keys() | other.named.keys()
        return CpuSample(
            self.total_s - other.total_s, {k: self.named.get(k, 0.0) - other.named.get(k, 0.0) for k in sorted(kinds)}
        )


def cpu_sample(prefix: str) -> CpuSample:
    """This process's CPU time (user + system) and the part its live threads whose Python
    name starts with `prefix` used, by kind (Linux: /proc/self/task; none elsewhere).
    A named thread that exits between two samples drops out of the difference."""
    import re
    import threading

    t = os.times()
    named: dict[str, float] = {}
    for thread in threading.enumerate():
        if not thread.name.startswith(prefix) or thread.native_id is None:
            continue
        stat = proc_stat(f"/proc/self/task/{thread.native_id}/stat")
        if stat is None:
            continue
        kind = re.sub(r"-\d+$", "", thread.name)
        named[kind] = named.get(kind, 0.0) + stat[1]
    return CpuSample(t.user + t.system, named)


def proc_stat(path: str) -> tuple[int, float] | None:
    """(process group, CPU seconds used: user + system) from a Linux ``/proc/PID/stat`` or
    ``/proc/PID/task/TID/stat`` file; None when it cannot be read (gone, or not Linux)."""
    fields = stat_fields(path)  # state ppid pgrp ...
    if fields is None:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # pgrp, utime and stime: fields 5, 14 and 15 of stat, counted from the first
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / tick


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


@contextmanager
def busy_python_threads(n: int, own_cores: bool = False) -> Iterator[None]:
    """While inside: `n` threads of this process running Python without pause (an engine
    scheduler's stand-in: each time a timed call gives the GIL up it may wait a switch interval).

    With `own_cores`, where this process may run on `n` + 1 CPUs, the calling thread and each
    busy thread are pinned to a CPU of their own (the caller's CPUs are restored on the way out):
    the scheduler thread on a core of its own, as in a server, so that the busy thread takes the
    GIL at every hand-off. Unpinned on 2 cores, whether it does follows where the kernel places
    the two threads, and a run's timings fall in one of two modes."""
    stop = threading.Event()
    cpus = sorted(os.sched_getaffinity(0)) if own_cores else []
    pin = len(cpus) >= n + 1
    mine = os.sched_getaffinity(0) if pin else None

    def spin(cpu: int | None) -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # Linux: 0 is the calling thread
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    threads = [threading.Thread(target=spin, args=(cpus[i + 1] if pin else None,), daemon=True) for i in range(n)]
    if pin:
        os.sched_setaffinity(0, {cpus[0]})
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()
        if mine is not None:
            os.sched_setaffinity(0, mine)
