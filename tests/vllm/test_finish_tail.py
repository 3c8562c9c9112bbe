"""A turn that ends at EOS or a stop string leaves its answer's last partial block for the next turn.

One in-process engine with kvpack (memory and disk, ``prefix_match_unit`` 1,
vLLM's own prefix cache off, so every hit is kvpack's). Turn k is a prompt of
one block and 72 tokens; its greedy answer stops at a token picked from what
the engine generates (``stop_token_ids``: vLLM ends it as at EOS) or at a stop
string (the frontend stops it; the engine core sees an abort), before it fills
the block. Turn k+1 is turn k's prompt, its answer and new tokens: it must hit
everything turn k computed, n - 1 of the shared part (the answer's last token
has no KV). Before finish-time tails only a request that could end by length
saved its last partial block, so this turn hit the prompt alone (200 tokens).
Tokens are picked from probe runs under another cache salt (other keys, so the
probes' tails are never what a turn hits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import BLOCK, Run, close_llm, kv_config, make_llm, metric, prompt, same_output

pytestmark = pytest.mark.vllm

P = prompt(61, BLOCK + 72)  # turn k's prompt: one block and a 72-token tail
Q = prompt(62, BLOCK + 72)
NEW = prompt(63, 20)  # turn k+1's new tokens
PROBE_TOKENS = 40


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store = tmp_path_factory.mktemp("finish-tail-store")
    engine = make_llm(tiny_llama, kv_config({"disk": {"path": str(store)}, "prefix_match_unit": 1}))
    yield engine
    close_llm(engine)


def _generate(llm: Any, ids: list[int], max_tokens: int, salt: str | None = None, **stop: Any) -> tuple[Run, str]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, **stop)
    prompt_arg: dict[str, Any] = {"prompt_token_ids": ids}
    if salt is not None:
        prompt_arg["cache_salt"] = salt
    out = llm.generate([prompt_arg], sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    lps = tuple(float(lp[t].logprob) for lp, t in zip(comp.logprobs, comp.token_ids))
    return Run(tuple(comp.token_ids), lps, int(out.num_cached_tokens or 0)), str(comp.finish_reason)


def _first_new(tokens: tuple[int, ...], start: int) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _follow_up(llm: Any, answer: tuple[int, ...], first: list[int]) -> tuple[Run, Run]:
    """Turn k+1 on `llm` and the same prompt under a fresh salt (a miss: the reference)."""
    ids = first + list(answer) + NEW
    hit, _ = _generate(llm, ids, 8)
    miss, _ = _generate(llm, ids, 8, salt=f"ref-{len(answer)}-{first[0]}")
    return hit, miss


def test_follow_up_after_a_stop_token_reuses_all_turn_k_computed(llm) -> None:  # type: ignore[no-untyped-def]
    probe, _ = _generate(llm, P, PROBE_TOKENS, salt="probe")
    stop = probe.tokens[_first_new(probe.tokens, 20)]
    turn, reason = _generate(llm, P, 2 * PROBE_TOKENS, stop_token_ids=[stop])
    assert reason == "stop" and turn.tokens[-1] == stop and len(turn.tokens) < PROBE_TOKENS
    before = metric("tail_hit_tokens", role="SCHEDULER")
    hit, miss = _follow_up(llm, turn.tokens, P)
    assert hit.cached == len(P) + len(turn.tokens) - 1  # n - 1 of the shared part (200 before the fix)
    assert metric("tail_hit_tokens", role="SCHEDULER") - before == hit.cached - BLOCK
    assert same_output(hit, miss)


def test_follow_up_after_a_stop_string_reuses_all_turn_k_computed(llm) -> None:  # type: ignore[no-untyped-def]
    probe, _ = _generate(llm, Q, PROBE_TOKENS, salt="probe")
    decode = llm.get_tokenizer().decode
    text = decode(list(probe.tokens))
    i = next(
        i
        for i in range(20, len(probe.tokens))
        if (s := decode([probe.tokens[i]]).strip()) and s not in decode(list(probe.tokens[:i])) and text.count(s) == 1
    )
    stop_text = decode([probe.tokens[i]]).strip()
    turn, reason = _generate(llm, Q, 2 * PROBE_TOKENS, stop=[stop_text])
    assert reason == "stop" and len(turn.tokens) < PROBE_TOKENS
    hit, miss = _follow_up(llm, turn.tokens, Q)
    assert hit.cached == len(Q) + len(turn.tokens) - 1
    assert same_output(hit, miss)
