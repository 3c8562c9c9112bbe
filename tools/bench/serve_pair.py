"""`kvpack bench pair`: two vLLM servers on one host behind a round-robin proxy, shared-prefix traffic.

A load balancer that knows nothing of prefixes sends each request to the next
instance (`kvpack.tools.proxy.RoundRobin`), so about half of the repeats of a
prefix land on the instance that did not compute it. What kvpack's tiers make
of that, one row per tier set-up, each on two freshly started servers, one row
after another in ONE run:

1. ``process``: each server its own memory tier (``memory.mode: process``), disk off;
2. ``process + disk``: the same, plus one disk store both use (today's default);
3. ``host``: one host memory tier for both (``memory.mode: host``), disk off.

vLLM's prefix caching is off in every row, so every reused token is kvpack's:
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}`` summed over both
servers over the client's run, against the tokens an unbounded shared cache
could reuse (`serve_bench.common_prefixes`). The traffic is vLLM's benchmark
client (``prefix_repetition``, `serve_bench`'s workloads) against the proxy; TTFT
is the client's, mean and median, over all requests and over the repeats alone.

Then a hand-off probe per row, `--probes` fresh prompts each: server A computes the
prompt, A answers it again (A's own repeat hit), then B answers it for the first
time. Each is a 1-token completion timed by the caller (its TTFT plus one HTTP
round trip); the row gives the medians and B first / A repeat. Prints a table;
asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpack.tools.bench.serve_bench import WORKLOADS, Workload, common_prefixes, kv_cache_blocks, run_client, traffic
from kvpack.tools.bench.serve_server import BLOCK_SIZE, HOST, Counters, Server, http_call
from kvpack.tools.bench.timing import publish
from kvpack.tools.ports import free_port
from kvpack.tools.proxy import RoundRobin, serve


@dataclass(frozen=True)
class PairRow:
    """Two servers' lifetime under the client and the probe."""

    name: str
    requests: int
    prompt_tokens: int
    repeatable: int
    reused: int
    ttft_mean_s: float
    ttft_median_s: float
    ttft_repeats_mean_s: float
    repeat_a_s: float
    """Median time of A's second answer to a probe prompt (its own repeat hit)."""
    first_b_s: float
    """Median time of B's first answer to the same prompt."""
    first_b_reused: int
    """Tokens B reused over the probes (of `probe_tokens`)."""
    probe_tokens: int
    failed: int = 0
    """Requests of the client's run that failed (not in the TTFTs)."""

    @property
    def reuse(self) -> float:
        return self.reused / self.repeatable if self.repeatable else float("nan")


def _timed_completion(port: int, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    began = time.perf_counter()
    status, text = http_call("POST", port, "/v1/completions", body, timeout=300)
    if status != 200:
        raise RuntimeError(f"probe request answered {status}: {text[:300]}")
    return time.perf_counter() - began


def _probe(a: Server, b: Server, model: str, w: Workload, count: int, seed: int) -> tuple[float, float, int, int]:
    """(median A repeat s, median B first s, tokens B reused, tokens B could reuse) over `count` prompts."""
    from kvpack.tools.tinymodel import VOCAB_WORDS

    rng = random.Random(seed)
    repeat, first, reused, could = [], [], 0, 0
    for _ in range(count):
        ids = [rng.randrange(3, VOCAB_WORDS) for _ in range(w.prefix_len + w.suffix_len)]
        _timed_completion(a.port, model, ids)
        repeat.append(_timed_completion(a.port, model, ids))
        before = Counters.read(b.port).external
        first.append(_timed_completion(b.port, model, ids))
        reused += int(Counters.settled(b.port).external - before)
        could += len(ids) - 1
    return statistics.median(repeat), statistics.median(first), reused, could


@dataclass
class Pair:
    model: str
    workload: Workload
    kv_cache_bytes: int
    root: Path
    seed: int
    probes: int
    start_timeout_s: float
    client_timeout_s: float
    prompts: list[list[int]]

    def row(self, name: str, kvpack: dict[str, Any]) -> PairRow:
        tag = name.replace(" ", "_").replace("+", "and")
        servers = [
            Server(
                self.model,
                free_port(),
                self.root / f"server-{tag}-{i}.log",
                False,
                kvpack,
                self.kv_cache_bytes,
                self.workload.max_model_len,
                10,
            )
            for i in range(2)
        ]
        print(f"[pair bench] {name}: starting two servers (logs {servers[0].log.parent})", flush=True)
        with ThreadPoolExecutor(2) as pool:
            started = [pool.submit(s.start, self.start_timeout_s) for s in servers]
            start_errors = [f.exception() for f in started]
        proxy = serve(RoundRobin([f"http://{HOST}:{s.port}" for s in servers], self.client_timeout_s), HOST, 0)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            if any(start_errors):
                raise RuntimeError(f"a server did not start: {next(e for e in start_errors if e)}")
            before = [Counters.settled(s.port) for s in servers]
            result = run_client(
                self.model,
                int(proxy.server_address[1]),
                self.workload,
                self.seed,
                self.client_timeout_s,
                self.root,
                self.root / f"client-{tag}.log",
            )
            after = [Counters.settled(s.port) for s in servers]
            probe = _probe(servers[0], servers[1], self.model, self.workload, self.probes, 2000 + self.seed)
        except BaseException:
            for s in servers:
                print(s.log_tail(), file=sys.stderr)
            raise
        finally:
            proxy.shutdown()
            proxy.server_close()
            for s in servers:
                s.stop()
        errors = [e for e in result.get("errors", []) if e]
        if errors:
            print(f"[pair bench] {name}: {len(errors)} failed requests, first: {errors[0][:300]}", file=sys.stderr)
        if not result.get("completed"):
            raise RuntimeError(f"no request completed: {errors[:1]}")
        ttfts = [t for t, e in zip(result.get("ttfts", []), result.get("errors", [])) if not e]
        shared = common_prefixes(self.prompts)
        again = [
            t for t, e, n in zip(result.get("ttfts", []), result.get("errors", []), shared) if not e and n >= BLOCK_SIZE
        ]
        nan = float("nan")
        return PairRow(
            name=name,
            requests=len(result.get("ttfts", [])),
            prompt_tokens=int(result.get("total_input_tokens", 0)),
            repeatable=sum(shared),
            reused=int(sum(x.external - y.external for x, y in zip(after, before))),
            ttft_mean_s=statistics.mean(ttfts) if ttfts else nan,
            ttft_median_s=statistics.median(ttfts) if ttfts else nan,
            ttft_repeats_mean_s=statistics.mean(again) if again else nan,
            repeat_a_s=probe[0],
            first_b_s=probe[1],
            first_b_reused=probe[2],
            probe_tokens=probe[3],
            failed=len(errors),
        )


def report(rows: list[PairRow]) -> str:
    out = [
        "| tiers | reused / repeatable | reuse | mean TTFT ms | median TTFT ms | repeats' mean TTFT ms "
        "| probe: A repeat ms | B first ms | B first / A repeat | B reused | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.name} | {r.reused} / {r.repeatable} | {r.reuse:.2f} | {r.ttft_mean_s * 1e3:.0f} "
            f"| {r.ttft_median_s * 1e3:.0f} | {r.ttft_repeats_mean_s * 1e3:.0f} | {r.repeat_a_s * 1e3:.0f} "
            f"| {r.first_b_s * 1e3:.0f} | {r.first_b_s / r.repeat_a_s:.2f}x | {r.first_b_reused} / {r.probe_tokens} "
            f"| {r.failed} |"
        )
    base = next((r for r in rows if r.name == "process"), None)
    for r in rows:
        if base is not None and r is not base:
            out.append(f"\n{r.name}: mean TTFT {r.ttft_mean_s / base.ttft_mean_s:.2f}x the per-process tiers'")
    return "\n".join(out)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench pair", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    p.add_argument("--model", default="", help="model directory (default: build the bench Llama in --model-dir)")
    p.add_argument("--model-dir", default=str(Path(os.path.expanduser("~/.cache/kvpack/models/bench-llama"))))
    p.add_argument("--rows", default="process,process+disk,host", help="comma-separated, of the three rows")
    p.add_argument("--kv-cache-fraction", type=float, default=0.5, help="each engine's KV cache / the working set")
    p.add_argument("--probes", type=int, default=3, help="hand-off probe prompts per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=400.0)
    p.add_argument("--client-timeout-s", type=float, default=0.0, help="default: 10 s per request, at least 180 s")
    p.add_argument("--out", default="", help="write a markdown results file here")
    p.add_argument("--keep", action="store_true", help="keep the stores and server logs (printed at the end)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", HOST)
    from kvpack.tiers.host import drop
    from kvpack.tools.tinymodel import build_bench_llama

    model = Path(args.model) if args.model else build_bench_llama(args.model_dir)
    w = WORKLOADS[args.workload]
    blocks = kv_cache_blocks(w, args.kv_cache_fraction)
    from kvpack.tools.bench.serve_bench import _kv_bytes_per_token

    kv_bytes = blocks * BLOCK_SIZE * _kv_bytes_per_token(model)
    prompts = traffic(str(model), w, args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvpack-pair-bench-"))
    host_name = f"pair-bench-{os.getpid()}"
    plans: dict[str, dict[str, Any]] = {
        "process": {"memory": {"mode": "process", "capacity": "1GiB"}, "disk": {"enabled": False}},
        "process+disk": {"memory": {"mode": "process", "capacity": "1GiB"}, "disk": {"path": str(root / "disk")}},
        "host": {"memory": {"mode": "host", "host_name": host_name, "capacity": "1GiB"}, "disk": {"enabled": False}},
    }
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    bad = [n for n in names if n not in plans]
    if bad:
        print(f"kvpack bench pair: --rows {bad[0]!r} is not one of {sorted(plans)}", file=sys.stderr)
        return 2
    pair = Pair(
        str(model),
        w,
        kv_bytes,
        root,
        args.seed,
        args.probes,
        args.start_timeout_s,
        args.client_timeout_s or max(180.0, 10.0 * len(prompts)),
        prompts,
    )
    setup = (
        f"Workload `{w.name}` through a round-robin proxy over two servers: {w.num_prefixes} prefixes of "
        f"{w.prefix_len} tokens, suffixes of {w.suffix_len}, {len(prompts)} requests, concurrency {w.concurrency}, "
        f"{w.output_len} output tokens; each engine's KV cache {blocks * BLOCK_SIZE} tokens; vLLM prefix caching "
        f"off; kvpack memory 1 GiB (per process, or per host in `host`). Model {model.name}."
    )
    print(f"[pair bench] {setup}", flush=True)
    rows = []
    try:
        for name in names:
            rows.append(pair.row(name, plans[name]))
            drop(host_name)
    finally:
        drop(host_name)
        if args.keep:
            print(f"[pair bench] kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    publish(
        "pair",
        argv,
        "kvpack bench pair: two vLLM servers behind a round-robin proxy",
        f"{setup}\n\n{report(rows)}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
