"""`kvpack bench sglang --multiturn`'s per-prefetch figures (`tools/bench/sglang_prefetch_stats.py`): the
probe's log lines, SGLang's ``/metrics`` and the responses' ``meta_info`` become one row."""

from __future__ import annotations

from kvpack.tools.bench.sglang_prefetch_stats import HEADER, PrefetchStats

LOG = """\
[2026-12-04 12:13:15] HiCache prefetch success req=a completed=256 matched=0 loaded=256 occupied=0
kvpack-probe query rid=a queued_s=0.0010 query_s=0.0020 asked=512 found=256
kvpack-probe query rid=b queued_s=0.0000 query_s=0.0040 asked=256 found=0
kvpack-probe transfer rid=a start_s=0.3000 transfer_s=0.0100 asked=256 loaded=256 terminated=0
kvpack-probe transfer rid=c start_s=1.2000 transfer_s=0.0500 asked=512 loaded=256 terminated=1
kvpack-probe backup queued_s=0.0200 backup_s=0.0100 asked=512 written=512 cpu_s=0.0040 samples=files.py:93:write_all:3
kvpack-probe backup queued_s=0.0400 backup_s=0.0300 asked=512 written=512
kvpack-probe submit rid=a outcome=issued occupied=256
kvpack-probe submit rid=b outcome=declined_rate_limited occupied=1024
kvpack-probe submit rid=a outcome=none occupied=768
kvpack-probe submit rid=c outcome=issued occupied=0
"""
METRICS = """\
# HELP sglang:prefetched_tokens_total x
sglang:prefetched_tokens_total{model_name="m"} 512.0
sglang:storage_prefetch_hit_tokens_total{model_name="m"} 768.0
sglang:storage_prefetch_unfulfilled_tokens_total{model_name="m",reason="deadline"} 256.0
sglang:storage_prefetch_unfulfilled_tokens_total{model_name="m",reason="dropped"} 0.0
sglang:storage_prefetch_unfulfilled_tokens_total{model_name="m",reason="cache_admission_shortfall"} 32.0
"""


def test_a_run_becomes_one_row_of_prefetch_figures() -> None:
    stats = PrefetchStats()
    stats.add_log(LOG)
    stats.add_metrics(METRICS)
    stats.add_response(
        {"cached_tokens_details": {"device": 0, "host": 32, "storage": 224}, "storage_prefetch_wait": 0.5}
    )
    stats.add_response({"cached_tokens_details": {"device": 256, "host": 0}})
    cells = stats.cells()
    assert len(cells) == len(HEADER)
    assert cells == [
        "2 (1 cut)",
        "0.78 / 1.25",  # submit to last page: 0.31 s and 1.25 s, median 0.78
        "3 / 30",  # ms: queries 2 and 4, reads 10 and 50
        "768 / 256 / 512 / 224",
        "768 / 512",
        "1 (0.50 s)",
        "cache_admission_shortfall 32, deadline 256",
        "2: 30 / 20 / 4",  # the second line is an older probe's, without cpu_s
        "declined_rate_limited 1, issued 2, none 1",
    ]


def test_a_run_without_prefetches_has_empty_cells() -> None:
    cells = PrefetchStats().cells()
    assert cells == ["0 (0 cut)", "-", "- / -", "0 / 0 / 0 / 0", "0 / 0", "0", "none", "0: - / - / -", "-"]
