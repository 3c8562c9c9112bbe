"""`EngineCounters`: kvpack's interval stats as counters in an engine's own Prometheus registry."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvpack import EngineCounters, Metrics, MetricsInterval


def test_each_engine_core_has_its_series_and_tenants_are_summed_away() -> None:
    registry = CollectorRegistry()
    counters = EngineCounters(
        partial(Counter, registry=registry), "eng:kvpack_", ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    )
    for engine, tenants in ((0, ("a", "b")), (1, ("c",))):  # two engine cores (data-parallel ranks)
        m = Metrics()
        interval = MetricsInterval(m, series=True)
        for t in tenants:
            m.inc("loaded_bytes", 100, tenant=t, tier="disk")
            m.inc("hit_tier_tokens", 7, tier="host")
            m.inc("loaded_tokens", 5, tenant=t)
        m.observe("lookup_seconds", 0.1, tenant=tenants[0])  # a histogram: not exported here
        counters.add(interval.take(), engine)
        counters.add(interval.take(), engine)  # an empty interval adds nothing
    text = generate_latest(registry).decode()
    assert 'eng:kvpack_loaded_bytes_total{engine="0",model_name="m",tier="disk"} 200.0' in text
    assert 'eng:kvpack_loaded_bytes_total{engine="1",model_name="m",tier="disk"} 100.0' in text
    assert 'eng:kvpack_hit_tier_tokens_total{engine="0",model_name="m",tier="host"} 14.0' in text
    assert 'eng:kvpack_loaded_tokens_total{engine="1",model_name="m"} 5.0' in text
    assert "tenant=" not in text and "lookup_seconds" not in text
    counters.add({"no_such_counter": 3, "loaded_bytes": 9}, 0)  # unknown keys and a labelled plain sum: skipped
    assert (
        'eng:kvpack_loaded_bytes_total{engine="0",model_name="m",tier="disk"} 200.0'
        in generate_latest(registry).decode()
    )
