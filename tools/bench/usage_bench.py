"""`kvpack bench usage`: ``kvpack usage`` over a disk store index of N objects, timed.

Builds the index with the disk tier's own `Catalog` (tenants x models, one object per group,
every row ready, each model named as an engine names it; no object file: usage never opens
one), then times `kvpack.operate.operating.usage` `--repeat` times in this process, and prints the
objects it counted and each time. The index goes to a temporary folder unless `--dir` names
one (an existing index there is reused: build once, time often).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import StoreKey
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.operate.operating import usage
from kvpack.tiers.disk.catalog import INDEX_NAME, Catalog

BATCH = 20_000
"""Rows per `Catalog.admit` while building."""


def build(root: str, objects: int, tenants: int, models: int) -> float:
    """Index `objects` one-object groups in `root`, spread over tenants and models; seconds taken."""
    catalog = Catalog(os.path.join(root, INDEX_NAME))
    specs = [
        KVLayoutSpec(engine="vllm:cpu", model=f"model-{m}", dtype="bfloat16", chunk_tokens=16) for m in range(models)
    ]
    per = objects // (tenants * models)
    started = time.perf_counter()
    try:
        for spec in specs:
            fp = spec.group_fingerprint
            catalog.name_fingerprint(fp, spec.describe(f"/models/{spec.model}"))
            for t in range(tenants):
                for lo in range(0, per, BATCH):
                    keys = [StoreKey(f"t{t}", fp, f"{i:064x}", "kv") for i in range(lo, min(per, lo + BATCH))]
                    catalog.admit(f"t{t}", [(k, 1000, None) for k in keys], 1 << 60, {})
                    catalog.mark_ready(keys)
    finally:
        catalog.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack bench usage", description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100_000, help="objects in the index (default 100000)")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="where the index lives (default: a temporary folder)")
    args = parser.parse_args(argv)
    if not (1 <= args.tenants <= 1000 and 1 <= args.models <= 100 and 1 <= args.objects <= 10**8):
        parser.error("--objects 1..1e8, --tenants 1..1000, --models 1..100")
    with tempfile.TemporaryDirectory(prefix="kvpack-usage-") as tmp:
        root = args.dir or tmp
        os.makedirs(root, exist_ok=True)
        if not os.path.exists(os.path.join(root, INDEX_NAME)):
            print(f"built {args.objects} objects in {build(root, args.objects, args.tenants, args.models):.1f} s")
        config = KVPackConfig.from_dict({"disk": {"path": root}})
        for _ in range(max(1, args.repeat)):
            started = time.perf_counter()
            stores, _ = usage(config)
            took = time.perf_counter() - started
            counted = sum(r.objects for s in stores if s.tier == "disk" for r in s.rows)
            print(f"kvpack usage: {counted} objects in {took:.3f} s")
    return 0
