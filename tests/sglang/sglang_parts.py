"""Real SGLang parts for the kvpack backend tests: host pools, storage configs, page keys.

Pools are SGLang's own MHATokenToKVPoolHost / MLATokenToKVPoolHost built on the
CPU from small "device" buffers (CPU tensors standing in for the GPU pool; the
host pool only reads their geometry here). Backends are built through SGLang's
real StorageBackendFactory, exactly as ``--hicache-storage-backend dynamic`` does.
"""

from __future__ import annotations

from typing import Any

import kvpack_sglang_shim  # noqa: F401  (must precede every sglang import)
import numpy as np
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvpack import chain_hash

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DYNAMIC = {
    "backend_name": "kvpack",
    "module_path": "kvpack.sglang_plugin",
    "class_name": "KVPackStorage",
    "interface_v1": 1,
}


def _ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def _host_args(layout: str, page_size: int, device_tokens: int, layers: int) -> dict[str, object]:
    """The host-pool constructor arguments MHA and MLA pools share (CPU, unpinned, 2x the device)."""
    return dict(
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
    )


def mha_pool(
    layout: str,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    device_tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    pool_label: str = "kv",
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (host capacity 2x the device pool, not pinned)."""
    ks = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
    vs = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=tuple(ks), v=tuple(vs), k_data_ptrs=_ptrs(ks), v_data_ptrs=_ptrs(vs), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(info, **_host_args(layout, page_size, device_tokens, layers), pool_label=pool_label)
    pool._kvpack_keepalive = (ks, vs)  # the host pool keeps raw pointers to these
    return pool


def mla_pool(
    layout: str,
    *,
    layers: int = 2,
    kv_lora_rank: int = 64,
    rope_dim: int = 32,
    page_size: int = 16,
    device_tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16,
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (one latent row per token and layer)."""
    width = kv_lora_rank + rope_dim
    bufs = [torch.zeros(device_tokens, 1, width, dtype=dtype) for _ in range(layers)]
    info = MLABufferInfo(
        buffers=tuple(bufs),
        data_ptrs=_ptrs(bufs),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(info, **_host_args(layout, page_size, device_tokens, layers), target_layer_num=layers)
    pool._kvpack_keepalive = bufs
    return pool


def make_pool(kind: str, layout: str, **kw: Any) -> Any:
    return mha_pool(layout, **kw) if kind == "mha" else mla_pool(layout, **kw)


def storage_config(
    extra: dict[str, Any],
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    layout: str = "page_first",
    model: str = "kvpack-tiny",
) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds (_generate_storage_config), for one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=dict(extra),
    )


def kvpack_extra(
    store_dir: Any = None, *, memory: bool = True, disk: bool = True, zero_copy: bool = True, **more: Any
) -> dict[str, Any]:
    """DYNAMIC + a kvpack config with the chosen tiers (`zero_copy` False: without ``interface_v1``,
    so that SGLang drives the backend through its generic by-value path)."""
    extra: dict[str, Any] = dict(DYNAMIC)
    if not zero_copy:
        del extra["interface_v1"]
    extra["memory"] = {"enabled": memory, "capacity": "256MiB"}
    extra["disk"] = {"enabled": disk, "path": str(store_dir)} if disk else {"enabled": False}
    extra.update(more)
    return extra


def make_backend(pool: Any, extra: dict[str, Any], **cfg: Any) -> Any:
    """Build through SGLang's real factory and register the KV pool, as the controller does."""
    config = storage_config(extra, layout=pool.layout, **cfg)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_keys(n: int, seed: int, page_size: int = 16) -> list[str]:
    """SGLang-style chained page hashes of n pages of random tokens."""
    rng = np.random.default_rng(seed)
    keys: list[str] = []
    parent = None
    for _ in range(n):
        parent = chain_hash(parent, rng.integers(0, 32000, size=page_size))
        keys.append(parent)
    return keys


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in the whole host buffer (every page distinct)."""
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def poison(pool: Any, value: int = 0xA5) -> None:
    pool.kv_buffer.view(-1).view(torch.uint8).fill_(value)


def alloc_pages(pool: Any, n: int) -> torch.Tensor:
    idx = pool.alloc(n * pool.page_size)
    assert idx is not None, "host pool too small for the test"
    return idx


def page_bytes(pool: Any, indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes in SGLang's flat page order (independent of kvpack's code)."""
    ps = pool.page_size
    return [
        pool.get_data_page(int(indices[i * ps]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for i in range(len(indices) // ps)
    ]
