"""Issue 15: a request's ``kvpack_tenant`` is the client's word, not the operator's.

Any HTTP client of vLLM's OpenAI server can send ``kv_transfer_params``; by
default kvpack ignores the tenant named there (counted, logged once) and the
request's own scope applies. An operator opts in for a trusted front end by
listing names (`trusted_tenants`) or by a key that front end signs names with
(`tenant_signing_key`). Without an engine: `request_scope` and the real
`SchedulerSide` over a real disk store.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import tenant_signature

pytest.importorskip("vllm")

from vllm_helpers import fake_request  # noqa: E402

from kvpack import BadTenant  # noqa: E402
from kvpack.vllm_plugin.request_scopes import request_scope  # noqa: E402

KEY = "5e" * 32


def _request(tenant: Any = None, salt: str | None = None, sig: str | None = None) -> Any:
    req = fake_request(list(range(32)))
    params: dict[str, Any] = {}
    if tenant is not None:
        params["kvpack_tenant"] = tenant
    if sig is not None:
        params["kvpack_tenant_sig"] = sig
    req.kv_transfer_params = params or None
    req.cache_salt = salt
    return req


def test_client_chosen_tenant_is_ignored_by_default(caplog: pytest.LogCaptureFixture) -> None:
    config = KVPackConfig()
    seen: list[str] = []
    warned = threading.Event()  # the scheduler's: logged once per scheduler, no process-wide flag
    with caplog.at_level(logging.WARNING, logger="kvpack.vllm"):
        for _ in range(3):
            assert request_scope(_request("bob"), config, seen.append, warned).tenant == "default"
    assert seen == ["bob"] * 3  # counted every time
    assert sum("kvpack_tenant" in r.getMessage() for r in caplog.records) == 1  # logged once
    # the salt's own scope applies, never the named tenant
    assert request_scope(_request("bob", salt="s1"), config).tenant == "s1"


def test_untrusted_invalid_names_are_ignored_not_trusted() -> None:
    assert request_scope(_request("../bob"), KVPackConfig()).tenant == "default"
    assert request_scope(_request("bob"), "acme").tenant == "acme"  # a bare tenant name trusts nothing


def test_listed_tenants_are_honoured_and_others_ignored() -> None:
    config = KVPackConfig.from_dict({"trusted_tenants": ["alice"]})
    assert request_scope(_request("alice"), config).tenant == "alice"
    assert request_scope(_request("bob"), config).tenant == "default"
    star = KVPackConfig.from_dict({"trusted_tenants": ["*"]})
    assert request_scope(_request("bob"), star).tenant == "bob"
    for bad in ("../bob", 12345, ["bob"], ""):
        with pytest.raises(BadTenant):
            request_scope(_request(bad), star)  # trusted, so validated: refused as before
    assert request_scope(_request(12345), config).tenant == "default"  # not listed: ignored


def test_signed_tenants_are_honoured_only_with_the_right_signature() -> None:
    config = KVPackConfig.from_dict({"tenant_signing_key": KEY})
    good = tenant_signature(bytes.fromhex(KEY), "bob")
    assert request_scope(_request("bob", sig=good), config).tenant == "bob"
    assert request_scope(_request("mallory", sig=good), config).tenant == "default"  # bob's signature, not mallory's
    assert request_scope(_request("bob", sig="00" * 32), config).tenant == "default"
    assert request_scope(_request("bob"), config).tenant == "default"
    other = tenant_signature(b"\x01" * 32, "bob")
    assert request_scope(_request("bob", sig=other), config).tenant == "default"


def test_scheduler_counts_ignored_tenants_and_never_looks_up_the_named_one(tmp_path: Path) -> None:
    from kvpack.identity.layout_spec import KVLayoutSpec
    from kvpack.policy.groups import Coverage
    from kvpack.vllm_plugin.scheduler import SchedulerSide
    from kvpack.vllm_plugin.scopes import CacheGroup, Scope

    config = KVPackConfig.from_dict({"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv")}})
    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="m", dtype="float32", chunk_tokens=16)
    side = SchedulerSide(
        config, Scope(spec=spec, members=("kv",), block_size=16, draft="", groups=groups, world=1), True, True
    )
    try:
        scope = side._scope_of(_request("bob"))  # noqa: SLF001
        assert scope is not None and scope.tenant == "default"
        assert side.take_stats().get("untrusted_tenants") == 1  # the connector stats are the metrics' increases
        assert side.session.metrics.value("untrusted_tenants") == 1
    finally:
        side.close()
