"""Test-only patches that let SGLang 0.5.23's HiCache run on the CPU engine. Never part of kvpack.

Loaded by this folder's ``sitecustomize.py`` in the server subprocess of
``test_sglang_server.py`` only; the installed SGLang files are never edited.
Each patch is applied right after its module is first imported (`PostImportPatcher`),
in every SGLang process (the scheduler is started with multiprocessing ``spawn``
and inherits PYTHONPATH).

1. ``sglang.srt.mem_cache.pool_host.common._cuda_host_register``: the HiCache
   host pool pins its buffer with ``cudaHostRegister`` (``torch.cuda.cudart()``),
   which raises "Torch not compiled with CUDA enabled" on a CPU torch. Replaced
   by a no-op that records no registered ranges (what the pool's own unpinned
   and HIP paths record), so ``destroy()`` unregisters nothing.
2. ``sglang.srt.mem_cache.pool_host.mha``: with ``--hicache-io-backend direct``
   the MHA host pool calls ``transfer_kv_direct``,
   ``transfer_kv_all_layer_direct_lf_pf`` and ``transfer_kv_per_layer_direct_pf_lf``,
   which it imports from ``sgl_kernel.kvcacheio`` only on CUDA/ROCm (XPU gets
   its own); on CPU the names are unbound (NameError on the first backup). They
   are bound here to torch index copies with the kernels' semantics: indices are
   token slots; ``layer_first`` host buffers are one tensor per layer (K layers
   then V layers), ``page_first_direct`` host buffers are ``[page, layer,
   page_offset, head, dim]`` per K and V. Its ``get_dummy_flat_data_page`` (the
   buffer SGLang's generic L3 read path, the ``file`` backend's, reads a page into)
   asks for ``pin_memory=True``, which a CPU torch refuses; it is made unpinned.
3. ``sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES``: before it makes a
   HiCache host pool SGLang checks that the machine's available memory less this reserve
   (10 GiB) holds the pool, so a server with a 1 GB pool starts only with 11 GiB available.
   On the 24 GiB test machine, with the other lane's engines running beside it, two servers
   were refused at start-up (and killed, -9) with 10.7 GiB available. Set to `TEST_RESERVE_BYTES`:
   the check still runs; kvpack's part of the pool is the same either way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

Patch = Callable[[ModuleType], None]


def _slots(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.long)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every layer tensor i."""
    src, dst = _slots(src_indices), _slots(dst_indices)
    for src_layer, dst_layer in zip(src_layers, dst_layers, strict=True):
        dst_layer[dst] = src_layer[src]


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first -> host page_first_direct, all layers.

    ``src_ptrs`` holds ``len(dst_ptrs)`` groups of per-layer tensors (K layers,
    then V layers); ``dst_ptrs[j]`` is ``[page, layer, page_offset, ...]``.
    """
    src, dst = _slots(src_indices), _slots(dst_indices)
    pages, offsets = dst // page_size, dst % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for j, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[:, layer][pages, offsets] = src_ptrs[j * layers + layer][src]


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page_first_direct -> device layer-first, one layer: ``dst_ptrs[j][dst] = src_ptrs[j][page, layer_id, offset]``."""
    src, dst = _slots(src_indices), _slots(dst_indices)
    pages, offsets = src // page_size, src % page_size
    for host, device in zip(src_ptrs, dst_ptrs, strict=True):
        device[dst] = host[:, layer_id][pages, offsets]


def _no_host_register(module: ModuleType) -> None:
    attr = module._CUDA_HOST_REGISTERED_RANGES_ATTR  # fails loudly if SGLang renamed it

    def cuda_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
        setattr(buffer, attr, [])

    assert callable(module._cuda_host_register)
    module._cuda_host_register = cuda_host_register


def _direct_copies(module: ModuleType) -> None:
    module.transfer_kv_direct = transfer_kv_direct
    module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    pool = module.MHATokenToKVPoolHost
    assert callable(pool.get_dummy_flat_data_page)

    def get_dummy_flat_data_page(self: object) -> torch.Tensor:
        """SGLang's, unpinned (its ``pin_memory=self.pin_memory`` raises on a CPU torch)."""
        p = self
        shape = (2, p.layer_num, p.page_size, p.head_num, p.head_dim)  # type: ignore[attr-defined]
        return torch.zeros(shape, dtype=p.dtype, device=p.device).flatten()  # type: ignore[attr-defined]

    pool.get_dummy_flat_data_page = get_dummy_flat_data_page


TEST_RESERVE_BYTES = 2 << 30
"""Memory a test server's HiCache check keeps for everything else (bytes)."""


def _small_reserve(module: ModuleType) -> None:
    assert module.HICACHE_HOST_MEMORY_RESERVE_BYTES >= TEST_RESERVE_BYTES  # fails loudly if SGLang renamed it
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_RESERVE_BYTES


PATCHES: dict[str, Patch] = {
    "sglang.srt.mem_cache.pool_host.common": _no_host_register,
    "sglang.srt.mem_cache.pool_host.mha": _direct_copies,
    "sglang.srt.mem_cache.pool_host.base": _small_reserve,
}


class PostImportPatcher(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module `name` is executed."""

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            patch(module)
            print(f"[kvpack test patch] {fullname}: {patch.__name__}", file=sys.stderr, flush=True)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the patcher first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, PostImportPatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportPatcher(PATCHES))
