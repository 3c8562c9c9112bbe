"""Host memory a GPU reads in place (`kvpack.transfers.host_registration`) and the per-run uploads
(`kvpack.upload_runs`) a GPU load makes from it.

CUDA is not on this machine: the registration calls go through a stand-in of torch's runtime
bindings (``torch.cuda.cudart()``: ``cudaHostRegister(ptr, size, flags)`` and
``cudaHostUnregister(ptr)`` returning a ``cudaError_t``) that records what it was asked and
on which thread. The GPU check (``scripts/gpu_check.sh``) runs the real calls on a GPU host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvpack import address_of, upload_runs
from kvpack.transfers.host_registration import (
    CUDA_ERROR_ALREADY_REGISTERED,
    CUDA_HOST_REGISTER_PORTABLE,
    RegisteredRanges,
    Registration,
    register_with_cuda,
    unregister_with_cuda,
)


@dataclass
class Runtime:
    """A stand-in of ``torch.cuda.cudart()``: answers `code` (or raises, or blocks) and records calls."""

    code: int = 0
    raises: bool = False
    block: threading.Event | None = None
    calls: list[tuple[str, int, int, int, int]] = field(default_factory=list)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple[int]:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size, flags, threading.get_ident()))
        if self.block is not None:
            self.block.wait(10)
        if self.raises:
            raise RuntimeError("no CUDA driver")
        return (self.code,)  # some torch versions answer a tuple

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0, 0, threading.get_ident()))
        return self.code


def test_ranges_cover_only_what_lies_inside_one_registered_range() -> None:
    ranges = RegisteredRanges()
    assert not ranges and not ranges.covers(4096, 1)
    ranges.add(4096, 8192)
    ranges.add(65536, 4096)
    assert ranges.covers(4096, 8192) and ranges.covers(8000, 100) and ranges.covers(65536, 4096)
    assert not ranges.covers(4095, 2)  # starts before
    assert not ranges.covers(12000, 300)  # runs past the end
    assert not ranges.covers(12288, 1)  # between the two
    assert not ranges.covers(8192, 65536)  # spans both and the gap
    assert ranges.total_bytes == 8192 + 4096
    ranges.remove(4096)
    assert not ranges.covers(8000, 100) and ranges.covers(65536, 1)
    assert ranges
    ranges.clear()
    assert not ranges and not ranges.covers(65536, 1)


@pytest.mark.parametrize(
    ("code", "raises", "want"),
    [
        (0, False, Registration.REGISTERED),
        (CUDA_ERROR_ALREADY_REGISTERED, False, Registration.ALREADY),
        (1, False, Registration.REFUSED),  # cudaErrorInvalidValue
        (0, True, Registration.REFUSED),
    ],
)
def test_registration_reports_what_cuda_answered_and_calls_it_on_a_thread_of_its_own(
    code: int, raises: bool, want: Registration
) -> None:
    runtime = Runtime(code=code, raises=raises)
    outcome, _ = register_with_cuda(1 << 20, 4096, runtime)
    assert outcome is want
    [(verb, ptr, size, flags, thread)] = runtime.calls
    assert (verb, ptr, size, flags) == ("register", 1 << 20, 4096, CUDA_HOST_REGISTER_PORTABLE)
    # a refusal leaves CUDA's last error on the calling thread: never the engine's
    assert thread != threading.get_ident()


def test_a_registration_that_does_not_answer_in_time_is_a_refusal() -> None:
    gate = threading.Event()
    runtime = Runtime(block=gate)
    try:
        outcome, code = register_with_cuda(1 << 20, 4096, runtime, timeout_s=0.05)
        assert outcome is Registration.REFUSED and code == -1
    finally:
        gate.set()


def test_unregistration_answers_cudas_code() -> None:
    runtime = Runtime()
    assert unregister_with_cuda(1 << 20, runtime) == 0
    assert runtime.calls[0][:2] == ("unregister", 1 << 20)


def test_upload_runs_puts_every_object_in_a_row_runs_in_address_order() -> None:
    size = 96
    arena = np.random.default_rng(5).integers(0, 256, size * 12, dtype=np.uint8)
    base = address_of(arena)
    # objects 0-2 ascending back to back, 3-4 descending back to back, 5 alone, 6 after a gap
    slots = [4, 5, 6, 9, 8, 0, 2]
    order_of_rows = upload_runs(
        [base + s * size for s in slots], size, out := torch.zeros((7, size), dtype=torch.uint8)
    )
    assert sorted(order_of_rows) == list(range(7))
    for row, obj in enumerate(order_of_rows):
        want = arena[slots[obj] * size : (slots[obj] + 1) * size]
        assert np.array_equal(out[row].numpy(), want), (row, obj)
    assert order_of_rows[3:5] == [4, 3]  # the descending run, read once from its lowest address
