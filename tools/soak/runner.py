"""One soak run: start everything, drive the load, inject the faults, stop everything.

`Soak(cfg).run()` returns a `SoakReport`. The order:

1. a work folder; a small tmpfs under the disk tier when this process may
   mount (so "disk full" is a real ENOSPC); a Mooncake master and segment
   holder on 127.0.0.1 (when Mooncake is installed);
2. the no-cache reference (`kvpack.tools.soak.reference`, a child process) runs
   while the vLLM server with kvpack boots;
3. `clients` threads send the workload until the load time is over and the
   fault schedule (`kvpack.tools.soak.faults.SCHEDULE`, once per cycle) has run;
   a sampler records the server tree's RSS;
4. every process the soak started is stopped by PID (also on failure), the
   tmpfs unmounted, and the report built.

Nothing leaves 127.0.0.1; every wait has a bound.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpack.config.schema import METRICS_PORT_SPAN as METRICS_PORTS
from kvpack.tools.ports import free_ports

from . import faults as F
from .procs import HOST, MooncakeProcs, Tmpfs, mooncake_binaries, tree_rss
from .reference import key_of
from .report import (
    Comparison,
    Row,
    Window,
    by_labels,
    compare,
    fmt_counter,
    format_table,
    overlapping_windows,
    parse_prometheus,
    parse_server_log,
)
from .server import VllmServer
from .workload import Result, Workload, completion_body, stream_completion


@dataclass
class SoakConfig:
    duration_s: float = 90.0
    """Load time (the fault schedule runs once per `cycle_s` within it)."""
    cycle_s: float = 0.0
    """Length of one fault cycle; 0: one cycle over the whole duration."""
    clients: int = 8
    tenants: tuple[str, ...] = ("acme", "globex", "initech")
    max_tokens: int = 16
    model: str = ""
    workdir: str = ""
    keep_workdir: bool = False
    mooncake: bool = True
    faults: bool = True
    only_faults: tuple[str, ...] = ()
    """Names of the fault functions to run (`faults.SCHEDULE`); empty: all of them."""
    kvpack: bool = True
    """False: the same server and load without kvpack (a numerics baseline; no tiers, no faults)."""
    dtype: str = "float32"
    """Model dtype of the server and the reference (see `kvpack.tools.soak`: why fp32)."""
    metrics_port: int = 0
    """kvpack's ``metrics_port`` (first of 16); 0: a free range found at start."""
    seed: int = 0
    probe_fraction: float = 0.08
    followup_fraction: float = 0.25
    fault_hold_s: float = 4.0
    slow_hold_s: float = 3.0
    warmup_fraction: float = 0.5
    """RSS growth is measured from this fraction of the run to its end: in a short
    run the first half still fills vLLM's and kvpack's bounded caches (allocator
    high-water marks, the memory tier's slab); a leak keeps growing after it."""
    memory_capacity: str = "16MiB"
    disk_capacity: str = "40MiB"
    tmpfs_size: str = "64m"
    io_timeout_ms: int = 500
    mooncake_timeout_ms: int = 200
    write_queue_depth: int = 64
    evictors: int = 24
    block_size: int = 128
    request_timeout_s: float = 30.0
    delay_bound_s: float = 0.5
    """Target for the longest step delay while a tier is down."""
    memory_growth_bound_mib: float = 256.0

    def __post_init__(self) -> None:
        F.selected(self.only_faults)  # an unknown fault name fails here, not in the fault thread


@dataclass
class SoakReport:
    rows: list[Row]
    windows: list[Window]
    comparison: Comparison
    counts: dict[str, Any]
    workdir: str

    @property
    def passed(self) -> bool:
        return all(r.ok is not False for r in self.rows)

    def table(self) -> str:
        lines = [format_table(self.rows), "", "faults and events (seconds from the start of the load):"]
        for w in self.windows:
            lines.append(f"  {w.start:7.1f} -> {w.end:7.1f}  {w.name}: {w.note}")
        if self.comparison.examples:
            lines += ["", "outputs that differ from the reference:"] + [f"  {e}" for e in self.comparison.examples]
        lines += ["", f"logs: {self.workdir}"]
        return "\n".join(lines)


def default_model() -> str:
    """The tiny test Llama (`kvpack.tools.tinymodel`), built once and cached."""
    from ..tinymodel import build_tiny_llama

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpack" / "soak-model"
    return str(build_tiny_llama(cache))


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.workload = Workload.build(cfg.seed, cfg.tenants, evictors=cfg.evictors)
        self.work = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvpack-soak-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.tmpfs = Tmpfs(self.work / "diskfs", cfg.tmpfs_size)
        self.disk_root = self.tmpfs.path / "store"
        self.sentinel = self.work / "UNPICKLED-sentinel"
        self.mooncake: MooncakeProcs | None = None
        self.server: VllmServer | None = None
        self.refs: dict[str, dict[str, Any]] = {}
        self.results: list[Result] = []
        self.windows: list[Window] = []
        self.rss: list[tuple[float, int]] = []
        self.cycle_index = 0
        self._tmpfs_was_mounted = False
        self._root_clean: bool | None = None
        self._quiet_until = 0.0
        self._log_end = 0
        self.t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._probe_seq = 0
        self.metrics_port = cfg.metrics_port or (free_ports(METRICS_PORTS) if cfg.kvpack else 0)
        self._done_pool: list[tuple[str, tuple[int, ...]]] = []

    # -- helpers used by the faults ------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def send(self, kind: str, tenant: Any, prompt: tuple[int, ...], cache_salt: Any = None) -> Result:
        assert self.server is not None
        res = Result(kind, str(tenant) if not isinstance(tenant, str) else tenant, tuple(prompt))
        body = completion_body(
            self.server.served_name, prompt, self.cfg.max_tokens, tenant=tenant, cache_salt=cache_salt
        )
        stream_completion(self.server.port, body, res, self.cfg.request_timeout_s)
        with self._lock:
            self.results.append(res)
            if res.status == "ok" and kind in ("normal", "followup"):
                self._done_pool.append((res.tenant, res.prompt))
        return res

    def fingerprint(self) -> str | None:
        for tenant in sorted(self.cfg.tenants):
            d = self.disk_root / tenant
            if d.is_dir():
                for fp in sorted(d.iterdir()):
                    if fp.is_dir():
                        return fp.name
        return None

    def evict_memory(self, tenant: str) -> None:
        """Push `tenant`'s older objects out of the host-memory tier with distinct prompts of its own."""
        prompts = [self.workload.extra[f"evictor{i}"] for i in range(self.cfg.evictors)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: self.send("evictor", tenant, p), prompts))

    @contextlib.contextmanager
    def quiet(self, max_s: float = 15.0) -> Iterator[None]:
        """Pause the load clients (each finishes its request in flight) for at most `max_s`."""
        self._quiet_until = time.monotonic() + max_s
        time.sleep(1.0)
        try:
            yield
        finally:
            self._quiet_until = 0.0

    # -- set-up ----------------------------------------------------------------------

    def kvpack_config(self) -> dict[str, Any]:
        cfg = self.cfg
        kv: dict[str, Any] = {
            "io_timeout_ms": cfg.io_timeout_ms,
            "write_queue_depth": cfg.write_queue_depth,
            "metrics_port": self.metrics_port,
            # the soak's client is its own trusted front end: it names tenants (and sends bad names on purpose)
            "trusted_tenants": ["*"],
            "memory": {"capacity": cfg.memory_capacity},
            "disk": {"path": str(self.disk_root), "capacity": cfg.disk_capacity},
        }
        if self.mooncake is not None:
            kv["mooncake"] = {
                "enabled": True,
                "master_server_address": self.mooncake.address,
                "global_segment_size": 0,
                "local_buffer_size": "16MiB",
                "staging_size": "32MiB",
                "timeout_ms": cfg.mooncake_timeout_ms,
                "backoff_s": 1.0,
            }
        return kv

    def _reference_spec(self) -> dict[str, Any]:
        w = self.workload
        prompts = [list(p) for p in w.first_turns()] + [list(p) for p in w.extra.values()]
        followups = [
            [list(w.first_turn(d, q)), list(w.followup_questions[f])]
            for d in w.docs
            for q in range(len(w.questions))
            for f in range(len(w.followup_questions))
        ]
        return {
            "model": self.model,
            "dtype": self.cfg.dtype,
            "max_tokens": self.cfg.max_tokens,
            "max_model_len": 2048,
            "prompts": prompts,
            "followups": followups,
        }

    def _start_reference(self) -> subprocess.Popen[bytes]:
        spec = self.work / "reference-in.json"
        spec.write_text(json.dumps(self._reference_spec()))
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
        log = open(self.work / "reference.log", "wb")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "kvpack.tools.soak.reference", str(spec), str(self.work / "reference-out.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        finally:
            log.close()

    def _wait_reference(self, proc: subprocess.Popen[bytes], timeout_s: float = 420.0) -> None:
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(
                f"the reference run did not finish in {timeout_s}s; see {self.work}/reference.log"
            ) from exc
        if rc != 0:
            tail = (self.work / "reference.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the reference run failed (rc={rc}):\n{tail}")
        self.refs = json.loads((self.work / "reference-out.json").read_text())["outputs"]

    # -- load ------------------------------------------------------------------------

    def _client(self, idx: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + idx)
        w = self.workload
        while not self._stop.is_set():
            if time.monotonic() < self._quiet_until:
                time.sleep(0.05)
                continue
            with self._lock:
                pool = list(self._done_pool[-200:])
            if pool and rng.random() < self.cfg.probe_fraction:
                victim_tenant, prompt = rng.choice(pool)
                with self._lock:
                    self._probe_seq += 1
                    probe = f"probe-{self._probe_seq}"  # a fresh tenant: any hit is another tenant's entry
                self.send("probe", probe, prompt)
                continue
            tenant = rng.choice(self.cfg.tenants)
            doc = rng.choice(w.tenant_docs[tenant])
            q = rng.randrange(len(w.questions))
            first = w.first_turn(doc, q)
            if rng.random() < self.cfg.followup_fraction:
                f = rng.randrange(len(w.followup_questions))
                reply = self.refs[key_of(first)]["tokens"]
                self.send("followup", tenant, w.followup(doc, q, reply, f))
            else:
                self.send("normal", tenant, first)

    def _sampler(self) -> None:
        while not self._stop.wait(1.0):
            pid = self.server.pid if self.server else None
            if pid:
                self.rss.append((self.now(), tree_rss(pid)))

    def _fault_runner(self) -> None:
        cfg = self.cfg
        cycle = cfg.cycle_s if cfg.cycle_s > 0 else cfg.duration_s
        n_cycles = max(1, int(cfg.duration_s // cycle))
        for c in range(n_cycles):
            self.cycle_index = c
            for fault in F.selected(cfg.only_faults):
                if self._stop.is_set():
                    return
                at = c * cycle + fault.at * cycle
                while self.now() < at and not self._stop.is_set():
                    time.sleep(0.05)
                start = self.now()
                try:
                    note = fault.fn(self)
                except Exception as exc:
                    note = f"FAULT INJECTION FAILED: {type(exc).__name__}: {exc}"
                down = fault.tier_down and not note.startswith("skipped")
                with self._lock:
                    self.windows.append(Window(fault.name, start + self.t0, self.now() + self.t0, down, note))

    # -- run -------------------------------------------------------------------------

    def run(self) -> SoakReport:
        cfg = self.cfg
        self.model = cfg.model or default_model()
        ref_proc: subprocess.Popen[bytes] | None = None
        try:
            self._tmpfs_was_mounted = self.tmpfs.mount()
            self.disk_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if cfg.kvpack and cfg.mooncake and mooncake_binaries() is not None:
                self.mooncake = MooncakeProcs(self.work / "mooncake").start()
            ref_proc = self._start_reference()
            kv = self.kvpack_config() if cfg.kvpack else None
            self.server = VllmServer(self.model, self.work / "server.log", kv, dtype=cfg.dtype)
            self.server.start()
            self._wait_reference(ref_proc)
            self.t0 = time.monotonic()
            threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(cfg.clients)]
            threads.append(threading.Thread(target=self._sampler, daemon=True))
            with_faults = cfg.faults and cfg.kvpack
            runner = threading.Thread(target=self._fault_runner, daemon=True) if with_faults else None
            for t in threads + ([runner] if runner else []):
                t.start()
            hard_stop = cfg.duration_s * 1.5 + 120
            while self.now() < cfg.duration_s or (runner is not None and runner.is_alive()):
                if self.now() > hard_stop:
                    break
                time.sleep(0.2)
            self._stop.set()
            for t in threads:
                t.join(cfg.request_timeout_s + 5)
            if runner is not None:
                runner.join(30)
            server_alive = self.server.proc is not None and self.server.proc.alive() and self.server.healthy()
            metrics_text = self.scrape_metrics()
            self._root_clean = self._root_is_clean()  # before the tmpfs goes
            self._log_end = (self.work / "server.log").stat().st_size  # shutdown noise is not a finding
        finally:
            self._stop.set()
            if ref_proc is not None and ref_proc.poll() is None:
                ref_proc.kill()
                ref_proc.wait(10)
            if self.server is not None:
                self.server.stop()
            if self.mooncake is not None:
                self.mooncake.stop()
            F.cleanup_disk(self.disk_root)
            self.tmpfs.unmount()
        return self._report(server_alive, metrics_text)

    def scrape_metrics(self) -> str:
        """kvpack's ``kvpack_*`` series from every process of the server.

        Each kvpack store (the scheduler side and each worker) serves its own
        registry on the first free port of ``metrics_port .. +15``; all of them
        are read and `parse_prometheus` sums the series. vLLM's own /metrics is
        read too, in case an adapter also exports there."""
        assert self.server is not None
        urls = [f"http://{HOST}:{self.server.port}/metrics"]
        if self.metrics_port:
            urls += [f"http://{HOST}:{p}/metrics" for p in range(self.metrics_port, self.metrics_port + METRICS_PORTS)]
        texts = []
        for url in urls:
            try:
                texts.append(urllib.request.urlopen(url, timeout=2).read().decode())
            except (OSError, http.client.HTTPException):  # no server there (a closed loopback port can self-connect)
                continue
        return "\n".join(texts)

    # -- report ----------------------------------------------------------------------

    def _report(self, server_alive: bool, metrics_text: str) -> SoakReport:
        cfg = self.cfg
        results = list(self.results)
        raw = (self.work / "server.log").read_bytes()
        log = parse_server_log(raw[: self._log_end or len(raw)].decode(errors="replace"))
        prom = parse_prometheus(metrics_text)
        windows = [Window(w.name, w.start - self.t0, w.end - self.t0, w.tier_down, w.note) for w in self.windows]
        by_kind: dict[str, list[Result]] = {}
        for r in results:
            by_kind.setdefault(r.kind, []).append(r)
        expected_400 = [r for r in by_kind.get("bad-salt", [])]
        counted = [r for r in results if r.kind != "bad-salt"]
        failed = [r for r in counted if r.status != "ok"]
        cmp = compare(counted, self.refs)
        traffic = by_kind.get("normal", []) + by_kind.get("followup", [])
        whole = sum(1 for r in traffic if r.status == "ok" and (r.cached_tokens or 0) >= len(r.prompt) - 1)
        miss = sum(1 for r in traffic if r.status == "ok" and not r.cached_tokens)
        part = sum(1 for r in traffic if r.status == "ok") - whole - miss
        hit_tokens = sum(r.cached_tokens or 0 for r in traffic if r.status == "ok")
        prompt_tokens = sum(len(r.prompt) for r in traffic if r.status == "ok")
        probes = by_kind.get("probe", [])
        probe_hits = [r for r in probes if r.cached_tokens]
        bad = by_kind.get("bad-tenant", [])
        bad_ok = [r for r in bad if r.status == "ok" and not r.cached_tokens]
        salt_400 = [r for r in expected_400 if r.status == "http_400"]
        refused = log["refused"]
        bombs_refused = {tier: v for (tier, reason), v in refused.items() if reason == "bad_magic"}
        canary_refused = sum(
            v for (t, reason), v in log["refused_tenants"].items() if t.startswith("canary") and reason != "bad_magic"
        )
        gaps = [(a, b) for r in results for a, b in r.gaps]
        t0 = self.t0
        longest = max((b - a for a, b in gaps), default=0.0)
        quiet = [b - a for a, b in gaps if not overlapping_windows(a - t0, b - t0, windows, down_only=False)]
        longest_quiet = max(quiet, default=0.0)
        down_gaps = [(b - a, a - t0, overlapping_windows(a - t0, b - t0, windows)) for a, b in gaps]
        longest_down, longest_down_at, longest_down_in = max(
            ((d, at, w) for d, at, w in down_gaps if w), default=(0.0, 0.0, [])
        )
        warm_t = cfg.duration_s * cfg.warmup_fraction
        after = [v for t, v in self.rss if t >= warm_t]
        base = after[:3] if after else [0]
        end = after[-3:] if after else [0]
        growth = (sum(end) / len(end) - sum(base) / len(base)) / (1 << 20)
        peak = max((v for _, v in self.rss), default=0) / (1 << 20)
        dropped = by_labels(prom, "store_dropped", ("tier", "reason"))
        rejected = by_labels(prom, "rejected_objects", ("tier", "reason"))
        tier_errors = by_labels(prom, "tier_errors", ("tier", "status"))
        partial = by_labels(prom, "partial_hits", ("missing_member",))
        exported = any(k.startswith("kvpack_") for k in prom)
        na = "n/a: no kvpack metrics read"
        xfer = log["xfer"]
        rows = [
            Row("requests sent", str(len(results))),
            Row("requests completed", str(sum(1 for r in counted if r.status == "ok"))),
            Row("requests failed", str(len(failed)), "0", not failed),
            Row(
                "outputs equal to the reference",
                f"{cmp.equal}/{cmp.equal + cmp.different + cmp.near_tie}",
                "all",
                cmp.different == 0 and cmp.no_reference == 0,
            ),
            Row("  near-tie divergences (margin < 1e-3)", str(cmp.near_tie), "reported"),
            Row("hits: whole prompt / prefix only / miss", f"{whole} / {part} / {miss}"),
            Row("tokens reused by kvpack / prompt tokens", f"{hit_tokens} / {prompt_tokens}"),
            Row(
                "cross-tenant probes with a hit",
                f"{len(probe_hits)} of {len(probes)}",
                "0 (of >0)",
                not probe_hits and bool(probes),
            ),
            Row("bad tenant names served, no cache", f"{len(bad_ok)}/{len(bad)}", "all", len(bad_ok) == len(bad)),
            Row(
                "bad cache_salt answered HTTP 400",
                f"{len(salt_400)}/{len(expected_400)}",
                "all",
                len(salt_400) == len(expected_400),
            ),
            Row("store root holds only valid tenants", str(self._root_clean), "True", self._root_clean is True),
            Row(
                "pickle bombs refused (bad_magic) per tier, never run",
                f"{fmt_counter(bombs_refused)}, sentinel {'PRESENT' if self.sentinel.exists() else 'absent'}",
                ">0 from mooncake, absent" if self.mooncake is not None else "absent",
                (self.mooncake is None or bool(bombs_refused.get("mooncake"))) and not self.sentinel.exists(),
            ),
            Row(
                "corrupted canary objects refused (flipped byte: any reason but bad_magic)",
                str(canary_refused),
                ">0 (reported)" if by_kind.get("canary-reload") else "",
                None,  # see tests/soak: a new tenant keeps ~one object per full tier today
            ),
            Row("rejected objects by tier/reason (server log)", fmt_counter(refused)),
            Row("rejected objects by tier/reason (kvpack metrics)", fmt_counter(rejected) if exported else na),
            Row("store drops by tier/reason (back-pressure etc.)", fmt_counter(dropped) if exported else na),
            Row("tier errors by tier/status", fmt_counter(tier_errors) if exported else na),
            Row("partial hits by missing member", fmt_counter(partial) if exported else na),
            Row(
                "connector stats (vLLM log)",
                fmt_counter(
                    {
                        k: v
                        for k, v in xfer.items()
                        if k in ("load_timeouts", "failed_blocks", "load_error_blocks", "save_errors", "bad_tenants")
                    }
                )
                or "none",
            ),
            Row("longest step delay (all)", f"{longest:.3f}s"),
            Row("longest step delay outside every fault window (the machine's own noise)", f"{longest_quiet:.3f}s"),
            Row(
                "longest step delay while a tier was down",
                f"{longest_down:.3f}s"
                + (f" from {longest_down_at:.1f}s ({', '.join(longest_down_in)})" if longest_down_in else ""),
                f"< {cfg.delay_bound_s}s",
                longest_down < cfg.delay_bound_s,
            ),
            Row(
                "server tree RSS: peak / growth after warm-up",
                f"{peak:.0f} / {growth:+.0f} MiB",
                f"< {cfg.memory_growth_bound_mib:.0f} MiB",
                growth < cfg.memory_growth_bound_mib,
            ),
            Row("server alive and healthy at the end", str(server_alive), "True", server_alive),
            Row(
                "engine deaths / tracebacks in the server log",
                f"{log['engine_dead']} / {log['tracebacks']}",
                "0 / -",
                log["engine_dead"] == 0,
            ),
        ]
        counts = dict(
            failed=[(r.kind, r.tenant, r.status, r.error[:200]) for r in failed],
            probes=len(probes),
            probe_hits=len(probe_hits),
            bad_tenants=len(bad),
            bad_tenants_ok=len(bad_ok),
            bombs_refused=bombs_refused,
            sentinel=self.sentinel.exists(),
            root_clean=self._root_clean,
            canary_refused=canary_refused,
            mooncake=self.mooncake is not None,
            refused={f"{t}/{r}": v for (t, r), v in refused.items()},
            rss=[(round(t, 1), v >> 20) for t, v in self.rss],
            xfer=dict(xfer),
            longest_gap=longest,
            longest_gap_quiet=longest_quiet,
            longest_gap_down=longest_down,
            longest_gap_down_in=longest_down_in,
            rss_growth_mib=growth,
            server_alive=server_alive,
            engine_dead=log["engine_dead"],
            hits=(whole, part, miss),
            tmpfs_mounted=self._tmpfs_was_mounted,
            kvpack_metrics=prom,
        )
        return SoakReport(rows, windows, cmp, counts, str(self.work))

    def _root_is_clean(self) -> bool | None:
        from kvpack.identity.keys import validate_tenant
        from kvpack.tiers.disk.fs import MARKER

        if not self.disk_root.is_dir():
            return None
        for entry in self.disk_root.iterdir():
            if entry.name == MARKER or entry.name.startswith(MARKER + "."):  # the marker, the index beside it
                continue
            try:
                validate_tenant(entry.name)
            except ValueError:
                return False
        extra = {p.name for p in self.tmpfs.path.iterdir()} - {"store"} if self.tmpfs.path.is_dir() else set()
        return not extra
