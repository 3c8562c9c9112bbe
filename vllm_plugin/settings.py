"""Translation of vLLM's configuration and requests into kvpack terms.

Everything here is a pure function of the `VllmConfig` (and, for workers,
the cache tensors) or of one request, so the scheduler-side and worker-side
connectors, which may live in different processes, compute the same keys,
fingerprints and member names independently.

- config: ``kv_connector_extra_config`` -> `KVPackConfig` (strict; a bad key
  fails engine start-up naming the field).
- scope: the group fingerprint (engine, model + draft model, dtype, block size,
  TP/PP sizes) and this rank's member name (``kv``, or ``kv@<rank>of<world>``).
- tenant and chain seed of a request: ``kv_transfer_params["kvpack_tenant"]``,
  else ``cache_salt``, else ``config.tenant``; the salt (and a LoRA adapter)
  seed the key chain so salted prompts never share keys.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpack.config import KVPackConfig
from kvpack.errors import ConfigError
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
    """Every rank's member name; a chunk is a hit only when all are stored."""
    block_size: int
    draft: str
    """Draft model identity ("" without speculative decoding)."""

    @property
    def fingerprint(self) -> str:
        return self.spec.group_fingerprint


def draft_identity(vllm_config: VllmConfig) -> str:
    """The speculative config's draft, as it affects the KV layer set ("" when none)."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens", None):
        return ""
    method = str(getattr(spec, "method", "") or "")
    model = str(getattr(spec, "model", "") or "")
    return f"{method}:{model}"


def member_name(rank: int, world: int) -> str:
    return "kv" if world == 1 else f"kv@{rank}of{world}"


def make_scope(vllm_config: VllmConfig) -> Scope:
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    world = tp * pp
    block_size = int(vllm_config.cache_config.block_size)
    model_cfg = vllm_config.model_config
    draft = draft_identity(vllm_config)
    model = str(model_cfg.model)
    if draft:
        model += f"|draft={draft}"
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
    return Scope(spec=spec, members=members, block_size=block_size, draft=draft)


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
