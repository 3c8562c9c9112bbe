"""kvpack's counters in an engine's own Prometheus registry, fed by its per-interval stats.

An engine that gathers its connector's stats every step and serves one /metrics (vLLM)
hands each interval's increases (`MetricsInterval` with ``series=True``: plain sums and
`series_key` label sets) to `EngineCounters.add` with the index of the engine core that
sent them. Every counter of `exported_counters` becomes one family ``<prefix><name>``
with the engine's labels first, then kvpack's (never ``tenant``). Label sets are bounded:
the engine's per engine, kvpack's fixed sets (tiers, reasons, members).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .metrics import ExportedCounter, exported_counters, parse_series_key

CounterFactory = Callable[..., Any]
"""A prometheus-client ``Counter`` class (or the engine's wrapper of it): called as
``make(name=..., documentation=..., labelnames=[...])``; the result has ``labels(*values)``
whose child has ``inc(amount)``."""


class EngineCounters:
    """See the module docstring. Not thread-safe: the engine's stats thread calls `add`."""

    def __init__(
        self,
        make: CounterFactory,
        prefix: str,
        engine_labels: Sequence[str],
        per_engine: Mapping[int, Sequence[object]],
    ) -> None:
        """`per_engine`: each engine core's index -> its values of `engine_labels`."""
        self._per_engine = per_engine
        self._specs: dict[str, ExportedCounter] = {c.name: c for c in exported_counters()}
        self._families = {
            c.name: make(name=prefix + c.name, documentation=f"kvpack: {c.doc}", labelnames=[*engine_labels, *c.labels])
            for c in self._specs.values()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def add(self, interval: Mapping[str, Any], engine: int = 0) -> None:
        """Add one interval's increases to engine core `engine`'s series (keys that are no
        exported counter's, a histogram's count or sum, a labelled counter's plain sum, are skipped)."""
        for key, value in interval.items():
            if isinstance(value, (int, float)) and value > 0:
                child = self._child(engine, key)
                if child is not None:
                    child.inc(value)

    def _child(self, engine: int, key: str) -> Any:
        if (engine, key) in self._children:
            return self._children[(engine, key)]
        parsed = parse_series_key(key)
        name, labels = parsed if parsed is not None else (key, {})
        spec = self._specs.get(name)
        values = self._per_engine.get(engine)
        child = None
        if spec is not None and values is not None and set(labels) == set(spec.labels):
            child = self._families[name].labels(*values, *(labels[k] for k in spec.labels))
        self._children[(engine, key)] = child
        return child
