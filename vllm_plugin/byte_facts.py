"""What changes the bytes of a vLLM KV block, beyond its shape and dtype.

A stored block is the engine's own bytes, so every fact that changes them
must reach the member fingerprint (principle 2), or a reader whose engine
packs blocks differently loads garbage with every check passing. Measured:
vLLM's CPU attention writes blocks in its ISA's packing (`amx`, `vec`,
`vec16`, `neon`...: ``cpu_attn._get_attn_isa``); a block written under
`vec` and read under `amx` gave 0 of 12 output tokens right.

`BlockByteFacts` lists them; the tensors' dtype, shape and strides (which
tell GPU NHD from HND layouts) are in `BlockLayout.description` already.
Taken from the attention layers vLLM built (``static_forward_context``,
whose backends and ISA are chosen before ``register_kv_caches``), so the
fingerprint says what this worker actually writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

UNKNOWN = "?"


@dataclass(frozen=True)
class BlockByteFacts:
    """Facts that change a block's bytes (each a string; ``"-"``: not applicable)."""

    attn_backend: str
    """vLLM's attention backend of the layers (``CPU_ATTN``, ``FLASH_ATTN``, ``FLASHINFER``...)."""
    cpu_attn_isa: str
    """CPU attention packing of a block (``amx``, ``vec``, ``vec16``, ``neon``...; ``-`` off CPU)."""
    kv_cache_dtype: str
    """``cache_config.cache_dtype`` (``auto``: the model dtype; ``fp8_e4m3``...)."""
    kv_scales: str
    """How quantized K/V are scaled: ``-`` (not quantized), ``calculated`` (per run), or the
    layers' checkpoint scales."""

    def as_extra(self) -> tuple[tuple[str, str], ...]:
        """Entries for `KVLayoutSpec.extra` (sorted by name)."""
        return (
            ("attn_backend", self.attn_backend),
            ("cpu_attn_isa", self.cpu_attn_isa),
            ("kv_cache_dtype", self.kv_cache_dtype),
            ("kv_scales", self.kv_scales),
        )


def _joined(values: Iterable[str]) -> str:
    unique = sorted(set(values))
    return ",".join(unique) if unique else UNKNOWN


def _backend_name(layer: Any) -> str:
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        get = getattr(layer, "get_attn_backend", None)
        backend = get() if callable(get) else None
    name = getattr(backend, "get_name", None)
    if callable(name):
        return str(name())
    return type(layer).__name__ if backend is None else getattr(backend, "__name__", UNKNOWN)


def _scale(layer: Any, attr: str) -> str:
    value = getattr(layer, attr, None)
    if value is None:
        return UNKNOWN
    try:
        return f"{float(value):.9g}"
    except (TypeError, ValueError):
        try:
            return ",".join(f"{float(v):.9g}" for v in value.flatten().tolist())
        except Exception:
            return UNKNOWN


def block_byte_facts(vllm_config: VllmConfig, layer_names: Iterable[str], device_type: str) -> BlockByteFacts:
    """The facts for the layers `layer_names` of this worker (see the module docstring).

    Layers vLLM did not put in ``static_forward_context`` (Mamba state) carry no
    backend or ISA; they count as ``?`` consistently on every reader."""
    context: dict[str, Any] = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    layers = [context[n] for n in layer_names if n in context]
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    quantized = cache_dtype not in ("auto", "float16", "bfloat16", "float32", "half", "float")
    if not quantized:
        scales = "-"
    elif getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        scales = "calculated"
    else:
        scales = _joined(f"{_scale(layer, '_k_scale')}/{_scale(layer, '_v_scale')}" for layer in layers)
    isa = _joined(str(getattr(layer, "isa", UNKNOWN)) for layer in layers) if device_type == "cpu" else "-"
    return BlockByteFacts(
        attn_backend=_joined(_backend_name(layer) for layer in layers),
        cpu_attn_isa=isa,
        kv_cache_dtype=cache_dtype,
        kv_scales=scales,
    )
