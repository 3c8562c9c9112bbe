"""Prefill/decode disaggregation through the store: vLLM's handoff protocol, in kvpack terms.

vLLM's disaggregated serving (its proxies, its NIXL and Mooncake connectors)
works like this: the proxy sends a prompt to the prefill instance with
``kv_transfer_params: {"do_remote_decode": true}`` and ``max_tokens: 1``; the
prefill side's ``request_finished`` returns the ``kv_transfer_params`` for the
decode side, which vLLM puts in the response; the proxy sends the request with
those params to the decode instance, whose connector sees
``do_remote_prefill`` and loads asynchronously before the request runs.

kvpack speaks it over a shared tier (disk, Mooncake). The prefill instance
saves every block in the step that computes it, so when its one token comes
back the objects are written or in flight; it answers with a `Handoff`: the
layout group's fingerprint, the tenant, how many prompt tokens it computed
and where its partial-block tail went. The decode instance checks that the
fingerprint and tenant are its own (a mismatch is refused at once, with an
error naming both; it then recomputes), and loads every chunk, waiting at
most ``handoff_wait_ms`` for objects still landing; what is not there by then is
recomputed (counted), never waited on longer.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpack import HandoffClaim, clip

HANDOFF_KEY = "kvpack"
"""Key of kvpack's handoff inside ``kv_transfer_params``."""


class HandoffRefusal(enum.Enum):
    """Why a handoff was refused: the ``reason`` label of ``kvpack_handoff_refused_total``."""

    MALFORMED = "malformed"
    """Not an object, or a field of the wrong type or range."""
    OTHER_LAYOUT = "other_layout"
    """Another layout group's fingerprint (model, dtype, block size, parallel sizes, format)."""
    OTHER_TENANT = "other_tenant"
    """Another tenant than the request's own."""
    OTHER_HEAD_SPLIT = "other_head_split"
    """A head split this model has not (canonical objects)."""


class HandoffError(ValueError):
    """Handoff params that are malformed, or that name another layout or tenant.

    The message quotes the client's values only through `kvpack.client_input.clip`."""

    def __init__(self, reason: HandoffRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Handoff:
    """What a decode instance needs to load a prefill instance's prompt from the store."""

    fingerprint: str
    """The prefill instance's layout group fingerprint (must equal the decode side's)."""
    tenant: str
    tokens: int
    """Prompt tokens the prefill instance computed (and saved)."""
    tail_chunk: str | None
    """Chunk id of the saved partial-block tail (None: the prompt ends on a block boundary;
    ``""``: the prefill instance sent something that is not a string). The decode side loads
    it only if it is a tail slot after the prompt's last whole chunk (`kvpack.policy.hits`); any
    other value drops the tail alone, never the handoff's whole chunks."""
    head_ranges: int = 0
    """Canonical objects: how many KV-head ranges the prefill instance stores each chunk
    as (its head split, `kvpack.identity.heads`: 2 for a TP=2 engine of a model with 2 or more KV
    heads), so a decode instance at another TP size reads the objects the prefill
    instance wrote. 0: native objects, or a prefill instance that did not say (the decode
    instance's own split)."""

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the prefill instance returns for the decode instance."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            HANDOFF_KEY: {
                "fingerprint": self.fingerprint,
                "tenant": self.tenant,
                "tokens": self.tokens,
                "tail_chunk": self.tail_chunk,
                "head_ranges": self.head_ranges,
            },
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Handoff | None:
        """The handoff in a decode request's params (None: not a kvpack handoff).
        Raises HandoffError for a malformed one."""
        if not params or not params.get("do_remote_prefill") or HANDOFF_KEY not in params:
            return None
        raw = params[HANDOFF_KEY]
        bad = HandoffRefusal.MALFORMED
        if not isinstance(raw, Mapping):
            raise HandoffError(bad, f"kv_transfer_params[{HANDOFF_KEY!r}] must be an object, got {clip(raw)}")
        fingerprint, tenant, tokens, tail = (
            raw.get("fingerprint"),
            raw.get("tenant"),
            raw.get("tokens"),
            raw.get("tail_chunk"),
        )
        if not isinstance(fingerprint, str) or not isinstance(tenant, str):
            raise HandoffError(bad, "kvpack handoff needs string 'fingerprint' and 'tenant'")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise HandoffError(bad, f"kvpack handoff 'tokens' must be an integer >= 0, got {clip(tokens)}")
        if tail is not None and not isinstance(tail, str):
            tail = ""  # names no tail: dropped by the plan, the whole chunks still load
        ranges = raw.get("head_ranges", 0)
        if not isinstance(ranges, int) or isinstance(ranges, bool) or ranges < 0:
            raise HandoffError(bad, f"kvpack handoff 'head_ranges' must be an integer >= 0, got {clip(ranges)}")
        return cls(fingerprint, tenant, tokens, tail, ranges)

    def check(self, fingerprint: str, tenant: str) -> None:
        """Raise HandoffError unless this handoff is for `fingerprint` and `tenant`."""
        if self.fingerprint != fingerprint:
            raise HandoffError(
                HandoffRefusal.OTHER_LAYOUT,
                f"the prefill instance stores layout {clip(self.fingerprint)}, this decode instance reads "
                f"{fingerprint}: model, dtype, block size, parallel sizes and kvpack's format must match on both sides",
            )
        if self.tenant != tenant:
            raise HandoffError(
                HandoffRefusal.OTHER_TENANT,
                f"the prefill instance stored tenant {clip(self.tenant)}, this request is tenant {tenant!r}",
            )


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """True for a prefill request of a disaggregated pair (vLLM's ``do_remote_decode``)."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


def handoff_claim(
    params: Mapping[str, Any] | None, fingerprint: str, tenant: str, split_sizes: Sequence[int]
) -> HandoffClaim | None:
    """The prefill instance's handoff in a request's ``kv_transfer_params``, as the core's
    `HandoffClaim` (None: the request carries none). Checked against this engine's layout
    `fingerprint` and the request's `tenant`; its head split is the index into `split_sizes`
    (canonical objects: each head split's number of ranges, the engine's own first; empty
    otherwise) of the ranges the prefill instance wrote (0: this engine's own). Raises
    HandoffError, with its refusal reason, for a handoff this engine must refuse."""
    handoff = Handoff.from_params(params)
    if handoff is None:
        return None
    handoff.check(fingerprint, tenant)
    source = 0
    if handoff.head_ranges and split_sizes:
        found = next((i for i, size in enumerate(split_sizes) if size == handoff.head_ranges), None)
        if found is None:
            raise HandoffError(
                HandoffRefusal.OTHER_HEAD_SPLIT,
                f"the prefill instance stores each chunk as {clip(handoff.head_ranges)} KV-head ranges; "
                f"this model's heads split into {sorted(split_sizes)} ranges only",
            )
        source = found
    return HandoffClaim(tokens=handoff.tokens, tail_chunk=handoff.tail_chunk, source=source)
