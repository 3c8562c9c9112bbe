"""One counter system: `Metrics.totals` and `MetricsInterval`, the engine's per-interval stats."""

from __future__ import annotations

from kvpack import Metrics, MetricsInterval, exported_counters, parse_series_key, series_key


def test_totals_are_the_series_summed_and_an_interval_takes_each_increase_once() -> None:
    m = Metrics()
    interval = MetricsInterval(m)
    m.inc("loaded_tokens", 5, tenant="a")
    m.inc("loaded_tokens", 7, tenant="b")
    m.inc("save_errors")  # a label-less counter
    m.observe("lookup_seconds", 0.25, tenant="a")
    snap = m.snapshot()
    assert m.totals()["loaded_tokens"] == sum(snap["loaded_tokens"].values()) == 12
    assert interval.take() == {
        "loaded_tokens": 12,
        "save_errors": 1,
        "lookup_seconds_count": 1,
        "lookup_seconds_sum": 0.25,
    }
    assert interval.take() == {}  # nothing counted since
    m.inc("save_errors", 2)
    assert interval.take() == {"save_errors": 2}
    assert m.value("save_errors") == 3


def test_an_engines_interval_also_takes_each_label_set_summed_over_tenants() -> None:
    """vLLM's /metrics gets kvpack's counters by tier, reason and member, never by tenant
    (bounded series whatever the tenants); its log line keeps the plain sums."""
    m = Metrics()
    interval = MetricsInterval(m, series=True)
    m.inc("loaded_bytes", 10, tenant="a", tier="disk")
    m.inc("loaded_bytes", 5, tenant="b", tier="disk")
    m.inc("loaded_bytes", 1, tenant="b", tier="memory")
    m.inc("rejected_objects", tier="disk", reason="checksum")
    m.inc("partial_hits", 3, tenant="a", missing_member="draft")
    m.inc("loaded_tokens", 4, tenant="a")  # labelled by tenant only: its sum is its only series
    taken = interval.take()
    assert taken == {
        "loaded_bytes": 16,
        "rejected_objects": 1,
        "partial_hits": 3,
        "loaded_tokens": 4,
        series_key("loaded_bytes", {"tier": "disk"}): 15,
        series_key("loaded_bytes", {"tier": "memory"}): 1,
        series_key("rejected_objects", {"tier": "disk", "reason": "checksum"}): 1,
        series_key("partial_hits", {"missing_member": "draft"}): 3,
    }
    assert parse_series_key(series_key("rejected_objects", {"tier": "disk", "reason": "checksum"})) == (
        "rejected_objects",
        {"reason": "checksum", "tier": "disk"},
    )
    assert parse_series_key("loaded_bytes") is None
    m.inc("loaded_bytes", 2, tenant="c", tier="disk")
    assert interval.take() == {"loaded_bytes": 2, series_key("loaded_bytes", {"tier": "disk"}): 2}
    exported = {c.name: c.labels for c in exported_counters()}
    assert exported["loaded_bytes"] == ("tier",) and exported["loaded_tokens"] == ()
    assert "lookup_seconds" not in exported  # histograms stay on kvpack's own port
