"""The hostile client's requests: what any HTTP client of vLLM's OpenAI server may send kvpack.

Every request is a real completion body (``/v1/completions``) whose kvpack-facing fields
come from the client: ``kv_transfer_params`` (a kvpack handoff, a tenant name and its
signature, anything else) and ``cache_salt``. `hostile_fields` makes the `i`-th such set,
cycling through `KINDS`; each large field is distinct (it starts with `i`), so nothing
that keeps refused input by value could share it between requests.
"""

from __future__ import annotations

import enum
import random
from typing import Any

from kvpack.tools.tinymodel import VOCAB_WORDS

HANDOFF_KEY = "kvpack"
"""The handoff's key in ``kv_transfer_params`` (`kvpack.vllm_plugin.handoff`)."""
DEEP = 20
SALT_CHARS = 128
"""vLLM's largest ``cache_salt`` (its OpenAI server answers 400 to a longer one)."""
"""Nesting depth of the deep-value kind (vLLM's request parser reads it; kvpack refuses it)."""


class Kind(enum.Enum):
    """One way a client sends kvpack something it must refuse or ignore."""

    HANDOFF_FINGERPRINT = "handoff_fingerprint"
    """A handoff naming a large unknown layout fingerprint (refused: other layout)."""
    HANDOFF_TENANT = "handoff_tenant"
    """A handoff for a large tenant name (refused: other tenant)."""
    HANDOFF_TOKENS = "handoff_tokens"
    """A handoff whose token count is a large string (refused: malformed)."""
    HANDOFF_NEGATIVE = "handoff_negative"
    """A handoff whose head split is a large negative integer, beside a large unknown field
    (refused: malformed; vLLM itself answers 400 to integers past 64 bits)."""
    HANDOFF_NOT_AN_OBJECT = "handoff_not_an_object"
    """A handoff that is a large string (refused: malformed)."""
    HANDOFF_TAIL = "handoff_tail"
    """A handoff whose tail chunk is a large string (refused, or the tail dropped)."""
    FORGED_TENANT = "forged_tenant"
    """A large tenant name the config does not trust (ignored, counted)."""
    FORGED_SIGNATURE = "forged_signature"
    """A trusted-looking tenant with a large forged signature (ignored, counted)."""
    SALT = "salt"
    """A distinct ``cache_salt`` of vLLM's largest size (128 characters; its own scope, a tenant
    of its own) beside a large field kvpack never reads."""
    DEEP_PARAMS = "deep_params"
    """``kv_transfer_params`` holding a large deeply nested value under kvpack's keys."""


KINDS = tuple(Kind)
PAD_KEY = "not_kvpacks"
"""A ``kv_transfer_params`` key kvpack never reads: the padded benign requests' large field."""


def padded_fields(i: int, field_chars: int) -> dict[str, Any]:
    """A benign request's extra fields carrying a distinct large field where kvpack never looks:
    what vLLM's own transport of such a request costs, beside the hostile ones."""
    return {"kv_transfer_params": {PAD_KEY: f"{i:08d}" + "x" * max(0, field_chars - 8)}}


def prompt(rng: random.Random, words: int) -> str:
    """A prompt of `words` words of the tiny model's vocabulary (one token each)."""
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(words))


def _handoff(tokens: Any, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"fingerprint": "0" * 32, "tenant": "default", "tokens": tokens, "tail_chunk": None}
    body["head_ranges"] = 0
    body.update(fields)
    return {"do_remote_prefill": True, "do_remote_decode": False, HANDOFF_KEY: body}


def hostile_fields(i: int, field_chars: int, prompt_tokens: int) -> tuple[Kind, dict[str, Any]]:
    """The `i`-th hostile request's extra body fields (beside model, prompt and max_tokens),
    with a distinct large field of `field_chars` characters."""
    kind = KINDS[i % len(KINDS)]
    big = f"{i:08d}" + "x" * max(0, field_chars - 8)
    if kind is Kind.HANDOFF_FINGERPRINT:
        return kind, {"kv_transfer_params": _handoff(prompt_tokens, fingerprint=big)}
    if kind is Kind.HANDOFF_TENANT:
        return kind, {"kv_transfer_params": _handoff(prompt_tokens, tenant=big)}
    if kind is Kind.HANDOFF_TOKENS:
        return kind, {"kv_transfer_params": _handoff(big)}
    if kind is Kind.HANDOFF_NEGATIVE:
        return kind, {"kv_transfer_params": _handoff(prompt_tokens, head_ranges=-(2**62) - i, pad=big)}
    if kind is Kind.HANDOFF_NOT_AN_OBJECT:
        return kind, {"kv_transfer_params": {"do_remote_prefill": True, HANDOFF_KEY: big}}
    if kind is Kind.HANDOFF_TAIL:
        return kind, {"kv_transfer_params": _handoff(prompt_tokens, tail_chunk=big)}
    if kind is Kind.FORGED_TENANT:
        return kind, {"kv_transfer_params": {"kvpack_tenant": big}}
    if kind is Kind.FORGED_SIGNATURE:
        return kind, {"kv_transfer_params": {"kvpack_tenant": "admin", "kvpack_tenant_sig": big}}
    if kind is Kind.SALT:
        return kind, {"cache_salt": f"{i:08d}" + "s" * (SALT_CHARS - 8), **padded_fields(i, field_chars)}
    deep: Any = big
    for _ in range(DEEP):
        deep = [deep]
    return kind, {"kv_transfer_params": {"kvpack_tenant": deep, "kvpack_tenant_sig": deep, HANDOFF_KEY: deep}}
