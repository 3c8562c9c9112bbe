"""The core's tenant policy (`kvpack.policy.tenancy`), from engine facts alone: no engine.

The vLLM adapter's `request_scope` hands it ``cache_salt`` and ``kv_transfer_params``
(tests/vllm/test_safety_tenants.py); any other adapter hands it the same facts.
"""

from __future__ import annotations

import pytest

from kvpack import BadTenant, KVPackConfig, TenantSource, resolve_tenant, shares_facts
from kvpack.identity.keys import seed_hash, tenant_signature

KEY = "a1" * 32


def test_named_tenant_needs_trust() -> None:
    seen: list[str] = []
    assert resolve_tenant(TenantSource(named="bob"), KVPackConfig(), seen.append).tenant == "default"
    assert seen == ["bob"]
    listed = KVPackConfig.from_dict({"trusted_tenants": ["bob"]})
    assert resolve_tenant(TenantSource(named="bob"), listed).tenant == "bob"
    signed = KVPackConfig.from_dict({"tenant_signing_key": KEY})
    sig = tenant_signature(bytes.fromhex(KEY), "bob")
    assert resolve_tenant(TenantSource(named="bob", signature=sig), signed).tenant == "bob"
    assert resolve_tenant(TenantSource(named="eve", signature=sig), signed).tenant == "default"
    with pytest.raises(BadTenant):
        resolve_tenant(TenantSource(named="../x"), KVPackConfig.from_dict({"trusted_tenants": ["*"]}))


def test_salt_scopes_tenant_and_seeds_the_chain() -> None:
    plain = resolve_tenant(TenantSource(), "acme")
    assert plain.tenant == "acme" and plain.seed is None
    salted = resolve_tenant(TenantSource(salt="s1"), "acme")
    assert salted.tenant == "s1" and salted.seed == seed_hash("salt=s1")
    odd = resolve_tenant(TenantSource(salt="a b/c"), "acme")
    assert odd.tenant.startswith("salt-") and len(odd.tenant) == len("salt-") + 16
    lora = resolve_tenant(TenantSource(salt="s1", adapter="sql:3"), "acme")
    assert lora.tenant == "s1" and lora.seed == seed_hash("salt=s1\x00lora=sql:3") != salted.seed


def test_only_unsalted_requests_share_their_blocks_facts() -> None:
    """A salted request's blocks get no facts row on a shared tier (kvpack.observe.router_facts): only the
    instance that computed them announces them to its routers; a named tenant does not change it."""
    trusted = KVPackConfig.from_dict({"trusted_tenants": ["*"]})
    for source, shares in (
        (TenantSource(), True),
        (TenantSource(named="bob"), True),
        (TenantSource(adapter="lora:1"), True),
        (TenantSource(salt="s"), False),
        (TenantSource(salt="s", named="bob"), False),
    ):
        scope = resolve_tenant(source, trusted)
        assert (scope.salted, shares_facts(scope)) == (not shares, shares), source
