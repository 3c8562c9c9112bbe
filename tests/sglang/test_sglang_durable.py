"""An acknowledged SGLang store survives its process: True from batch_set means stored.

SGLang calls ``batch_set_v1`` (and v2) from its backup thread and takes True
as done; when the server stops it SIGKILLs the scheduler process
(``kill_process_tree``). So a writer process here stores 4 pages, gets
``[True] * 4``, and then either simply ends (no close, no flush) or is killed
with SIGKILL at once. A second process (this test's own, with a new backend on a
new host pool: `sglang_peer.check`) must find all 4,
bit-exact. Before, the disk writes were still queued: 3 of 4 were found.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import sglang_peer
from sglang_parts import kvpack_extra, page_keys
from sglang_shared import PEER_MODULES, peer_env

from fixtures.warm_start import warm_starts

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent

WRITER = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, HERE)
    import kvpack_sglang_shim
    from sglang_parts import alloc_pages, fill_random, make_backend, make_pool, page_bytes
    args = json.loads(open(sys.argv[1]).read())
    pool = make_pool("mha", args["layout"])
    backend = make_backend(pool, args["extra"])
    assert backend.wait_ready(20)
    fill_random(pool, seed=191)
    src = alloc_pages(pool, len(args["keys"]))
    open(args["want"], "wb").write(b"".join(page_bytes(pool, src)))
    ok = backend.batch_set_v1(args["keys"], src)
    print("SET", json.dumps(ok), flush=True)
    if args["how"] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": the process simply ends
    """
).replace("HERE", repr(str(HERE)))


@pytest.mark.parametrize("how", ["exit", "sigkill"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_acknowledged_before_the_process_ends_are_found_by_the_next(
    tmp_path: Path, layout: str, how: str
) -> None:
    extra = kvpack_extra(tmp_path / "kv")
    keys = page_keys(4, seed=192)
    args = {"extra": extra, "layout": layout, "keys": keys, "want": str(tmp_path / "pages.bin"), "how": how}
    (tmp_path / "writer.json").write_text(json.dumps(args))
    writer = warm_starts().run_script(
        sys.executable, ["-c", WRITER, str(tmp_path / "writer.json")], peer_env(PYTHONUNBUFFERED="1"),
        tmp_path / "writer.log", timeout_s=180, modules=PEER_MODULES,
    )  # fmt: skip
    assert "SET [true, true, true, true]" in writer.stdout, writer.stderr[-3000:]
    assert writer.returncode == (-signal.SIGKILL if how == "sigkill" else 0), writer.stderr[-3000:]
    peer_args = {
        "extra": extra,
        "kind": "mha",
        "layout": layout,
        "keys": keys,
        "missing": page_keys(2, seed=193),
        "want": args["want"],
    }
    seen = sglang_peer.check(peer_args)  # here: a process of its own too, started before the writer
    assert seen["exists"] == 4 and all(seen["get"]) and seen["bit_exact"], seen
    assert seen["exists_missing"] == 0  # negative control
