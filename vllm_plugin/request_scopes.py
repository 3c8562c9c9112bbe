"""A vLLM request's tenant and chain seed (`kvpack.RequestScope`), or None for a request that
does not use the cache.

`request_scope` hands the core's `kvpack.policy.tenancy.resolve_tenant` the request's engine facts
(``cache_salt``, ``kv_transfer_params["kvpack_tenant"]`` and its signature, the LoRA
adapter); the core holds the policy (trusted names, signed names, the salt's scope, the
default). `RequestScopes.of` answers None for a request with images or prompt embeddings
(its KV is not a function of its token ids, `cacheable`) or whose trusted tenant name is
invalid (`BadTenant`: logged once per process, counted as ``kvpack_bad_tenants``); a
client-named tenant the config does not trust is ignored, counted as
``kvpack_untrusted_tenants`` and warned about once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvpack import (
    MAX_DETAIL_CHARS,
    AdapterEvent,
    BadTenant,
    KVPackConfig,
    RequestScope,
    Session,
    TenantSource,
    WeightsState,
    adapter_identity,
    clip,
    pin_trusted,
    resolve_tenant,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvpack.vllm")

TENANT_PARAM = "kvpack_tenant"
"""Key of ``kv_transfer_params`` naming a request's tenant."""
TENANT_SIG_PARAM = "kvpack_tenant_sig"
"""Key of ``kv_transfer_params`` with a front end's signature of ``kvpack_tenant`` (`tenant_signing_key`)."""


def request_scope(
    request: Request,
    config: KVPackConfig | str,
    on_untrusted: Callable[[str], None] | None = None,
    warned: threading.Event | None = None,
) -> RequestScope:
    """Tenant and chain seed of `request`: its engine facts (``cache_salt``,
    ``kv_transfer_params["kvpack_tenant"]`` and ``["kvpack_tenant_sig"]``, the LoRA
    adapter) handed to the core's `kvpack.policy.tenancy.resolve_tenant`, which decides.
    Raises BadTenant for an invalid trusted tenant name."""
    params: dict[str, Any] = getattr(request, "kv_transfer_params", None) or {}
    if not isinstance(params, dict):
        params = {}
    lora = getattr(request, "lora_request", None)
    adapter = "" if lora is None else lora_identity(lora)
    source = TenantSource(
        salt=getattr(request, "cache_salt", None) or "",
        named=params.get(TENANT_PARAM),
        signature=params.get(TENANT_SIG_PARAM),
        adapter=adapter,
        named_by=f"kv_transfer_params[{TENANT_PARAM!r}]",
        request_id=str(getattr(request, "request_id", "?")),
    )
    return resolve_tenant(source, config, on_untrusted, warned)


def lora_identity(lora: Any) -> str:
    """A LoRA request's adapter by content (`kvpack.adapter_identity` of its ``lora_path``),
    by ``<name>:<int id>`` where its files are not on this machine."""
    name = f"{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}"
    return adapter_identity(getattr(lora, "lora_path", None) or getattr(lora, "path", None), name)


def cacheable(request: Request) -> bool:
    """Requests whose KV is a function of their token ids only (no images, no embeddings)."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


class RequestScopes:
    """The scopes of one scheduler's requests (see the module docstring)."""

    def __init__(self, config: KVPackConfig, session: Session) -> None:
        self.config = config
        self.session = session
        self._untrusted_warned = threading.Event()
        self._bad_tenant_logged = threading.Event()
        self._untrusted_pin_logged = threading.Event()
        self.weights = WeightsState()
        """The engine's weights as the workers last reported them: every request scoped from now on
        carries their identity (its transfers are refused under other weights)."""

    def adopt(self, weights: WeightsState | None) -> bool:
        """True when `weights` (a workers' report; None: no news) is newer than what requests carry
        now: from here on they carry it."""
        if weights is None or not weights.newer_than(self.weights):
            return False
        self.weights = weights
        return True

    def pins(self, request: Request) -> bool:
        """Does `request` ask to pin its prompt (``kv_transfer_params["kvpack_pin"]``) under a tenant the
        config trusts (`kvpack.pin_trusted`)? An untrusted ask is ignored, counted (``kvpack_untrusted_pins``)
        and logged once per scheduler."""
        asked = pin_trusted(self.config, getattr(request, "kv_transfer_params", None))
        if asked is False:
            self.session.record(AdapterEvent.UNTRUSTED_PIN)
            if not self._untrusted_pin_logged.is_set():
                self._untrusted_pin_logged.set()
                log.warning(
                    "kvpack: ignoring kv_transfer_params['kvpack_pin'] of request %s (and of any later one): only a "
                    "request whose kvpack_tenant the config trusts may pin",
                    clip(request.request_id),
                )
        return bool(asked)

    def of(self, request: Request) -> RequestScope | None:
        if not cacheable(request):
            return None
        try:
            rs = request_scope(
                request,
                self.config,
                lambda _asked: self.session.record(AdapterEvent.UNTRUSTED_TENANT),
                self._untrusted_warned,
            )
        except BadTenant as exc:
            if not self._bad_tenant_logged.is_set():  # once per process: the name is the client's
                self._bad_tenant_logged.set()
                log.warning(
                    "kvpack: request %s runs without the cache: %s (later ones are only counted: kvpack_bad_tenants)",
                    clip(request.request_id),
                    clip(str(exc), MAX_DETAIL_CHARS),
                )
            self.session.record(AdapterEvent.BAD_TENANT)
            return None
        return replace(rs, weights=self.weights.identity) if self.weights.identity else rs
