"""`kvpack bench serve`'s rows and report: what one server lifetime measured, the
serving targets (benchmarks/RESULTS.md) as ratios of the same run, and the markdown table.

A row's reuse is vLLM's own count of prompt tokens by source over the run
(``vllm:prompt_tokens_by_source``), against the tokens a cache could have reused
(`serve_bench.repeatable_tokens`); its TTFTs are the client's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class RowName:
    NO_CACHE = "no cache"
    VLLM_PC = "vLLM prefix caching"
    KVPACK = "kvpack"
    KVPACK_PC = "kvpack + vLLM prefix caching"
    RESTART = "kvpack after SIGINT restart"


@dataclass(frozen=True)
class Row:
    """One server lifetime under the client: TTFT and where its prompt tokens came from."""

    name: str
    ttft_median_s: float
    ttft_p90_s: float
    completed: int
    requests: int
    prompt_tokens: int
    reused_vllm: int
    """``vllm:prompt_tokens_by_source{source="local_cache_hit"}`` over the run (vLLM's prefix cache)."""
    reused_connector: int
    """``...{source="external_kv_transfer"}`` over the run (kvpack)."""
    repeatable: int
    """Upper bound on reusable tokens for this row (see the module docstring)."""
    preemptions: int = 0
    objects_on_disk: int | None = None
    """kvpack objects in the store when this server started (the restart row)."""
    ttft_repeats_median_s: float = float("nan")
    """Median TTFT over the requests whose prefix an earlier request of the run computed."""
    failed: str = ""
    """Why the row has no numbers (the server or the client failed), else empty."""

    @property
    def reused(self) -> int:
        return self.reused_vllm + self.reused_connector

    @property
    def reuse_fraction(self) -> float:
        return self.reused / self.repeatable if self.repeatable > 0 else float("nan")


@dataclass(frozen=True)
class Target:
    what: str
    target: str
    measured: float
    limit: float
    at_least: bool

    @property
    def met(self) -> bool:
        if math.isnan(self.measured):
            return False
        return self.measured >= self.limit if self.at_least else self.measured <= self.limit


def targets(rows: list[Row]) -> list[Target]:
    """The serving targets (benchmarks/RESULTS.md), as ratios in this run."""
    by = {r.name: r for r in rows}
    out: list[Target] = []

    def ttft(name: str) -> float:
        return by[name].ttft_median_s if name in by else float("nan")

    for name in (RowName.KVPACK, RowName.KVPACK_PC):
        if name in by:
            out.append(
                Target(
                    f"{name}: first-lifetime reuse / repeated prefix tokens",
                    ">= 0.9",
                    by[name].reuse_fraction,
                    0.9,
                    True,
                )
            )
    for name in (RowName.KVPACK, RowName.KVPACK_PC):
        if name in by and RowName.VLLM_PC in by:
            out.append(
                Target(
                    f"{name}: median TTFT x vLLM prefix caching",
                    "<= 0.5",
                    ttft(name) / ttft(RowName.VLLM_PC),
                    0.5,
                    False,
                )
            )
    if RowName.RESTART in by and RowName.NO_CACHE in by:
        out.append(
            Target(
                f"{RowName.RESTART}: median TTFT x no cache",
                "<= 0.3",
                ttft(RowName.RESTART) / ttft(RowName.NO_CACHE),
                0.3,
                False,
            )
        )
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 and not math.isnan(a) and not math.isnan(b) else "-"


def report(rows: list[Row]) -> str:
    """Markdown: one line per row with ratios vs no cache and vs vLLM prefix caching, then the targets."""
    by = {r.name: r for r in rows}
    base = by[RowName.NO_CACHE].ttft_median_s if RowName.NO_CACHE in by else float("nan")
    pc = by[RowName.VLLM_PC].ttft_median_s if RowName.VLLM_PC in by else float("nan")
    pc_again = by[RowName.VLLM_PC].ttft_repeats_median_s if RowName.VLLM_PC in by else float("nan")
    lines = [
        "| row | TTFT median (s) | TTFT p90 (s) | median x no cache | median x vLLM PC | "
        "repeats only: median (s), x vLLM PC | "
        "reused: vLLM cache | reused: connector | reused / repeatable | requests ok | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r.name if r.objects_on_disk is None else f"{r.name} ({r.objects_on_disk} objects on disk)"
        if r.failed:
            lines.append(f"| {name} | failed: {r.failed} | | | | | | | | 0 of {r.requests} | |")
            continue
        lines.append(
            f"| {name} | {r.ttft_median_s:.3f} | {r.ttft_p90_s:.3f} | {_ratio(r.ttft_median_s, base)} | "
            f"{_ratio(r.ttft_median_s, pc)} | {r.ttft_repeats_median_s:.3f}, "
            f"{_ratio(r.ttft_repeats_median_s, pc_again)} | "
            f"{r.reused_vllm} | {r.reused_connector} | "
            f"{r.reused} of {r.repeatable} ({r.reuse_fraction:.2f}) | {r.completed} of {r.requests} | {r.preemptions} |"
        )
    lines += ["", "| target | wanted | measured | status |", "|---|---|---|---|"]
    for t in targets(rows):
        status = "no data" if math.isnan(t.measured) else "met" if t.met else "not met"
        lines.append(f"| {t.what} | {t.target} | {t.measured:.3f} | {status} |")
    return "\n".join(lines)
