"""One counter system: `Metrics.totals` and `MetricsInterval`, the engine's per-interval stats."""

from __future__ import annotations

from kvpack import Metrics, MetricsInterval


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
