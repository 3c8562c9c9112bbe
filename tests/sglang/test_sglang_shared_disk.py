"""Pages written through the SGLang backend are found by another instance in another process (disk tier)."""

from __future__ import annotations

import pytest
from sglang_parts import kvpack_extra
from sglang_shared import write_then_read_elsewhere

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first")])
def test_disk_tier_shared_across_processes(kind, layout, store_dir, tmp_path):
    seen = write_then_read_elsewhere(kvpack_extra(store_dir, memory=True, disk=True), tmp_path, kind, layout)
    assert seen["exists"] == 6 and seen["bit_exact"]
