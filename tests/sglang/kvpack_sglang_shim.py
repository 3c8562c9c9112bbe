"""Make SGLang importable on a CPU-only machine (tests only, never kvpack's runtime).

PyPI's torchvision is CUDA-linked; its Python code registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` at import, which fails when the
CUDA library did not load ("operator torchvision::nms does not exist").
Defining the two op schemas first is enough for everything SGLang's storage
and host-pool code needs. A real SGLang server on a GPU machine has a working
torchvision, so kvpack's plugin itself does not do this.

Import this module (or call `install()`) before anything imports sglang; the
subprocess helpers in these tests do so as their first statement.
"""

from __future__ import annotations

import torch

_LIB: torch.library.Library | None = None


def install() -> None:
    """Define the torchvision op schemas once per process (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # a working torchvision (or someone else) already defined them
    except RuntimeError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB = lib


install()
