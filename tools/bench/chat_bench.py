"""`kvpack bench chat`: multi-turn chat (or long-document QA) through vLLM's OpenAI chat endpoint.

Workloads (`kvpack.tools.bench.chat_workload`):

- ``chat``: users share one system prompt, each has a context of its own, and
  talks for `rounds` turns; a turn sends the whole conversation so far. Rounds
  run one after another; within a round the users' turns run `concurrency` at a
  time. Answers: the tiny model decodes greedily and almost never emits EOS, so
  each turn's ``max_tokens`` is drawn from [answer_min, answer_max] (seeded) and
  the answer ends there (finish ``length``), or at EOS if the model emits it.
- ``longdoc``: a few long documents, each read once (round 1), then queried
  again in random order with many requests in flight (round 2), as LMCache's
  long-doc QA does.

Set-ups, each on a fresh ``vllm.entrypoints.openai.api_server`` on 127.0.0.1
with a plain Jinja chat template (``--chat-template``) and an engine KV cache
(``--kv-cache-memory-bytes``) of `--kv-cache-fraction` of the workload's tokens,
so vLLM's prefix cache alone must evict: no cache (the answers' reference); vLLM
prefix caching; + kvpack (memory + disk); + LMCache MP (``lmcache server`` and
``LMCacheMPConnector``, installed into ~/.cache/kvpack/peers, never into the
venv; skipped with a line where it cannot run); kvpack restarted on the same
disk store (the same turns again, from disk). ``--spec`` adds a draft model (a
copy of the target, 3 speculative tokens) to every set-up and reports the accept
rate per round. ``--dtype`` (float32 by default) is the model's dtype and every
server's ``--dtype``: vLLM's CPU build runs even a float32 model in bf16 without
it, and in bf16 a cached prompt's greedy answer may differ from one prefill's.

Per set-up: TTFT per round (mean, p50, p90; the client's streamed responses),
prompt tokens per source over the run (``vllm:prefix_cache_hits``,
``vllm:external_prefix_cache_hits``; kvpack's ``kvpack_loaded_tokens``, the
tokens its loads restored into the engine, and ``kvpack_loaded_bytes`` per tier
/ KV bytes per token: every object read counted whole, a tail's block included),
and answers equal to the no-cache run's. Servers are stopped by PID.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpack.tools.bench.chat_report import report
from kvpack.tools.bench.chat_workload import (
    CHAT_TEMPLATE,
    ChatShape,
    DocShape,
    Plan,
    Result,
    SetupRun,
    Turn,
    chat_plan,
    longdoc_plan,
    normalize_answer,
    plot,
)
from kvpack.tools.bench.chat_workload import words as make_words
from kvpack.tools.bench.prom import parse_counters, parse_total
from kvpack.tools.bench.serve_bench import _kv_bytes_per_token
from kvpack.tools.bench.serve_server import BLOCK_SIZE, HOST, Server, http_call, scrape
from kvpack.tools.bench.timing import publish
from kvpack.tools.ports import free_port

PEERS = Path(os.path.expanduser("~/.cache/kvpack/peers"))
LMCACHE_DIR = PEERS / "lmcache-0.5.6"
LMCACHE_PKGS = ("lmcache==0.5.6", "aiofile", "caio", "aiofiles", "opentelemetry-exporter-prometheus==0.66b2")

SIZES: dict[str, dict[str, ChatShape | DocShape]] = {
    "small": {
        "chat": ChatShape(4, 3, 128, 256, 16, 8, 32, 2),
        "longdoc": DocShape(3, 768, 2, 16, 8, 4),
    },
    "issue": {
        "chat": ChatShape(8, 5, 512, 1024, 32, 24, 96, 4),
        "longdoc": DocShape(4, 3000, 4, 32, 16, 8),
    },
}


DTYPES = ("float32", "bfloat16")
"""``--dtype`` choices. bf16 on CPU changes greedy tokens with the batch shape, so a cached prompt's
answer may differ from one prefill's; the answers check needs fp32."""


def _model(base: Path, size: str, dtype: str) -> Path:
    """The bench's model built in `dtype` (its config's ``torch_dtype``, which vLLM, the KV bytes per
    token and the connectors read). The shared models keep their names (``bench-llama`` is bf16,
    ``tiny`` fp32); the other dtype gets a folder of its own, so no other bench's model is rebuilt."""
    from kvpack.tools.tinymodel import BENCH_SIZES, build_tiny_llama

    if size == "bench":
        name = "bench-llama" if dtype == BENCH_SIZES["dtype"] else f"bench-llama-{dtype}"
        sizes: dict[str, Any] = dict(BENCH_SIZES, dtype=dtype)
        return build_tiny_llama(base / name, **sizes)
    return build_tiny_llama(base / ("tiny" if dtype == "float32" else f"tiny-{dtype}"), dtype=dtype)


class Setup:
    NO_CACHE = "no cache"
    VLLM_PC = "vLLM prefix caching"
    KVPACK = "vLLM PC + kvpack"
    LMCACHE = "vLLM PC + LMCache MP"
    RESTART = "kvpack restarted (disk)"


@dataclass
class ChatServer(Server):
    """`Server` with extra arguments (chat template, LMCache connector, draft model) and extra env."""

    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def command(self) -> list[str]:
        return super().command() + list(self.extra)

    def start(self, timeout_s: float) -> None:
        with _env(dict(self.env)):
            super().start(timeout_s)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment while a child starts (Server.start copies it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stream_chat(port: int, model: str, messages: list[dict[str, str]], max_tokens: int, timeout: float) -> Result:
    """One streamed chat completion: TTFT (first content delta), prompt tokens, the answer."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    prompt_tokens = 0
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Result(-1, -1, ttft, 0, "", f"status {resp.status}: {resp.read()[:200]!r}")
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text and math.isnan(ttft):
                    ttft = time.perf_counter() - start
                parts.append(text)
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
        conn.close()
    except (OSError, ValueError) as exc:
        return Result(-1, -1, ttft, 0, "", f"{type(exc).__name__}: {exc}")
    if math.isnan(ttft):
        ttft = time.perf_counter() - start
    return Result(-1, -1, ttft, prompt_tokens, normalize_answer("".join(parts)))


@dataclass(frozen=True)
class Snapshot:
    """The counters a set-up reports, read from the server's /metrics and kvpack's metrics ports."""

    values: dict[str, float]

    @classmethod
    def read(cls, port: int, kvpack_ports: tuple[int, ...]) -> Snapshot:
        v: dict[str, float] = {}
        text = scrape(port) or ""
        for name in (
            "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_hits",
            "vllm:prompt_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_draft_tokens",
        ):
            v[name] = parse_total(text, name)
        for kp in kvpack_ports:
            ktext = scrape(kp) or ""
            for tier, n in parse_counters(ktext, "kvpack_loaded_bytes", "tier").items():
                v[f"kvpack {tier} bytes"] = v.get(f"kvpack {tier} bytes", 0.0) + n
            v["kvpack loaded tokens"] = v.get("kvpack loaded tokens", 0.0) + parse_total(ktext, "kvpack_loaded_tokens")
        return cls(v)

    def minus(self, other: Snapshot) -> dict[str, float]:
        return {k: v - other.values.get(k, 0.0) for k, v in self.values.items()}


@dataclass
class Bench:
    model: str
    plan: Plan
    concurrency: int
    kv_cache_bytes: int
    max_model_len: int
    root: Path
    template: Path
    draft: str
    bytes_per_token: int
    dtype: str
    """vLLM's ``--dtype`` for every server (the model is also built in it, see `_model`)."""
    start_timeout_s: float = 300.0
    request_timeout_s: float = 300.0

    def _spec_args(self) -> tuple[str, ...]:
        if not self.draft:
            return ()
        spec = {"method": "draft_model", "model": self.draft, "num_speculative_tokens": 3}
        return ("--speculative-config", json.dumps(spec))

    def server_args(self, lmcache_port: int = 0) -> tuple[list[str], tuple[tuple[str, str], ...]]:
        """(extra vLLM arguments, extra env) of every set-up's server: the chat template, the dtype,
        the draft model; with `lmcache_port`, LMCache's connector and its folder on PYTHONPATH."""
        extra = ["--chat-template", str(self.template), "--dtype", self.dtype, *self._spec_args()]
        env: tuple[tuple[str, str], ...] = ()
        if lmcache_port:
            cfg = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port}
            ktc = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}
            extra += ["--kv-transfer-config", json.dumps(ktc)]
            env = (("PYTHONPATH", f"{LMCACHE_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"),)
        return extra, env

    def run_setup(
        self, name: str, prefix_caching: bool, kvpack: dict[str, Any] | None, lmcache_port: int = 0
    ) -> SetupRun:
        extra, env = self.server_args(lmcache_port)
        kports: tuple[int, ...] = ()
        if kvpack is not None:
            kvpack = dict(kvpack, metrics_port=free_port())
            kports = tuple(kvpack["metrics_port"] + i for i in range(4))
        log = self.root / f"server-{name.replace(' ', '_').replace('+', 'and').replace('(', '').replace(')', '')}.log"
        server = ChatServer(
            self.model,
            free_port(),
            log,
            prefix_caching,
            kvpack,
            self.kv_cache_bytes,
            self.max_model_len,
            10 if kvpack is not None else None,
            extra=tuple(extra),
            env=env,
        )
        print(f"[chat bench] {name}: starting the server (log {log})", flush=True)
        server.start(self.start_timeout_s)
        run = SetupRun(name)
        try:
            self._warm_up(server.port)
            before = Snapshot.read(server.port, kports)
            last = before
            for turns in self.plan.rounds:
                run.results += self._round(server.port, turns)
                now = Snapshot.read(server.port, kports)
                d = now.minus(last)
                drafted = d.get("vllm:spec_decode_num_draft_tokens", 0.0)
                if self.draft:
                    acc = d.get("vllm:spec_decode_num_accepted_tokens", 0.0)
                    run.accept.append(acc / drafted if drafted else float("nan"))
                last = now
            time.sleep(1.0)
            total = Snapshot.read(server.port, kports).minus(before)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
        run.tiers = {
            "prompt tokens": total.get("vllm:prompt_tokens", 0.0),
            "vLLM prefix cache": total.get("vllm:prefix_cache_hits", 0.0),
            "external": total.get("vllm:external_prefix_cache_hits", 0.0),
        }
        if kvpack is not None:
            run.tiers["kvpack loaded tokens"] = total.get("kvpack loaded tokens", 0.0)
        for k, v in total.items():
            if k.startswith("kvpack ") and k.endswith(" bytes"):
                run.tiers[k[: -len(" bytes")] + " (tokens)"] = v / self.bytes_per_token
        errors = [r.error for r in run.results if r.error]
        if errors:
            print(f"[chat bench] {name}: {len(errors)} failed turns, first: {errors[0]}", file=sys.stderr)
        return run

    def _warm_up(self, port: int) -> None:
        import random

        rng = random.Random(12345)
        msgs = [{"role": "system", "content": make_words(rng, 32)}, {"role": "user", "content": make_words(rng, 64)}]
        r = _stream_chat(port, self.model, msgs, 8, self.request_timeout_s)
        if r.error:
            raise RuntimeError(f"warm-up request failed: {r.error}")

    def _round(self, port: int, turns: tuple[Turn, ...]) -> list[Result]:
        """One round's turns, `concurrency` in flight; results in sending order; histories grow after."""

        def one(turn: Turn) -> Result:
            msgs = self.plan.messages(turn, self._history.get(turn.conv, []))
            r = _stream_chat(port, self.model, msgs, turn.max_tokens, self.request_timeout_s)
            return Result(turn.conv, turn.round, r.ttft_s, r.prompt_tokens, r.answer, r.error)

        if turns and turns[0].round == 1:
            self._history: dict[int, list[tuple[str, str]]] = {}
        with ThreadPoolExecutor(self.concurrency) as pool:
            out = list(pool.map(one, turns))
        for t, r in zip(turns, out):
            self._history.setdefault(t.conv, []).append((t.question, r.answer))
        return out


def _lmcache_ready(log: Path) -> str:
    """'' when LMCache is importable from its own folder (installing it there first), else why not."""
    if not (LMCACHE_DIR / "lmcache").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--target", str(LMCACHE_DIR), "--no-deps", *LMCACHE_PKGS]
        with open(log, "ab") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
        if rc != 0:
            return f"pip install of LMCache into {LMCACHE_DIR} failed (rc {rc}, log {log})"
    return ""


@contextmanager
def lmcache_server(root: Path) -> Iterator[int]:
    """``lmcache server`` (MP mode) on 127.0.0.1 in its own session; yields its ZMQ port; stopped by PID."""
    port, http_port, prom = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", HOST, "--port", str(port)]
    cmd += ["--chunk-size", str(BLOCK_SIZE), "--l1-size-gb", "1", "--eviction-policy", "LRU"]
    cmd += ["--supported-transfer-mode", "auto", "--http-host", HOST, "--http-port", str(http_port)]
    cmd += ["--prometheus-port", str(prom)]
    env = dict(os.environ, PYTHONPATH=f"{LMCACHE_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = root / "lmcache-server.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while http_call("GET", http_port, "/", timeout=2)[0] == 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not start (log {log})")
            time.sleep(1.0)
        yield port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench chat", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("chat", "longdoc"), default="chat")
    p.add_argument("--size", choices=sorted(SIZES), default="issue", help="workload sizes (small: a smoke run)")
    p.add_argument("--model-size", choices=("tiny", "bench"), default="bench", help="the tiny model or the bench one")
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/kvpack/models"))
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's and every server's dtype (float32: answers comparable with the no-cache run on CPU)",
    )
    p.add_argument("--kv-cache-fraction", type=float, default=0.5, help="engine KV cache / the workload's tokens")
    p.add_argument("--spec", action="store_true", help="speculative decoding with a draft model (copy of the target)")
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache set-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-dir", default="", help="root for stores and logs (default: a temp dir, removed)")
    p.add_argument("--plot", default="", help="draw TTFT per round per set-up into this PNG")
    p.add_argument("--out", default="", help="write a markdown results file here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[list[SetupRun], str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", HOST)
    from kvpack.tools.tinymodel import copy_model

    model = _model(Path(args.model_dir), args.model_size, args.dtype)
    draft = str(copy_model(model, Path(str(model) + "-draft"))) if args.spec else ""
    shape = SIZES[args.size][args.workload]
    plan = chat_plan(shape, args.seed) if isinstance(shape, ChatShape) else longdoc_plan(shape, args.seed)
    per_token = _kv_bytes_per_token(model) * (2 if draft else 1)
    conv_blocks = math.ceil(shape.conversation_tokens() / BLOCK_SIZE) + 1
    blocks = max(shape.resident() * conv_blocks, math.ceil(shape.total_tokens() * args.kv_cache_fraction / BLOCK_SIZE))
    root = Path(args.store_dir or tempfile.mkdtemp(prefix="kvpack-chat-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    template = root / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    bench = Bench(
        str(model),
        plan,
        shape.concurrency,
        blocks * BLOCK_SIZE * per_token,
        math.ceil(shape.conversation_tokens() * 1.3) + 64,
        root,
        template,
        draft,
        per_token,
        args.dtype,
    )
    turns = sum(len(r) for r in plan.rounds)
    setup = (
        f"Workload `{args.workload}` ({args.size}): {shape}; {len(plan.rounds)} rounds, {turns} turns; "
        f"about {shape.total_tokens()} distinct tokens. Engine KV cache {blocks} blocks of {BLOCK_SIZE} = "
        f"{blocks * BLOCK_SIZE} tokens. Model {model.name}, {args.dtype} ({per_token} KV bytes/token"
        f"{', target + draft, 3 speculative tokens' if draft else ''}). Answers end at max_tokens drawn per turn "
        f"(or EOS). CPU shared with other engineers (2 cores)."
    )
    print(f"[chat bench] {setup}", flush=True)
    kv = {"memory": {"capacity": "1GiB"}, "disk": {"path": str(root / "kvpack")}}
    runs: list[SetupRun] = []
    for name, pc, cfg in (
        (Setup.NO_CACHE, False, None),
        (Setup.VLLM_PC, True, None),
        (Setup.KVPACK, True, kv),
    ):
        runs.append(_guarded(lambda n=name, p=pc, c=cfg: bench.run_setup(n, p, c), name))
    if args.no_lmcache:
        runs.append(SetupRun(Setup.LMCACHE, skipped="--no-lmcache"))
    else:
        why = _lmcache_ready(root / "lmcache-install.log")
        if why:
            runs.append(SetupRun(Setup.LMCACHE, skipped=why))
        else:

            def lm() -> SetupRun:
                with lmcache_server(root) as port:
                    return bench.run_setup(Setup.LMCACHE, True, None, lmcache_port=port)

            runs.append(_guarded(lm, Setup.LMCACHE))
    runs.append(_guarded(lambda: bench.run_setup(Setup.RESTART, True, kv), Setup.RESTART))
    if not args.store_dir and not any(r.skipped for r in runs):
        shutil.rmtree(root, ignore_errors=True)
    return runs, setup


def _guarded(fn: Any, name: str) -> SetupRun:
    try:
        return fn()
    except Exception as exc:  # one set-up's failure is a line in the report; the others still run
        print(f"[chat bench] {name} failed: {exc}", file=sys.stderr, flush=True)
        return SetupRun(name, skipped=f"failed: {str(exc).splitlines()[0][:200]}")


def main(argv: list[str]) -> int:
    args = _parse(argv)
    runs, setup = run(args)
    if args.plot:
        plot(args.plot, runs, f"kvpack bench chat --workload {args.workload} ({args.size}): TTFT per round")
    publish("chat", argv, "kvpack bench chat", f"{setup}\n\n{report(runs)}", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
