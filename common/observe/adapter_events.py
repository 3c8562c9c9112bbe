"""What an engine adapter tells the core happened, each counted under one metric.

An adapter reports engine facts as events (`Session.record`); the core owns the metric
each event is counted as (the member's value, a name in `kvpack.observe.metrics.SPECS`), so no
adapter names a metric (tests/common/test_structure.py holds it for every adapter module).
"""

from __future__ import annotations

import enum


class AdapterEvent(enum.Enum):
    """An event an adapter reports; the value is the counter it is counted under."""

    UNTRUSTED_TENANT = "untrusted_tenants"
    """A request named a tenant the config does not trust (ignored; its own scope applies)."""
    BAD_TENANT = "bad_tenants"
    """A trusted tenant name was invalid: the request runs without the cache."""
    UNTRUSTED_PIN = "untrusted_pins"
    """A request asked to pin its prompt under a tenant the config does not trust (ignored)."""
    HANDOFF_REFUSED = "handoff_refused"
    """A prefill instance's handoff was refused (by reason: `Refusals`)."""
    HANDOFF_SENT = "handoff_sent"
    """A prefill instance told a decode instance what it stored."""
    LOAD_REQUESTED = "load_requests"
    """A request's hit was handed to the engine's workers to load."""
    SYNC_LOAD_REQUESTED = "sync_load_requests"
    """... to load inside the engine step that computes the rest of the prompt."""
    EXTERNAL_HIT_TOKENS = "external_hit_tokens"
    """Tokens the engine accepted as loaded from kvpack (per tenant)."""
    SAVE_BLOCKS_PLANNED = "save_blocks_planned"
    """Blocks the engine's workers were asked to save."""
    LOADED_TOKENS = "loaded_tokens"
    """Tokens restored into the engine's cache (per tenant; a page counts once, whatever its pools)."""


class AdapterRefusal(enum.Enum):
    """Why an adapter answered an engine call as a miss without a store call; counted as
    ``tier_errors`` with the adapter's engine as the tier and the member's value as status."""

    BAD_KEY = "bad_key"
    """A page or chunk key that is not a valid chunk hash."""
    UNKNOWN_POOL = "unknown_pool"
    """A call on a pool the adapter never bound (not registered, or not describable)."""
    EXCEPTION = "exception"
    """The call raised inside the adapter; the engine got a miss instead."""
