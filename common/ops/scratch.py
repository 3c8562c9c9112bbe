"""The torch path's staging on the cache's device: one transfer per call, not per layer.

The torch fallback (no compiler, a refused or failed CUDA build) copies a cache on a
GPU through strided views, one `(layer, segment)` or `(layer, K/V)` at a time. Done
straight into host staging, every one of those is a blocking cross-device copy (and a
pageable temporary when the host side is strided): 2 x layers host stalls per call,
each behind the forward queued on the stream. `on_cache_device` hands the torch path
a contiguous scratch on the cache's device instead and moves the staging bytes with
one ``non_blocking`` copy per direction, on the current stream (the caller's side
stream; pinned staging makes it asynchronous).

Invariants:

- Staging already on the cache's device (the CPU path, device staging) is used as it
  is: no scratch, no copy.
- A save (gather) copies the scratch out after the body; a load (scatter) copies the
  staging in before it. A save that writes only part of each row (`keep`: a token or
  head sub-range, other bytes left as they are) also copies the staging in first.
- The scratch is allocated on the current stream and only used on it, so torch's
  caching allocator does not hand it out again before that stream's copies ran; the
  staging's own lifetime is the caller's (`kvpack.transfers.staging` releases after the event).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def on_cache_device(
    staging: torch.Tensor,
    nbytes: int,
    device: torch.device,
    *,
    gather: bool,
    keep: bool,
    bounce: bool | None = None,
) -> Iterator[torch.Tensor]:
    """Yields uint8 staging on `device` for the first `nbytes` of `staging` (see the
    module docstring); `gather` is the direction (cache -> staging). `bounce` forces
    the scratch (True) or not (default: when `staging` is on another device; a machine
    without a GPU tests the bounce by forcing it on one device)."""
    if not (staging.device != device if bounce is None else bounce):
        yield staging
        return
    part = staging[:nbytes]
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if keep or not gather:
        scratch.copy_(part, non_blocking=True)
    yield scratch
    if gather:
        part.copy_(scratch, non_blocking=True)
