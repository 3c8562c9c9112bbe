"""A vLLM request's tenant and chain seed (`kvpack.RequestScope`), or None for a request that
does not use the cache: one with images or prompt embeddings (its KV is not a function of its
token ids), or one whose trusted tenant name is invalid (`BadTenant`: logged once per process,
counted as ``kvpack_bad_tenants``). A client-named tenant the config does not trust is
ignored, counted as ``kvpack_untrusted_tenants`` and warned about once (`settings.request_scope`,
`kvpack.tenancy.resolve_tenant`: the core holds the policy)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvpack import MAX_DETAIL_CHARS, AdapterEvent, KVPackConfig, RequestScope, Session, clip

from .settings import BadTenant, cacheable, request_scope

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvpack.vllm")


class RequestScopes:
    """The scopes of one scheduler's requests (see the module docstring)."""

    def __init__(self, config: KVPackConfig, session: Session) -> None:
        self.config = config
        self.session = session
        self._untrusted_warned = threading.Event()
        self._bad_tenant_logged = threading.Event()

    def of(self, request: Request) -> RequestScope | None:
        if not cacheable(request):
            return None
        try:
            return request_scope(
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
