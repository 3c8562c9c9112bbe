"""kvpack's counters and histograms, per tenant.

One `Metrics` object per store (no global registry): it feeds a private
prometheus-client `CollectorRegistry` (served by `serve_prometheus` or merged
into an engine's registry by the adapters) and keeps a plain mirror that
`snapshot()` returns as a dict, for tests, logs and the engines' own stats
hooks.

Every silent failure this project exists to stop has a counter here:
partial hits by missing member, rejected objects by reason, stores dropped by
reason, tier errors by status, evictions by tenant, and objects evicted between
a lookup and its load.

Label sets are bounded: the ``tenant`` label takes the tenants named in the
config plus the first `max_tenants` other tenants seen; every later tenant is
counted as `OTHER_TENANT` (20,000 ``cache_salt`` values must not become
20,000 series). A tenant keeps the label it was first given, so every series
stays monotonic.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from ..config.schema import KVPackConfig

log = logging.getLogger("kvpack")

OTHER_TENANT = "other"
"""The ``tenant`` label of every tenant beyond `Metrics.max_tenants`."""
DEFAULT_MAX_TENANTS = 64


class Kind(enum.Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"
    """A level read when scraped from the function given to `Metrics.gauge` (not in `totals`)."""


@dataclass(frozen=True)
class MetricSpec:
    name: str
    doc: str
    labels: tuple[str, ...]
    kind: Kind = Kind.COUNTER

    @property
    def labels_without_tenant(self) -> tuple[str, ...]:
        return tuple(k for k in self.labels if k != "tenant")


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("lookups", "Prefix lookups", ("tenant",)),
    MetricSpec("lookup_tokens", "Tokens asked about in lookups", ("tenant",)),
    MetricSpec("hit_tokens", "Tokens reported as hits (every required member present)", ("tenant",)),
    MetricSpec("full_hits", "Lookups whose hit covers every required member", ("tenant",)),
    MetricSpec(
        "partial_hits", "Chunks whose target was stored but a required member was not", ("tenant", "missing_member")
    ),
    MetricSpec(
        "hit_tier_tokens",
        "Tokens the engine accepted as loaded, by the tier the lookup found them in (a chunk: its farthest member's)",
        ("tier",),
    ),
    MetricSpec("tail_hit_tokens", "Tokens reused from stored partial-block tails", ("tenant",)),
    MetricSpec("loaded_tokens", "Tokens restored into the engine", ("tenant",)),
    MetricSpec(
        "sync_loads",
        "Hits loaded inside the engine step that computes the rest of the prompt (no step spent waiting)",
        ("tenant",),
    ),
    MetricSpec("loaded_bytes", "Payload bytes read", ("tenant", "tier")),
    MetricSpec(
        "loaded_in_place_bytes",
        "Payload bytes a load converted into the engine's cache straight from a tier's memory (no staging copy)",
        ("tenant",),
    ),
    MetricSpec("stored_bytes", "Payload bytes written", ("tenant", "tier")),
    MetricSpec("stored_objects", "Objects written", ("tenant", "tier")),
    MetricSpec("load_failures", "Objects that could not be loaded (the engine recomputes)", ("tenant", "status")),
    MetricSpec(
        "evicted_before_load",
        "Objects a lookup found in a tier that no longer held them at load (evicted in between; another tier or a "
        "recompute served them)",
        ("tenant", "tier"),
    ),
    MetricSpec("rejected_objects", "Stored objects refused on load", ("tier", "reason")),
    MetricSpec("store_dropped", "Stores dropped instead of blocking the engine", ("tier", "reason")),
    MetricSpec("tier_errors", "Tier calls that failed, or were not made because the tier was down", ("tier", "status")),
    MetricSpec(
        "lookups_held",
        "Lookups held back (the request waited, not the engine) while a tier made its first connect",
        ("tenant",),
    ),
    MetricSpec("budget_skips", "Remote tier calls skipped: the engine step's wait budget was spent", ("tier",)),
    MetricSpec("evictions", "Groups evicted", ("tier", "tenant")),
    MetricSpec("evicted_bytes", "Bytes evicted", ("tier", "tenant")),
    MetricSpec("cleared_objects", "Objects removed by a reset or clear (kvpack.policy.clearing)", ("tier",)),
    MetricSpec(
        "cleared_bytes", "Bytes removed by a reset or clear (0 where the tier cannot tell: Mooncake)", ("tier",)
    ),
    MetricSpec("clear_failures", "Resets or clears a tier could not apply", ("tier",)),
    MetricSpec(
        "tier_events_dropped", "Tier events (stored/removed, for KV-aware routers) dropped undrained, oldest first", ()
    ),
    MetricSpec(
        "shared_withdrawals",
        "Announced groups withdrawn from routers (removed events) because another process evicted them",
        ("tier",),
    ),
    MetricSpec(
        "shared_facts",
        "Router facts rows of a shared tier (kvpack.observe.router_facts): recorded or not_recorded by this writer;"
        " taken (announced), own or other_identity (skipped) by this reader",
        ("tier", "outcome"),
    ),
    MetricSpec("handoff_loads", "Prefill/decode handoffs loaded (objects still landing waited for)", ("tenant",)),
    MetricSpec("handoff_missing", "Handoff objects not landed within handoff_wait_ms (recomputed)", ("tenant",)),
    MetricSpec(
        "handoff_wait_seconds",
        "How long a handoff load waited for the prefill instance's objects",
        ("tenant",),
        Kind.HISTOGRAM,
    ),
    MetricSpec("lookup_seconds", "Lookup latency", ("tenant",), Kind.HISTOGRAM),
    MetricSpec("load_seconds", "Batch load latency", ("tier",), Kind.HISTOGRAM),
    MetricSpec("store_seconds", "Batch store latency", ("tier",), Kind.HISTOGRAM),
    # what an engine adapter counts around the core calls (vLLM's connector reports these,
    # with everything above, as its interval stats: `MetricsInterval`)
    MetricSpec("untrusted_tenants", "Requests whose client-chosen tenant was ignored (not trusted)", ()),
    MetricSpec("bad_tenants", "Requests run without the cache: a trusted tenant name was invalid", ()),
    MetricSpec("untrusted_pins", "Requests whose kvpack_pin was ignored (their tenant is not trusted)", ()),
    MetricSpec("pins_refused", "Groups a pin asked for past the tenant's pinned budget (not pinned)", ("tenant",)),
    MetricSpec(
        "workers_disabled",
        "Workers running without kvpack: their KV cache was refused at registration (loads recompute, no saves)",
        (),
    ),
    MetricSpec("other_split_hits", "Hits on objects another TP size stored (canonical head ranges)", ()),
    MetricSpec("external_hit_tokens", "Tokens the engine accepted as loaded from kvpack", ("tenant",)),
    MetricSpec("load_requests", "Requests handed to the workers to load", ()),
    MetricSpec("sync_load_requests", "Requests whose hit is loaded inside the engine step", ()),
    MetricSpec("sync_load_failures", "Loads inside the step that failed (recomputed)", ()),
    MetricSpec(
        "captures_dropped_failed_load",
        "Saves not taken: computed in a step whose load of the same request failed (that KV is recomputed)",
        ("tenant",),
    ),
    MetricSpec("save_blocks_planned", "Blocks the scheduler asked the workers to save", ()),
    MetricSpec("saved_blocks", "Blocks the workers saved", ()),
    MetricSpec("save_errors", "Saves that failed (a future miss, never an engine error)", ()),
    MetricSpec(
        "weight_changes",
        "In-place weight changes seen by this process, by what the new weights are (checkpoint, reloaded, private)",
        ("origin",),
    ),
    MetricSpec(
        "stale_weights_transfers",
        "Loads refused and saves dropped because the request was planned under weights since replaced",
        ("kind",),
    ),
    MetricSpec("save_dropped_at_exit", "Saves still queued when the exit flush's bound ran out (lost)", ()),
    MetricSpec("loaded_blocks", "Blocks restored into the engine", ()),
    MetricSpec("loaded_draft_blocks", "Blocks restored with their draft-model KV", ()),
    MetricSpec("loaded_without_draft_blocks", "Blocks restored without draft KV (target_only policy)", ()),
    MetricSpec("failed_blocks", "Blocks a load could not restore (recomputed)", ()),
    MetricSpec("load_error_blocks", "Blocks reported to the engine as load errors", ()),
    MetricSpec("load_timeouts", "Loads cancelled after io_timeout_ms (recomputed)", ()),
    MetricSpec("load_waits_for_saves_timed_out", "Loads that stopped waiting for earlier saves at their bound", ()),
    MetricSpec("missing_at_load", "Objects a lookup found that no tier had at load", ()),
    MetricSpec("handoff_planned", "Prefill/decode handoffs planned by a decode instance", ()),
    MetricSpec(
        "handoff_refused",
        "Handoff parameters refused (the request ran without the handoff), by reason (a fixed set)",
        ("reason",),
    ),
    MetricSpec("handoff_sent", "Prompts a prefill instance stored for a decode instance", ()),
    MetricSpec(
        "handoff_tails_dropped",
        "Handoff tails that name no tail slot of the prompt: not loaded (the whole chunks still are)",
        (),
    ),
    MetricSpec(
        "transfers_turned_away",
        "Saves (a future miss) and loads (recomputed) turned away by a host-memory bound; the engine never waits",
        ("direction", "bound"),
    ),
    MetricSpec("transfer_bytes_turned_away", "Payload bytes of the transfers turned away", ("direction", "bound")),
    MetricSpec(
        "transfers_skipped_cache_released",
        "Loads (recomputed) and saves (a future miss) not run because the engine had released its KV cache (sleep)",
        ("tenant",),
    ),
    MetricSpec("pinned_bytes", "Host memory this process holds pinned for GPU staging", (), Kind.GAUGE),
    MetricSpec(
        "host_registered_bytes",
        "Host store memory this process registered with its GPU (loads from it copy once, no staging)",
        (),
        Kind.GAUGE,
    ),
)

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """Thread-safe counters/histograms named in `SPECS` (prefix ``kvpack_``)."""

    def __init__(
        self, namespace: str = "kvpack", max_tenants: int = DEFAULT_MAX_TENANTS, named_tenants: Iterable[str] = ()
    ) -> None:
        """`max_tenants`: tenants beyond `named_tenants` with a label of their own (see the module docstring)."""
        self.max_tenants = max_tenants
        self._named = frozenset(named_tenants)
        self._seen: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        self._specs = {s.name: s for s in SPECS}
        self._prom: dict[str, Counter | Histogram | Gauge] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        for spec in SPECS:
            if spec.kind is Kind.COUNTER:
                self._prom[spec.name] = Counter(
                    spec.name, spec.doc, spec.labels, namespace=namespace, registry=self.registry
                )
            elif spec.kind is Kind.GAUGE:
                self._prom[spec.name] = Gauge(spec.name, spec.doc, namespace=namespace, registry=self.registry)
            else:
                self._prom[spec.name] = Histogram(
                    spec.name, spec.doc, spec.labels, namespace=namespace, registry=self.registry, buckets=_BUCKETS
                )
        self._server: Any = None
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        self._totals: dict[str, float] = defaultdict(float)
        """Per counter, its sum over label sets; per histogram, ``_count`` and ``_sum``: kept as
        they change, so `totals` (read once per engine step) copies ~60 numbers, never the series."""
        self._hist: dict[str, dict[tuple[str, ...], list[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0.0, 0.0, 0.0])
        )
        self._kept = {c.name: tuple(self._specs[c.name].labels.index(k) for k in c.labels) for c in exported_counters()}
        """Per counter with labels besides ``tenant``: the positions of those (`series_totals`)."""
        self._series: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
        """Per such counter and label set without the tenant: its sum, kept as it changes."""

    @classmethod
    def for_config(cls, config: KVPackConfig) -> Metrics:
        """Metrics whose tenant labels are bounded as `config` says (its tenants always named)."""
        named = {config.tenant, *config.eviction.tenant_quotas, *(t for t in config.trusted_tenants if t != "*")}
        return cls(max_tenants=config.metrics_max_tenants, named_tenants=named)

    def tenant_label(self, tenant: str, register: bool = True) -> str:
        """The ``tenant`` label `tenant` is counted under (`OTHER_TENANT` beyond the bound)."""
        if tenant in self._named or tenant in self._seen:
            return tenant
        if not register:
            return OTHER_TENANT
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.max_tenants:
                self._seen.add(tenant)
                return tenant
        return OTHER_TENANT

    def _labels(self, name: str, labels: dict[str, str], register: bool = True) -> tuple[str, ...]:
        spec = self._specs[name]
        if set(labels) != set(spec.labels):
            raise ValueError(f"metric {name} takes labels {spec.labels}, got {tuple(labels)}")
        if "tenant" in labels:
            labels = {**labels, "tenant": self.tenant_label(str(labels["tenant"]), register)}
        return tuple(str(labels[k]) for k in spec.labels)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if amount == 0:
            return
        values = self._labels(name, labels)
        prom = self._prom[name]
        (prom.labels(*values) if values else prom).inc(amount)  # type: ignore[union-attr]
        kept = self._kept.get(name)
        with self._lock:
            self._values[name][values] += amount
            self._totals[name] += amount
            if kept:
                self._series[(name, tuple(values[i] for i in kept))] += amount

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        values = self._labels(name, labels)
        self._prom[name].labels(*values).observe(seconds)  # type: ignore[union-attr]
        with self._lock:
            h = self._hist[name][values]
            h[0] += 1
            h[1] += seconds
            h[2] = max(h[2], seconds)
            self._totals[f"{name}_count"] += 1
            self._totals[f"{name}_sum"] += seconds

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """Gauge `name` reads `read()` whenever it is scraped or asked (`value`, `snapshot`)."""
        if self._specs[name].kind is not Kind.GAUGE:
            raise ValueError(f"metric {name} is not a gauge")
        self._gauges[name] = read
        self._prom[name].set_function(read)  # type: ignore[union-attr]

    def value(self, name: str, **labels: str) -> float:
        """Sum of a counter over every label set matching the given labels (a gauge: its level)."""
        spec = self._specs[name]
        if spec.kind is Kind.GAUGE:
            read = self._gauges.get(name)
            return float(read()) if read is not None else 0.0
        if "tenant" in labels:
            labels = {**labels, "tenant": self.tenant_label(str(labels["tenant"]), register=False)}
        idx = {k: spec.labels.index(k) for k in labels}
        with self._lock:
            return sum(
                v for key, v in self._values[name].items() if all(key[i] == str(labels[k]) for k, i in idx.items())
            )

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{metric: {"label=value,...": value}}``; histograms give count/sum/max."""
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for name, series in self._values.items():
                labels = self._specs[name].labels
                out[name] = {_fmt(labels, k): v for k, v in series.items()}
            for name, hists in self._hist.items():
                labels = self._specs[name].labels
                for k, (count, total, peak) in hists.items():
                    key = _fmt(labels, k)
                    out.setdefault(f"{name}_count", {})[key] = count
                    out.setdefault(f"{name}_sum", {})[key] = total
                    out.setdefault(f"{name}_max", {})[key] = peak
        for name, read in self._gauges.items():
            out[name] = {"": float(read())}
        return out

    def totals(self) -> dict[str, float]:
        """Every counter summed over its label sets, and each histogram's ``_count`` and ``_sum``."""
        with self._lock:
            return dict(self._totals)

    def series_totals(self) -> dict[str, float]:
        """Every counter of `exported_counters` that has labels besides ``tenant``, summed over
        tenants, per label set: ``{series_key(name, labels): value}``."""
        with self._lock:
            items = list(self._series.items())
        return {series_key(n, dict(zip(self._specs[n].labels_without_tenant, v))): x for (n, v), x in items}

    def serve_prometheus(self, port: int, span: int = 1, addr: str = "127.0.0.1") -> int | None:
        """Expose this registry over HTTP on the first free port of
        ``port .. port + span - 1`` (loopback by default). Returns the port, or
        None when every port was taken (the caller logs it; metrics still count)."""
        for candidate in range(port, port + span):
            try:
                served = start_http_server(candidate, addr=addr, registry=self.registry)
            except OSError:
                continue
            self._server = served[0] if isinstance(served, tuple) else None
            return candidate
        return None

    def serve_configured(self, port: int, span: int) -> int | None:
        """`serve_prometheus` on ``port .. port + span - 1`` (0: not served), logging where."""
        if not port:
            return None
        served = self.serve_prometheus(port, span)
        if served is None:
            log.warning("kvpack: no free metrics port in %d..+%d", port, span - 1)
        else:
            log.info("kvpack: metrics on http://127.0.0.1:%d/metrics", served)
        return served

    def stop_serving(self) -> None:
        """Close the HTTP endpoint started by `serve_prometheus`, if any."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MetricsInterval:
    """What `metrics` counted since the last `take`: one counter system for an engine's own
    per-interval stats hook (vLLM's ``KVConnectorStats``) and Prometheus alike."""

    def __init__(self, metrics: Metrics, series: bool = False) -> None:
        """`series`: also take the label sets of `Metrics.series_totals` (for an engine's
        own metrics endpoint; plain keys stay each counter's sum, for its log line)."""
        self._metrics = metrics
        self._series = series
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self) -> dict[str, float]:
        """``{name: increase}`` of every total that changed since the last call (see `Metrics.totals`)."""
        totals = self._metrics.totals()
        if self._series:
            totals.update(self._metrics.series_totals())
        with self._lock:
            last, self._last = self._last, totals
        return {k: v - last.get(k, 0.0) for k, v in totals.items() if v != last.get(k, 0.0)}


class Tally:
    """Per-batch accumulator: many `inc` calls on a hot path become one per label set.

    tally = Tally(metrics)
    for item in batch:
        tally.inc("stored_bytes", n, tenant=t, tier="memory")
    tally.flush()
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._acc: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self._acc[(name, tuple(labels.items()))] += amount

    def flush(self) -> None:
        for (name, labels), amount in self._acc.items():
            self._metrics.inc(name, amount, **dict(labels))
        self._acc.clear()


@dataclass(frozen=True)
class ExportedCounter:
    """A counter as an engine's own metrics endpoint shows it: summed over tenants (the
    engine's label sets stay bounded whatever the tenants), by its other labels."""

    name: str
    doc: str
    labels: tuple[str, ...]


def exported_counters() -> list[ExportedCounter]:
    """Every counter of `SPECS`, its labels without ``tenant``."""
    return [ExportedCounter(s.name, s.doc, s.labels_without_tenant) for s in SPECS if s.kind is Kind.COUNTER]


def series_key(name: str, labels: dict[str, str]) -> str:
    """One label set of a counter as a plain string key (``name{"tier":"disk"}``): an
    engine's stats payload stays a flat ``{str: number}`` that sums key by key."""
    return name + json.dumps(labels, sort_keys=True, separators=(",", ":"))


def parse_series_key(key: str) -> tuple[str, dict[str, str]] | None:
    """`series_key`'s inverse (None: a plain total's key, or not one of its keys)."""
    brace = key.find("{")
    if brace <= 0:
        return None
    try:
        labels = json.loads(key[brace:])
    except ValueError:
        return None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        return None
    return key[:brace], labels


def _fmt(labels: tuple[str, ...], values: tuple[str, ...]) -> str:
    return ",".join(f"{k}={v}" for k, v in zip(labels, values))
