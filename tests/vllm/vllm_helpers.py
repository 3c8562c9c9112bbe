"""Helpers for the real-vLLM tests: engine construction, greedy runs, stored-object surgery.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless a test asks for vLLM's default multi-process mode. Prompts are token
ids, so lengths (and block boundaries) are exact.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fixtures.warm_start import warm_starts
from kvpack.tools.offline import shutdown
from kvpack.tools.ports import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("vllm")

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def _track_connectors() -> None:
    """Record every `KVPackConnector` this process builds from now on, until its engine shuts
    it down (wraps its ``__init__`` and ``shutdown`` once): an in-process engine's connectors,
    whose sessions the tests read. A closed engine's connectors leave at its shutdown, not when
    the garbage collector finds them."""
    from kvpack.vllm_plugin.connector import KVPackConnector

    init, shutdown = KVPackConnector.__init__, KVPackConnector.shutdown
    if getattr(init, "tracked", False):
        return

    @functools.wraps(init)
    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _LIVE.add(self)

    @functools.wraps(shutdown)
    def untracked(self: Any) -> None:
        _LIVE.discard(self)
        shutdown(self)

    tracked.tracked = True  # type: ignore[attr-defined]
    KVPackConnector.__init__ = tracked  # type: ignore[method-assign]
    KVPackConnector.shutdown = untracked  # type: ignore[method-assign]


_track_connectors()


def live_connectors() -> list[Any]:
    """The kvpack connectors of the engines alive in this process (in-process engines: both roles)."""
    return list(_LIVE)


BLOCK = 128
"""vLLM's default block size on CPU."""


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 1999) for _ in range(n)]


def fake_request(ids: list[int], req_id: str = "r1", computed: int = 0) -> Any:
    """What `SchedulerSide` reads of a vLLM ``Request`` (for scheduler-side tests without an engine)."""
    return SimpleNamespace(
        request_id=req_id,
        num_tokens=len(ids),
        num_prompt_tokens=len(ids),
        num_output_tokens=0,
        max_tokens=None,
        all_token_ids=list(ids),
        num_computed_tokens=computed,
        kv_transfer_params=None,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def scheduler_output(
    new: list[Any], cached: dict[str, tuple[int, tuple[list[int], ...] | None]], scheduled: dict[str, int]
) -> Any:
    """What `SchedulerSide.build_connector_meta` reads of a vLLM ``SchedulerOutput``: the `new`
    requests (``req_id``, ``block_ids``, ``num_computed_tokens``), the `cached` ones (req_id ->
    (computed tokens, new block ids per group or None)) and the tokens each is `scheduled`."""
    ids = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids,
            resumed_req_ids=set(),
            new_block_ids=[cached[r][1] for r in ids],
            num_computed_tokens=[cached[r][0] for r in ids],
        ),
        num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens={},
    )


def kv_config(extra: dict[str, Any] | None, role: str = "kv_both") -> dict[str, Any]:
    return {"kv_connector": "KVPackConnector", "kv_role": role, "kv_connector_extra_config": extra or {}}


COMPARE_DTYPE = "float32"
"""Model dtype of every engine whose output a test compares with a no-cache run.

vLLM's CPU build downcasts an fp32 checkpoint to bf16 unless told; in bf16 a
continuation from a cached prefix rounds differently from a one-pass prefill
by up to 0.06 in the first logprob on an Intel Xeon with AMX (tokens equal),
far less on an AMD EPYC. In fp32 the split point costs 2e-6..8e-6 on both, so
a comparison in fp32 holds on every CPU of this machine kind."""

LOGPROB_TOL = 1e-4
"""Largest logprob difference between a kvpack hit and a no-cache run (fp32):
10x the worst split-point rounding measured (8e-6), far below what loading one
wrong block does (tokens change)."""


def make_llm(model: Path, kv: dict[str, Any] | None = None, **kw: Any):  # type: ignore[no-untyped-def]
    """An offline engine; fp32 (`COMPARE_DTYPE`) unless the test passes ``dtype``."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(model),
        dtype=COMPARE_DTYPE,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,  # every hit below comes from kvpack, not vLLM's own cache
        seed=0,
    )
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    # vLLM collects the whole heap three times while an engine starts (twice in load_model,
    # once in freeze_gc_heap); in a test process, which holds vLLM, torch, transformers and
    # pytest (some 600k objects), each is a walk of all of them. Collected once here (what a
    # closed engine left goes now, before the new one starts, as vLLM's first collection
    # took it before), then frozen, as vLLM itself freezes the heap once an engine has
    # started: the start's own collections walk only what it allocates. The engine's
    # shutdown unfreezes the heap again (vLLM's own).
    gc.collect()
    gc.freeze()
    return LLM(**args)


def close_llm(llm: Any) -> None:
    shutdown(llm)


@dataclass(frozen=True)
class Run:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached: int


def run(llm: Any, ids: list[int], max_tokens: int = 8, **params: Any) -> Run:
    from vllm import SamplingParams

    extra = {}
    if "tenant" in params:
        extra["kv_transfer_params"] = {"kvpack_tenant": params.pop("tenant")}
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, extra_args=extra or None)
    prompt_arg: dict[str, Any] = {"prompt_token_ids": ids}
    if "cache_salt" in params:
        prompt_arg["cache_salt"] = params.pop("cache_salt")
    out = llm.generate([prompt_arg], sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    lps = tuple(float(lp[t].logprob) for lp, t in zip(comp.logprobs, comp.token_ids))
    return Run(tuple(comp.token_ids), lps, int(out.num_cached_tokens or 0))


def no_cache_run(model: Path, ids: list[int]) -> Run:
    """`ids` through a new engine without a connector (the reference a hit must equal)."""
    llm = make_llm(model)
    try:
        return run(llm, ids)
    finally:
        close_llm(llm)


def finished_load(worker: Any, req_id: str, timeout_s: float = 10.0) -> set[str]:
    """Poll a bare `WorkerSide.get_finished` until `req_id`'s load is reported (at most
    `timeout_s`); the request ids whose blocks failed. AssertionError if it never is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recving, failed = worker.get_finished()
        if req_id in recving:
            return set(failed)
        time.sleep(0.01)
    raise AssertionError(f"load {req_id} never finished")


def bare_worker(config: Any, block_size: int, store: Any = None):  # type: ignore[no-untyped-def]
    """A real `WorkerSide` of a dense one-group engine without vLLM around it (no
    registration: tests drive its load and save paths directly)."""
    from types import SimpleNamespace

    from kvpack import Session
    from kvpack.identity.layout_spec import KVLayoutSpec
    from kvpack.policy.groups import Coverage
    from kvpack.vllm_plugin.scopes import CacheGroup, Scope
    from kvpack.vllm_plugin.worker import WorkerSide

    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=block_size)
    scope = Scope(
        spec=spec,
        members=("kv",),
        block_size=block_size,
        draft="",
        groups=(CacheGroup(0, Coverage.ALL, 0, (), "FullAttentionSpec"),),
        world=1,
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
        compilation_config=SimpleNamespace(static_forward_context={}),
        cache_config=SimpleNamespace(cache_dtype="auto", calculate_kv_scales=False),
    )
    session = Session(store, scope.fingerprint) if store is not None else None
    return WorkerSide(vllm_config, config, scope, session=session)  # type: ignore[arg-type]


def same_output(a: Run, b: Run, tol: float = LOGPROB_TOL) -> bool:
    """Greedy tokens equal and every logprob within `tol` (see `LOGPROB_TOL`)."""
    return a.tokens == b.tokens and all(abs(x - y) <= tol for x, y in zip(a.logprobs, b.logprobs))


def metrics(role: str = "WORKER") -> dict[str, float]:
    """Flat ``{"name{labels}": value}`` of this process's live connectors of `role`."""
    out: dict[str, float] = {}
    for conn in live_connectors():
        if conn.role.name != role:
            continue
        for name, series in conn.session.report.snapshot().items():
            for labels, value in series.items():
                key = f"{name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + value
    return out


def metric(name: str, role: str = "WORKER", **labels: str) -> float:
    want = [f"{k}={v}" for k, v in labels.items()]
    total = 0.0
    for key, value in metrics(role).items():
        base, _, lab = key.partition("{")
        if base == name and all(w in lab for w in want):
            total += value
    return total


def stored_files(store: Path, tenant: str | None = None) -> list[Path]:
    root = store / tenant if tenant else store
    return sorted(root.rglob("*.kvp"))


def file_for(store: Path, chunk_pred) -> list[Path]:  # type: ignore[no-untyped-def]
    return [p for p in stored_files(store) if chunk_pred(p.name)]


def corrupt_payload(path: Path) -> None:
    """Flip one payload byte (the checksum no longer matches: kvpack must refuse it)."""
    from kvpack.identity.objects import decode_header

    raw = bytearray(path.read_bytes())
    header = decode_header(bytes(raw))
    pos = len(raw) - header.payload_len + header.payload_len // 2
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))


def swap_payload(path: Path, donor: Path) -> None:
    """Put `donor`'s payload (KV of other tokens) under `path`'s header with a *matching*
    checksum: every check passes, so kvpack loads wrong KV (the negative control)."""
    import dataclasses

    from kvpack.identity.objects import decode_header, payload_checksum

    raw, other = path.read_bytes(), donor.read_bytes()
    header, donor_header = decode_header(raw), decode_header(other)
    assert header.payload_len == donor_header.payload_len
    payload = other[len(other) - donor_header.payload_len :]
    old = header.encode()
    new = dataclasses.replace(header, checksum=payload_checksum(payload)).encode()
    assert len(new) == len(old)
    start = len(raw) - header.payload_len
    path.write_bytes(new + raw[len(old) : start] + payload)


def object_files(
    store: Path, ids: list[int], tenant: str = "default", seed: str | None = None
) -> tuple[list[Path], Path | None]:
    """The files of `ids`' full blocks (in order) and of its tail object, if stored."""
    from kvpack.identity.keys import chunk_hashes
    from kvpack.policy.tails import tail_chunk

    hashes = chunk_hashes(ids, BLOCK, parent=seed)  # type: ignore[arg-type]
    files = {p.name.split(".")[0]: p for p in (store / tenant).rglob("*.kvp")}
    blocks = [files[h] for h in hashes if h in files]
    return blocks, files.get(tail_chunk(hashes[-1] if hashes else seed))


@dataclass
class EngineProcess:
    """An engine process `start_engine_process` started; `result` waits for it."""

    proc: Any
    log: Path
    out: Path

    def result(self, timeout_s: float = 300) -> dict[str, Run]:
        """Each prompt's `Run` once the process ended (AssertionError if it failed)."""
        import json
        import subprocess

        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        stdout = self.out.read_text(errors="replace")
        stderr = self.log.read_text(errors="replace")
        self.log.write_text(stdout + stderr)
        self.out.unlink()
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert self.proc.returncode == 0 and line is not None, (
            f"engine process failed (rc={self.proc.returncode}); see {self.log}:\n{stderr[-3000:]}"
        )
        data = json.loads(line[len("RESULT ") :])
        return {name: Run(tuple(r["tokens"]), tuple(r["logprobs"]), int(r["cached"])) for name, r in data.items()}


def engine_script_env(**extra: str) -> dict[str, str]:
    """This process's environment for an engine script (`engine_run.py`, an OpenAI server) with
    `extra`, and ``LD_PRELOAD`` naming the OpenMP runtime torch loads (libgomp), as vLLM's CPU
    platform sets it for the processes an engine spawns and its CPU guide has users set it: so
    what a script spawns loads what the script loaded (`fixtures.warm_spawn`)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "libgomp" not in preload:  # (an in-process engine of this process has set it already)
        import torch  # noqa: F401 - loads libgomp

        with open("/proc/self/maps") as maps:
            libgomp = next(line.split()[-1] for line in maps if "/libgomp" in line)
        preload = f"{preload}:{libgomp}" if preload else libgomp
    return {**os.environ, "LD_PRELOAD": preload, **extra}


def start_engine_process(
    model: Path,
    extra: dict[str, Any] | None,
    prompts: dict[str, list[int]],
    log: Path,
    *,
    multiprocess: bool = False,
    preamble: str = "",
    max_tokens: int = 8,
    steps: list[Any] | None = None,
    salts: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    **engine: Any,
) -> EngineProcess:
    """Start `prompts` through a new engine in a new process that then simply ends, as a
    user's script does (kvpack config `extra`; None: no connector), without waiting for it:
    the test may do other work meanwhile. `preamble` runs first in that process, before vLLM
    is imported (e.g. to force an attention ISA), `env` adds to its environment; `salts`
    gives some prompts (by name) a ``cache_salt``. The process forks from one that has
    imported vLLM already (`warm_start`), or starts a fresh interpreter when there is a
    preamble."""
    import json
    import sys

    spec = json.dumps(
        {
            "model": str(model),
            "extra": extra,
            "prompts": prompts,
            "preamble": preamble,
            "max_tokens": max_tokens,
            "engine": engine,
            "steps": steps,
            "salts": salts or {},
        }
    )
    here = str(Path(__file__).parent)
    environment = engine_script_env(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        PYTHONPATH=os.pathsep.join([here, str(Path(here).parent), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    )
    script = str(Path(here) / "engine_run.py")
    out = log.with_name(log.name + ".stdout")
    # a preamble runs before vLLM is imported (it patches what an import reads): a fresh interpreter
    proc = warm_starts().start_script(sys.executable, [script, spec], environment, out, log, cold=bool(preamble))
    return EngineProcess(proc, log, out)


def engine_process(
    model: Path,
    extra: dict[str, Any] | None,
    prompts: dict[str, list[int]],
    log: Path,
    *,
    multiprocess: bool = False,
    preamble: str = "",
    max_tokens: int = 8,
    timeout_s: float = 300,
    steps: list[Any] | None = None,
    env: dict[str, str] | None = None,
    **engine: Any,
) -> dict[str, Run]:
    """`start_engine_process`, then its result: each prompt's `Run` (each generation's, with `steps`)."""
    started = start_engine_process(
        model,
        extra,
        prompts,
        log,
        multiprocess=multiprocess,
        preamble=preamble,
        max_tokens=max_tokens,
        steps=steps,
        env=env,
        **engine,
    )
    return started.result(timeout_s)


# -- OpenAI servers (vLLM's default multi-process mode) ------------------------------


SERVER_KV_CACHE_BYTES = 64 << 20
"""KV cache of each worker of a test's OpenAI server (bytes): some 30k tokens of the tiny model,
far more than a test's requests hold at once. vLLM's CPU default would take GiBs per worker, and
a suite that runs several servers beside an SGLang server (which starts only with 11 GiB of the
machine's memory available: its HiCache keeps 10 GiB in reserve) must leave that much."""


def start_openai(
    model: Path,
    kv: dict[str, Any] | None,
    log: Path,
    *args: str,
    env: dict[str, str] | None = None,
):  # type: ignore[no-untyped-def]
    """Start vLLM's OpenAI server on 127.0.0.1 (fp32, eager, vLLM prefix caching off) with
    kv-transfer-config `kv` (None: no connector) and the extra environment `env`, without
    waiting for it (`wait_healthy`): a test that needs two servers starts both, then waits.
    Returns (process, port); the process leads a session of its own (`stop_server`). It is
    ``python -m vllm.entrypoints.openai.api_server`` forked from a process that has imported
    vLLM (`warm_start`); its engine core and workers start as vLLM starts them (spawned)."""
    import json
    import sys

    port = free_port()
    env = engine_script_env(VLLM_ENABLE_V1_MULTIPROCESSING="1", **(env or {}))
    cmd = [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", str(SERVER_KV_CACHE_BYTES),
        "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0", "--dtype", COMPARE_DTYPE,
        *args,
    ]  # fmt: skip
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    # appended: a test's second lifetime of a server writes on after the first's
    proc = warm_starts().start_script(sys.executable, cmd, env, log, log, new_session=True, append=True)
    return proc, port


def wait_healthy(proc: Any, port: int, log: Path, ready_s: float = 240) -> None:
    """Wait until the server `start_openai` started answers /health (at most `ready_s`);
    AssertionError (the server stopped) if it exits or never does."""
    import http.client
    import time
    import urllib.request

    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (OSError, http.client.HTTPException):  # not listening yet (a closed port may even self-connect)
            time.sleep(0.5)
    stop_server(proc)
    raise AssertionError(f"server not ready in {ready_s} s; see {log}")


def serve_openai(
    model: Path,
    kv: dict[str, Any] | None,
    log: Path,
    *args: str,
    ready_s: float = 240,
    env: dict[str, str] | None = None,
):  # type: ignore[no-untyped-def]
    """`start_openai`, then `wait_healthy`: a healthy server. Returns (process, port)."""
    proc, port = start_openai(model, kv, log, *args, env=env)
    wait_healthy(proc, port, log, ready_s)
    return proc, port


def stop_server(proc: Any) -> None:
    """Ctrl-C (SIGINT) as a user stops a server; SIGKILL of its session after 60 s."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def post_completion(port: int, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def cached_tokens(response: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion (0 when absent)."""
    return int(((response.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def scrape_kvpack(base_port: int, name: str, span: int = 16) -> float:
    """Sum of Prometheus samples `name` (e.g. ``kvpack_loaded_tokens_total``) over every
    kvpack process serving metrics on ``base_port .. base_port + span - 1`` (config
    ``metrics_port``: each process of an engine takes the next free port)."""
    total = 0.0
    for port in range(base_port, base_port + span):
        text = _metrics_text(port)
        for line in (text or "").splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


METRICS_ANSWER_S = 30.0
"""How long a process serving metrics may take to answer (a busy worker's serving thread waits
for the GIL and a core: one took over 2 s on a loaded 2-core machine, and was counted as absent)."""


def _metrics_text(port: int) -> str | None:
    """The /metrics text on 127.0.0.1:`port`; None where nothing serves it (refused, or a
    closed loopback port that connected to itself). AssertionError if a server there has not
    answered within `METRICS_ANSWER_S`: a slow process is never counted as an absent one."""
    import http.client
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + METRICS_ANSWER_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, TimeoutError):
                return None  # refused: no server
        except TimeoutError:
            pass
        except (OSError, http.client.HTTPException):  # reset by a process that ended; a self-connect
            return None
        assert time.monotonic() < deadline, f"metrics on port {port} did not answer in {METRICS_ANSWER_S:.0f} s"
