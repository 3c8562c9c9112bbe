"""`kvpack bench serve`: the real vLLM OpenAI server under vLLM's own benchmark client.

What is measured: time to first token (median and p90, from the client's
streamed responses) and prompt tokens reused, for shared-prefix traffic on a
server whose KV cache is smaller than the workload's working set, in five rows
measured one after another in ONE run, each on a freshly started server:

1. no cache: no connector, ``--no-enable-prefix-caching``;
2. vLLM prefix caching: no connector, ``--enable-prefix-caching``;
3. kvpack: the kvpack connector (memory tier + a disk store in a temp dir),
   vLLM prefix caching off, so every reused token is kvpack's;
4. kvpack + vLLM prefix caching: both (a store of its own, also empty at start);
5. kvpack after a restart: row 3's server stopped with SIGINT, a new server on
   the same disk store, the same traffic again.

How: each server is ``python -m vllm.entrypoints.openai.api_server`` on
127.0.0.1 (the ``vllm`` console command is broken in the CPU build) in vLLM's
default multi-process mode, with ``--kv-cache-memory-bytes`` set to
`--kv-cache-fraction` (default 0.5) of the working set: the distinct prefix
tokens plus, per concurrent request, its suffix and output (what an engine must
hold to serve every repeat from its own cache), never below what the concurrent
requests need. After /health answers, two warm-up requests of random token ids
(sharing no prefix with the traffic) are sent, then the client runs in a child
process: ``vllm.benchmarks.serve`` (``add_cli_args`` + ``main``), dataset
``prefix_repetition`` (random prefixes and suffixes from the tokenizer alone,
``num_prompts // num_prefixes`` prompts per prefix, shuffled), temperature 0,
``--ignore-eos``, its own ready check and warm-ups off. Reuse is the increase
of the server's ``vllm:prompt_tokens_by_source`` counter over the client's run:
``local_cache_hit`` is vLLM's prefix cache, ``external_kv_transfer`` the
connector's (kvpack). "Repeatable" is, per request, the longest common token
prefix with any earlier request of the run (tokenized as the server does),
summed: what an unbounded prefix cache could reuse in a first lifetime. For the
restart row every prompt was computed by the previous lifetime, so its bound
is the prompt tokens less one per request. Half of the short workload's
requests are first occurrences that no cache can help, so the table also gives
the median TTFT of the repeats alone (requests sharing at least one block with
an earlier one; the client returns per-request TTFTs in request order).

Servers are stopped by PID with SIGINT (then SIGKILL of their process group
after a bound), never by name. Every request loop is bounded in count and
time. Prints a table with ratios and the serving targets next to the measured
values; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvpack.tools.bench.prom import percentile
from kvpack.tools.bench.serve_report import Row, RowName, report
from kvpack.tools.bench.serve_server import BLOCK_SIZE, HOST, Counters, Server, http_call
from kvpack.tools.bench.timing import publish
from kvpack.tools.ports import free_port

DEFAULT_MODEL_DIR = Path(os.path.expanduser("~/.cache/kvpack/models/bench-llama"))


@dataclass(frozen=True)
class Workload:
    """Shared-prefix traffic for vLLM's ``prefix_repetition`` dataset."""

    name: str
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    num_prompts: int
    concurrency: int
    output_len: int

    @property
    def requests(self) -> int:
        """Requests the dataset makes: ``num_prompts // num_prefixes`` per prefix."""
        return self.num_prefixes * (self.num_prompts // self.num_prefixes)

    @property
    def request_tokens(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len

    @property
    def max_model_len(self) -> int:
        """Room for a request, and 1.3x the prompt: the server refuses a text prompt longer
        than max_model_len times the longest token's characters (5 here; words are
        separated by spaces the tokens do not hold)."""
        return math.ceil(1.3 * (self.prefix_len + self.suffix_len)) + self.output_len + 64

    def working_set_tokens(self) -> int:
        """Distinct prefix tokens plus, per concurrent request, its suffix and output."""
        return self.num_prefixes * self.prefix_len + self.concurrency * (self.suffix_len + self.output_len)


WORKLOADS: dict[str, Workload] = {
    # prefixes repeated about twice (a burst; 16 // 6 = 2 prompts per prefix)
    "short": Workload(
        "short", num_prefixes=6, prefix_len=768, suffix_len=256, num_prompts=16, concurrency=2, output_len=32
    ),
    "long": Workload(
        "long", num_prefixes=8, prefix_len=1536, suffix_len=256, num_prompts=48, concurrency=2, output_len=32
    ),
}


def _warm_up(port: int, model: str, w: Workload, seed: int, count: int = 2) -> None:
    """`count` requests of random words (no prefix shared with the traffic); each bounded in time."""
    from kvpack.tools.tinymodel import VOCAB_WORDS

    rng = random.Random(seed)
    for _ in range(count):
        # token ids, not text: the server bounds a text prompt by characters (5 per token)
        ids = [rng.randrange(3, VOCAB_WORDS) for _ in range(w.prefix_len + w.suffix_len)]
        body = {"model": model, "prompt": ids, "max_tokens": w.output_len, "temperature": 0}
        status, text = http_call("POST", port, "/v1/completions", body, timeout=300)
        if status != 200:
            raise RuntimeError(f"warm-up request answered {status}: {text[:300]}")


def _client_argv(model: str, port: int, w: Workload, seed: int) -> list[str]:
    """Arguments for vLLM's benchmark client (``vllm bench serve``'s own parser)."""
    return [
        "--backend",
        "openai",
        "--host",
        HOST,
        "--port",
        str(port),
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        str(w.num_prompts),
        "--prefix-repetition-num-prefixes",
        str(w.num_prefixes),
        "--prefix-repetition-prefix-len",
        str(w.prefix_len),
        "--prefix-repetition-suffix-len",
        str(w.suffix_len),
        "--prefix-repetition-output-len",
        str(w.output_len),
        "--max-concurrency",
        str(w.concurrency),
        "--temperature",
        "0",
        "--ignore-eos",
        "--num-warmups",
        "0",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft",
        "--metric-percentiles",
        "50,90",
        "--seed",
        str(seed),
    ]


def _client_args(argv: list[str]) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


_CLIENT = (
    "import sys; from kvpack.tools.bench.serve_bench import _client_args; "
    "from vllm.benchmarks.serve import main; main(_client_args(sys.argv[1:]))"
)
"""The client runs in a child process: a hung server cannot hang the bench (the
client's own session timeout is 6 hours, and it does not always end on cancellation)."""


def common_prefixes(prompts: list[list[int]]) -> list[int]:
    """Per prompt, its longest common prefix with any earlier prompt (at most len - 1:
    an engine always computes a prompt's last token)."""
    out = []
    for i, ids in enumerate(prompts):
        best = 0
        for prev in prompts[:i]:
            n = 0
            for a, b in zip(ids, prev):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        out.append(min(best, len(ids) - 1))
    return out


def repeatable_tokens(prompts: list[list[int]]) -> int:
    """Tokens an unbounded prefix cache could reuse in a first lifetime: `common_prefixes` summed."""
    return sum(common_prefixes(prompts))


def traffic(model: str, w: Workload, seed: int) -> list[list[int]]:
    """The client's prompts in its order, as the server tokenizes them (same seed, same sampler)."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    args = _client_args(_client_argv(model, 0, w, seed))
    random.seed(seed)
    tok = get_tokenizer(model)
    return [list(tok(cast(str, r.prompt)).input_ids) for r in get_samples(args, tok)]  # these datasets give text


def run_client(
    model: str, port: int, w: Workload, seed: int, timeout_s: float, out_dir: Path, log: Path
) -> dict[str, Any]:
    """vLLM's benchmark client against the server, in a child process bounded by `timeout_s`
    (then SIGINT, then SIGKILL, by PID); its per-request results come back as its JSON file."""
    name = f"client-{port}.json"
    argv = _client_argv(model, port, w, seed) + [
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, *argv], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout_s)
        except BaseException as exc:  # over time, or Ctrl-C: end the client (SIGINT, then SIGKILL), by PID
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise RuntimeError(f"vLLM's benchmark client did not finish within {timeout_s:.0f}s (log {log})") from None
    if rc != 0:
        raise RuntimeError(f"vLLM's benchmark client exited with {rc} (log {log})")
    return dict(json.loads((out_dir / name).read_text()))


@dataclass
class Bench:
    model: str
    workload: Workload
    kv_cache_bytes: int
    root: Path
    seed: int
    start_timeout_s: float
    client_timeout_s: float
    repeatable: int
    prompt_tokens_bound: int
    repeats: list[bool]
    """Per request, in the client's order: shares at least one block with an earlier one."""
    shutdown_timeout_s: int | None = None

    def row(self, name: str, prefix_caching: bool, kvpack: dict[str, Any] | None, first_lifetime: bool = True) -> Row:
        objects = None
        if kvpack is not None and not first_lifetime:
            from kvpack.operate.inspect_store import summarize

            objects = sum(t.objects for t in summarize(Path(kvpack["disk"]["path"])).tenants.values())
        log = self.root / f"server-{name.replace(' ', '_').replace('+', 'and')}.log"
        server = Server(
            self.model,
            free_port(),
            log,
            prefix_caching,
            kvpack,
            self.kv_cache_bytes,
            self.workload.max_model_len,
            self.shutdown_timeout_s,
        )
        print(f"[serve bench] {name}: starting the server (log {log})", flush=True)
        server.start(self.start_timeout_s)
        try:
            _warm_up(server.port, self.model, self.workload, seed=1000 + self.seed)
            before = Counters.settled(server.port)
            result = run_client(
                self.model,
                server.port,
                self.workload,
                self.seed,
                self.client_timeout_s,
                self.root,
                log.with_name(log.stem + ".client.log"),
            )
            after = Counters.settled(server.port)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
        errors = [e for e in result.get("errors", []) if e]
        if errors:
            print(f"[serve bench] {name}: {len(errors)} failed requests, first: {errors[0][:300]}", file=sys.stderr)
        if not result.get("completed"):
            raise RuntimeError(f"no request completed ({len(errors)} failed: {errors[0][:120] if errors else '?'})")
        ttfts = [t for t, e in zip(result.get("ttfts", []), result.get("errors", [])) if not e]
        # the client returns its outputs in request order (asyncio.gather); a restart repeats everything
        mask = self.repeats if first_lifetime else [True] * len(self.repeats)
        again = [t for t, e, r in zip(result.get("ttfts", []), result.get("errors", []), mask) if not e and r]
        return Row(
            name=name,
            ttft_median_s=statistics.median(ttfts) if ttfts else float("nan"),
            ttft_p90_s=percentile(ttfts, 90),
            completed=int(result.get("completed", 0)),
            requests=len(result.get("ttfts", [])),
            prompt_tokens=int(result.get("total_input_tokens", 0)),
            reused_vllm=int(after.local_cache_hit - before.local_cache_hit),
            reused_connector=int(after.external - before.external),
            repeatable=self.repeatable if first_lifetime else self.prompt_tokens_bound,
            preemptions=int(after.preemptions - before.preemptions),
            objects_on_disk=objects,
            ttft_repeats_median_s=statistics.median(again) if again else float("nan"),
        )


def kv_cache_blocks(w: Workload, fraction: float) -> int:
    """Blocks for the engine: `fraction` of the working set, never below the concurrent requests' need."""
    need = max(w.concurrency * math.ceil(w.request_tokens / BLOCK_SIZE), math.ceil(w.max_model_len / BLOCK_SIZE))
    return max(need, math.ceil(w.working_set_tokens() * fraction / BLOCK_SIZE))


def _kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    elem = 4 if "32" in dtype else 2
    return int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * int(head_dim) * 2 * elem


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    p.add_argument("--model", default="", help="model directory (default: build the bench Llama in --model-dir)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--output-len", type=int, default=0, help="output tokens per request (default: the workload's)")
    p.add_argument(
        "--kv-cache-fraction", type=float, default=0.5, help="engine KV cache as a fraction of the working set"
    )
    p.add_argument(
        "--store-dir", default="", help="root for the kvpack stores and server logs (default: a temp dir, removed)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--client-timeout-s",
        type=float,
        default=0.0,
        help="bound on one client run (default: 10 s per request, at least 180 s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        help="pass vLLM's --shutdown-timeout to every server (default: vLLM's own, 0: the engine is "
        "killed at once on SIGINT; kvpack warns at start-up and examples/vllm/server.sh passes 10)",
    )
    p.add_argument("--io-timeout-ms", type=int, default=0, help="kvpack io_timeout_ms (default: kvpack's default)")
    p.add_argument("--out", default="", help="write a markdown results file here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[list[Row], str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", HOST)
    from kvpack.tools.tinymodel import build_bench_llama

    model = Path(args.model) if args.model else build_bench_llama(args.model_dir)
    w = WORKLOADS[args.workload]
    if args.output_len:
        w = Workload(w.name, w.num_prefixes, w.prefix_len, w.suffix_len, w.num_prompts, w.concurrency, args.output_len)
    blocks = kv_cache_blocks(w, args.kv_cache_fraction)
    per_token = _kv_bytes_per_token(model)
    kv_bytes = blocks * BLOCK_SIZE * per_token
    prompts = traffic(str(model), w, args.seed)
    shared = common_prefixes(prompts)
    repeatable = sum(shared)
    bound = sum(len(p) - 1 for p in prompts)
    root = Path(args.store_dir or tempfile.mkdtemp(prefix="kvpack-serve-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    setup = (
        f"Workload `{w.name}`: {w.num_prefixes} prefixes of {w.prefix_len} tokens, suffixes of {w.suffix_len}, "
        f"--num-prompts {w.num_prompts} ({len(prompts)} requests: {w.num_prompts // w.num_prefixes} per prefix), "
        f"{w.output_len} output tokens, concurrency {w.concurrency}; {sum(map(len, prompts))} prompt tokens, "
        f"{repeatable} repeatable. Engine KV cache {blocks} blocks of {BLOCK_SIZE} = {blocks * BLOCK_SIZE} tokens "
        f"({kv_bytes / 2**20:.1f} MiB) for a working set of {w.working_set_tokens()} tokens "
        f"({w.working_set_tokens() * per_token / 2**20:.1f} MiB). Model {model.name} ({per_token} KV bytes/token)."
    )
    print(f"[serve bench] {setup}", flush=True)
    client_timeout = args.client_timeout_s or max(180.0, 10.0 * len(prompts))
    bench = Bench(
        str(model),
        w,
        kv_bytes,
        root,
        args.seed,
        args.start_timeout_s,
        client_timeout,
        repeatable,
        bound,
        [n >= BLOCK_SIZE for n in shared],
        args.shutdown_timeout,
    )

    def kv(store: str) -> dict[str, Any]:
        cfg: dict[str, Any] = {"memory": {"capacity": "1GiB"}, "disk": {"path": str(root / store)}}
        if args.io_timeout_ms:
            cfg["io_timeout_ms"] = args.io_timeout_ms
        return cfg

    plan: list[tuple[str, bool, dict[str, Any] | None, bool]] = [
        (RowName.NO_CACHE, False, None, True),
        (RowName.VLLM_PC, True, None, True),
        (RowName.KVPACK, False, kv("kvpack"), True),
        (RowName.KVPACK_PC, True, kv("kvpack-pc"), True),
        (RowName.RESTART, False, kv("kvpack"), False),
    ]
    rows: list[Row] = []
    for name, prefix_caching, cfg, first in plan:
        try:
            rows.append(bench.row(name, prefix_caching, cfg, first_lifetime=first))
        except Exception as exc:  # one row's failure is reported in the table; the others still run
            print(f"[serve bench] {name} failed: {exc}", file=sys.stderr, flush=True)
            nan = float("nan")
            rows.append(
                Row(name, nan, nan, 0, len(prompts), 0, 0, 0, repeatable, failed=str(exc).splitlines()[0][:200])
            )
    if any(r.failed for r in rows):
        print(f"[serve bench] kept {root} (server logs) because a row failed", file=sys.stderr)
    elif not args.store_dir:
        shutil.rmtree(root, ignore_errors=True)
    return rows, setup


def main(argv: list[str]) -> int:
    args = _parse(argv)
    rows, setup = run(args)
    publish(
        "serve",
        argv,
        "kvpack bench serve: the vLLM OpenAI server under vLLM's benchmark client",
        f"{setup}\n\n{report(rows)}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
