"""examples/grafana/kvpack-dashboard.json names only metrics (and labels) that kvpack.observe.metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvpack.observe.metrics import SPECS, Kind

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvpack-dashboard.json"
_NAME = re.compile(r"\bkvpack_[a-z_]+")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")


def problems(expr: str) -> list[str]:
    """What in one PromQL expression names no exported metric, a wrong suffix, or a label it lacks."""
    specs = {f"kvpack_{s.name}": s for s in SPECS}
    out: list[str] = []
    labels: set[str] = set()
    for full in _NAME.findall(expr):
        for suffix, kinds in (
            ("_total", (Kind.COUNTER,)),
            ("_bucket", (Kind.HISTOGRAM,)),
            ("_sum", (Kind.HISTOGRAM,)),
            ("_count", (Kind.HISTOGRAM,)),
        ):
            base = full.removesuffix(suffix)
            if base != full and base in specs:
                if specs[base].kind not in kinds:
                    out.append(f"{full}: {base} is a {specs[base].kind.name.lower()}")
                labels |= set(specs[base].labels) | ({"le"} if specs[base].kind is Kind.HISTOGRAM else set())
                break
        else:
            out.append(f"{full}: no such metric (Prometheus names need _total / _bucket / _sum / _count)")
    for group in _BY.findall(expr):
        out += [
            f"label {lb!r} not on the metrics of {expr!r}"
            for lb in (g.strip() for g in group.split(","))
            if lb and lb not in labels
        ]
    return out


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_every_metric_the_dashboard_names_exists() -> None:
    exprs = _exprs()
    assert len(exprs) >= 8
    found = [p for e in exprs for p in problems(e)]
    assert found == []


def test_the_dashboard_covers_the_issue_panels() -> None:
    text = " ".join(_exprs())
    for name in (
        "kvpack_hit_tokens_total",
        "kvpack_lookup_tokens_total",
        "kvpack_loaded_bytes_total",
        "kvpack_stored_bytes_total",
        "kvpack_rejected_objects_total",
        "kvpack_handoff_wait_seconds_bucket",
    ):
        assert name in text


def test_the_check_catches_wrong_names_suffixes_and_labels() -> None:
    assert problems("rate(kvpack_hit_tokens[5m])")  # no _total
    assert problems("rate(kvpack_no_such_metric_total[5m])")
    assert problems("rate(kvpack_lookup_seconds_total[5m])")  # a histogram
    assert problems("sum by (reason) (rate(kvpack_hit_tokens_total[5m]))")  # no such label
    assert problems("sum by (tier, reason) (rate(kvpack_rejected_objects_total[5m]))") == []
