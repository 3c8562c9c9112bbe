"""Issue 34: an SGLang L3 call of a canonical pool gives the GIL up only where it must.

Inside an SGLang server the backend is called from the prefetch and backup threads while the
scheduler thread runs Python; every time a call gives the GIL up, taking it back can wait a switch
interval (5 ms). Most torch calls from Python give it up even when they do next to nothing
(``Tensor.view``, ``Tensor.set_``, ``torch.empty``: another thread ran during 75-92 of 100 such calls,
5-7 of 100 for ``Tensor.numpy`` and ``Tensor.to`` to the tensor's own device and dtype), and the
staging rows of a 12-page get made four of them. So a page get or set of a canonical pool makes
no torch call that gives the GIL up but the conversion kernel's: the staging rows are numpy.

Recorded with `sys.setprofile` (every builtin called from Python on the calling thread), on real
SGLang host pools through SGLang's factory, for each tier set-up. The recorder's control: it sees
the conversion kernel in every call.
"""

from __future__ import annotations

import builtins
import sys
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_bytes, page_keys, poison

pytestmark = pytest.mark.sglang

ALLOWED = {"numpy", "numel", "to", "tensor", "canonical_copy_at"}
"""torch calls that keep the GIL here (``Tensor.numpy``, ``Tensor.numel``, ``Tensor.to`` the
tensor's own device and dtype, ``torch.tensor`` of a list of ints on the CPU), and the conversion
kernel, which releases it on purpose (it copies megabytes)."""

TIERS = {
    "memory": dict(memory=True, disk=False),
    "disk": dict(memory=False, disk=True),
    "memory+disk": dict(memory=True, disk=True),
}


def _torch_calls(call: Callable[[], Any]) -> tuple[Any, Counter[str]]:
    """`call`'s result and the torch builtins it called from Python on this thread, by name."""
    seen: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_call":
            return
        owner = getattr(arg, "__self__", None)
        module = getattr(arg, "__module__", None) or (type(owner).__module__ if owner is not None else "")
        is_torch = (
            isinstance(owner, torch.Tensor)
            or str(module).startswith("torch")
            # a custom op's call, from torch's own Python (not the builtins that code uses)
            or (frame.f_code.co_filename.endswith("torch/_ops.py") and module != "builtins" and owner is not builtins)
        )
        if is_torch:
            seen[getattr(arg, "__name__", repr(arg))] += 1

    sys.setprofile(profile)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    return out, seen


@pytest.mark.parametrize("tiers", list(TIERS))
def test_a_page_set_and_get_make_no_torch_call_but_the_kernel(tiers: str, store_dir: Any) -> None:
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir, **TIERS[tiers]))
    try:
        assert backend.binding("kv").canonical is not None, "the test is about canonical pools"
        n = 12
        fill_random(pool, seed=3)
        src = alloc_pages(pool, n)
        # once: what a process does on its first call only (the kernel's lookup, its cached base table)
        assert backend.batch_set_v1(page_keys(n, seed=12), src) == [True] * n
        want = page_bytes(pool, src)
        keys = page_keys(n, seed=11)
        stored, set_calls = _torch_calls(lambda: backend.batch_set_v1(keys, src))
        assert stored == [True] * n
        assert backend.flush(10)
        poison(pool)
        dst = alloc_pages(pool, n)
        loaded, get_calls = _torch_calls(lambda: backend.batch_get_v1(keys, dst))
        assert loaded == [True] * n
        assert page_bytes(pool, dst) == want
        for what, calls in (("set", set_calls), ("get", get_calls)):
            assert calls["canonical_copy_at"] >= 1, f"{what}: the recorder saw no conversion ({dict(calls)})"
            assert set(calls) <= ALLOWED, f"{what}: torch calls that give the GIL up: {set(calls) - ALLOWED}"
    finally:
        backend.close()
