"""Write pages through one backend here, read them in another process (sglang_peer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sglang_parts import alloc_pages, fill_random, make_backend, make_pool, page_bytes, page_keys

PEER = Path(__file__).resolve().parent / "sglang_peer.py"


def write_then_read_elsewhere(
    extra: dict[str, Any], tmp_path: Path, kind: str = "mha", layout: str = "page_first"
) -> dict:
    pool = make_pool(kind, layout)
    backend = make_backend(pool, extra, mla=kind == "mla")
    try:
        assert backend.wait_ready(20), "a tier did not come up"
        fill_random(pool, seed=91)
        n = 6
        keys = page_keys(n, seed=92)
        src = alloc_pages(pool, n)
        (tmp_path / "pages.bin").write_bytes(b"".join(page_bytes(pool, src)))
        assert backend.batch_set_v1(keys, src) == [True] * n
        assert backend.flush(20)
        assert backend.session.report.metrics.value("store_dropped") == 0
    finally:
        backend.close()
    args = {
        "extra": extra,
        "kind": kind,
        "layout": layout,
        "keys": keys,
        "missing": page_keys(2, seed=93),
        "want": str(tmp_path / "pages.bin"),
    }
    (tmp_path / "args.json").write_text(json.dumps(args))
    proc = subprocess.run(
        [sys.executable, str(PEER), str(tmp_path / "args.json")], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    seen = json.loads(lines[-1]) if lines else {}
    assert proc.returncode == 0, f"peer failed ({proc.returncode}): {seen}\n{proc.stderr[-3000:]}"
    return seen
