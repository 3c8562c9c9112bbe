"""Translation of vLLM's configuration and requests into kvpack terms.

Everything here is a pure function of the `VllmConfig` (and, for workers,
the cache tensors) or of one request, so the scheduler-side and worker-side
connectors, which may live in different processes, compute the same keys,
fingerprints and member names independently.

- config: ``kv_connector_extra_config`` -> `KVPackConfig` (strict; a bad key
  fails engine start-up naming the field).
- scope: the group fingerprint (engine, model + draft model and its placement,
  dtype, block size, TP/PP sizes) and this rank's member names (``kv``, or
  ``kv@<rank>of<world>``; plus ``draft``/``draft@<rank>of<world>`` when the
  draft KV is a sidecar).
- draft layers: which registered KV layers belong to the drafter, told apart by
  the speculative config, never by position alone (`split_draft_layers`).
- tenant and chain seed of a request: ``kv_transfer_params["kvpack_tenant"]``,
  else ``cache_salt``, else ``config.tenant``; the salt (and a LoRA adapter)
  seed the key chain so salted prompts never share keys.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpack.config import DraftPlacementMode, KVPackConfig
from kvpack.errors import ConfigError
from kvpack.groups import DraftPlacement
from kvpack.keys import ChunkHash, seed_hash, validate_tenant
from kvpack.layout import KVLayoutSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpack.vllm")

TENANT_PARAM = "kvpack_tenant"
"""Key of ``kv_transfer_params`` naming a request's tenant."""


def load_config(vllm_config: VllmConfig) -> KVPackConfig:
    """kvpack config from ``kv_connector_extra_config``; raises ConfigError naming the field."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", "must be a JSON object")
    config = KVPackConfig.from_dict(extra)
    if not extra:
        where = [f"memory ({config.memory.capacity} bytes)"] if config.memory.enabled else []
        if config.disk.enabled:
            where.append(f"disk at {config.disk.path}")
        log.info("kvpack: no kv_connector_extra_config given; using the defaults: %s", ", ".join(where))
    return config


@dataclass(frozen=True)
class Scope:
    """What every process of one engine agrees on: group fingerprint, members, block size."""

    spec: KVLayoutSpec
    """Group-level spec (no layer set): `spec.group_fingerprint` scopes keys."""
    members: tuple[str, ...]
    """Every rank's target member name; a chunk is a hit only when all are stored."""
    block_size: int
    draft: str
    """Draft model identity ("" without speculative decoding)."""
    draft_placement: DraftPlacement = DraftPlacement.NONE
    """NONE (no draft KV), PACKED (draft layers inside the ``kv`` objects) or SIDECAR."""
    draft_members: tuple[str, ...] = ()
    """Every rank's sidecar draft member name (SIDECAR only; role DRAFT)."""

    @property
    def fingerprint(self) -> str:
        return self.spec.group_fingerprint

    @property
    def all_members(self) -> tuple[str, ...]:
        """Target members, then sidecar draft members: everything one chunk's group holds."""
        return self.members + self.draft_members


def draft_identity(vllm_config: VllmConfig) -> str:
    """The speculative config's draft, as it affects the KV layer set ("" when none)."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens", None):
        return ""
    method = str(getattr(spec, "method", "") or "")
    model = str(getattr(spec, "model", "") or "")
    return f"{method}:{model}"


def member_name(rank: int, world: int, base: str = "kv") -> str:
    return base if world == 1 else f"{base}@{rank}of{world}"


DRAFT_MEMBER = "draft"
"""Base name of the sidecar draft member (``draft@<rank>of<world>`` with TP/PP)."""

_DRAFT_PREFIX = "draft_model."
"""Prefix of every layer a ``draft_model`` drafter registers (vLLM builds it under that prefix)."""
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def has_draft_kv(vllm_config: VllmConfig) -> bool:
    """True when the speculative method keeps KV layers of its own (draft model,
    EAGLE/EAGLE-3, MTP, DFlash...); False without speculative decoding and for
    n-gram, suffix, Medusa-style methods, which have no draft KV."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens", None):
        return False
    uses = getattr(spec, "uses_draft_kv_cache", None)
    if callable(uses):
        return bool(uses())
    method = str(getattr(spec, "method", "") or "")
    return method not in ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "custom_class")


def target_layer_count(vllm_config: VllmConfig) -> int:
    """The target model's total number of hidden layers (all PP stages)."""
    model_cfg = vllm_config.model_config
    try:
        return int(model_cfg.get_total_num_hidden_layers())
    except Exception:
        return int(getattr(model_cfg.hf_text_config, "num_hidden_layers", 0) or 0)


def split_draft_layers(vllm_config: VllmConfig, names: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Registered KV layer names -> (target layers, draft layers), order kept.

    A layer is the drafter's when the speculative method has draft KV and
    either vLLM built it under the ``draft_model.`` prefix (``draft_model``
    method) or its layer index is at or past the target's layer count (EAGLE
    heads and MTP layers appear as ``model.layers.<n>`` after the target's).
    Without draft KV every layer is the target's.
    """
    if not has_draft_kv(vllm_config):
        return tuple(names), ()
    n_target = target_layer_count(vllm_config)
    target: list[str] = []
    draft: list[str] = []
    for name in names:
        m = _LAYER_INDEX.search(name)
        if name.startswith(_DRAFT_PREFIX) or (m is not None and n_target and int(m.group(1)) >= n_target):
            draft.append(name)
        else:
            target.append(name)
    return tuple(target), tuple(draft)


def resolve_draft_placement(vllm_config: VllmConfig, config: KVPackConfig) -> DraftPlacement:
    """The configured `draft_placement`, with AUTO decided for this engine.

    AUTO is PACKED when the draft layers share the target's block index space.
    The connector accepts one KV cache group only (it refuses more at start-up),
    and every layer of that group, target and draft, is addressed by the same
    block ids: so on vLLM AUTO is PACKED whenever the drafter has KV.
    """
    if not has_draft_kv(vllm_config):
        return DraftPlacement.NONE
    if config.draft_placement is DraftPlacementMode.SIDECAR:
        return DraftPlacement.SIDECAR
    return DraftPlacement.PACKED


def make_scope(vllm_config: VllmConfig, config: KVPackConfig | None = None) -> Scope:
    """The engine's `Scope`. `config` defaults to the one in ``kv_connector_extra_config``."""
    from vllm.platforms import current_platform

    if config is None:
        ktc = vllm_config.kv_transfer_config
        config = KVPackConfig.from_dict(dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {})
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    world = tp * pp
    block_size = int(vllm_config.cache_config.block_size)
    model_cfg = vllm_config.model_config
    draft = draft_identity(vllm_config)
    placement = resolve_draft_placement(vllm_config, config)
    model = str(model_cfg.model)
    if draft:
        model += f"|draft={draft}"
    if placement is not DraftPlacement.NONE:
        model += f"|{placement.value}"  # packed and sidecar objects never share keys
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model_cfg.dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
    spec = KVLayoutSpec(
        engine=f"vllm:{current_platform.device_type}",
        model=model,
        dtype=dtype.replace("torch.", ""),
        chunk_tokens=block_size,
        tp_size=tp,
        pp_size=pp,
    )
    members = tuple(member_name(r, world) for r in range(world))
    draft_members = (
        tuple(member_name(r, world, DRAFT_MEMBER) for r in range(world)) if placement is DraftPlacement.SIDECAR else ()
    )
    return Scope(
        spec=spec,
        members=members,
        block_size=block_size,
        draft=draft,
        draft_placement=placement,
        draft_members=draft_members,
    )


# -- requests ------------------------------------------------------------------


@dataclass(frozen=True)
class RequestScope:
    """A request's tenant and the seed of its key chain (None: unsalted)."""

    tenant: str
    seed: ChunkHash | None


class BadTenant(ValueError):
    """The request names a tenant kvpack refuses; the request runs without the cache."""


def request_scope(request: Request, default_tenant: str) -> RequestScope:
    """Tenant and chain seed of `request`. Raises BadTenant for an invalid tenant name."""
    params: dict[str, Any] = getattr(request, "kv_transfer_params", None) or {}
    salt = getattr(request, "cache_salt", None) or ""
    tenant = params.get(TENANT_PARAM) if isinstance(params, dict) else None
    if tenant is None and salt:
        tenant = salt if _valid_tenant(salt) else "salt-" + hashlib.sha256(salt.encode()).hexdigest()[:16]
    if tenant is None:
        tenant = default_tenant
    try:
        validate_tenant(tenant)
    except ValueError as exc:
        raise BadTenant(str(exc)) from None
    seed_parts = []
    if salt:
        seed_parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        seed_parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    seed = seed_hash("\x00".join(seed_parts)) if seed_parts else None
    return RequestScope(tenant=tenant, seed=seed)


def _valid_tenant(name: str) -> bool:
    try:
        validate_tenant(name)
        return True
    except ValueError:
        return False


def cacheable(request: Request) -> bool:
    """Requests whose KV is a function of their token ids only (no images, no embeddings)."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None
