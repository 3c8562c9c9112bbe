"""Write pages through one backend here, read them in another process (sglang_peer.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from sglang_parts import alloc_pages, fill_random, make_backend, make_pool, page_bytes, page_keys

from fixtures.warm_start import warm_starts

PEER = Path(__file__).resolve().parent / "sglang_peer.py"
PEER_MODULES = (
    "kvpack_sglang_shim",  # before any sglang import
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.storage",
)
"""What a process on SGLang's host pools (`sglang_peer`, a test's writer) imports first: its fork
server imports them before it forks (`fixtures.warm_start`; kvpack is imported by the process)."""


def peer_env(**more: str) -> dict[str, str]:
    """The environment of such a process (this folder on PYTHONPATH: the shim, `sglang_parts`)."""
    here = str(Path(__file__).resolve().parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])), **more)


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
    proc = warm_starts().run_script(
        sys.executable,
        [str(PEER), str(tmp_path / "args.json")],
        peer_env(),
        tmp_path / "peer.log",
        timeout_s=120,
        modules=PEER_MODULES,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    seen = json.loads(lines[-1]) if lines else {}
    assert proc.returncode == 0, f"peer failed ({proc.returncode}): {seen}\n{proc.stderr[-3000:]}"
    return seen
