"""`kvpack bench vllm`: time to first token on the real vLLM engine, kvpack next to its peer.

One run, one process, engines one after another (in-process mode), each with
vLLM's own prefix cache off so every reuse comes from the connector:

- no connector (recompute every prompt);
- kvpack: a miss (the prompt is computed and stored) and a hit from host
  memory (same engine), then a hit from disk (a new engine on the same store);
- vLLM's ExampleConnector (disk, safetensors): a miss (store) and a hit.

`--hybrid` runs the same on a sliding-window hybrid of the bench model (two
full-attention layers, four with a 1024-token window: several KV cache
groups), adds kvpack with ``tail_reuse`` off (block-aligned reuse only) for
the tokens-reused comparison, and runs ExampleConnector the only way vLLM
allows it there (it does not support the hybrid allocator, so vLLM turns the
allocator off and keeps every layer's whole history).

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1``; each number is
the median over `--repeats` distinct prompts after `--warmups` warm-up prompts.
Decode speed (no connector, and a kvpack engine whose prompts are hits): per
prompt, `DECODE_STEPS` more tokens' wall time over a 1-token run of the same
prompt, median over the timed prompts. CPU: the store pass's CPU seconds until its
stores are drained, and the part kvpack's own threads used (by thread), next to the
no-connector pass's: what saving costs the engine's cores, which this bench's TTFT
noise (other work on a shared machine) can hide. Prints ratios; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpack.tiers.host import drop
from kvpack.tools.bench.timing import CpuSample, cpu_sample, write_report
from kvpack.tools.offline import drain, shutdown

DECODE_STEPS = 32
"""Tokens decoded per prompt for the decode-speed rows (after the first one)."""

DEFAULT_MODEL_DIR = Path(os.path.expanduser("~/.cache/kvpack/models/bench-llama"))


@dataclass
class Result:
    name: str
    ttft_s: float
    reused_tokens: float
    prompt_tokens: int
    decode_tps: float = 0.0
    """Decode tokens/s after the first token (0: not measured in this row)."""
    cpu: CpuSample | None = None
    """The row's pass: the process's CPU seconds, and those of kvpack's own threads (saves,
    write-back, copies) until its stores were drained (None: not measured in this row)."""


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench vllm", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model directory (default: build the bench Llama in --model-dir)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--small", action="store_true", help="quick run: the 2-layer test model, 1000-token prompts")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmups", type=int, default=3)
    p.add_argument("--store-dir", default="", help="kvpack / ExampleConnector store root (default: a temp dir)")
    p.add_argument("--out", default="", help="write a markdown results file here")
    p.add_argument("--no-disk-hit", action="store_true", help="skip the new-engine (disk) kvpack hit")
    p.add_argument("--hybrid", action="store_true", help="a sliding-window hybrid of the bench model (see above)")
    p.add_argument(
        "--memory-mode",
        choices=["auto", "process", "host"],
        default="auto",
        help="kvpack's memory.mode (host: a host store of its own, dropped at the end)",
    )
    return p.parse_args(argv)


def _model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from ..tinymodel import build_bench_llama, build_bench_swa_llama, build_tiny_llama

    if args.small:
        return build_tiny_llama(Path(args.model_dir).with_name("tiny-llama"))
    if args.hybrid:
        return build_bench_swa_llama(Path(args.model_dir).with_name("bench-swa-llama"))
    return build_bench_llama(args.model_dir)


def _prompts(seed: int, count: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 1999) for _ in range(n)] for _ in range(count)]


def _engine(model: Path, kv: dict[str, Any] | None, max_len: int):
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=str(model),
        kv_cache_memory_bytes=1 << 30,
        max_model_len=max_len,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
    )
    if kv is not None:
        kw["kv_transfer_config"] = kv
    return LLM(**kw)


def _ttft(llm: Any, prompts: list[list[int]]) -> tuple[float, float]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0)
    times, reused = [], []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        reused.append(out.num_cached_tokens or 0)
    return statistics.median(times), statistics.median(reused)


def _decode_rate(llm: Any, prompts: list[list[int]]) -> float:
    """Median decode tokens/s: `DECODE_STEPS` extra tokens over a 1-token run of each prompt."""
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0)
    more = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    rates = []
    for ids in prompts:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], more, use_tqdm=False)
        rates.append(DECODE_STEPS / max(1e-9, time.perf_counter() - start - first))
    return statistics.median(rates)


def _store_then_hit(
    model: Path, kv: dict[str, Any], max_len: int, warm: list[list[int]], timed: list[list[int]]
) -> tuple[tuple[float, float, CpuSample], tuple[float, float, float]]:
    """One kvpack engine: (TTFT, reused, CPU) of `timed` on a miss (computed and stored),
    then (TTFT, reused, decode tokens/s) on a hit of the same prompts from host memory.
    Saves are drained between passes (deterministic points for timing, not for
    correctness); the miss pass's CPU is counted until its stores are drained."""
    llm = _engine(model, kv, max_len)
    _ttft(llm, warm)
    drain(llm)
    before = cpu_sample("kvpack")
    t, r = _ttft(llm, timed)
    drain(llm)
    miss = (t, r, cpu_sample("kvpack") - before)
    hit = _ttft(llm, timed)
    drain(llm)
    decode = _decode_rate(llm, timed)  # every prompt a hit: decode right after a restored prefix
    shutdown(llm)
    return miss, (*hit, decode)


def run(args: argparse.Namespace) -> list[Result]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    model = _model(args)
    n = 1000 if args.small and args.prompt_tokens == 3000 else args.prompt_tokens
    max_len = n + 64
    warm = _prompts(1, args.warmups, n)
    timed = _prompts(2, args.repeats, n)
    root = Path(args.store_dir or tempfile.mkdtemp(prefix="kvpack-bench-"))
    kv_dir, ex_dir = root / "kvpack", root / "example"
    shutil.rmtree(kv_dir, ignore_errors=True)
    shutil.rmtree(ex_dir, ignore_errors=True)
    ex_dir.mkdir(parents=True)
    results: list[Result] = []

    llm = _engine(model, None, max_len)
    _ttft(llm, warm)
    before = cpu_sample("kvpack")
    t, r = _ttft(llm, timed)
    cpu = cpu_sample("kvpack") - before
    results.append(Result("no connector", t, r, n, _decode_rate(llm, timed), cpu))
    shutdown(llm)

    memory = {"mode": args.memory_mode, "host_name": f"bench-vllm-{os.getpid()}"}
    kv = {
        "kv_connector": "KVPackConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"disk": {"path": str(kv_dir)}, "memory": memory},
    }
    try:
        miss, hit = _store_then_hit(model, kv, max_len, warm, timed)
        results += [
            Result("kvpack miss (store)", miss[0], miss[1], n, cpu=miss[2]),
            Result("kvpack hit (memory)", hit[0], hit[1], n, hit[2]),
        ]
        if not args.no_disk_hit:
            drop(memory["host_name"])  # a host store outlives its engine: the new engine must read the disk
            llm = _engine(model, kv, max_len)
            _ttft(llm, _prompts(3, args.warmups, n))
            t, r = _ttft(llm, timed)
            results.append(Result("kvpack hit (disk, new engine)", t, r, n))
            shutdown(llm)
    finally:
        drop(memory["host_name"])
    if args.hybrid:
        aligned = {**kv, "kv_connector_extra_config": {"disk": {"path": str(root / "aligned")}, "tail_reuse": False}}
        _, hit = _store_then_hit(model, aligned, max_len, warm, timed)
        results.append(Result("kvpack hit (memory), block-aligned only", hit[0], hit[1], n, hit[2]))

    ex = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(ex_dir)},
    }
    llm = _engine(model, ex, max_len)
    _ttft(llm, warm)
    t, r = _ttft(llm, timed)
    results.append(Result("ExampleConnector miss (store)", t, r, n))
    t, r = _ttft(llm, timed)
    results.append(Result("ExampleConnector hit", t, r, n))
    shutdown(llm)
    results.append(Result("_bytes", float(_du(kv_dir) / max(1, args.repeats + 2 * args.warmups)), 0, n))
    results.append(Result("_ex_bytes", float(_du(ex_dir) / max(1, args.repeats + args.warmups)), 0, n))
    if not args.store_dir:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def report(results: list[Result], prompts: int) -> str:
    """The results table; `prompts`: timed prompts per row (`--repeats`)."""
    by = {r.name: r for r in results}
    base = by["no connector"].ttft_s
    ex_hit = by["ExampleConnector hit"].ttft_s
    lines = [
        "| run | TTFT median (s) | x no connector | x ExampleConnector hit | tokens reused |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if r.name.startswith("_"):
            continue
        lines.append(
            f"| {r.name} | {r.ttft_s:.4f} | {r.ttft_s / base:.3f} | {r.ttft_s / ex_hit:.3f} | "
            f"{r.reused_tokens:.0f} of {r.prompt_tokens} |"
        )
    lines.append("")
    base_tps = by["no connector"].decode_tps
    for r in results:
        if r.decode_tps and r.name != "no connector":
            lines.append(
                f"Decode after the first token: {r.name} {r.decode_tps:.1f} tokens/s, no connector {base_tps:.1f} "
                "tokens/s "
                f"({r.decode_tps / base_tps:.3f}x; {DECODE_STEPS} tokens per prompt, median)."
            )
    store, base_cpu = by["kvpack miss (store)"].cpu, by["no connector"].cpu
    if store is not None and base_cpu is not None and store.total_s > 0:
        lines.append(
            f"CPU of the store pass (until its stores were drained): {store.total_s:.2f} s, of which kvpack's own "
            f"threads {store.named_s:.2f} s = {store.named_s / store.total_s:.1%} "
            f"({1e3 * store.named_s / prompts:.1f} ms per prompt: "
            + ", ".join(f"{k} {1e3 * v / prompts:.1f}" for k, v in store.named.items())
            + f"); the no-connector pass used {base_cpu.total_s:.2f} s "
            f"({store.total_s / max(1e-9, base_cpu.total_s):.3f}x). The copy out of the KV cache in each step's "
            "wait_for_save runs on the engine's thread and is in the total only."
        )
    lines.append(
        f"Bytes stored per prompt: kvpack {by['_bytes'].ttft_s / 2**20:.1f} MiB (memory + disk copies counted once, "
        f"disk only), ExampleConnector {by['_ex_bytes'].ttft_s / 2**20:.1f} MiB."
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    command = "kvpack bench vllm " + " ".join(shlex.quote(a) for a in argv)
    results = run(args)
    table = report(results, args.repeats)
    print(table)
    if args.out:
        write_report(args.out, "kvpack bench vllm: TTFT on the real vLLM CPU engine", command, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
