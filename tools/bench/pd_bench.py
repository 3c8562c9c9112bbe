"""`kvpack bench pd`: prefill/decode through the store vs one instance, end to end.

What is measured: client-side time to first token (TTFT: the time from
sending the request to the first streamed ``data:`` chunk) and total latency
(to ``[DONE]``) of N distinct token-id prompts (default 12 of 1500 tokens,
``max_tokens`` 16, greedy, ``ignore_eos``), sent one at a time, streamed, to

(a) one vLLM OpenAI server with kvpack (``kv_both``, a disk store of its own);
(b) a prefill instance (``kv_producer``) and a decode instance
    (``kv_consumer``) on one shared disk store, with `kvpack proxy` in front
    (as ``examples/vllm/prefill_decode.sh`` runs them): the proxy sends the
    prompt to the prefill instance with ``max_tokens: 1``, then the request
    with its handoff to the decode instance, which loads n - 1 prompt tokens
    from the store (waiting at most ``handoff_wait_ms`` for objects still landing)
    and streams the answer back.

All three servers run at once and the prompts alternate between (a) and (b)
(ABBA order), so load from other jobs on the machine falls on both alike.
Every prompt is new to every server (vLLM's prefix cache off), so (a)
computes and stores each one, and (b) computes it on the prefill instance and
loads it on the decode instance.

The decode instance's kvpack metrics (config ``metrics_port``; each of its
processes takes a port of ``metrics_port .. +15``) are scraped before and
after every request: the histogram ``kvpack_handoff_wait_seconds`` gives the
wait distribution (count, mean from ``_sum / _count``, p50 and p90
interpolated in its buckets as Prometheus' ``histogram_quantile`` does, and,
one handoff per request, each request's exact wait from the ``_sum`` delta);
``kvpack_handoff_missing_total`` the objects that had not landed within
``handoff_wait_ms`` (recomputed); ``kvpack_loaded_tokens_total`` the tokens loaded.
Each server's own vLLM request histograms (TTFT, queue, prefill, inter-token,
end to end; ``_sum / _count`` over the timed requests) split PD's TTFT into
the prefill leg, the decode instance's load and first token, and the proxy.

Servers listen on 127.0.0.1 only and are stopped by PID with SIGINT, then
SIGKILL of their process group after a bound; every request is bounded in
time. Prints a table with ratios; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpack.tools.bench.prom import EMPTY, Histogram, parse_histogram, parse_total, percentile
from kvpack.tools.bench.serve_server import HOST, Counters, Server, http_call, scrape
from kvpack.tools.bench.timing import publish
from kvpack.tools.ports import free_port

DEFAULT_MODEL_DIR = Path(os.path.expanduser("~/.cache/kvpack/models/bench-llama"))
METRICS_SPAN = 16
"""Ports a kvpack engine tries from ``metrics_port`` on (kvpack.config.schema.METRICS_PORT_SPAN)."""
WAIT = "kvpack_handoff_wait_seconds"


@dataclass(frozen=True)
class Sample:
    """One streamed request, seen by the client."""

    ttft_s: float
    total_s: float
    chunks: int
    """Streamed ``data:`` chunks that carried text."""


@dataclass
class Side:
    """One setup's requests: its samples and its failures."""

    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def stat(self, what: str, p: float) -> float:
        return percentile([getattr(s, what) for s in self.samples], p)


@dataclass(frozen=True)
class ConsumerMetrics:
    """The decode instance's kvpack metrics, summed over its processes."""

    wait: Histogram
    missing: float
    loaded_tokens: float
    handoff_loads: float

    @classmethod
    def read(cls, ports: list[int]) -> ConsumerMetrics:
        texts = [scrape(p) or "" for p in ports]
        hists = [parse_histogram(t, WAIT) for t in texts]
        hists = [h for h in hists if h.bounds]
        wait = hists[0] if hists else EMPTY
        for h in hists[1:]:
            if h.bounds == wait.bounds:
                wait = Histogram(
                    wait.bounds,
                    tuple(a + b for a, b in zip(wait.cumulative, h.cumulative)),
                    wait.total + h.total,
                    wait.count + h.count,
                )
        return cls(
            wait,
            sum(parse_total(t, "kvpack_handoff_missing") for t in texts),
            sum(parse_total(t, "kvpack_loaded_tokens") for t in texts),
            sum(parse_total(t, "kvpack_handoff_loads") for t in texts),
        )

    def minus(self, other: ConsumerMetrics) -> ConsumerMetrics:
        return ConsumerMetrics(
            self.wait.minus(other.wait) if other.wait.bounds else self.wait,
            self.missing - other.missing,
            self.loaded_tokens - other.loaded_tokens,
            self.handoff_loads - other.handoff_loads,
        )


SERVER_TIMES = {
    "TTFT": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "inter-token": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
"""vLLM's own request histograms (seconds), as the server measures them."""


@dataclass(frozen=True)
class ServerTimes:
    """One vLLM server's request histograms (`SERVER_TIMES`) from its ``/metrics``."""

    hists: dict[str, Histogram]

    @classmethod
    def read(cls, port: int) -> ServerTimes:
        text = scrape(port) or ""
        return cls({k: parse_histogram(text, name) for k, name in SERVER_TIMES.items()})

    def minus(self, other: ServerTimes) -> ServerTimes:
        return ServerTimes(
            {
                k: h.minus(other.hists.get(k, EMPTY)) if other.hists.get(k, EMPTY).bounds else h
                for k, h in self.hists.items()
            }
        )


def kvpack_metric_ports(base: int) -> set[int]:
    """Ports of ``base .. base + METRICS_SPAN - 1`` that serve kvpack metrics now."""
    return {p for p in range(base, base + METRICS_SPAN) if "kvpack_" in (scrape(p) or "")}


def stream_completion(port: int, body: dict[str, Any], timeout_s: float) -> Sample:
    """POST a streamed completion; TTFT at the first ``data:`` chunk, total at ``[DONE]`` (or the
    end of the stream). Each socket read is bounded by `timeout_s`, and so is the whole request."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    first: float | None = None
    chunks = 0
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:300]}")
        while line := resp.readline():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stream did not end within {timeout_s:.0f}s")
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                end = time.perf_counter()
                resp.read()  # the rest of the stream (its last chunk), so the connection ends cleanly
                break
            if first is None:
                first = time.perf_counter()
            try:
                choices = json.loads(payload).get("choices") or [{}]
            except ValueError:
                continue
            chunks += bool(choices[0].get("text"))
        else:
            end = time.perf_counter()
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream carried no data chunk")
    return Sample(first - start, end - start, chunks)


@dataclass
class Proxy:
    """`kvpack proxy` in a session of its own, stopped by PID (SIGINT, then SIGKILL of its group)."""

    prefill_port: int
    decode_port: int
    port: int
    log: Path
    timeout_s: float
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, ready_s: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "kvpack.cli", "proxy", "--host", HOST, "--port", str(self.port),
               "--prefill", f"http://{HOST}:{self.prefill_port}", "--decode", f"http://{HOST}:{self.decode_port}",
               "--timeout-s", str(self.timeout_s)]  # fmt: skip
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"kvpack proxy exited (rc {self.popen.returncode}); see {self.log}")
            if http_call("GET", self.port, "/health", timeout=2)[0] == 200:
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvpack proxy not ready after {ready_s:.0f}s; see {self.log}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(10)


@dataclass(frozen=True)
class Result:
    single: Side
    pd: Side
    handoff: ConsumerMetrics
    per_request_wait_s: list[float]
    """Each PD request's handoff wait (``_sum`` delta; requests with exactly one handoff)."""
    handoffs_per_request: list[float]
    expected_loaded: int
    """n - 1 per successful PD request: what a full handoff loads."""
    decode_computed: int
    """Prompt tokens the decode instance computed itself over the timed requests (vLLM's counter)."""
    decode_external: int
    server_times: dict[str, ServerTimes]
    """Per server (one instance, prefill, decode): vLLM's request histograms over the timed requests."""


def _prompts(seed: int, count: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(count)]


def _model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from kvpack.tools.tinymodel import build_bench_llama, build_tiny_llama

    if args.small:
        return build_tiny_llama(Path(args.model_dir).with_name("tiny-llama"))
    return build_bench_llama(args.model_dir)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench pd", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model directory (default: build the bench Llama in --model-dir)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--small", action="store_true", help="the 2-layer test model instead of the bench Llama")
    p.add_argument("--prompts", type=int, default=12, help="timed prompts per setup (distinct)")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmups", type=int, default=2, help="untimed prompts per setup first")
    p.add_argument("--handoff-wait-ms", type=int, default=2000, help="the decode instance's kvpack handoff_wait_ms")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="bound of each request")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--shutdown-timeout", type=int, default=10, help="vLLM --shutdown-timeout of every server")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="engine KV cache per server")
    p.add_argument("--store-dir", default="", help="root for the stores and logs (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write a markdown results file here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[Result, str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", HOST)
    from kvpack.tools.tinymodel import VOCAB_WORDS

    model = _model(args)
    root = Path(args.store_dir or tempfile.mkdtemp(prefix="kvpack-pd-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    max_len = 128 * math.ceil((args.prompt_tokens + args.max_tokens + 64) / 128)
    kv_bytes = args.kv_cache_mib << 20
    pd_store = {"memory": {"capacity": "256MiB"}, "disk": {"path": str(root / "pd")}}
    metrics_base = free_port()
    taken = kvpack_metric_ports(metrics_base)  # not the decode instance's: someone else's

    def server(name: str, kv: dict[str, Any], role: str) -> Server:
        return Server(
            str(model),
            free_port(),
            root / f"{name}.log",
            False,
            kv,
            kv_bytes,
            max_len,
            args.shutdown_timeout,
            kv_role=role,
        )

    single = server("single", {"memory": {"capacity": "256MiB"}, "disk": {"path": str(root / "single")}}, "kv_both")
    producer = server("prefill", pd_store, "kv_producer")
    consumer = server(
        "decode", {**pd_store, "handoff_wait_ms": args.handoff_wait_ms, "metrics_port": metrics_base}, "kv_consumer"
    )
    proxy = Proxy(producer.port, consumer.port, free_port(), root / "proxy.log", args.request_timeout_s)
    setup = (
        f"Model {model.name}; {args.prompts} distinct prompts of {args.prompt_tokens} token ids, max_tokens "
        f"{args.max_tokens} (ignore_eos, greedy), streamed, one at a time, alternating one instance / PD "
        f"(ABBA), after {args.warmups} warm-ups each; vLLM prefix caching off; "
        f"decode handoff_wait_ms {args.handoff_wait_ms}; "
        f"--shutdown-timeout {args.shutdown_timeout}; every server's KV cache {args.kv_cache_mib} MiB."
    )
    print(f"[pd bench] {setup} Logs in {root}", flush=True)
    failed = False
    started: list[Server] = []
    try:
        for s in (single, producer, consumer):
            print(f"[pd bench] starting {s.log.stem} (kv_role {s.kv_role}) on port {s.port}", flush=True)
            s.start(args.start_timeout_s)
            started.append(s)
        proxy.start()
        ports = sorted(kvpack_metric_ports(metrics_base) - taken)
        if not ports:
            raise RuntimeError(f"the decode instance serves no kvpack metrics in {metrics_base}..+{METRICS_SPAN - 1}")
        print(f"[pd bench] decode instance's kvpack metrics on {ports}; proxy on {proxy.port}", flush=True)
        servers = {
            "one instance": single.port,
            "prefill (kv_producer)": producer.port,
            "decode (kv_consumer)": consumer.port,
        }
        result = _measure(args, str(model), VOCAB_WORDS, single.port, proxy.port, consumer.port, ports, servers)
    except BaseException:
        failed = True
        for s in started:
            print(f"--- {s.log.stem} log tail ---\n{s.log_tail()}", file=sys.stderr)
        raise
    finally:
        proxy.stop()
        for s in reversed(started):
            s.stop()
        if failed or args.store_dir:
            print(f"[pd bench] kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return result, setup


def _measure(
    args: argparse.Namespace,
    model: str,
    vocab: int,
    single_port: int,
    proxy_port: int,
    decode_port: int,
    ports: list[int],
    servers: dict[str, int],
) -> Result:
    def body(ids: list[int]) -> dict[str, Any]:
        return {"model": model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

    warm = _prompts(args.seed + 1000, 2 * args.warmups, args.prompt_tokens, vocab)
    for i, ids in enumerate(warm):
        stream_completion(single_port if i % 2 == 0 else proxy_port, body(ids), args.request_timeout_s)
    prompts = _prompts(args.seed, args.prompts, args.prompt_tokens, vocab)
    single, pd = Side("one instance (kvpack, kv_both)"), Side("PD through kvpack proxy")
    waits: list[float] = []
    handoffs: list[float] = []
    vllm_before = Counters.settled(decode_port)
    start = ConsumerMetrics.read(ports)
    times_before = {name: ServerTimes.read(port) for name, port in servers.items()}
    for i, ids in enumerate(prompts):
        order = ["single", "pd"] if i % 4 in (0, 3) else ["pd", "single"]
        for which in order:
            side = single if which == "single" else pd
            before = ConsumerMetrics.read(ports) if which == "pd" else None
            try:
                side.samples.append(
                    stream_completion(
                        single_port if which == "single" else proxy_port, body(ids), args.request_timeout_s
                    )
                )
            except Exception as exc:  # counted in the table; the run goes on
                side.errors.append(f"{type(exc).__name__}: {exc}")
                print(f"[pd bench] {side.name}, prompt {i}: {side.errors[-1][:300]}", file=sys.stderr, flush=True)
            if before is not None:
                delta = ConsumerMetrics.read(ports).minus(before)
                handoffs.append(delta.handoff_loads)
                if delta.wait.count == 1:
                    waits.append(delta.wait.total)
        last = pd.samples[-1] if pd.samples else None
        print(
            f"[pd bench] prompt {i}: single {_ms(single.samples[-1].ttft_s) if single.samples else '-'} ms, "
            f"PD {_ms(last.ttft_s) if last else '-'} ms TTFT",
            flush=True,
        )
    handoff = ConsumerMetrics.read(ports).minus(start)
    vllm_after = Counters.settled(decode_port)  # also: vLLM has recorded every finished request
    times = {name: ServerTimes.read(port).minus(times_before[name]) for name, port in servers.items()}
    return Result(
        single,
        pd,
        handoff,
        waits,
        handoffs,
        len(pd.samples) * (args.prompt_tokens - 1),
        int(vllm_after.computed - vllm_before.computed),
        int(vllm_after.external - vllm_before.external),
        times,
    )


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{1000 * s:.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and not (math.isnan(a) or math.isnan(b)) else "-"


def report(r: Result, prompts: int) -> str:
    lines = [
        "| setup | requests ok | TTFT median (ms) | TTFT p90 (ms) | total median (ms) | total p90 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for side in (r.single, r.pd):
        lines.append(
            f"| {side.name} | {len(side.samples)} of {prompts} | {_ms(side.stat('ttft_s', 50))} | "
            f"{_ms(side.stat('ttft_s', 90))} | {_ms(side.stat('total_s', 50))} | {_ms(side.stat('total_s', 90))} |"
        )
    lines.append(
        f"| PD / one instance | | {_ratio(r.pd.stat('ttft_s', 50), r.single.stat('ttft_s', 50))} | "
        f"{_ratio(r.pd.stat('ttft_s', 90), r.single.stat('ttft_s', 90))} | "
        f"{_ratio(r.pd.stat('total_s', 50), r.single.stat('total_s', 50))} | "
        f"{_ratio(r.pd.stat('total_s', 90), r.single.stat('total_s', 90))} |"
    )
    h = r.handoff
    exact = r.per_request_wait_s
    exact_s = f"{_ms(statistics.median(exact))} / {_ms(max(exact))}" if exact else "-"
    one_each = sum(1 for n in r.handoffs_per_request if n == 1)
    lines += [
        "",
        "| decode instance (timed requests) | handoff loads | wait count | wait mean (ms) | wait p50 / p90 "
        "from buckets (ms) | per-request wait median / max (ms) | objects missing | tokens loaded (of n - 1 each) "
        "| prompt tokens: vLLM external / computed |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| kv_consumer, `kvpack_handoff_wait_seconds` | {h.handoff_loads:.0f} ({one_each} of "
        f"{len(r.handoffs_per_request)} requests with exactly one) | {h.wait.count:.0f} | {_ms(h.wait.mean)} | "
        f"{_ms(h.wait.quantile(0.5))} / {_ms(h.wait.quantile(0.9))} | {exact_s} | {h.missing:.0f} | "
        f"{h.loaded_tokens:.0f} of {r.expected_loaded} | {r.decode_external} / {r.decode_computed} |",
    ]
    keys = list(SERVER_TIMES)
    lines += [
        "",
        "| server-side means over the timed requests (vLLM's histograms, ms) | requests | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for name, t in r.server_times.items():
        count = t.hists["e2e"].count
        lines.append(f"| {name} | {count:.0f} | " + " | ".join(_ms(t.hists[k].mean) for k in keys) + " |")
    if r.single.errors or r.pd.errors:
        first = (r.pd.errors or r.single.errors)[0]
        lines += [
            "",
            f"Failed requests: one instance {len(r.single.errors)}, PD {len(r.pd.errors)}; first: {first[:200]}",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    result, setup = run(args)
    publish(
        "pd",
        argv,
        "kvpack bench pd: prefill/decode through the store vs one instance",
        f"{setup}\n\n{report(result, args.prompts)}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
