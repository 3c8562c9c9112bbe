"""`kvpack bench sglang --handoff`: a CPU SGLang server's first request for prompts a vLLM server computed.

Issue 37's hand-off with SGLang as the second server: on one host, a vLLM OpenAI
server (A, run by the vLLM venv's python, `--vllm-python`) and a CPU SGLang
server with HiCache and kvpack as its L3 (B) share one host store
(``memory.mode: host``, the same ``memory.host_name``, disk off), so the host
store is the only place B can find A's KV. The bench model in fp32, vLLM's block
= SGLang's page = `--page` tokens (one canonical object per page). vLLM's prefix
caching is off, so A's repeat is a kvpack hit too. Per probe (`--probes` prompts of
`--tokens` fresh ids each):

1. A computes the prompt (a 1-token completion), then answers it again: A's own
   repeat hit, from the host store;
2. B answers it for the first time: its full pages from the host store
   (``meta_info.cached_tokens_details.storage``);
3. B drops its radix cache (``/flush_cache``) and answers it again: B's own repeat
   hit, over the same objects by the same path as 2;
4. B answers a fresh prompt of the same length: its prefill, what a load saves.

Each answer is one greedy token, timed by the caller (TTFT plus one local HTTP
round trip). Prints the medians, B first / A repeat (the issue's 1.2x) and
B first / B repeat (what reading another engine's objects costs SGLang), and
the tokens B loaded of its full pages. Asserts nothing.

A CPU SGLang server needs the test-only shim of ``tests/sglang/server/cpu_site``
(`--cpu-site`), as ``--multiturn`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpack.tools.bench.serve_server import Server, http_call
from kvpack.tools.bench.sglang_multiturn import KVPACK_BACKEND, SGLangServer, add_server_options
from kvpack.tools.bench.timing import proc_stat, publish
from kvpack.tools.ports import free_port

REQUEST_TIMEOUT_S = 300.0


@dataclass
class Handoff:
    """The probes' timings (seconds) and B's loaded tokens."""

    a_repeat: list[float] = field(default_factory=list)
    b_first: list[float] = field(default_factory=list)
    b_repeat: list[float] = field(default_factory=list)
    b_prefill: list[float] = field(default_factory=list)
    b_loaded: int = 0
    """Tokens B's first answers took from storage, over all probes."""
    b_loadable: int = 0
    """The probes' full pages, in tokens: what B could take from storage."""
    same_token: int = 0
    """Probes whose first greedy token B answered as A did."""
    quiet_wait: list[float] = field(default_factory=list)
    """Per probe, the wait for A's processes to be idle before B's first request."""

    def report(self) -> str:
        med = {k: statistics.median(getattr(self, k)) for k in ("a_repeat", "b_first", "b_repeat", "b_prefill")}
        return "\n".join(
            [
                "| A repeat ms | B first ms | B repeat ms | B prefill ms | B first / A repeat "
                "| B first / B repeat | B first / B prefill | B loaded / full pages | same first token |",
                "|---|---|---|---|---|---|---|---|---|",
                f"| {med['a_repeat'] * 1e3:.0f} | {med['b_first'] * 1e3:.0f} | {med['b_repeat'] * 1e3:.0f} "
                f"| {med['b_prefill'] * 1e3:.0f} | {med['b_first'] / med['a_repeat']:.2f}x "
                f"| {med['b_first'] / med['b_repeat']:.2f}x | {med['b_first'] / med['b_prefill']:.2f}x "
                f"| {self.b_loaded} / {self.b_loadable} | {self.same_token} of {len(self.b_first)} |",
                "",
                f"Before each B first: A idle after {statistics.median(self.quiet_wait) * 1e3:.0f} ms (median), "
                f"{max(self.quiet_wait) * 1e3:.0f} ms at most.",
            ]
        )


def _vllm_token(port: int, model: str, ids: list[int]) -> tuple[float, int]:
    """(seconds, the greedy token) of one 1-token completion on the vLLM server."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    began = time.perf_counter()
    status, text = http_call("POST", port, "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    took = time.perf_counter() - began
    if status != 200:
        raise RuntimeError(f"vLLM answered {status}: {text[:300]}")
    token = json.loads(text)["choices"][0]["logprobs"]["tokens"][0]  # "token_id:<id>"
    return took, int(str(token).rsplit(":", 1)[-1])


def _sglang_token(port: int, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, the greedy token, tokens from storage) of one 1-token ``/generate`` on the SGLang server."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    began = time.perf_counter()
    status, text = http_call("POST", port, "/generate", body, timeout=REQUEST_TIMEOUT_S)
    took = time.perf_counter() - began
    if status != 200:
        raise RuntimeError(f"SGLang answered {status}: {text[:300]}")
    answer: dict[str, Any] = json.loads(text)
    details = answer["meta_info"].get("cached_tokens_details") or {}
    return took, int(answer["output_ids"][-1]), int(details.get("storage", 0) or 0)


def _flush(port: int, timeout_s: float = 60.0) -> None:
    """SGLang's ``/flush_cache`` (device tree and host pool), asked again while its scheduler is not idle
    (its L3 backup of the last answer still in flight); bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = http_call("POST", port, "/flush_cache", {}, timeout=timeout_s)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang /flush_cache kept answering {status}: {text[:300]}")
        time.sleep(0.2)


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`."""
    stats = (proc_stat(f"/proc/{entry}/stat") for entry in os.listdir("/proc") if entry.isdigit())
    return sum(cpu for group, cpu in filter(None, stats) if group == pgid)


def _wait_quiet(a: Server, window_s: float = 0.25, busy: float = 0.05, bound_s: float = 5.0) -> float:
    """Until A's processes use under `busy` of a core over `window_s` (at most `bound_s`).

    vLLM's CPU worker polls for its next step on one full core for about a second after a request
    (with or without kvpack: 1.0 s of CPU in the 1.5 s after each request either way); on a machine
    of two cores that slows SGLang's forward pass threefold, which no host of GPU servers sees (each
    engine has its own cores). Returns the seconds waited (printed beside the table)."""
    assert a.popen is not None
    began = time.monotonic()
    last = _group_cpu_s(a.popen.pid)
    while time.monotonic() - began < bound_s:
        time.sleep(window_s)
        now = _group_cpu_s(a.popen.pid)
        if now - last < busy * window_s:
            break
        last = now
    return time.monotonic() - began


def probe(a: Server, b_port: int, model: str, args: argparse.Namespace) -> Handoff:
    """The four steps of the module's docstring, `args.probes` times (plus one untimed warm-up probe)."""
    from kvpack.tools.tinymodel import VOCAB_WORDS

    rng = random.Random(args.seed)
    out = Handoff()

    def fresh() -> list[int]:
        return [rng.randrange(3, VOCAB_WORDS) for _ in range(args.tokens)]

    for i in range(args.probes + 1):
        ids = fresh()
        _vllm_token(a.port, model, ids)
        a_repeat, a_token = _vllm_token(a.port, model, ids)
        quiet_wait = _wait_quiet(a)
        b_first, b_token, loaded = _sglang_token(b_port, ids)
        _flush(b_port)
        b_repeat = _sglang_token(b_port, ids)[0]
        b_prefill = _sglang_token(b_port, fresh())[0]
        if i == 0:  # warm-up: both servers' first requests of their lifetime
            continue
        out.a_repeat.append(a_repeat)
        out.b_first.append(b_first)
        out.b_repeat.append(b_repeat)
        out.b_prefill.append(b_prefill)
        out.b_loaded += loaded
        out.b_loadable += args.tokens // args.page * args.page
        out.same_token += int(a_token == b_token)
        out.quiet_wait.append(quiet_wait)
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench sglang --handoff", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(Path.home() / ".cache" / "kvpack" / "models"))
    p.add_argument("--vllm-python", default=os.environ.get("KVPACK_VLLM_PYTHON", ""), help="the vLLM venv's python")
    p.add_argument("--tokens", type=int, default=1560, help="prompt tokens per probe")
    p.add_argument("--probes", type=int, default=5)
    add_server_options(p, device=8192, start_timeout=400.0)  # --device sizes vLLM's cache too
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write a markdown results file here")
    p.add_argument("--keep", action="store_true", help="keep the servers' logs (the folder is printed)")
    args = p.parse_args(argv)
    args.dtype, args.l2_ratio, args.prefetch_policy = "float32", 2.0, "timeout"  # SGLangServer's other options
    return args


def main(argv: list[str], before_model: Callable[[], None] = lambda: None) -> int:
    """Run (`argv`: this tool's options); `before_model` as in `sglang_multiturn.main`."""
    args = _parse(argv)
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print("kvpack bench sglang --handoff: --vllm-python (or KVPACK_VLLM_PYTHON) names no python", file=sys.stderr)
        return 2
    if not args.cpu_site.is_dir():
        print(f"kvpack bench sglang --handoff: no CPU server shim at {args.cpu_site} (--cpu-site)", file=sys.stderr)
        return 2
    from kvpack.tiers.host import drop
    from kvpack.tools.bench.chat_bench import _model
    from kvpack.tools.bench.serve_bench import _kv_bytes_per_token

    before_model()
    model = _model(Path(args.model_dir), "bench", args.dtype)
    root = Path(tempfile.mkdtemp(prefix="kvpack-sglang-handoff-"))
    host_name = f"handoff-bench-{os.getpid()}"
    shared = {"memory": {"mode": "host", "host_name": host_name, "capacity": "1GiB"}, "disk": {"enabled": False}}
    sglang_config = {**KVPACK_BACKEND, **shared}
    a = Server(
        str(model),
        free_port(),
        root / "vllm.log",
        False,
        shared,
        args.device * _kv_bytes_per_token(model),
        args.tokens + 64,
        extra_args=("--block-size", str(args.page), "--dtype", args.dtype),  # vLLM CPU defaults to bf16
        python=args.vllm_python,
    )
    b: SGLangServer | None = None
    try:
        a.start(args.start_timeout)
        storage = ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config"]
        b = SGLangServer(args, model, [*storage, json.dumps(sglang_config)], {}, root / "sglang.log")
        result = probe(a, b.port, str(model), args)
    except BaseException:
        print(a.log_tail(), file=sys.stderr)
        raise
    finally:
        if b is not None:
            b.stop()
        a.stop()
        drop(host_name)
        if args.keep:
            print(f"[handoff bench] kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    setup = (
        f"vLLM server A and CPU SGLang server B on one host store (disk off), {model.name} fp32, "
        f"block = page = {args.page}, prompts of {args.tokens} tokens, {args.probes} probes (medians) after one warm-up"
    )
    publish("sglang --handoff", argv, "kvpack bench sglang --handoff", f"{setup}\n\n{result.report()}", args.out)
    return 0
