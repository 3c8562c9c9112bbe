"""kvpack's vLLM adapter: the `KVPackConnector` KV connector.

`register()` is the ``vllm.general_plugins`` entry point (it runs in every
vLLM process): it registers ``KVPackConnector`` with vLLM's
`KVConnectorFactory` by module path, so nothing heavy is imported until vLLM
builds the connector. ``kv_connector_module_path="kvpack.vllm_plugin"`` works
too: the class is resolved lazily from this package.

Modules: `connector` (the vLLM class, routing only), `scheduler` and `worker`
(the two halves), `metadata` (what passes between them, and a hit plan as the
blocks vLLM allocated), `scopes` (vLLM's config -> kvpack config and `Scope`), `request_scopes`
(a request's tenant and seed), `handoff` (prefill/decode), `captures` (what each
step saves), `state_tails` (Mamba state handed over at finish), `workers_memory` (the
scheduler's index of the workers' memory tiers), `registration`
(what a worker copies), `loads` (a load's staging rows and scatter), `saves`,
`blocks` and `canonical_blocks` (whole-block and canonical copies).
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "KVPackConnector"


def register() -> None:
    """Register ``KVPackConnector`` with vLLM (idempotent; tolerates an earlier registration)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent: nothing to register with
        return
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvpack.vllm_plugin.connector", CONNECTOR_NAME)
    except ValueError:  # registered concurrently under the same name
        pass


def __getattr__(name: str) -> Any:
    if name in (CONNECTOR_NAME, "KVPackConnectorStats"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
