"""Test-only stand-in for `sgl_kernel` (the CPU build is not on PyPI). Never part of kvpack.

On the CPU engine (`SGLANG_USE_CPU_ENGINE=1`) SGLang imports a few ``*_cpu`` kernels
from `sgl_kernel` at module load (`copy_all_layer_kv_cache_cpu`,
`assign_req_to_token_pool_cpu`, the speculative-decoding helpers, ...). The tiny
Llama server run by ``test_sglang_server.py`` calls none of them: every name
resolves to a function that raises when called, naming itself, so a path that
does need a real kernel fails loudly instead of computing nonsense.

No ``torch.ops.sgl_kernel`` op is registered, so SGLang's AMX check
(`hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`) is false and the CPU
engine uses its torch-native layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

STUB = True  # lets a test or a log line tell this package from a real build


def _missing_kernel(name: str) -> Callable[..., NoReturn]:
    """A stand-in for kernel `name` that raises when the server actually calls it."""

    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (tests/sglang/server/cpu_site)")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing_kernel(name)
