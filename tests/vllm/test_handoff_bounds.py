"""Refused client input costs nothing beyond the request: the vLLM scheduler side.

Any client of vLLM's OpenAI server can send ``kv_transfer_params``: a kvpack handoff
(``do_remote_prefill``) with fields of any size, or a tenant name. The real
`SchedulerSide` over a real store, fed a thousand distinct refused handoffs with large
fields, keeps its memory flat (tracemalloc), logs at most one line per refusal reason,
each line short, and counts every refusal under its reason.
"""

from __future__ import annotations

import gc
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpack.config.schema import KVPackConfig
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.policy.groups import Coverage

pytest.importorskip("vllm")

from vllm_helpers import fake_request  # noqa: E402

from kvpack.vllm_plugin.handoff import Handoff, HandoffRefusal  # noqa: E402
from kvpack.vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from kvpack.vllm_plugin.scopes import CacheGroup, Scope  # noqa: E402

BS = 16
FIELD = 64 * 1024
"""Characters of each large client field (1000 of them whole: 64 MiB)."""
IDS = list(range(300, 340))  # 2 chunks and an 8-token tail


class LineMeter(logging.Handler):
    """Counts the records of one logger and the longest line; keeps no record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines = 0
        self.longest = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        self.longest = max(self.longest, len(record.getMessage()))


@pytest.fixture
def meter() -> Iterator[LineMeter]:
    meter = LineMeter()
    logger = logging.getLogger("kvpack.vllm")
    logger.addHandler(meter)
    try:
        yield meter
    finally:
        logger.removeHandler(meter)


def _side(tmp_path: Path, **config: Any) -> SchedulerSide:
    cfg = KVPackConfig.from_dict({"disk": {"path": str(tmp_path / "kv")}, **config})
    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=BS)
    scope = Scope(spec=spec, members=("kv",), block_size=BS, draft="", groups=groups, world=1)
    return SchedulerSide(cfg, scope, can_load=True, can_save=True)


def _refused(side: SchedulerSide, i: int) -> tuple[dict[str, Any], HandoffRefusal]:
    """The `i`-th hostile handoff: a distinct large field in the place that `i` picks."""
    big = f"{i:08d}" + "x" * FIELD
    good = Handoff(side.scope.fingerprint, "default", len(IDS), None).to_params()
    fields = good["kvpack"]
    kind = i % 4
    if kind == 0:
        fields["fingerprint"] = big
        return good, HandoffRefusal.OTHER_LAYOUT
    if kind == 1:
        fields["tenant"] = big
        return good, HandoffRefusal.OTHER_TENANT
    if kind == 2:
        fields["tokens"] = big
        return good, HandoffRefusal.MALFORMED
    fields["head_ranges"] = -(10**400) - i  # a negative integer of 401 digits
    return good, HandoffRefusal.MALFORMED


def _serve(side: SchedulerSide, i: int) -> HandoffRefusal:
    """One request's life: the lookup that refuses its handoff, then its finish."""
    params, reason = _refused(side, i)
    req = fake_request(IDS, f"hostile-{i}")
    req.kv_transfer_params = params
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # served as any other (nothing stored)
    side.request_finished(req, [[]])
    return reason


def test_a_thousand_refused_handoffs_with_large_fields_keep_memory_flat(tmp_path: Path, meter: LineMeter) -> None:
    side = _side(tmp_path)
    try:
        counts: dict[HandoffRefusal, int] = {}

        def serve(i: int) -> None:
            reason = _serve(side, i)
            counts[reason] = counts.get(reason, 0) + 1

        for i in range(40):  # every reason once, every lazy structure built
            serve(i)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(40, 1040):
                serve(i)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # kept: nothing of the 1000 requests (today every distinct message was kept whole: 64 MiB)
        assert grown < FIELD, f"the scheduler side kept {grown} bytes after 1000 refused handoffs"
        assert meter.lines <= len(HandoffRefusal), f"{meter.lines} log lines for {len(HandoffRefusal)} reasons"
        assert 0 < meter.longest <= 1024, f"a log line of {meter.longest} characters"
        metrics = side.session.store.metrics
        for reason, n in counts.items():
            assert metrics.value("handoff_refused", reason=reason.value) == n
        assert side._plans == {}  # noqa: SLF001  (nothing of a finished request stays)
    finally:
        side.close()


def test_an_invalid_trusted_tenant_is_logged_once_and_cut(tmp_path: Path, meter: LineMeter) -> None:
    side = _side(tmp_path, trusted_tenants=["*"])
    try:
        for i in range(20):
            req = fake_request(IDS, f"bad-tenant-{i}")
            req.kv_transfer_params = {"kvpack_tenant": f"{i}/" + "y" * FIELD}  # trusted, so validated: refused
            assert side.get_num_new_matched_tokens(req, 0) == (0, False)
            side.request_finished(req, [[]])
        assert meter.lines == 1 and meter.longest <= 1024
        assert side.session.store.metrics.value("bad_tenants") == 20
    finally:
        side.close()
