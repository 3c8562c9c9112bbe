"""Per-prefetch figures of one SGLang server run, for `kvpack bench sglang --multiturn` (benchmarks only).

Read from three places, all SGLang's or the bench's own, backend-neutral (the same for ``file``
and kvpack):

- the timing probe's lines in the server log (``tests/sglang/server/cpu_site/cpu_server_probe.py``,
  ``kvpack-probe query ...`` / ``transfer ...`` / ``submit ...``): per prefetch, seconds from its
  submission to its last page read, the hit query's and the reads' own seconds, tokens asked,
  found by the hit query and read; per L3 write (backup), its wait in SGLang's backup queue and
  its own seconds (SGLang keeps the L2 pages of a write from eviction until its ack is drained);
  per prefetch submission, what SGLang's own outcome counters counted (issued, or why declined);
- SGLang's ``/metrics`` (``--enable-metrics``): ``sglang:prefetched_tokens_total`` (read into L2),
  ``sglang:storage_prefetch_hit_tokens_total`` (found by the hit query) and
  ``sglang:storage_prefetch_unfulfilled_tokens_total`` by reason (``deadline``: the stop policy
  cut the read; ``cache_admission_shortfall``: read into L2, gone by admission; ...);
- each response's ``meta_info``: ``cached_tokens_details.storage`` (the tokens the request was
  credited with from L3 when scheduled) and ``storage_prefetch_wait`` (seconds the scheduler
  held it waiting for its prefetch).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

QUERY = re.compile(r"kvpack-probe query rid=(\S+) queued_s=([\d.]+) query_s=([\d.]+) asked=(\d+) found=(\d+)")
TRANSFER = re.compile(
    r"kvpack-probe transfer rid=(\S+) start_s=([\d.]+) transfer_s=([\d.]+) asked=(\d+) loaded=(\d+) terminated=(\d)"
)
SUBMIT = re.compile(r"kvpack-probe submit rid=(\S+) outcome=(\S+) occupied=(-?\d+)")
BACKUP = re.compile(
    r"kvpack-probe backup queued_s=([\d.]+) backup_s=([\d.]+) asked=(\d+) written=(\d+)(?: cpu_s=([\d.]+))?"
)
SAMPLE = re.compile(r"^([a-zA-Z_:]+)(?:\{(.*)\})? ([0-9.eE+-]+)$")


@dataclass
class PrefetchStats:
    """One server's prefetches (seconds, tokens)."""

    queries: int = 0
    query_s: list[float] = field(default_factory=list)
    asked: int = 0
    found: int = 0
    reads: int = 0
    latency_s: list[float] = field(default_factory=list)
    """Per read prefetch: submission to its last page read (probe ``start_s + transfer_s``)."""
    read_s: list[float] = field(default_factory=list)
    loaded: int = 0
    cut: int = 0
    """Reads the scheduler had terminated by the time they returned."""
    backup_queued_s: list[float] = field(default_factory=list)
    backup_s: list[float] = field(default_factory=list)
    backup_cpu_s: list[float] = field(default_factory=list)
    sglang_prefetched: int = 0
    sglang_hit: int = 0
    unfulfilled: dict[str, int] = field(default_factory=dict)
    credited: int = 0
    waits_s: list[float] = field(default_factory=list)
    """Per request held for a prefetch: SGLang's ``storage_prefetch_wait``."""
    submits: dict[str, int] = field(default_factory=dict)
    """Prefetch submissions by SGLang's outcome (``issued``, ``declined_*``, ``none``)."""

    def add_log(self, text: str) -> None:
        for m in QUERY.finditer(text):
            self.queries += 1
            self.query_s.append(float(m.group(3)))
            self.asked += int(m.group(4))
            self.found += int(m.group(5))
        for m in TRANSFER.finditer(text):
            self.reads += 1
            self.latency_s.append(float(m.group(2)) + float(m.group(3)))
            self.read_s.append(float(m.group(3)))
            self.loaded += int(m.group(5))
            self.cut += int(m.group(6))
        for m in SUBMIT.finditer(text):
            for outcome in m.group(2).split(","):
                self.submits[outcome] = self.submits.get(outcome, 0) + 1
        for m in BACKUP.finditer(text):
            self.backup_queued_s.append(float(m.group(1)))
            self.backup_s.append(float(m.group(2)))
            if m.group(5) is not None:
                self.backup_cpu_s.append(float(m.group(5)))

    def add_metrics(self, text: str) -> None:
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", int(float(m.group(3)))
            if name == "sglang:prefetched_tokens_total":
                self.sglang_prefetched += value
            elif name == "sglang:storage_prefetch_hit_tokens_total":
                self.sglang_hit += value
            elif name == "sglang:storage_prefetch_unfulfilled_tokens_total" and value:
                reason = re.search(r'reason="([^"]*)"', labels)
                key = reason.group(1) if reason else "?"
                self.unfulfilled[key] = self.unfulfilled.get(key, 0) + value

    def add_response(self, meta: dict[str, object]) -> None:
        details = meta.get("cached_tokens_details") or {}
        if isinstance(details, dict):
            self.credited += int(details.get("storage", 0) or 0)
        wait = meta.get("storage_prefetch_wait")
        if isinstance(wait, (int, float)) and wait > 0:
            self.waits_s.append(float(wait))

    def cells(self) -> list[str]:
        """Table cells: reads, latency median/max, query and read means, tokens asked/found/loaded/credited,
        SGLang's hit and prefetched tokens, requests held (mean wait), unfulfilled by reason, L3 writes."""

        def med_max(xs: list[float]) -> str:
            return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"

        def mean(xs: list[float]) -> str:
            return f"{statistics.fmean(xs) * 1000:.0f}" if xs else "-"

        unfulfilled = ", ".join(f"{k} {v}" for k, v in sorted(self.unfulfilled.items())) or "none"
        held = f"{len(self.waits_s)} ({statistics.fmean(self.waits_s):.2f} s)" if self.waits_s else "0"
        return [
            f"{self.reads} ({self.cut} cut)",
            med_max(self.latency_s),
            f"{mean(self.query_s)} / {mean(self.read_s)}",
            f"{self.asked} / {self.found} / {self.loaded} / {self.credited}",
            f"{self.sglang_hit} / {self.sglang_prefetched}",
            held,
            unfulfilled,
            f"{len(self.backup_s)}: {mean(self.backup_queued_s)} / {mean(self.backup_s)} / {mean(self.backup_cpu_s)}",
            ", ".join(f"{k} {v}" for k, v in sorted(self.submits.items())) or "-",
        ]


HEADER = [
    "L3 reads (cut)",
    "prefetch s, submit to last page: median / max",
    "ms: query / read, mean",
    "tokens asked / found / loaded / credited",
    "SGLang hit / prefetched",
    "requests held (mean wait)",
    "SGLang unfulfilled by reason",
    "L3 writes: ms queued / writing / on the writing thread's CPU, mean",
    "prefetch submissions by SGLang's outcome",
]
