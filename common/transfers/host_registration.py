"""Host memory a GPU copies from without staging: ranges registered with CUDA (`cudaHostRegister`).

A load from the host store (`kvpack.tiers.host`) into a GPU cache copies each object once,
straight from the store's shared mapping to the device, when this process registered that
mapping with CUDA: the device's copy engine reads registered memory as it reads pinned memory
(one DMA per run of objects back to back, then the canonical conversion on the device). A range
that is not registered (the memory tier's pageable slots, a mapping CUDA refused) is first
copied into the transfer's pinned staging rows, as every GPU load did before.

Registration pins the mapping's pages (the host store populates them when it maps the arena, so
nothing more is allocated), once per process at the cache's registration, and is undone when
the transfer runner closes, before the store unmaps. It runs on a short-lived thread of its
own: a refused ``cudaHostRegister`` leaves CUDA's "last error" on the thread that called it,
where a later kernel-launch check of the engine's thread would report it as its own.

`RegisteredRanges` is the lookup the load thread asks (`covers`); `register_with_cuda` and
`unregister_with_cuda` are the two CUDA calls, through torch's runtime bindings
(``torch.cuda.cudart()``), passed in as `runtime` so a test can stand in for CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: every CUDA context of the process sees the range as pinned."""
CUDA_ERROR_ALREADY_REGISTERED = 712
"""``cudaErrorHostMemoryAlreadyRegistered``: another part of the process registered the range."""
REGISTER_TIMEOUT_S = 60.0
"""Bound on one registration (pinning a 64 GiB mapping takes seconds): past it the range is treated
as not registered, and loads stage through pinned rows."""


class Registration(str, Enum):
    """What `register_with_cuda` did with a range."""

    REGISTERED = "registered"
    """Registered by this call: `unregister_with_cuda` undoes it."""
    ALREADY = "already"
    """Registered before by someone else in this process: readable in place, never unregistered here."""
    REFUSED = "refused"
    """CUDA refused it (or did not answer in time): copies stage it through pinned rows."""


@dataclass
class RegisteredRanges:
    """Host ranges ``[address, address + nbytes)`` a device copies from in place.

    Adding and removing happen on the thread that sets up or closes the transfers; `covers`
    may run on any thread at any time: it reads one immutable snapshot (a sorted tuple)."""

    _ranges: tuple[tuple[int, int], ...] = field(default=())

    def add(self, address: int, nbytes: int) -> None:
        if nbytes > 0:
            self._ranges = tuple(sorted({*self._ranges, (address, address + nbytes)}))

    def remove(self, address: int) -> None:
        self._ranges = tuple(r for r in self._ranges if r[0] != address)

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one registered range."""
        ranges = self._ranges
        i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
        return i >= 0 and ranges[i][0] <= address and address + nbytes <= ranges[i][1]

    @property
    def total_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self._ranges)

    def clear(self) -> None:
        self._ranges = ()

    def __bool__(self) -> bool:
        """Whether any range is registered."""
        return bool(self._ranges)


def _code(result: object) -> int:
    """The integer of a ``cudaError_t`` as torch's bindings return it (an enum, an int, or a tuple)."""
    if isinstance(result, tuple):
        result = result[0]
    value = getattr(result, "value", result)
    return int(value)  # type: ignore[call-overload]


def _on_own_thread(fn: Callable[[], int], timeout_s: float) -> int | None:
    """``fn()`` on a new thread (CUDA's last error stays there); None when it raised or ran past `timeout_s`."""
    out: list[int | None] = [None]

    def run() -> None:
        try:
            out[0] = fn()
        except Exception:  # noqa: BLE001 - an unusable runtime is a refusal
            out[0] = None

    t = threading.Thread(target=run, name="kvpack-cuda-register", daemon=True)
    t.start()
    t.join(timeout_s)
    return None if t.is_alive() else out[0]


def _on_device(device: torch.device | None) -> AbstractContextManager[object]:
    """`device` current for a CUDA call (None: the thread's current device, as a test's runtime wants)."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def register_with_cuda(
    address: int, nbytes: int, runtime: Any, device: torch.device | None = None, timeout_s: float = REGISTER_TIMEOUT_S
) -> tuple[Registration, int]:
    """Register ``[address, address + nbytes)`` with CUDA (portable) on `device`'s context, through
    `runtime` (``torch.cuda.cudart()``); returns what happened and CUDA's error code (0 when
    registered). Never raises."""

    def call() -> int:
        with _on_device(device):
            return _code(runtime.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE))

    code = _on_own_thread(call, timeout_s)
    if code == 0:
        return Registration.REGISTERED, 0
    if code == CUDA_ERROR_ALREADY_REGISTERED:
        return Registration.ALREADY, code
    return Registration.REFUSED, -1 if code is None else code


def unregister_with_cuda(
    address: int, runtime: Any, device: torch.device | None = None, timeout_s: float = REGISTER_TIMEOUT_S
) -> int:
    """Undo a `Registration.REGISTERED` range; CUDA's error code (0: done; -1: no answer)."""

    def call() -> int:
        with _on_device(device):
            return _code(runtime.cudaHostUnregister(address))

    code = _on_own_thread(call, timeout_s)
    return -1 if code is None else code
