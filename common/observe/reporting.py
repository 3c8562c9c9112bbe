"""What an adapter reports, and reads back, in one place (`Session.report`).

An adapter counts what it saw (`AdapterEvent`: the core names each metric), what it
answered as a miss itself (`AdapterRefusal`), and refused client input of one kind
(`Refusals`: counted by reason, logged once per reason). It reads the counters back
(`snapshot`), and may ask the store's tiers to report what they take and let go
(`tier_events`). Counting never raises and never blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..client_input import Refusals
from .adapter_events import AdapterEvent, AdapterRefusal
from .metrics import Metrics
from .tier_events import TierEventFeed

ADAPTER_REFUSALS = "tier_errors"
"""The counter of engine calls an adapter answered as a miss itself: the engine as the tier,
the reason as the status."""


class Reporting:
    """One session's reporting surface over the store's `Metrics`."""

    def __init__(self, metrics: Metrics, tier_events: Callable[[], TierEventFeed]) -> None:
        self.metrics = metrics
        """The store's counters, gauges and histograms (what an adapter counts goes here too)."""
        self._tier_events = tier_events

    def record(self, event: AdapterEvent, amount: float = 1, tenant: str | None = None) -> None:
        """Add `amount` (the event's unit: tokens, blocks, requests) to `event`'s metric, per
        `tenant` when given."""
        if tenant is None:
            self.metrics.inc(event.value, amount)
        else:
            self.metrics.inc(event.value, amount, tenant=tenant)

    def refused(self, engine: str, why: AdapterRefusal) -> None:
        """Count an engine call the adapter answered as a miss itself (`AdapterRefusal`): a
        ``tier_errors`` count with `engine` as the tier and the reason as the status."""
        self.metrics.inc(ADAPTER_REFUSALS, tier=engine, status=why.value)

    def engine_refusals(self, engine: str, what: str, logger: logging.Logger) -> Refusals:
        """A `Refusals` of engine calls the adapter answers as a miss itself (`AdapterRefusal`):
        each counted as `refused` counts it, the first of each reason logged as a warning."""
        return Refusals(
            self.metrics,
            ADAPTER_REFUSALS,
            what,
            logger,
            label="status",
            labels={"tier": engine},
            level=logging.WARNING,
        )

    def refusals(self, event: AdapterEvent, what: str, logger: logging.Logger) -> Refusals:
        """A `Refusals` of client input of one kind (`what`), counted under `event`'s metric by
        reason and logged on `logger` once per reason."""
        return Refusals(self.metrics, event.value, what, logger)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every counter's and gauge's value by label set (`Metrics.snapshot`)."""
        return self.metrics.snapshot()

    def tier_events(self) -> TierEventFeed:
        """From now on, report what this process's tiers take and let go (`kvpack.observe.tier_events`:
        a bounded feed the adapter drains, e.g. into vLLM's KV events for routers)."""
        return self._tier_events()


__all__ = ["Reporting"]
