"""Mooncake tier benchmark: kvpack's tier vs the raw MooncakeDistributedStore batch API.

Same data, same cluster, same run: for each object size, batch put and batch
get throughput of the raw API (``batch_put_from`` / ``batch_get_into`` on the
caller's buffers, one call per batch), of the raw API with the same Mooncake
group ids kvpack passes (one per kvpack group: here one per object), and of
`MooncakeTier` (header + checksum + staging copy + verification + group ids);
the ratios kvpack / raw and kvpack / raw with groups (the like-for-like one:
kvpack must pass group ids for its group semantics), and the latency of a
1000-key batch lookup (``batch_is_exist`` vs ``MooncakeTier.contains``).

    python -m kvpack.tools.bench.mooncake_bench              # starts a master + holder on 127.0.0.1
    python -m kvpack.tools.bench.mooncake_bench --master 10.0.0.1:50051

Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvpack.tools.ports import free_port

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


class _LocalCluster:
    """A master and one holder on loopback, stopped by PID."""

    def __init__(self, segment: str) -> None:
        import mooncake

        pkg = Path(mooncake.__file__).parent
        self.rpc, metrics, holder = free_port(), free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="kvpack-mc-bench-")
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        log = open(os.path.join(self.dir, "master.log"), "wb")
        self.master = subprocess.Popen(
            [
                str(pkg / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
                "--logtostderr",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        time.sleep(0.3)
        log = open(os.path.join(self.dir, "holder.log"), "wb")
        self.holder = subprocess.Popen(
            [
                str(pkg / "mooncake_client"),
                f"--global_segment_size={segment}",
                f"--master_server_address=127.0.0.1:{self.rpc}",
                "--metadata_server=P2PHANDSHAKE",
                "--host=127.0.0.1",
                f"--port={holder}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=1).read().decode()
                if any(
                    line.startswith("master_total_capacity_bytes ") and not line.endswith(" 0")
                    for line in text.splitlines()
                ):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Mooncake holder did not mount its segment; logs in {self.dir}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    def stop(self) -> None:
        for p in (self.holder, self.master):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpack bench mooncake", description=__doc__.split("\n\n")[0])
    ap.add_argument("--master", default="", help="host:port of a running master (default: start one locally)")
    ap.add_argument("--segment", default="2GB", help="segment of the local holder")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes per measured batch")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    from kvpack.config.schema import MooncakeTierConfig
    from kvpack.identity.keys import StoreKey
    from kvpack.identity.objects import Expectation, ObjectHeader
    from kvpack.tiers.base import PutItem, TierStatus
    from kvpack.tiers.mooncake import MooncakeTier

    cluster = None if args.master else _LocalCluster(args.segment)
    master = args.master or cluster.address  # type: ignore[union-attr]
    raw = MooncakeDistributedStore()
    tier = None
    try:
        rc = raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            print(f"raw Mooncake setup failed ({rc})")
            return 1
        tier = MooncakeTier(
            MooncakeTierConfig(
                enabled=True,
                master_server_address=master,
                global_segment_size=0,
                staging_size=64 << 20,
                workers=args.workers,
                timeout_ms=30000,
            )
        )
        if not tier.wait_ready(30):
            print(f"kvpack tier did not connect: {tier.state}")
            return 1
        total = args.total_mib << 20
        fp = "cd" * 16
        print(
            f"master {master}; {args.total_mib} MiB per batch, {args.repeats} interleaved repeats; GB/s of the median; "
            "ratios of the medians and of the best times; spread = (max-min)/median of raw and kvpack"
        )
        print(
            "ratio: kvpack / raw; ratio/g and best/g: kvpack / raw with the same group ids; +checksum: get with "
            "payload "
            "checksum verification, its ratio vs raw with groups"
        )
        print(
            f"{'size':>6} {'op':>4} {'raw':>6} {'raw+g':>6} {'kvpack':>6} {'ratio':>6} {'ratio/g':>7} {'best/g':>6}"
            f"  {'+checksum':>9} {'ratio/g':>7}  {'spread raw/raw+g/kvpack':>23}"
        )
        for label, size in SIZES.items():
            n = max(1, total // size)
            src = np.random.default_rng(size).integers(0, 256, n * size, dtype=np.uint8)
            dst = np.zeros_like(src)
            views = [memoryview(src[i * size : (i + 1) * size]) for i in range(n)]
            dviews = [memoryview(dst[i * size : (i + 1) * size]) for i in range(n)]
            ptrs = [src.ctypes.data + i * size for i in range(n)]
            dptrs = [dst.ctypes.data + i * size for i in range(n)]
            t: dict[str, list[float]] = {k: [] for k in ("rp", "rg", "gp", "gg", "kp", "kg", "kgc")}
            for r in range(args.repeats):
                rkeys = [f"bench/raw/{label}/{r}/{i}" for i in range(n)]
                gkeys = [f"bench/rawg/{label}/{r}/{i}" for i in range(n)]
                gcfg = ReplicateConfig()
                gcfg.group_ids = [f"bench/rawg/{label}/{r}/g{i}" for i in range(n)]
                keys = [StoreKey("default", fp, f"b{label}-{r}-{i}", "kv") for i in range(n)]
                items = [
                    PutItem(k, ObjectHeader(fp, "default", k.chunk, "kv", 16, size, None), v)
                    for k, v in zip(keys, views)
                ]
                exp = [Expectation(fp, "default", k.chunk, "kv", 16, size) for k in keys]

                # Interleaved, order alternating per repeat: the machine is shared, so
                # raw and kvpack should see the same background load.
                def raw_put() -> None:
                    s0 = time.perf_counter()
                    codes = raw.batch_put_from(rkeys, ptrs, [size] * n)
                    t["rp"].append(time.perf_counter() - s0)
                    assert all(c == 0 for c in codes), codes

                def rawg_put() -> None:
                    s0 = time.perf_counter()
                    codes = raw.batch_put_from(gkeys, ptrs, [size] * n, gcfg)
                    t["gp"].append(time.perf_counter() - s0)
                    assert all(c == 0 for c in codes), codes

                def rawg_get() -> None:
                    s0 = time.perf_counter()
                    got = raw.batch_get_into(gkeys, dptrs, [size] * n)
                    t["gg"].append(time.perf_counter() - s0)
                    assert all(g == size for g in got), got

                def kv_put() -> None:
                    s0 = time.perf_counter()
                    st = tier.put_from(items)
                    t["kp"].append(time.perf_counter() - s0)
                    assert all(x is TierStatus.OK for x in st), st

                def raw_get() -> None:
                    s0 = time.perf_counter()
                    got = raw.batch_get_into(rkeys, dptrs, [size] * n)
                    t["rg"].append(time.perf_counter() - s0)
                    assert all(g == size for g in got), got

                def kv_get() -> None:
                    s0 = time.perf_counter()
                    res = tier.get_into(keys, dviews, exp, False)
                    t["kg"].append(time.perf_counter() - s0)
                    assert all(x.ok for x in res)

                order = (raw_put, rawg_put, kv_put, raw_get, rawg_get, kv_get)
                for fn in order if r % 2 == 0 else order[2::-1] + order[:2:-1]:
                    fn()
                s0 = time.perf_counter()
                res = tier.get_into(keys, dviews, exp, True)
                t["kgc"].append(time.perf_counter() - s0)
                assert all(x.ok for x in res) and np.array_equal(src, dst)
                raw.batch_remove(rkeys, True)
                raw.batch_remove(gkeys, True)
                tier.remove_groups([k.group for k in keys])
            m = {k: _gbps(n * size, statistics.median(v)) for k, v in t.items()}
            b = {k: _gbps(n * size, min(v)) for k, v in t.items()}
            # spread: (slowest - fastest) / median of each series, the noise of this run
            sp = {k: (max(v) - min(v)) / statistics.median(v) for k, v in t.items()}
            print(
                f"{label:>6} {'put':>4} {m['rp']:6.2f} {m['gp']:6.2f} {m['kp']:6.2f} {m['kp'] / m['rp']:6.2f} "
                f"{m['kp'] / m['gp']:7.2f}"
                f" {b['kp'] / b['gp']:6.2f}  {'(always)':>9} {'':>7}  {sp['rp']:7.0%} {sp['gp']:7.0%} {sp['kp']:7.0%}"
            )
            print(
                f"{label:>6} {'get':>4} {m['rg']:6.2f} {m['gg']:6.2f} {m['kg']:6.2f} {m['kg'] / m['rg']:6.2f} "
                f"{m['kg'] / m['gg']:7.2f}"
                f" {b['kg'] / b['gg']:6.2f}  {m['kgc']:9.2f} {m['kgc'] / m['gg']:7.2f}  {sp['rg']:7.0%} "
                f"{sp['gg']:7.0%} {sp['kg']:7.0%}"
            )
        # Batch lookup latency, 1000 keys (half present).
        keys = [StoreKey("default", fp, f"look-{i}", "kv") for i in range(1000)]
        small = np.zeros(64, dtype=np.uint8)
        tier.put_from(
            [PutItem(k, ObjectHeader(fp, "default", k.chunk, "kv", 16, 64, None), small.data) for k in keys[:500]]
        )
        names = [k.as_str() for k in keys]
        lr, lk = [], []
        for _ in range(50):
            s0 = time.perf_counter()
            raw.batch_is_exist(names)
            lr.append(time.perf_counter() - s0)
            s0 = time.perf_counter()
            found = tier.contains(keys)
            lk.append(time.perf_counter() - s0)
        assert sum(found) == 500, sum(found)
        print(
            f"lookup 1000 keys: raw batch_is_exist {statistics.median(lr) * 1e3:.2f} ms, "
            f"kvpack contains {statistics.median(lk) * 1e3:.2f} ms (median of 50)"
        )
        tier.remove_groups([k.group for k in keys])
        return 0
    finally:
        if tier is not None:
            tier.close()
        raw.close()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
