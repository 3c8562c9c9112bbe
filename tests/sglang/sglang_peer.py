"""A second SGLang backend instance in its own process (tests/sglang cross-process checks).

    python sglang_peer.py ARGS.json     # exit 0 when every check passed

ARGS: {"extra": {...dynamic + kvpack config...}, "kind": "mha"|"mla",
"layout": ..., "keys": [...], "missing": [...], "want": "pages.bin"}. Builds its
own host pool (different memory, poisoned), loads KVPackStorage through SGLang's
factory, and checks: every key of `keys` is found and loads bit-exact, no key
of `missing` is found. Prints one JSON line with what it saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import json  # noqa: E402
from typing import Any  # noqa: E402

import kvpack_sglang_shim  # noqa: E402,F401
from sglang_parts import alloc_pages, make_backend, make_pool, page_bytes, poison  # noqa: E402


def check(args: dict[str, Any]) -> dict[str, Any]:
    """What a new backend on its own host pool sees of `args` (the checks `main` reports);
    also called in the test's own process when the writer was another process."""
    pool = make_pool(args["kind"], args["layout"])
    backend = make_backend(pool, args["extra"], mla=args["kind"] == "mla")
    backend.wait_ready(20)
    keys, missing = args["keys"], args["missing"]
    want = Path(args["want"]).read_bytes()
    poison(pool)
    dst = alloc_pages(pool, len(keys))
    seen = {
        "exists": backend.batch_exists(keys),
        "exists_missing": backend.batch_exists(missing),
        "get": backend.batch_get_v1(keys, dst),
    }
    seen["bit_exact"] = b"".join(page_bytes(pool, dst)) == want
    seen["metrics"] = backend.metrics_snapshot().get("rejected_objects", {})
    backend.close()
    return seen


def main(path: str) -> int:
    args = json.loads(Path(path).read_text())
    seen = check(args)
    keys = args["keys"]
    print(json.dumps(seen))
    ok = seen["exists"] == len(keys) and seen["exists_missing"] == 0 and all(seen["get"]) and seen["bit_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
