"""CPU facts kvpack must act on: asking Linux for AMX tile state once per process.

On Intel Xeons with AMX, Linux refuses AMX tile instructions (SIGILL) in a
process that has not asked for the tile-data state component with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. vLLM's CPU attention
uses AMX for some shapes; a process whose first forward is a long prefill has
asked already (its GEMM library does), but one whose first forward is a
1-token step over a long prefix restored by kvpack (the n - 1 reuse) dies in
``cpu_attention_with_kv_cache``. kvpack makes that shape reachable, so kvpack
asks, once per process, before the engine's first forward (vLLM: worker
registration; SGLang: backend start). Where AMX is absent, or on another
architecture or OS, the request fails harmlessly and nothing changes.

The answer is cached per process (the permission itself is per process, so
caching it is not global policy; a forked child inherits the permission).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import os
import platform
import sys

log = logging.getLogger("kvpack")

SYS_ARCH_PRCTL = 158
"""x86-64 syscall number of ``arch_prctl``."""
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
"""The AMX tile-data state component."""


class AmxPermission(enum.Enum):
    """Outcome of `request_amx_permission`."""

    GRANTED = "granted"
    """This call asked and Linux granted it."""
    ALREADY = "already"
    """The process had it already (an earlier call, or a library asked first)."""
    UNSUPPORTED = "unsupported"
    """Not Linux on x86-64, or the CPU/kernel has no AMX: nothing to ask for."""
    REFUSED = "refused"
    """Linux refused (errno logged at debug level); AMX code would fault."""


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_has_amx() -> bool:
    """True when /proc/cpuinfo lists ``amx_tile`` (Linux on an AMX-capable x86-64 CPU)."""
    return "amx_tile" in _cpu_flags()


@functools.cache
def request_amx_permission() -> AmxPermission:
    """Ask Linux for AMX tile state for this process (idempotent, cached, never raises).

    Logged once at debug level. Safe on every host: a no-op where AMX is
    absent or already granted."""
    result = _request()
    log.debug("kvpack: AMX tile permission for pid %d: %s", os.getpid(), result.value)
    return result


def _syscall():
    """libc's ``syscall`` (restype long), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


def _tile_data_permitted(syscall) -> bool:
    mask = ctypes.c_ulong(0)
    ok = syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
    return ok and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def _request() -> AmxPermission:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64") or not host_has_amx():
        return AmxPermission.UNSUPPORTED
    syscall = _syscall()
    if syscall is None:
        return AmxPermission.UNSUPPORTED
    if _tile_data_permitted(syscall):
        return AmxPermission.ALREADY
    if syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return AmxPermission.GRANTED
    log.debug("kvpack: arch_prctl(ARCH_REQ_XCOMP_PERM) failed: errno %d", ctypes.get_errno())
    return AmxPermission.REFUSED
