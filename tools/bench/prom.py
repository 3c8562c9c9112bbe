"""Reading a server's Prometheus ``/metrics`` text: histograms, counters, percentiles (benchmarks only)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its label sets: cumulative bucket counts by upper bound."""

    bounds: tuple[float, ...]
    """Upper bounds, ascending, the last one +Inf."""
    cumulative: tuple[float, ...]
    total: float
    count: float

    def minus(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            return self
        cum = tuple(a - b for a, b in zip(self.cumulative, other.cumulative))
        return Histogram(self.bounds, cum, self.total - other.total, self.count - other.count)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else float("nan")

    def quantile(self, q: float) -> float:
        """``histogram_quantile``: linear within the bucket holding rank q * count (the lowest
        bucket starts at 0); a rank in the +Inf bucket gives the highest finite bound."""
        if self.count <= 0 or not self.bounds:
            return float("nan")
        rank = q * self.count
        prev_bound, prev_cum = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative):
            if cum >= rank:
                if math.isinf(bound):
                    return prev_bound
                if cum == prev_cum:
                    return bound
                return prev_bound + (bound - prev_bound) * (rank - prev_cum) / (cum - prev_cum)
            prev_bound, prev_cum = bound, cum
        return prev_bound


EMPTY = Histogram((), (), 0.0, 0.0)

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_histogram(text: str, name: str) -> Histogram:
    """`name`'s ``_bucket`` / ``_sum`` / ``_count`` samples, summed over every label but ``le``."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        value = float(m["value"])
        if m["name"] == name + "_bucket":
            le = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or "")).get("le", "+Inf")
            bound = float("inf") if le in ("+Inf", "Inf") else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif m["name"] == name + "_sum":
            total += value
        elif m["name"] == name + "_count":
            count += value
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total, count)


def parse_counters(text: str, name: str, label: str | None = None) -> dict[str, float]:
    """Sum a Prometheus counter's samples over every other label, keyed by `label`'s value ("" when None)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] not in (name, name + "_total"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        key = labels.get(label, "") if label else ""
        out[key] = out.get(key, 0.0) + float(m["value"])
    return out


def parse_total(text: str, name: str) -> float:
    """A counter's samples (``name`` or ``name_total``) summed over every label set."""
    return sum(parse_counters(text, name).values())


def percentile(values: list[float], p: float) -> float:
    """The `p`-th percentile (0-100) of `values`, linear between ranks (nan when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
