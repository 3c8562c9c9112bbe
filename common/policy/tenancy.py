"""Who a request's tenant is, and the seed of its key chain: engine-neutral policy.

An adapter hands `resolve_tenant` the engine facts of one request (`TenantSource`:
its cache salt, the tenant it names and that name's signature, its LoRA adapter)
and the operator's config; the core decides. The rules (docs/ARCHITECTURE.md):

- A named tenant is a client's word, not the operator's: it is honoured only when
  the config trusts whoever set it (`KVPackConfig.trusted_tenants` lists the name,
  or ``"*"``; or the signature is the name's HMAC under
  `KVPackConfig.tenant_signing_key`). Otherwise it is ignored: `on_untrusted` is
  called with it (the adapter counts it) and it is logged, once per `warned` event
  the caller holds (one per scheduler: not per request, and no process-wide state).
- Else the salt's own scope: the salt itself when it is a valid tenant name, else
  ``salt-<16 hex of its SHA-256>``.
- Else the config's default tenant.
- A trusted name that is not a valid tenant (`keys.validate_tenant`) raises
  `BadTenant`: the request runs without the cache.
- The salt and the LoRA adapter seed the key chain (`keys.seed_hash`), so salted
  prompts never share keys, whatever the tenant is.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..config.schema import KVPackConfig
from ..identity.keys import ChunkHash, seed_hash, tenant_signature_ok, validate_tenant

log = logging.getLogger("kvpack.policy.tenancy")


@dataclass(frozen=True)
class TenantSource:
    """The engine facts of one request that decide its tenant and chain seed."""

    salt: str = ""
    """The engine's cache salt ("" unsalted): vLLM ``cache_salt``."""
    named: object = None
    """The tenant the request names (None: none), as the client sent it (any JSON value)."""
    signature: object = None
    """A front end's signature of `named` (`keys.tenant_signature`), or None."""
    adapter: str = ""
    """The LoRA adapter's identity ("" none): a different adapter never shares keys."""
    named_by: str = "the request"
    """Where `named` came from, for the log (vLLM: ``kv_transfer_params['kvpack_tenant']``)."""
    request_id: str = "?"
    """For the log only."""


@dataclass(frozen=True)
class RequestScope:
    """A request's tenant and the seed of its key chain (None: unsalted, no adapter), and the
    weights the engine held when the request was scoped (`kvpack.WeightsState.identity`; an
    adapter refuses its transfers once the engine holds others)."""

    tenant: str
    seed: ChunkHash | None
    weights: str = ""
    salted: bool = False
    """The request carries a cache salt: its blocks are announced to routers only by the instance
    that computed them, never through a shared tier's facts (`shares_facts`)."""


class BadTenant(ValueError):
    """The request names a tenant kvpack refuses; the request runs without the cache."""


def resolve_tenant(
    source: TenantSource,
    config: KVPackConfig | str,
    on_untrusted: Callable[[str], None] | None = None,
    warned: threading.Event | None = None,
) -> RequestScope:
    """Tenant and chain seed of one request (module docstring). Raises BadTenant for an
    invalid trusted name. A bare tenant name as `config` trusts no named tenant.
    `warned`: set once an ignored name was logged, so a caller that keeps one logs it
    once (None: logged every time)."""
    default_tenant = config if isinstance(config, str) else config.tenant
    salt = source.salt or ""
    tenant: str | None = None
    if source.named is not None:
        if not isinstance(config, str) and tenant_trusted(config, source.named, source.signature):
            if not isinstance(source.named, str):
                raise BadTenant(f"tenant must be a string, got {type(source.named).__name__}")
            tenant = source.named  # validated below
        else:
            if on_untrusted is not None:
                on_untrusted(str(source.named)[:64])
            if warned is None or not warned.is_set():
                if warned is not None:
                    warned.set()
                log.warning(
                    "kvpack: ignoring %s of request %s (and of any later request): the config trusts no "
                    "client-chosen tenant (set trusted_tenants or tenant_signing_key behind a front end that "
                    "sets it)",
                    source.named_by,
                    source.request_id,
                )
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
    if source.adapter:
        seed_parts.append(f"lora={source.adapter}")
    seed = seed_hash("\x00".join(seed_parts)) if seed_parts else None
    return RequestScope(tenant=tenant, seed=seed, salted=bool(salt))


def tenant_trusted(config: KVPackConfig, tenant: object, signature: object) -> bool:
    """May a request choose `tenant`? Under ``"*"`` anything the front end sends is its
    word, a malformed name included (then refused as BadTenant)."""
    if "*" in config.trusted_tenants:
        return True
    if not isinstance(tenant, str):
        return False
    if tenant in config.trusted_tenants:
        return True
    key = config.signing_key_bytes()
    return bool(key) and tenant_signature_ok(key, tenant, signature)


def _valid_tenant(name: str) -> bool:
    try:
        validate_tenant(name)
        return True
    except ValueError:
        return False


def shares_facts(scope: RequestScope) -> bool:
    """Whether the blocks of a request of `scope` get a facts row on a shared tier (module
    docstring): not for a salted request."""
    return not scope.salted
