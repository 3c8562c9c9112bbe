"""`kvpack bench sglang --multiturn`: SGLang's HiCache multi-turn shape against real CPU SGLang servers.

The workload of SGLang's own ``benchmark/hicache/bench_multiturn.py``, small: `--clients`
clients of `--rounds` rounds, each round appending `--question` new tokens to the client's whole
history (greedy, `--answer` tokens), the clients in parallel, on a device pool of `--device`
tokens and an L2 host pool of twice that (`--l2-ratio`), so later rounds find their history only in L3.
Set-ups, one server each, one after another on the same machine: HiCache L2 only, SGLang's
``file`` backend, kvpack (memory + disk), then both L3s again on a fresh server over the same
store (a restart: the same conversations from their first round). Per set-up: the tokens SGLang
served from storage (``meta_info.cached_tokens_details.storage``, summed), the mean time to the
first token of rounds >= 2 (streamed), the L3 failures in the server's log (failed writes,
failed reads, kvpack calls answering a miss), and per prefetch (`sglang_prefetch_stats`): its
latency from submission to its last page read (a timing probe in the CPU shim, the same for both
backends), the tokens the hit query found, read and credited to the request when it was
scheduled, and SGLang's own reasons for the found tokens it did not credit. SGLang credits a
request with L3 tokens only when its prefetch is done when the scheduler admits it; under the
default ``timeout`` policy the scheduler holds a request for its prefetch at most
``1 s + 0.25 s per 1024 tokens`` from its first blocked admission poll, then cuts the read
(``deadline``); ``--prefetch-policy wait_complete`` holds it until the read ends (a control:
what each L3 holds, independent of timing); `--in-turn` sends one request at a time, the clients
taking turns (no queueing: the same schedule for every backend). `--repeat` runs every set-up
again on fresh stores, kvpack first in even runs.
Prints a table per run; asserts nothing.

A CPU server needs the test-only shim of ``tests/sglang/server/cpu_site`` (a stub ``sgl_kernel``
and three patches to SGLang internals): `--cpu-site` (default: that folder of this checkout).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpack.tools.bench.sglang_prefetch_stats import HEADER as PREFETCH_HEADER
from kvpack.tools.bench.sglang_prefetch_stats import PrefetchStats
from kvpack.tools.ports import free_port

FAILURES = {
    "failed writes": "Write page to storage",
    "failed reads": "failed to retrieve page",
    "kvpack misses": "failed, answering a miss",
    "failed prefetches": "prefetch transfer failed",
}
"""Server log lines that are a failed L3 call (SGLang's controller, kvpack's backend)."""

KVPACK_BACKEND: dict[str, object] = {
    "backend_name": "kvpack",
    "module_path": "kvpack.sglang_plugin",
    "class_name": "KVPackStorage",
    "interface_v1": 1,
}
"""kvpack as SGLang's ``dynamic`` storage backend: the part of ``--hicache-storage-backend-extra-config``
that names it (kvpack's own settings go beside these keys)."""


@dataclass
class SetupResult:
    """One set-up's figures."""

    name: str
    storage_tokens: int = 0
    prompt_tokens: int = 0
    ttft_later: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    start_s: float = 0.0
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttft_later) / len(self.ttft_later) if self.ttft_later else float("nan")


def _stream_generate(port: int, ids: list[int], answer: int, timeout_s: float) -> tuple[float, dict[str, object]]:
    """(seconds to the first streamed chunk, the last chunk's JSON) of one greedy ``/generate``."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": answer, "ignore_eos": True},
        "stream": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, last = time.perf_counter(), None, {}
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            last = json.loads(line[5:])
    return (first if first is not None else time.perf_counter() - start), last


class SGLangServer:
    """One CPU SGLang server in its own session, stopped by its PID (`args`: this tool's options that
    shape a server: ``dtype``, ``device``, ``page``, ``l2_ratio``, ``prefetch_policy``, ``start_timeout``,
    ``cpu_site``)."""

    def __init__(self, args: argparse.Namespace, model: Path, storage: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.log = log
        cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
            "--attention-backend", "torch_native", "--dtype", args.dtype,
            "--max-total-tokens", str(args.device), "--page-size", str(args.page),
            "--skip-server-warmup", "--enable-hierarchical-cache", "--hicache-size", "0",
            "--hicache-ratio", str(args.l2_ratio), "--hicache-io-backend", "direct", "--enable-metrics",
            "--hicache-storage-prefetch-policy", args.prefetch_policy, *storage,
        ]  # fmt: skip
        full_env = dict(
            os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONUNBUFFERED="1", KVPACK_SGLANG_PREFETCH_PROBE="1", **env
        )
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.cpu_site), full_env.get("PYTHONPATH")]))
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
            )
        began = time.monotonic()
        while time.monotonic() - began < args.start_timeout:
            if self.popen.poll() is not None:
                raise RuntimeError(f"server exited with {self.popen.returncode}; log {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - began
                        return
            except (OSError, http.client.HTTPException):  # not listening yet
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not healthy within {args.start_timeout} s; log {log}")

    def metrics(self) -> str:
        """SGLang's ``/metrics`` text ("" when it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
                return str(r.read().decode())
        except (OSError, http.client.HTTPException):
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(10)


def _conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per client, per round, the new question's token ids (the same for every set-up)."""
    out = []
    for c in range(args.clients):
        rng = random.Random(1000 + c)
        out.append([[rng.randrange(50, 1900) for _ in range(args.question)] for _ in range(args.rounds)])
    return out


def _run_setup(
    args: argparse.Namespace, model: Path, name: str, storage: list[str], env: dict[str, str], root: Path
) -> SetupResult:
    result = SetupResult(name)
    log = root / f"{name.replace(' ', '_').replace('/', '_')}.log"
    server = SGLangServer(args, model, storage, env, log)
    result.start_s = server.start_s
    questions = _conversations(args)
    lock = threading.Lock()
    errors: list[BaseException] = []

    turn = threading.Condition()
    next_turn = [0]  # --in-turn: the index (round x clients + client) of the request whose turn it is
    failed: set[int] = set()  # clients stopped by an error: their turns are skipped

    def advance() -> None:
        """Past the request just sent and the turns of failed clients (`turn` held)."""
        next_turn[0] += 1
        while next_turn[0] < args.rounds * args.clients and next_turn[0] % args.clients in failed:
            next_turn[0] += 1
        turn.notify_all()

    def client(c: int) -> None:
        history: list[int] = []
        try:
            for r in range(args.rounds):
                history += questions[c][r]
                if args.in_turn:
                    with turn:
                        turn.wait_for(lambda: next_turn[0] == r * args.clients + c)
                try:
                    ttft, last = _stream_generate(server.port, history, args.answer, args.request_timeout)
                finally:
                    if args.in_turn:
                        with turn:
                            advance()
                meta = last.get("meta_info", {}) if isinstance(last, dict) else {}
                details = (meta.get("cached_tokens_details") or {}) if isinstance(meta, dict) else {}
                with lock:
                    result.storage_tokens += int(details.get("storage", 0) or 0)
                    result.prefetch.add_response(meta if isinstance(meta, dict) else {})
                    result.prompt_tokens += len(history)
                    if r >= 1:
                        result.ttft_later.append(ttft)
                output = last.get("output_ids") if isinstance(last, dict) else None
                history += [int(t) for t in output][-args.answer :] if isinstance(output, list) else []
        except BaseException as exc:
            errors.append(exc)
            with turn:
                failed.add(c)
                if next_turn[0] % args.clients == c:
                    advance()

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(args.settle)  # SGLang backs pages up to L3 after a request ends
        result.prefetch.add_metrics(server.metrics())
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    result.prefetch.add_log(text)
    result.failures = {k: text.count(needle) for k, needle in FAILURES.items()}
    if errors:
        result.failures["client errors"] = len(errors)
    return result


def add_server_options(p: argparse.ArgumentParser, *, device: int, start_timeout: float) -> None:
    """The `SGLangServer` options a bench user sets: the device KV pool (tokens), the page size
    (tokens; vLLM's block size too in ``--handoff``), the start-up bound (s) and the CPU shim's folder."""
    p.add_argument("--device", type=int, default=device, help="SGLang's device KV pool tokens")
    p.add_argument("--page", type=int, default=32, help="SGLang's page size (tokens)")
    p.add_argument("--start-timeout", type=float, default=start_timeout)
    default_site = Path(__file__).resolve().parents[2] / "tests" / "sglang" / "server" / "cpu_site"
    p.add_argument("--cpu-site", type=Path, default=default_site)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench sglang --multiturn", description=__doc__.splitlines()[0])
    p.add_argument("--model-size", choices=("tiny", "bench"), default="bench")
    p.add_argument("--model-dir", default=str(Path.home() / ".cache" / "kvpack" / "models"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--question", type=int, default=256, help="new tokens per round (>= SGLang's 256 threshold)")
    p.add_argument("--answer", type=int, default=8)
    add_server_options(p, device=1024, start_timeout=300.0)
    p.add_argument("--l2-ratio", type=float, default=2.0, help="HiCache L2 host pool size / device pool size")
    p.add_argument("--settle", type=float, default=3.0, help="seconds for L3 backups after the last round")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--markdown", default="", help="append the table to this file")
    p.add_argument("--keep", action="store_true", help="keep the servers' logs and stores (the folder is printed)")
    p.add_argument("--io-threads", type=int, default=2, help="kvpack's io_threads (its copy and conversion threads)")
    p.add_argument(
        "--prefetch-policy",
        choices=("timeout", "best_effort", "wait_complete"),
        default="timeout",
        help="SGLang's --hicache-storage-prefetch-policy (its default: timeout)",
    )
    p.add_argument(
        "--read-delay",
        type=float,
        default=0.0,
        help="a control: kvpack's servers start every prefetch's page reads this many seconds late "
        "(the CPU shim's KVPACK_SGLANG_READ_DELAY_S): does SGLang credit a slower L3 more?",
    )
    p.add_argument(
        "--write-delay",
        type=float,
        default=0.0,
        help="a control: kvpack's servers start every L3 write this many seconds late (the CPU shim's "
        "KVPACK_SGLANG_WRITE_DELAY_S): does SGLang's schedule move with how long a write holds its L2 pages?",
    )
    p.add_argument(
        "--kvpack-interface",
        choices=("v1", "generic"),
        default="v1",
        help="a control: SGLang drives kvpack through its zero-copy v1 path (the default) or, like `file`, "
        "through its generic by-value path (``interface_v1`` 0)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of every set-up, each on fresh stores")
    p.add_argument(
        "--in-turn",
        action="store_true",
        help="one request at a time, the clients taking turns round by round (a schedule that does not "
        "depend on timing: what each L3 holds, apart from SGLang's scheduling)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        help="a set-up to run, by its name in the table ('kvpack, restarted'); repeat for more (default: all)",
    )
    return p.parse_args(argv)


def _setups(args: argparse.Namespace, root: Path, run: int = 1) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, server arguments, server environment) of the set-ups asked for, stores under `root`;
    in even runs kvpack goes before `file` (before and after the restart), so neither backend is
    always the later one."""
    kvpack = {
        **KVPACK_BACKEND,
        "interface_v1": int(args.kvpack_interface == "v1"),
        "memory": {"capacity": "64MiB"},
        "disk": {"path": str(root / "kvpack"), "capacity": "8GiB"},
        "io_threads": args.io_threads,
    }
    file_args = ["--hicache-storage-backend", "file"]
    file_env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root / "file")}
    kv_args = ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(kvpack)]
    kv_env = {
        name: str(seconds)
        for name, seconds in (
            ("KVPACK_SGLANG_READ_DELAY_S", args.read_delay),
            ("KVPACK_SGLANG_WRITE_DELAY_S", args.write_delay),
        )
        if seconds > 0
    }
    setups: list[tuple[str, list[str], dict[str, str]]] = [
        ("L2 only", [], {}),
        ("file", file_args, file_env),
        ("kvpack", kv_args, kv_env),
        ("file, restarted", file_args, file_env),
        ("kvpack, restarted", kv_args, kv_env),
    ]
    if run % 2 == 0:
        setups = [setups[0], setups[2], setups[1], setups[4], setups[3]]
    if args.only:
        names = [s[0] for s in setups]
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"--only: no set-up named {unknown[0]!r} (set-ups: {'; '.join(names)})")
        setups = [s for s in setups if s[0] in args.only]
    return setups


def _table(results: list[SetupResult]) -> list[str]:
    """The markdown table of one run: tokens and TTFT against `file` (the restarted rows against
    `file, restarted`), L3 failures, then the per-prefetch columns (`PrefetchStats.cells`)."""
    lines = [
        "| set-up | tokens from storage | x file | mean TTFT rounds >= 2 (s) | x file | L3 failures in the log | "
        + " | ".join(PREFETCH_HEADER)
        + " |",
        "|---" * (6 + len(PREFETCH_HEADER)) + "|",
    ]
    by_name = {r.name: r for r in results}
    for r in results:
        ref = by_name.get("file, restarted" if "restarted" in r.name else "file")
        tok = f"{r.storage_tokens / ref.storage_tokens:.2f}x" if ref and ref.storage_tokens else "-"
        ttft = f"{r.mean_ttft / ref.mean_ttft:.2f}x" if ref and ref.ttft_later else "-"
        fails = ", ".join(f"{k} {v}" for k, v in r.failures.items() if v) or "none"
        cells = [r.name, str(r.storage_tokens), tok, f"{r.mean_ttft:.3f}", ttft, fails, *r.prefetch.cells()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str], before_model: Callable[[], None] = lambda: None) -> int:
    """Run (`argv`: this tool's options); `before_model` runs before the model is built
    (`kvpack bench sglang` passes its torchvision shim: transformers imports torchvision)."""
    args = _parse(argv)
    if not args.cpu_site.is_dir():
        print(f"kvpack bench sglang --multiturn: no CPU server shim at {args.cpu_site} (--cpu-site)", file=sys.stderr)
        return 2
    from kvpack.tools.bench.chat_bench import _model

    before_model()
    model = _model(Path(args.model_dir), args.model_size, args.dtype)
    root = Path(tempfile.mkdtemp(prefix="kvpack-sglang-multiturn-"))
    head = (
        f"{args.clients} clients x {args.rounds} rounds of {args.question} tokens (+{args.answer} answered), "
        f"{args.model_size} model {args.dtype}, page {args.page}, device {args.device} tokens, "
        f"L2 {int(args.l2_ratio * args.device)}, "
        f"prefetch policy {args.prefetch_policy}{', in turn' if args.in_turn else ''}"
        f"{f', kvpack reads delayed {args.read_delay} s' if args.read_delay > 0 else ''}"
        f"{f', kvpack writes delayed {args.write_delay} s' if args.write_delay > 0 else ''}"
        f"{', kvpack through the generic interface' if args.kvpack_interface == 'generic' else ''}"
    )
    for run in range(1, args.repeat + 1):
        run_root = root / f"run{run}" if args.repeat > 1 else root
        run_root.mkdir(exist_ok=True)
        results = []
        for name, storage, env in _setups(args, run_root, run):
            print(f"# {name} ...", flush=True)
            results.append(_run_setup(args, model, name, storage, env, run_root))
        lines = [f"# kvpack bench sglang --multiturn, run {run} of {args.repeat}: {head}", *_table(results)]
        print("\n".join(lines), flush=True)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write("\n" + "\n".join(lines) + "\n")
    if args.keep:
        print(f"# logs and stores kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0
