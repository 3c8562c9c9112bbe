"""`kvpack bench hostile`: a hostile client against the real vLLM OpenAI server, engine memory sampled.

    kvpack bench hostile [--requests 400] [--rounds 2] [--field-bytes 1048576] [--json FILE]

Starts vLLM's OpenAI server (tiny model, fp32, vLLM's default multi-process mode, prefix
caching off) with kvpack on a disk store (memory tier off, so stored prompts do not grow
the engine), finds its engine-core process by PID in the server's process tree, and sends:

1. the default tenant's prompt twice (the second is a kvpack hit);
2. three benign phases of `--requests` completions each (distinct prompts, nothing for
   kvpack to refuse): a warm-up; the noise phase, whose RSS change is what the same number
   of requests costs the engine without any large field; and the padded phase, whose
   requests carry a distinct large field in ``kv_transfer_params`` under a key kvpack never
   reads, so its change is what vLLM's own transport of such requests costs the engine;
3. `--rounds` hostile phases of `--requests` completions each (the same prompt shapes),
   every one carrying a distinct large field of `--field-bytes` characters
   (`hostile_requests.Kind`: bogus handoffs, forged tenants and signatures, salts, deep values);
4. the default tenant's prompt again: its hit must survive, with the same answer.

Per phase: the engine core's RSS (KiB, the median of three reads once the phase's answers
are in), its change and that change per request, the answers (HTTP status counts), and the
server log's growth: its bytes and kvpack's lines (count, longest). The refusals' counters
come from kvpack's own metrics (``metrics_port``). A client must not be able to make kvpack
hold anything beyond one request's life: after the first hostile phase (whose change is
the allocator's high-water mark for such requests, as the padded phase's is), a hostile
phase's change stays far below one field per request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpack.tools.bench.hostile_requests import KINDS, hostile_fields, padded_fields, prompt
from kvpack.tools.bench.prom import parse_counters, parse_total
from kvpack.tools.bench.serve_server import BLOCK_SIZE, Server, http_call
from kvpack.tools.ports import free_port
from kvpack.tools.tinymodel import build_tiny_llama

KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 1024
PROMPT_WORDS = 2 * BLOCK_SIZE + 40
"""Words (tokens) per prompt: two whole blocks and a tail."""
METRICS_SPAN = 16
"""Ports from kvpack's ``metrics_port`` on that an engine's processes may serve."""
REQUEST_TIMEOUT_S = 300.0
DISK_CAPACITY = "8GiB"
"""The store's capacity: every request's KV fits (about 0.6 MB each), so no eviction, which any
client's traffic causes under LRU by design, hides whether the default tenant's hit survives."""


@dataclass(frozen=True)
class Phase:
    """One phase's requests and what they cost the engine core and the log."""

    name: str
    requests: int
    statuses: dict[str, int]
    """HTTP status -> answers (``"0"``: no answer at all)."""
    rss_before_kib: int
    rss_after_kib: int
    log_bytes: int
    kvpack_log_lines: int
    longest_kvpack_line: int
    seconds: float

    @property
    def growth_kib(self) -> int:
        return self.rss_after_kib - self.rss_before_kib

    @property
    def answered(self) -> int:
        return self.requests - self.statuses.get("0", 0)


@dataclass
class Result:
    """The run: its parameters, its phases and the default tenant's hit before and after."""

    field_bytes: int
    requests: int
    engine_pid: int
    phases: list[Phase] = field(default_factory=list)
    hit_tokens_before: float = 0.0
    hit_tokens_after: float = 0.0
    same_answer: bool = False
    alive: bool = False
    refusals: dict[str, float] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)
    """``"kind status"`` -> answers over the run (a hostile kind, or a benign phase's name)."""

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def hostile(self) -> list[Phase]:
        return [p for p in self.phases if p.name.startswith("hostile")]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for p, raw in zip(self.phases, out["phases"]):
            raw["growth_kib"] = p.growth_kib
        return out


# -- the engine core's process --------------------------------------------------------------------


def descendants(pid: int) -> Iterator[int]:
    """Every process below `pid` (through ``/proc/PID/task/*/children``), depth first."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            yield child
            yield from descendants(child)


def rss_kib(pid: int) -> int:
    """The resident set of `pid` (KiB, ``VmRSS``); 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process among the server's descendants: the one whose process title
    (vLLM sets ``VLLM::EngineCore``) says so, else the largest one. Found by PID, never by name."""
    found = list(descendants(server_pid))
    for pid in found:
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    if not found:
        raise RuntimeError(f"the server (PID {server_pid}) has no child process")
    return max(found, key=rss_kib)


def settled_rss(pid: int) -> int:
    """The median of three RSS reads 0.5 s apart (KiB)."""
    reads = []
    for i in range(3):
        if i:
            time.sleep(0.5)
        reads.append(rss_kib(pid))
    return int(statistics.median(reads))


# -- requests ----------------------------------------------------------------------------------------


def _complete(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, text = http_call("POST", port, "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    try:
        return status, json.loads(text) if status == 200 else {}
    except ValueError:
        return status, {}


def _log_growth(log: Path, start: int) -> tuple[int, int, int]:
    """(bytes, kvpack lines, longest kvpack line) the server log gained past offset `start`
    (kvpack's lines: its logger's, which start ``kvpack:``)."""
    with open(log, "rb") as f:
        f.seek(start)
        data = f.read()
    lines = [len(line) for line in data.splitlines() if line.startswith(b"kvpack:") or b"] kvpack:" in line]
    return len(data), len(lines), max(lines, default=0)


def run_phase(
    server: Server,
    engine_pid: int,
    name: str,
    bodies: list[tuple[str, dict[str, Any]]],
    concurrency: int,
    by_kind: Counter[str],
) -> Phase:
    """Send `bodies` ((kind, body) pairs, `concurrency` at a time), then read what they cost;
    `by_kind` counts the answers as ``"kind status"``."""
    rss_before = settled_rss(engine_pid)
    offset = server.log.stat().st_size
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda b: _complete(server.port, b[1])[0], bodies))
    seconds = time.monotonic() - started
    rss_after = settled_rss(engine_pid)
    by_kind.update(f"{kind} {status}" for (kind, _), status in zip(bodies, answers))
    statuses = Counter(str(s) for s in answers)
    log_bytes, lines, longest = _log_growth(server.log, offset)
    return Phase(name, len(bodies), dict(statuses), rss_before, rss_after, log_bytes, lines, longest, seconds)


def _external_tokens(port: int) -> float:
    status, text = http_call("GET", port, "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    return parse_counters(text, "vllm:prompt_tokens_by_source", "source").get("external_kv_transfer", 0.0)


def _kvpack_refusals(metrics_port: int) -> dict[str, float]:
    """kvpack's refusal counters summed over the engine's processes (handoffs by reason)."""
    out: dict[str, float] = {}
    for port in range(metrics_port, metrics_port + METRICS_SPAN):
        status, text = http_call("GET", port, "/metrics", timeout=2.0)
        if status != 200:
            continue
        for reason, n in parse_counters(text, "kvpack_handoff_refused", "reason").items():
            out[f"handoff_refused:{reason}"] = out.get(f"handoff_refused:{reason}", 0.0) + n
        for name in ("kvpack_untrusted_tenants", "kvpack_bad_tenants", "kvpack_handoff_tails_dropped"):
            out[name] = out.get(name, 0.0) + parse_total(text, name)
    return out


def run(
    work: Path,
    requests: int,
    rounds: int,
    field_bytes: int,
    concurrency: int = 4,
    seed: int = 0,
    disk_capacity: str = DISK_CAPACITY,
) -> Result:
    """The whole run in `work` (model, store, server log); see the module docstring."""
    model = build_tiny_llama(work / "model")
    metrics_port = free_port()
    kvpack = {
        "memory": {"enabled": False},
        "disk": {"path": str(work / "store"), "capacity": disk_capacity},
        "metrics_port": metrics_port,
    }
    server = Server(
        model=str(model),
        port=free_port(),
        log=work / "server.log",
        prefix_caching=False,
        kvpack=kvpack,
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(seed)

    def body(**extra: Any) -> dict[str, Any]:
        return {"model": str(model), "prompt": prompt(rng, PROMPT_WORDS), "max_tokens": 1, "temperature": 0, **extra}

    server.start(timeout_s=600)
    try:
        assert server.popen is not None
        result = Result(field_bytes, requests, engine_core_pid(server.popen.pid))
        mine = body(max_tokens=4)
        first = _complete(server.port, mine)[1]
        before = _external_tokens(server.port)
        again = _complete(server.port, mine)[1]
        result.hit_tokens_before = _external_tokens(server.port) - before
        by_kind: Counter[str] = Counter()
        for name in ("warm-up", "noise", "padded"):
            pad = name == "padded"
            bodies = [(name, body(**padded_fields(i, field_bytes)) if pad else body()) for i in range(requests)]
            result.phases.append(run_phase(server, result.engine_pid, name, bodies, concurrency, by_kind))
            print(_row(result.phases[-1]), flush=True)
        n = 0
        for r in range(rounds):
            bodies = []
            for _ in range(requests):
                kind, fields = hostile_fields(n, field_bytes, PROMPT_WORDS)
                bodies.append((kind.value, body(**fields)))
                n += 1
            phase = run_phase(server, result.engine_pid, f"hostile-{r + 1}", bodies, concurrency, by_kind)
            result.phases.append(phase)
            del bodies
            print(_row(result.phases[-1]), flush=True)
        before = _external_tokens(server.port)
        last = _complete(server.port, mine)[1]
        result.hit_tokens_after = _external_tokens(server.port) - before
        result.same_answer = bool(first) and _text(first) == _text(again) == _text(last)
        result.alive = server.popen.poll() is None and http_call("GET", server.port, "/health")[0] == 200
        result.refusals = _kvpack_refusals(metrics_port)
        result.answers = dict(sorted(by_kind.items()))
        return result
    finally:
        server.stop()


def _text(answer: dict[str, Any]) -> str:
    choices = answer.get("choices") or [{}]
    return str(choices[0].get("text", ""))


def _row(p: Phase) -> str:
    per = p.growth_kib * 1024 / max(1, p.requests)
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(p.statuses.items()))
    return (
        f"| {p.name} | {p.requests} | {kinds} | {p.rss_before_kib / 1024:.1f} | {p.rss_after_kib / 1024:.1f} | "
        f"{p.growth_kib / 1024:+.1f} | {per:+.0f} | {p.log_bytes} | {p.kvpack_log_lines} | {p.longest_kvpack_line} |"
    )


HEADER = (
    "| phase | requests | HTTP answers | engine RSS before (MiB) | after (MiB) | change (MiB) | per request (B) "
    "| log bytes | kvpack log lines | longest (chars) |\n|---|---|---|---|---|---|---|---|---|---|"
)


def report(result: Result) -> str:
    """The phases as a table, then the verdict lines."""
    noise = abs(result.phase("noise").growth_kib)
    hostile = result.hostile()
    worst = max((p.growth_kib for p in hostile), default=0)
    refused = sum(p.requests for p in hostile)
    lines = [HEADER, *(_row(p) for p in result.phases), ""]
    lines.append(
        f"field {result.field_bytes} B, {len(KINDS)} kinds; engine core PID {result.engine_pid}; noise "
        f"(|change| over {result.requests} benign requests) {noise / 1024:.1f} MiB; largest hostile phase change "
        f"{worst / 1024:+.1f} MiB = {worst * 1024 / max(1, result.requests):+.0f} B per request "
        f"(one field: {result.field_bytes} B; kept whole: {refused * result.field_bytes / 2**20:.0f} MiB)"
    )
    lines.append(
        f"default tenant's hit: {result.hit_tokens_before:.0f} tokens before, {result.hit_tokens_after:.0f} after; "
        f"same answer: {result.same_answer}; server alive: {result.alive}"
    )
    lines.append("answers by kind: " + ", ".join(f"{k} x{v}" for k, v in result.answers.items()))
    lines.append("kvpack counted: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(result.refusals.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack bench hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per phase")
    parser.add_argument("--rounds", type=int, default=2, help="hostile phases")
    parser.add_argument("--field-bytes", type=int, default=1 << 20, help="characters of each large field")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--disk-capacity", default=DISK_CAPACITY, help="the store's capacity (every request's KV fits)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpack-hostile-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(HEADER, flush=True)
        result = run(work, args.requests, args.rounds, args.field_bytes, args.concurrency, 0, args.disk_capacity)
        print("\n" + report(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0
