"""Prefill/decode disaggregation through the store: a handoff, not a race.

Two real vLLM OpenAI servers share one store (a disk folder; or a Mooncake
cluster on 127.0.0.1): a prefill instance (``kv_producer``) and a decode
instance (``kv_consumer``), with `kvpack proxy` in front, as a user runs
them. Every prompt sent to the proxy is answered by the decode instance
with n - 1 prompt tokens loaded from the store (``cached_tokens``) and the
greedy text of a single-instance no-cache run. Before the handoff protocol
a request sent right after the producer answered missed (the producer's save
had not landed, and nothing told the consumer to wait).

A decode request whose prefill instance never stored anything waits at most
``handoff_wait_ms`` and recomputes (same text), and a handoff whose objects are there,
sent meanwhile, loads at once; a handoff from another layout is
refused at once with an error naming it. Over disk the prefill instance runs at
TP=2 and the decode instance at TP=1: the handoff says how many KV-head ranges it
stored each chunk as, and the decode instance reads those objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_helpers import (
    BLOCK,
    cached_tokens,
    close_llm,
    kv_config,
    make_llm,
    post_completion,
    prompt,
    scrape_kvpack,
    start_openai,
    stop_server,
    wait_healthy,
)

from kvpack.tools.ports import free_port

pytestmark = pytest.mark.vllm

PROMPTS = {"A": prompt(71, 700), "B": prompt(72, 300), "C": prompt(73, 257)}
LATE = prompt(75, 500)
"""Sent to the decode instance before the prefill instance has computed it."""
MAX_TOKENS = 12
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per rank of a TP=2 CPU server."""
PD_WAIT_MS = 10_000
"""The decode instance's `handoff_wait_ms`. The late handoff below is answered once the objects
land (well under a second on an idle machine), but on a loaded 2-core CI machine the prefill
instance took 2.4 s to answer a 500-token prompt, and 3 s once missed; only the case of a
prefill instance that never stores waits all of it."""


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, str]:
    """Greedy texts of every prompt from one single-instance no-cache engine (shared by the
    module's tests: it depends on the model and the prompts only)."""
    from vllm import SamplingParams

    llm = make_llm(tiny_llama)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        prompts = {**PROMPTS, "LATE": LATE}
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False)
        return {name: out.outputs[0].text for name, out in zip(prompts, outs)}
    finally:
        close_llm(llm)


def _handoff_for(sample: dict, ids: list[int]) -> dict:
    """The handoff a prefill instance answers for `ids` (layout and tenant as in `sample`;
    its tail goes to the first tail slot after its last whole block)."""
    from kvpack.identity.keys import chunk_hashes
    from kvpack.policy.tails import tail_chunk

    hashes = chunk_hashes(ids, BLOCK)
    tail = tail_chunk(hashes[-1] if hashes else None) if len(ids) % BLOCK else None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvpack": {**sample["kvpack"], "tokens": len(ids), "tail_chunk": tail},
    }


def _proxy(prefill: int, decode: int, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvpack.cli", "proxy", "--prefill", f"http://127.0.0.1:{prefill}",
           "--decode", f"http://127.0.0.1:{decode}", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            post_completion(port, {}, timeout_s=1)
        except OSError as exc:
            if "refused" not in str(exc).lower():
                return proc, port  # answering (an HTTP error from upstream is an answer)
            time.sleep(0.2)
        else:
            return proc, port
    proc.kill()
    raise AssertionError(f"proxy not ready; see {log}")


PREFILL_TP = {"disk": 2, "mooncake": 1}
"""The prefill instance's TP size per shared tier: over disk it is TP=2 for a decode instance at
TP=1 (wide prefill, narrow decode: a common shape), so one pair of servers covers both."""


@pytest.fixture(params=["disk", "mooncake"])
def shared_tier(request: pytest.FixtureRequest, tmp_path: Path) -> dict:
    if request.param == "disk":
        return {"disk": {"path": str(tmp_path / "kv")}}
    cluster = request.getfixturevalue("mooncake_cluster")
    mc = {
        "enabled": True,
        "master_server_address": cluster.master_address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        "local_buffer_size": "16MiB",
        "staging_size": "64MiB",
        "timeout_ms": 3000,
    }
    return {"disk": {"enabled": False}, "mooncake": mc}


def test_every_prompt_through_the_proxy_is_decoded_from_the_prefill_instances_kv(
    tiny_llama: Path, tmp_path: Path, shared_tier: dict, request: pytest.FixtureRequest
) -> None:
    common = {**shared_tier, "memory": {"capacity": "256MiB"}}
    metrics = free_port()
    consumer_kv = kv_config({**common, "handoff_wait_ms": PD_WAIT_MS, "metrics_port": metrics}, "kv_consumer")
    ranks = PREFILL_TP["disk" if "path" in shared_tier["disk"] else "mooncake"]
    wide = ("--tensor-parallel-size", "2") if ranks == 2 else ()
    # both instances start together (as a user's two servers would); each is waited for below
    producer, p_port = start_openai(
        tiny_llama, kv_config(common, "kv_producer"), tmp_path / "prefill.log", *wide, env=TWO_RANKS if wide else None
    )
    consumer, d_port = start_openai(tiny_llama, consumer_kv, tmp_path / "decode.log")
    proxy = None
    try:
        baseline: dict[str, str] = request.getfixturevalue("baseline")  # the first time: while they start
        wait_healthy(producer, p_port, tmp_path / "prefill.log")
        wait_healthy(consumer, d_port, tmp_path / "decode.log")
        proxy, port = _proxy(p_port, d_port, tmp_path / "proxy.log")

        def loaded() -> float:  # tokens the decode instance's kvpack restored
            return scrape_kvpack(metrics, "kvpack_loaded_tokens_total")

        def handoffs() -> float:  # decode loads that came through a handoff
            return scrape_kvpack(metrics, "kvpack_handoff_loads_total")

        for name, ids in PROMPTS.items():
            before, via = loaded(), handoffs()
            out = post_completion(
                port, {"model": str(tiny_llama), "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
            )
            assert loaded() - before == len(ids) - 1, name
            assert handoffs() - via == 1, name
            # vLLM reports the prefill side's own cache hits here (none: every prompt is new to it)
            assert cached_tokens(out) == 0
            assert out["choices"][0]["text"] == baseline[name], name

        handoff = post_completion(p_port, {"model": str(tiny_llama), "prompt": PROMPTS["B"], "max_tokens": 1,
                                           "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]  # fmt: skip
        assert handoff["do_remote_prefill"] and handoff["kvpack"]["tokens"] == len(PROMPTS["B"])
        if ranks == 2:  # it stores each chunk as two head ranges and says so; the TP=1 decode
            # instance loaded those above (every prompt's n - 1 tokens, the no-cache text)
            assert handoff["kvpack"]["head_ranges"] == 2, handoff
        # the race made certain: the decode request is in before the prefill instance starts;
        # the handoff makes it wait for the objects (bounded) instead of missing them
        early = _handoff_for(handoff, LATE)  # what the prefill instance is about to answer
        before = loaded()
        with ThreadPoolExecutor(1) as pool:
            decoded = pool.submit(post_completion, d_port, {"model": str(tiny_llama), "prompt": LATE, "max_tokens": MAX_TOKENS,
                                                            "temperature": 0, "kv_transfer_params": early})  # fmt: skip
            time.sleep(0.5)  # not to pass: to make sure the decode side asks first (the worst order)
            sent = time.monotonic()
            produced = post_completion(p_port, {"model": str(tiny_llama), "prompt": LATE, "max_tokens": 1,
                                                "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
            prefill_s = time.monotonic() - sent
            out = decoded.result(timeout=120)
        assert produced["kv_transfer_params"]["kvpack"] == early["kvpack"]
        assert loaded() - before == len(LATE) - 1, (
            f"prefill answered {prefill_s:.2f} s after it was sent; "
            f"handoff objects missing: {scrape_kvpack(metrics, 'kvpack_handoff_missing_total'):.0f}"
        )
        assert out["choices"][0]["text"] == baseline["LATE"]

        # the prefill instance never stored this prompt: the decode instance waits (bounded), recomputes;
        # a handoff whose objects are there, sent while it waits, loads at once (its wait holds up no other)
        unstored = prompt(74, 300)
        before = loaded()
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post_completion, d_port, {"model": str(tiny_llama), "prompt": unstored,
                                                            "max_tokens": MAX_TOKENS, "temperature": 0,
                                                            "kv_transfer_params": handoff})  # fmt: skip
            time.sleep(0.5)  # not to pass: to make sure the unstored handoff waits first
            beside = post_completion(d_port, {"model": str(tiny_llama), "prompt": PROMPTS["A"], "max_tokens": MAX_TOKENS,
                                              "temperature": 0, "kv_transfer_params": _handoff_for(handoff, PROMPTS["A"])})  # fmt: skip
            # answered inside the unstored one's wait: a load queued behind that wait starts after it
            assert time.monotonic() - start < PD_WAIT_MS / 1000, "the handoff beside waited for the unstored one"
            out = waiting.result(timeout=120)
        assert time.monotonic() - start < PD_WAIT_MS / 1000 + 30
        assert beside["choices"][0]["text"] == baseline["A"]
        assert loaded() - before == len(PROMPTS["A"]) - 1  # all of A; nothing of the unstored prompt
        alone = post_completion(
            d_port, {"model": str(tiny_llama), "prompt": unstored, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        assert out["choices"][0]["text"] == alone["choices"][0]["text"]

        # a handoff from another layout is refused at once, with an error that names it
        forged = json.loads(json.dumps(handoff))
        forged["kvpack"]["fingerprint"] = "0" * 32
        out = post_completion(d_port, {"model": str(tiny_llama), "prompt": PROMPTS["B"], "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "kv_transfer_params": forged})  # fmt: skip
        assert out["choices"][0]["text"] == baseline["B"]
    finally:
        for proc in (proxy, consumer, producer):
            if proc is not None:
                stop_server(proc)
    log = (tmp_path / "decode.log").read_text(errors="replace")
    assert "prefill/decode handoff refused" in log and "0" * 32 in log
    assert os.path.getsize(tmp_path / "prefill.log") > 0


def test_handoff_params_carry_the_head_split_and_refuse_a_bad_one() -> None:
    from kvpack.vllm_plugin.handoff import Handoff, HandoffError

    sent = Handoff("f" * 32, "t", 700, None, 2)
    assert Handoff.from_params(sent.to_params()) == sent
    older = sent.to_params()
    del older["kvpack"]["head_ranges"]  # a prefill instance from before the field: its split is the reader's own
    assert Handoff.from_params(older) == Handoff("f" * 32, "t", 700, None, 0)
    for bad in (-1, "2", True, 1.5):
        params = sent.to_params()
        params["kvpack"]["head_ranges"] = bad
        with pytest.raises(HandoffError, match="head_ranges"):
            Handoff.from_params(params)
