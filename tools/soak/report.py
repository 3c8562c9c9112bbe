"""The soak's findings: counts from the clients and the server's log, targets, the table.

Sources, in order of trust: what the clients saw (status, token ids,
``cached_tokens``, chunk times); the server's log (kvpack's refusal
warnings name tier and reason; vLLM logs the connector's interval stats as
``KV Transfer metrics: k=v, ...``); and kvpack counters on vLLM's
``/metrics`` when the connector exports them (``kvpack_*`` series).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .reference import key_of
from .workload import Result

REFUSED_RE = re.compile(r"kvpack: refused kvpack/([^/\s]+)/\S+ from (\w+): (\w+)")
XFER_RE = re.compile(r"KV Transfer metrics: (.*)$")
NEAR_TIE = 1e-3
"""A divergence where the reference's top-2 log-prob margin is below this is a
near-tie (batch-order noise), not a difference. In fp32 that noise is ~1e-5
(measured: the same prompt alone vs in a batch of 8); see `kvpack.tools.soak`."""


def parse_server_log(text: str) -> dict[str, Any]:
    refused: Counter[tuple[str, str]] = Counter()
    refused_tenants: Counter[tuple[str, str]] = Counter()
    """Refusals by (tenant, reason)."""
    for m in REFUSED_RE.finditer(text):
        refused[(m.group(2), m.group(3))] += 1
        refused_tenants[(m.group(1), m.group(3))] += 1
    xfer: Counter[str] = Counter()
    for line in text.splitlines():
        xm = XFER_RE.search(line)
        if not xm:
            continue
        for part in xm.group(1).split(","):
            k, _, v = part.strip().partition("=")
            try:
                xfer[k] += float(v)  # type: ignore[assignment]  # typeshed: Counter values are int; floats sum fine
            except ValueError:
                pass
    return {
        "refused": refused,
        "refused_tenants": refused_tenants,
        "xfer": xfer,
        "bad_tenant_warnings": text.count("runs without the cache"),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "engine_dead": text.count("EngineDeadError") + text.count("EngineCore encountered a fatal error"),
        "segfaults": text.count("Segmentation fault") + text.count("SIGSEGV"),
    }


def parse_prometheus(text: str, prefix: str = "kvpack_") -> dict[str, float]:
    """``{"name{labels}": value}`` of every series starting with `prefix`, summed
    over the scraped texts (one per process); ``*_created`` timestamps skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            if name.partition("{")[0].endswith("_created"):
                continue
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
    return out


LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def by_labels(prom: dict[str, float], metric: str, labels: Sequence[str]) -> Counter[tuple[str, ...]]:
    """Counter ``kvpack_<metric>_total`` summed by the values of `labels`."""
    want = f"kvpack_{metric}_total"
    out: Counter[tuple[str, ...]] = Counter()
    for key, value in prom.items():
        name, _, rest = key.partition("{")
        if name != want:
            continue
        found = dict(LABEL_RE.findall(rest))
        out[tuple(found.get(label, "") for label in labels)] += value  # type: ignore[assignment]  # as in xfer above
    return out


@dataclass
class Comparison:
    equal: int = 0
    near_tie: int = 0
    different: int = 0
    no_reference: int = 0
    examples: list[str] = field(default_factory=list)


def compare(results: Iterable[Result], refs: dict[str, dict[str, Any]]) -> Comparison:
    c = Comparison()
    for r in results:
        if r.status != "ok":
            continue
        ref = refs.get(key_of(r.prompt))
        if ref is None:
            c.no_reference += 1
            continue
        want = ref["tokens"]
        if r.tokens == want:
            c.equal += 1
            continue
        pos = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
        margin = ref["margins"][pos] if pos < len(ref["margins"]) else float("inf")
        if margin < NEAR_TIE:
            c.near_tie += 1
        else:
            c.different += 1
        if len(c.examples) < 5:
            c.examples.append(
                f"{r.kind} tenant={r.tenant!r} len={len(r.prompt)} cached={r.cached_tokens}: first difference at "
                f"token {pos} (reference margin {margin:.2e}); got {r.tokens[: pos + 2]} want {want[: pos + 2]}"
            )
    return c


@dataclass
class Window:
    """When a fault held a tier down (or an event ran), by the soak's monotonic clock."""

    name: str
    start: float
    end: float
    tier_down: bool
    note: str = ""


def overlapping_windows(a: float, b: float, windows: Sequence[Window], down_only: bool = True) -> list[str]:
    """Names of the windows (only tier-down ones if `down_only`) that the interval
    [a, b] (soak clock) overlaps."""
    return [w.name for w in windows if (w.tier_down or not down_only) and a < w.end and b > w.start]


@dataclass
class Row:
    name: str
    value: str
    target: str = ""
    ok: bool | None = None

    def verdict(self) -> str:
        return "" if self.ok is None else ("ok" if self.ok else "FAIL")


def format_table(rows: Sequence[Row], title: str = "kvpack soak") -> str:
    w0 = max(len(r.name) for r in rows)
    w1 = max(len(r.value) for r in rows)
    w2 = max(len(r.target) for r in rows)
    lines = [title, "-" * (w0 + w1 + w2 + 12)]
    lines.append(f"{'measure':<{w0}}  {'value':>{w1}}  {'target':<{w2}}  verdict")
    for r in rows:
        lines.append(f"{r.name:<{w0}}  {r.value:>{w1}}  {r.target:<{w2}}  {r.verdict()}")
    return "\n".join(lines)


def fmt_counter(c: Counter[Any] | dict[Any, Any]) -> str:
    if not c:
        return "none"
    parts = []
    for k, v in sorted(c.items(), key=lambda kv: str(kv[0])):
        name = "/".join(k) if isinstance(k, tuple) else str(k)
        parts.append(f"{name}={int(v)}")
    return ", ".join(parts)
