"""What `kvpack bench sglang` and its variants share: SGLang host pools of a bench's shape, page
keys, the storage config and the slice of SGLang's cache controller its page copies read."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvpack.identity.keys import ChunkHash, chain_hash

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torchvision_shim() -> None:
    """SGLang imports torchvision; PyPI's is CUDA-linked and fails to register its ops
    on a CPU-only machine. Defining the two op schemas first lets SGLang import (this
    benchmark process only; kvpack's plugin never does this)."""
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return
    except RuntimeError:
        pass
    try:
        import torchvision  # noqa: F401  (a working build registers the ops itself)

        return
    except Exception:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_TV_LIB"] = lib
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


def page_keys(n: int, seed: int, page_tokens: int) -> list[str]:
    """`n` chained page hashes of random tokens (SGLang's page keys of one prompt), from `seed`."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    parent: ChunkHash | None = None
    for _ in range(n):
        parent = chain_hash(parent, rng.integers(0, 32000, size=page_tokens))
        out.append(parent)
    return out


def host_pool(args: argparse.Namespace) -> Any:
    """An SGLang host pool of the bench's shape (`args`: kind, layout, dtype, pages and page geometry)
    over a CPU device pool, filled with random bytes; twice the device pool (source + destination)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = DTYPES[args.dtype]
    tokens = args.pages * args.page_tokens  # device pool; the host pool is 2x (source + destination pages)
    common = dict(
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=args.page_tokens,
        layout=args.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=args.layers,
    )
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    if args.kind == "mha":
        ks = [torch.zeros(tokens, args.heads, args.head_dim, dtype=dtype) for _ in range(args.layers)]
        vs = [torch.zeros(tokens, args.heads, args.head_dim, dtype=dtype) for _ in range(args.layers)]
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=tuple(ks), v=tuple(vs), k_data_ptrs=ptrs(ks), v_data_ptrs=ptrs(vs), layout=KVBufferLayout.NHD
            ),
            page_size=args.page_tokens,
            head_num=args.heads,
            head_dim=args.head_dim,
            v_head_dim=args.head_dim,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        pool = MHATokenToKVPoolHost(info, **common)
    else:
        width = args.heads * args.head_dim * 2  # same bytes per token and layer as the MHA pool
        bufs = [torch.zeros(tokens, 1, width, dtype=dtype) for _ in range(args.layers)]
        info = MLABufferInfo(
            buffers=tuple(bufs),
            data_ptrs=ptrs(bufs),
            layer_indices=tuple(range(args.layers)),
            device_layer_num=args.layers,
            page_size=args.page_tokens,
            kv_lora_rank=width - 64,
            qk_rope_head_dim=64,
            kv_cache_dim=width,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        pool = MLATokenToKVPoolHost(info, **common, target_layer_num=args.layers)
    if getattr(args, "engine_device", "cpu") != "cpu":
        # As a GPU server's pool says it (SGLang checks its device buffers against this device,
        # so a CPU machine cannot build one): kvpack reads it to choose its conversion threads.
        pool._transfer_device = torch.device(args.engine_device)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    return pool


def storage_config(extra: dict[str, Any] | None, args: argparse.Namespace) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=args.kind == "mla",
        enable_storage_metrics=False,
        is_page_first_layout=args.layout == "page_first",
        model_name="kvpack-bench",
        extra_config=extra,
    )


def controller(backend: Any, pool: Any) -> Any:
    """What SGLang's CacheController methods read from `self` on the storage path."""
    return SimpleNamespace(
        storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool, page_size=pool.page_size
    )


class BenchOp:
    request_id = "kvpack-bench"

    @staticmethod
    def is_terminated() -> bool:
        return False
