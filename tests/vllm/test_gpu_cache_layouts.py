"""Every KV cache vLLM 0.32/0.33 hands a connector registers and copies exactly.

The caches are built by vLLM's own allocator (``vllm.v1.worker.utils.allocate_kv_cache``)
from vLLM's own ``KVCacheConfig`` (``get_kv_cache_config_from_groups``) and cache specs,
in each of the six ``KVCacheLayout`` stride orders, for full attention and MLA, in bf16,
fp16, fp32 and fp8, with and without kernel-block splits, on the CPU (bytes) and on
``meta`` (shapes only: a GPU cache's registration without a GPU). They are registered
through the adapter's own path (`registration.register_layout`, with real
``VllmConfig``s), and must:

- register (canonical objects for unquantized caches, engine-native ones for fp8);
- round-trip: gather -> scatter into a fresh cache gives the same bytes, and no others;
- give, for the same K/V values, the canonical objects vLLM's CPU layout gives (written
  by vLLM's CPU write ops: ``cpu_attn_reshape_and_cache``, and the CPU MLA backend's
  ``do_kv_cache_update``), so a GPU engine, a CPU engine and SGLang share one cache;
- refuse a cell packing kvpack does not map, naming the order and the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures.cuda_emulation import emulate_cuda
from kvpack import LayoutError
from kvpack.ops import KVLayoutKind, load_extension
from kvpack.vllm_plugin.blocks import BlockLayout
from kvpack.vllm_plugin.canonical_blocks import CanonicalBlocks
from kvpack.vllm_plugin.registration import RankPosition, WorkerLayout, register_layout

pytestmark = pytest.mark.vllm

ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD = 2, 64  # the tiny Llama's
LATENT, MLA_BLOCK = 576, 16  # DeepSeek's kv_lora_rank 512 + rope 64; vLLM's CPU MLA block
NUM_BLOCKS = 5
IDS = [3, 0, 4]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def llama_config(tiny_llama: Path) -> Any:
    """A real VllmConfig of the tiny Llama (2 layers, 2 KV heads of 64)."""
    return _engine_config(tiny_llama)


@pytest.fixture(scope="module")
def mla_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig of a tiny DeepSeek-V2 (MLA: one 576-wide latent per token); the
    config alone, no weights: nothing here runs the model."""
    import transformers

    path = tmp_path_factory.mktemp("models") / "tiny-deepseek-v2"
    transformers.DeepseekV2Config(
        vocab_size=2000,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        max_position_embeddings=2048,
    ).save_pretrained(path)
    cfg = _engine_config(path, skip_tokenizer_init=True)
    assert cfg.model_config.use_mla and cfg.model_config.get_head_size() == LATENT
    return cfg


def _engine_config(model: Path, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model),
        dtype="bfloat16",
        kv_transfer_config={"kv_connector": "KVPackConnector", "kv_role": "kv_both"},
        **kw,
    ).create_engine_config()


@dataclass
class Engine:
    """One allocation as a worker would register it."""

    vllm_config: Any
    caches: dict[str, torch.Tensor]
    num_blocks: int
    layout: WorkerLayout | None = None


def _spec(mla: bool, dtype: torch.dtype | str, block: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    fp8 = dtype == "fp8"
    torch_dtype = torch.uint8 if fp8 else dtype  # vLLM's fp8 caches are uint8 views (scales elsewhere)
    quant = KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE
    if mla:
        return MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=LATENT,
            dtype=torch_dtype,
            kv_quant_mode=quant,
            cache_dtype_str="fp8" if fp8 else "auto",
        )
    return FullAttentionSpec(
        block_size=block, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch_dtype, kv_quant_mode=quant
    )


def allocate(
    vllm_config: Any,
    order: str,
    spec: Any,
    device: str,
    kernel_block: int | None = None,
    cache_dtype: str = "auto",
) -> Engine:
    """vLLM's own allocation of `NUM_BLOCKS` blocks of `spec` for `LAYERS` in `order` on
    `device`, with `vllm_config` set as the engine core would have resolved it."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    cache = vllm_config.cache_config
    cache.kv_cache_layout, cache.block_size, cache.cache_dtype = order, spec.block_size, cache_dtype
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    per_block = spec.page_size_bytes * len(LAYERS)
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, NUM_BLOCKS * per_block)
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kernel = [kernel_block] if kernel_block is not None else None
    caches = allocate_kv_cache(kv_cache_config, torch.device(device), KVCacheLayout[order], kernel)
    return Engine(vllm_config, caches, kv_cache_config.num_blocks)


def register(engine: Engine) -> WorkerLayout:
    from kvpack import KVPackConfig
    from kvpack.vllm_plugin.scopes import make_scope

    scope = make_scope(engine.vllm_config, KVPackConfig.from_dict({}))
    engine.layout = register_layout(engine.vllm_config, scope, RankPosition(), engine.caches, engine.num_blocks)
    return engine.layout


def _fill_random(engine: Engine, seed: int) -> None:
    buf = next(iter(engine.caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(buf)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def _blocks(engine: Engine, name: str) -> torch.Tensor:
    """Layer `name`'s bytes indexed by vLLM block id (kernel blocks grouped: ``group_kernel_blocks``)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    t = group_kernel_blocks(engine.caches[name], engine.num_blocks)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _gather(layout: WorkerLayout, ids: list[int]) -> torch.Tensor:
    member = layout.kv.layout
    rows = torch.zeros((len(ids), member.slot_bytes), dtype=torch.uint8)
    member.gather(ids, rows)
    return rows


# -- registration: every order and spec ---------------------------------------------------------


CASES = [
    pytest.param(order, mla, dtype, id=f"{order}-{'mla' if mla else 'full'}-{dtype}")
    for order in ORDERS
    for mla in (False, True)
    for dtype in (*DTYPES, "fp8")
]


def _config(request: pytest.FixtureRequest, mla: bool) -> Any:
    return request.getfixturevalue("mla_config" if mla else "llama_config")


@pytest.mark.parametrize(("order", "mla", "dtype"), CASES)
def test_a_gpu_cache_registers_in_every_order(
    request: pytest.FixtureRequest, order: str, mla: bool, dtype: str
) -> None:
    # on `meta`: what a GPU worker registers (no bytes); canonical objects unless fp8
    cfg = _config(request, mla)
    block = MLA_BLOCK if mla else 16
    fp8 = dtype == "fp8"
    engine = allocate(
        cfg, order, _spec(mla, DTYPES.get(dtype, "fp8"), block), "meta", cache_dtype=dtype if fp8 else "auto"
    )
    layout = register(engine)
    member = layout.kv.layout
    elem = 1 if fp8 else DTYPES[dtype].itemsize
    cell = LATENT if mla else 2 * HEAD
    assert member.slot_bytes == len(LAYERS) * block * cell * elem * (1 if mla else KV_HEADS)
    if fp8:
        assert isinstance(member, BlockLayout)
        assert all(r.layout.kind is KVLayoutKind.VLLM_BLOCK_VIEW for r in member.runs)  # a GPU cache: by token
    else:
        assert isinstance(member, CanonicalBlocks)
        assert member.geometry.num_kv == (1 if mla else 2)
        assert member.geometry.tokens == block and member.geometry.num_blocks == NUM_BLOCKS


# -- bytes: gather -> scatter round trip ---------------------------------------------------------


@pytest.mark.parametrize(("order", "mla", "dtype"), CASES)
def test_blocks_round_trip_exactly_in_every_order(
    request: pytest.FixtureRequest, order: str, mla: bool, dtype: str
) -> None:
    cfg = _config(request, mla)
    block = MLA_BLOCK if mla else 16
    fp8 = dtype == "fp8"
    spec = _spec(mla, DTYPES.get(dtype, "fp8"), block)
    source = allocate(cfg, order, spec, "cpu", cache_dtype=dtype if fp8 else "auto")
    _fill_random(source, seed=len(order) + mla)
    rows = _gather(register(source), IDS)
    fresh = allocate(cfg, order, spec, "cpu", cache_dtype=dtype if fp8 else "auto")
    layout = register(fresh)
    layout.kv.layout.scatter(IDS, rows)
    others = [b for b in range(NUM_BLOCKS) if b not in IDS]
    for name in LAYERS:
        src, dst = _blocks(source, name), _blocks(fresh, name)
        assert torch.equal(dst[IDS], src[IDS]), name
        assert not dst[others].any(), f"{name}: a block outside the scattered ones was written"


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_kernel_block_splits_round_trip(request: pytest.FixtureRequest, order: str, dtype: str) -> None:
    # an attention kernel's block (16) smaller than vLLM's (32): the views hold two kernel
    # blocks per block id, on the canonical (bf16) and the engine-native (fp8) path
    cfg = _config(request, False)
    fp8 = dtype == "fp8"
    spec = _spec(False, DTYPES.get(dtype, "fp8"), 32)
    cache_dtype = dtype if fp8 else "auto"
    source = allocate(cfg, order, spec, "cpu", kernel_block=16, cache_dtype=cache_dtype)
    assert next(iter(source.caches.values())).shape[0] == 2 * NUM_BLOCKS
    _fill_random(source, seed=3)
    rows = _gather(register(source), IDS)
    fresh = allocate(cfg, order, spec, "cpu", kernel_block=16, cache_dtype=cache_dtype)
    register(fresh).kv.layout.scatter(IDS, rows)
    others = [b for b in range(NUM_BLOCKS) if b not in IDS]
    for name in LAYERS:
        assert torch.equal(_blocks(fresh, name)[IDS], _blocks(source, name)[IDS]), name
        assert not _blocks(fresh, name)[others].any(), name


@pytest.mark.parametrize("order", ORDERS)
def test_a_gpu_load_of_objects_where_they_lie_uploads_them_then_converts_on_the_device(
    llama_config: Any, order: str
) -> None:
    """A GPU load from the host store's registered mapping (`CanonicalBlocks.scatter_at` on a
    device's lane; the recording device stands in for the GPU, its launches deferred to the
    event): the objects, scattered in the mapping (two back to back in descending order, one
    apart), are copied into device rows and converted there. Nothing is written before the
    event; after it the blocks equal the source's and no other block changed."""
    from fixtures.recording_device import RecordingDevice
    from kvpack.transfers import Direction, Staging

    spec = _spec(False, torch.float32, 16)
    source = allocate(llama_config, order, spec, "cpu")
    _fill_random(source, seed=21)
    objects = _gather(register(source), IDS)
    size = int(objects.shape[1])
    mapping = torch.zeros((8, size), dtype=torch.uint8)  # the tier's pages
    where = [6, 5, 1]
    for row, slot in zip(objects, where):
        mapping[slot] = row
    fresh = allocate(llama_config, order, spec, "cpu")
    layout = register(fresh).kv.layout
    assert isinstance(layout, CanonicalBlocks) and layout.reads_addresses
    before = {name: _blocks(fresh, name).clone() for name in LAYERS}
    device = RecordingDevice()
    staging = Staging(device)
    with staging.lane(Direction.LOAD) as lane:
        layout.scatter_at(IDS, [mapping[slot].data_ptr() for slot in where], lane)
        event = device.record(Direction.LOAD)
    assert ("device_rows", len(IDS), size) in device.ops  # the objects go to device rows first
    assert all(torch.equal(_blocks(fresh, n), before[n]) for n in LAYERS)  # nothing before the event
    device.synchronize(event)
    others = [b for b in range(NUM_BLOCKS) if b not in IDS]
    for name in LAYERS:
        assert torch.equal(_blocks(fresh, name)[IDS], _blocks(source, name)[IDS]), name
        assert torch.equal(_blocks(fresh, name)[others], before[name][others]), name


# -- canonical objects: every GPU order equals vLLM's CPU layout ----------------------------------


def _kv_values(dtype: torch.dtype, mla: bool, block: int) -> torch.Tensor:
    """[blocks, layers, kv, heads, tokens, dim] random values (the canonical object order)."""
    shape = (
        (NUM_BLOCKS, len(LAYERS), 1, 1, block, LATENT) if mla else (NUM_BLOCKS, len(LAYERS), 2, KV_HEADS, block, HEAD)
    )
    return torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(dtype)


def _write_by_slot(engine: Engine, values: torch.Tensor, mla: bool) -> None:
    """What a GPU backend's reshape-and-cache does: token t of block b into the view's kernel
    block and row (vLLM's ``group_kernel_blocks`` view of the allocator's blocks)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    for layer, name in enumerate(LAYERS):
        view = group_kernel_blocks(engine.caches[name], engine.num_blocks)  # [blocks, (ratio,) H, N, C]
        if view.dim() == 4:
            view = view.unsqueeze(1)
        ratio, n = int(view.shape[1]), int(view.shape[3])
        cell = values[:, layer].permute(0, 2, 3, 1, 4)  # [blocks, heads, tokens, kv, dim]
        cell = cell.reshape(*cell.shape[:3], -1).unflatten(2, (ratio, n)).transpose(1, 2)
        view.copy_(cell)


def _cpu_objects(cfg: Any, values: torch.Tensor, mla: bool, block: int) -> torch.Tensor:
    """Objects of blocks IDS from vLLM's CPU cache, written by vLLM's CPU write op."""
    from vllm import _custom_ops as ops

    dtype = values.dtype
    engine = allocate(cfg, "LBHNC", _spec(mla, dtype, block), "cpu")
    slots = torch.arange(NUM_BLOCKS * block, dtype=torch.int64)
    for layer, name in enumerate(LAYERS):
        cache = engine.caches[name]
        if mla:
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            latent = values[:, layer, 0, 0].reshape(-1, LATENT)
            write = CPUMLAImpl.do_kv_cache_update  # the CPU MLA backend's write (uses no instance state)
            write(None, latent[:, :512], latent[:, 512:].unsqueeze(1), cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]
            continue
        key_cache, value_cache = cache.view(NUM_BLOCKS, KV_HEADS, 2 * block, HEAD).chunk(2, dim=2)
        k = values[:, layer, 0].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD)  # [tokens, heads, dim]
        v = values[:, layer, 1].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD)
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
    if mla:
        layout = register(engine)  # vLLM's CPU MLA stamps no ISA: a block view, detected from the config
        assert isinstance(layout.kv.layout, CanonicalBlocks)
        return _gather(layout, IDS)
    from kvpack import HeadRange, KVPackConfig
    from kvpack.vllm_plugin.canonical_blocks import CacheKind
    from kvpack.vllm_plugin.scopes import make_scope

    split = make_scope(cfg, KVPackConfig.from_dict({})).heads
    assert split is not None
    blocks = CanonicalBlocks.from_tensors(
        [engine.caches[n] for n in LAYERS], NUM_BLOCKS, split, HeadRange(0, KV_HEADS), CacheKind.CPU_PACKED, isa="vec"
    )
    rows = torch.zeros((len(IDS), blocks.slot_bytes), dtype=torch.uint8)
    blocks.gather(IDS, rows)
    return rows


OBJECT_CASES = [
    pytest.param(
        order,
        mla,
        dtype,
        kernel,
        id=f"{order}-{'mla' if mla else 'full'}-{dtype}" + (f"-kernel{kernel}" if kernel else ""),
    )
    for order in ORDERS
    for mla in (False, True)
    for dtype in ("bf16", "fp32")
    for kernel in (None, 16)
    if not (kernel and (mla or order[0] == "B" or order == "LHBNC"))  # vLLM splits dense pages only
]


@pytest.mark.parametrize(("order", "mla", "dtype", "kernel"), OBJECT_CASES)
def test_a_gpu_order_writes_the_objects_of_the_cpu_layout(
    request: pytest.FixtureRequest, order: str, mla: bool, dtype: str, kernel: int | None
) -> None:
    cfg = _config(request, mla)
    block = MLA_BLOCK if mla else 32  # vLLM's CPU attention `vec` packs blocks of 32
    values = _kv_values(DTYPES[dtype], mla, block)
    expected = values[IDS].contiguous().view(torch.uint8).view(len(IDS), -1)
    cpu = _cpu_objects(cfg, values, mla, block)
    assert torch.equal(cpu, expected)  # the CPU layout's objects are the K/V values, canonically
    gpu = allocate(cfg, order, _spec(mla, DTYPES[dtype], block), "cpu", kernel_block=kernel)
    if kernel:
        assert next(iter(gpu.caches.values())).shape[0] == NUM_BLOCKS * block // kernel
    _write_by_slot(gpu, values, mla)
    layout = register(gpu)
    assert torch.equal(_gather(layout, IDS), cpu)
    for use_kernel in (True, False) if load_extension().available else (False,):  # C++ kernel and torch path
        fresh = allocate(cfg, order, _spec(mla, DTYPES[dtype], block), "cpu", kernel_block=kernel)
        geo = register(fresh).kv.layout
        assert isinstance(geo, CanonicalBlocks)
        geo.geometry.copy(IDS, cpu.view(-1), gather=False, obj_heads=geo.own.size, use_kernel=use_kernel)
        for name in LAYERS:
            assert torch.equal(_blocks(fresh, name)[IDS], _blocks(gpu, name)[IDS]), (name, use_kernel)


@pytest.mark.skipif(not load_extension().available, reason="needs the C++ extension")
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mla", [False, True], ids=["full", "mla"])
def test_the_cuda_kernels_indexing_reads_every_order(request: pytest.FixtureRequest, order: str, mla: bool) -> None:
    # canonical_copy.cu's word-by-word indexing (run on the CPU) on the new geometries: the
    # strides fit its word alignment, and it writes the same objects as the reference
    cfg = _config(request, mla)
    block = MLA_BLOCK if mla else 32
    engine = allocate(cfg, order, _spec(mla, torch.bfloat16, block), "cpu")
    _fill_random(engine, seed=5)
    blocks = register(engine).kv.layout
    assert isinstance(blocks, CanonicalBlocks)
    want = _gather(engine.layout, IDS).view(-1)  # type: ignore[arg-type]
    got = torch.zeros_like(want)
    word = emulate_cuda(blocks.geometry, IDS, got, gather=True, obj_heads=blocks.own.size)
    assert torch.equal(got, want)
    assert word == 16  # K and V bases, every stride: 16-byte words


# -- refusals ------------------------------------------------------------------------------------


def test_a_cell_packed_by_the_backend_is_refused_naming_order_and_spec(llama_config: Any) -> None:
    # b12x-style planes ([B, 2, N, heads * D]: the H dim is K/V, not KV heads) look like a
    # 2-KV-head cache by shape; the spec says otherwise, and kvpack must not misread them
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=torch.bfloat16,
        num_head_slots=2,
        state_content_bytes=KV_HEADS * HEAD * 2,
    )
    engine = allocate(llama_config, "LBNHC", spec, "meta")
    context = llama_config.compilation_config.static_forward_context
    layers = {n: _SpecLayer(spec) for n in LAYERS}
    context.update(layers)
    try:
        with pytest.raises(LayoutError, match="num_head_slots=2"):
            register(engine)
    finally:
        for n in LAYERS:
            context.pop(n, None)


def test_a_view_with_other_content_is_refused_naming_the_order(llama_config: Any) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD, head_size_v=32, dtype=torch.bfloat16)
    engine = allocate(llama_config, "LHBNC", spec, "meta")
    with pytest.raises(LayoutError, match=r"order LHBNC.*C is 96 elements"):
        register(engine)


def test_a_refused_cache_disables_the_worker_instead_of_failing_the_start(llama_config: Any, tmp_path: Path) -> None:
    # vLLM calls register_kv_caches once at start-up: an exception there stops the engine.
    # A refused cache leaves the worker disabled: one error line, a metric, every load failed
    # (vLLM recomputes it) and reported, nothing saved.
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvpack import KVPackConfig
    from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob
    from kvpack.vllm_plugin.scopes import make_scope
    from kvpack.vllm_plugin.worker import WorkerSide

    spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD, head_size_v=32, dtype=torch.bfloat16)
    engine = allocate(llama_config, "LBNHC", spec, "cpu")
    config = KVPackConfig.from_dict({"memory": {"capacity": "16MiB"}, "disk": {"enabled": False}})
    worker = WorkerSide(llama_config, config, make_scope(llama_config, config))
    try:
        worker.register_kv_caches(engine.caches, engine.num_blocks)
        assert worker.layout is None
        assert worker.session.store.metrics.value("workers_disabled") == 1
        chunk = "c" * 64
        loads = [
            TransferJob("async", "default", (BlockRef(chunk, (1,), 16),)),
            TransferJob("sync", "default", (BlockRef(chunk, (2,), 16),), sync=True),
        ]
        worker.start_step(KVPackConnectorMetadata(loads=loads), has_forward=False)
        _, done, failed = worker.get_finished()
        assert done == failed == {"async"}  # the synchronous load reports through its blocks only
        assert worker.take_load_errors() == {1, 2}
        worker.queue_saves(KVPackConnectorMetadata(saves=[TransferJob("w", "default", (BlockRef(chunk, (3,), 16),))]))
        assert worker.session.store.metrics.value("saved_blocks") == 0
    finally:
        worker.close()


def test_fp8_objects_name_their_scales(llama_config: Any) -> None:
    # fp8 caches hold the quantized bytes only; the scales live in the layers, so they are
    # in the native member fingerprint: objects written under other scales never load
    engine = allocate(llama_config, "LBNHC", _spec(False, "fp8", 16), "meta", cache_dtype="fp8")
    context = llama_config.compilation_config.static_forward_context
    prints = []
    try:
        for scale in (1.0, 0.5, 0.5):
            context.update({n: _ScaleLayer(scale) for n in LAYERS})
            prints.append(register(engine).kv.fingerprint)
        llama_config.cache_config.calculate_kv_scales = True
        prints.append(register(engine).kv.fingerprint)
    finally:
        llama_config.cache_config.calculate_kv_scales = False
        for n in LAYERS:
            context.pop(n, None)
    assert prints[1] == prints[2] and len(set(prints)) == 3


class _ScaleLayer:
    """A layer of the forward context as the fingerprint reads it: its K/V scales."""

    def __init__(self, scale: float) -> None:
        self._k_scale = torch.tensor(scale)
        self._v_scale = torch.tensor(2 * scale)


class _SpecLayer:
    """A layer of the forward context as the registration reads it: its cache spec only."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        return self._spec
