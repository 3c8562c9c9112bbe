"""What SGLang hands the kvpack backend is bounded before it is logged or counted.

The real backend (SGLang's factory, a real host pool) fed hundreds of distinct page keys
that are not chunk hashes, each 64 KiB: every call is a miss, every refusal counted under
``tier_errors{tier="sglang",status="bad_key"}``, and the log gets one short line, not one
line per call quoting the key whole (before: 300 lines of 64 KiB each).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sglang_parts import kvpack_extra, make_backend, make_pool

pytestmark = pytest.mark.sglang

CALLS = 300
KEY_CHARS = 64 * 1024


class LineMeter(logging.Handler):
    """Counts one logger's records and their longest message; keeps none."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines = 0
        self.longest = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        self.longest = max(self.longest, len(record.getMessage()))


def test_bad_page_keys_are_counted_and_logged_once_cut(tmp_path: Path) -> None:
    backend = make_backend(make_pool("mha", "page_first"), kvpack_extra(tmp_path / "kv"))
    meter = LineMeter()
    logger = logging.getLogger("kvpack.sglang")
    logger.addHandler(meter)
    try:
        for i in range(CALLS):
            assert backend.batch_exists([f"{i:08d}/" + "k" * KEY_CHARS]) == 0
        assert meter.lines == 1, meter.lines
        assert meter.longest < 1000, meter.longest
        assert backend.session.report.metrics.value("tier_errors", tier="sglang", status="bad_key") == CALLS
    finally:
        logger.removeHandler(meter)
        backend.close()
