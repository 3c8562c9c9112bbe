"""`kvpack.client_input`: a client's value is rendered short, whatever its size or type."""

from __future__ import annotations

import enum
import logging

import pytest

from kvpack.client_input import CLIP_CHARS, Refusals, clip
from kvpack.observe.metrics import Metrics


@pytest.mark.parametrize(
    "value",
    ["x" * 10**6, 10**5000, -(10**400), [[[]]] * 1000, {"a": "b" * 10**6}, b"\x00" * 10**6, 1.5e308, None, True],
    ids=["long-str", "huge-int", "negative-int", "nested-list", "dict", "bytes", "float", "none", "bool"],
)
def test_clip_is_short_for_any_value(value: object) -> None:
    assert len(clip(value)) <= CLIP_CHARS + 40  # the quoted prefix, the ellipsis and the length


def test_clip_quotes_short_values_whole() -> None:
    assert clip("abc") == "'abc'" and clip(42) == "42" and clip(None) == "None"
    assert clip("y" * 100).startswith(repr("y" * CLIP_CHARS)) and "100 characters" in clip("y" * 100)


class Why(enum.Enum):
    ONE = "one"
    TWO = "two"


def test_refusals_count_every_one_and_log_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    refusals = Refusals(metrics, "handoff_refused", "test input", logging.getLogger("kvpack.test"))
    with caplog.at_level(logging.ERROR, logger="kvpack.test"):
        for i in range(10):
            refusals.refuse(Why.ONE if i % 3 else Why.TWO, "z" * 10_000, request_id="r" * 10_000)
    assert metrics.value("handoff_refused", reason="one") == 6
    assert metrics.value("handoff_refused", reason="two") == 4
    assert len(caplog.records) == 2 and all(len(r.getMessage()) < 1000 for r in caplog.records)
    assert refusals.logged() == {Why.ONE, Why.TWO}


def test_refusals_under_other_labels_count_each_and_log_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    # an engine call an adapter answers as a miss: tier_errors{tier=<engine>, status=<reason>}, one warning per reason
    metrics = Metrics()
    refusals = Refusals(
        metrics,
        "tier_errors",
        "page call",
        logging.getLogger("kvpack.test"),
        label="status",
        labels={"tier": "engine"},
        level=logging.WARNING,
    )
    with caplog.at_level(logging.WARNING, logger="kvpack.test"):
        for i in range(5):
            refusals.refuse(Why.ONE if i % 2 else Why.TWO, "bad key")
    assert metrics.value("tier_errors", tier="engine", status="one") == 2
    assert metrics.value("tier_errors", tier="engine", status="two") == 3
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    assert "request" not in caplog.records[0].getMessage()
    assert "kvpack_tier_errors_total{tier='engine',status='two'}" in caplog.records[0].getMessage()
