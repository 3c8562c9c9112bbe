"""The chat bench's markdown report: TTFT per round per set-up, tokens per source, answers, targets.

Targets (benchmarks/RESULTS.md): kvpack's mean TTFT from round 2 on <= 0.5x vLLM prefix
caching alone and <= LMCache's; the restarted kvpack's mean TTFT (every round)
<= 0.3x no cache; answers equal the no-cache run's.
"""

from __future__ import annotations

import math

from kvpack.tools.bench.chat_workload import SetupRun, answers_equal, mean_from_round, ratio, round_stats

NO_CACHE, VLLM_PC, KVPACK, LMCACHE, RESTART = (
    "no cache",
    "vLLM prefix caching",
    "vLLM PC + kvpack",
    "vLLM PC + LMCache MP",
    "kvpack restarted (disk)",
)


COLUMNS = (
    "Columns: *external* is vLLM's ``external_prefix_cache_hits`` (prompt tokens a connector supplied, "
    "as vLLM counts them); *kvpack loaded tokens* is kvpack's ``kvpack_loaded_tokens`` (tokens its loads "
    "restored into the engine's blocks); *kvpack objects read by tier* is ``kvpack_loaded_bytes{tier}`` / KV "
    "bytes per token: every object read, counted as whole blocks (a tail object counts its full block), so it "
    "is larger than the tokens used and is not comparable with vLLM's count."
)


def targets(runs: list[SetupRun]) -> list[tuple[str, str, float, bool]]:
    """(what, wanted, measured, met) for each target whose set-ups ran."""
    by = {r.name: r for r in runs if not r.skipped}
    out: list[tuple[str, str, float, bool]] = []

    def m(name: str, first: int = 2) -> float:
        return mean_from_round(by[name].results, first) if name in by else float("nan")

    for other, limit in ((VLLM_PC, 0.5), (LMCACHE, 1.0)):
        v = ratio(m(KVPACK), m(other))
        out.append((f"kvpack mean TTFT, rounds >= 2, x {other}", f"<= {limit}", v, not math.isnan(v) and v <= limit))
    v = ratio(m(RESTART, 1), m(NO_CACHE, 1))
    out.append((f"{RESTART} mean TTFT x no cache (all rounds)", "<= 0.3", v, not math.isnan(v) and v <= 0.3))
    return out


def report(runs: list[SetupRun]) -> str:
    ref = next((r for r in runs if r.name == NO_CACHE and not r.skipped), None)
    lines = [
        "| set-up | round | turns | TTFT mean (s) | p50 (s) | p90 (s) | accept rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if run.skipped:
            lines.append(f"| {run.name} | skipped: {run.skipped} | | | | | |")
            continue
        for i, s in enumerate(round_stats(run.results)):
            acc = f"{run.accept[i]:.3f}" if i < len(run.accept) else "-"
            lines.append(f"| {run.name} | {s.round} | {s.n} | {s.mean_s:.3f} | {s.p50_s:.3f} | {s.p90_s:.3f} | {acc} |")
    lines += [
        "",
        "| set-up | mean TTFT rounds >= 2 (s) | prompt tokens | from vLLM prefix cache | external (vLLM's count) | "
        "kvpack loaded tokens | kvpack objects read by tier (block-tokens) | answers equal no cache | failed turns |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if run.skipped:
            continue
        kv = ", ".join(f"{k[7:-9]} {v:.0f}" for k, v in sorted(run.tiers.items()) if k.endswith(" (tokens)"))
        loaded = f"{t['kvpack loaded tokens']:.0f}" if "kvpack loaded tokens" in (t := run.tiers) else "-"
        eq = "-" if ref is None else "{} of {}".format(*answers_equal(run.results, ref.results))
        fails = sum(1 for r in run.results if r.error)
        lines.append(
            f"| {run.name} | {mean_from_round(run.results):.3f} | {t.get('prompt tokens', 0):.0f} | "
            f"{t.get('vLLM prefix cache', 0):.0f} | {t.get('external', 0):.0f} | {loaded} | {kv or '-'} | "
            f"{eq} | {fails} |"
        )
    lines += ["", "| target | wanted | measured | status |", "|---|---|---|---|"]
    for what, wanted, v, met in targets(runs):
        status = "no data" if math.isnan(v) else "met" if met else "not met"
        lines.append(f"| {what} | {wanted} | {v:.3f} | {status} |")
    lines += ["", COLUMNS]
    return "\n".join(lines)
