"""The chat bench's pure parts: deterministic workloads, the messages a turn sends, report maths, the plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpack.tools.bench.chat_report import report, targets
from kvpack.tools.bench.chat_workload import (
    ChatShape,
    DocShape,
    Result,
    SetupRun,
    answers_equal,
    chat_plan,
    longdoc_plan,
    mean_from_round,
    normalize_answer,
    plot,
    round_stats,
)

CHAT = ChatShape(
    users=3, rounds=4, system_words=20, context_words=30, question_words=5, answer_min=4, answer_max=9, concurrency=2
)
DOCS = DocShape(docs=3, doc_words=50, queries=2, question_words=4, answer_len=8, concurrency=4)


def test_plans_are_a_function_of_shape_and_seed() -> None:
    assert chat_plan(CHAT, 7) == chat_plan(CHAT, 7)
    assert chat_plan(CHAT, 7) != chat_plan(CHAT, 8)
    assert longdoc_plan(DOCS, 7) == longdoc_plan(DOCS, 7)
    assert longdoc_plan(DOCS, 7) != longdoc_plan(DOCS, 8)


def test_chat_plan_shape() -> None:
    plan = chat_plan(CHAT, 0)
    assert len(plan.rounds) == 4
    for r, turns in enumerate(plan.rounds, start=1):
        assert sorted(t.conv for t in turns) == [0, 1, 2]  # every user once per round
        assert all(t.round == r and 4 <= t.max_tokens <= 9 for t in turns)
    assert len(plan.system.split()) == 20 and all(len(c.split()) == 30 for c in plan.openings)
    assert len({t.max_tokens for turns in plan.rounds for t in turns}) > 1  # answers of varied length


def test_a_chat_turn_sends_the_shared_system_prompt_its_context_and_history() -> None:
    plan = chat_plan(CHAT, 0)
    t1 = next(t for t in plan.rounds[0] if t.conv == 1)
    t2 = next(t for t in plan.rounds[1] if t.conv == 1)
    first = plan.messages(t1, [])
    assert first == [
        {"role": "system", "content": plan.system},
        {"role": "user", "content": f"{plan.openings[1]} {t1.question}"},
    ]
    second = plan.messages(t2, [(t1.question, "w5 w6")])
    assert second[: len(first)] == first  # the next turn extends the last one's prompt
    assert second[2:] == [{"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": t2.question}]


def test_longdoc_reads_each_document_then_queries_them_again_shuffled() -> None:
    plan = longdoc_plan(DOCS, 0)
    first, again = plan.rounds
    assert [t.conv for t in first] == [0, 1, 2]
    assert sorted(t.conv for t in again) == [0, 0, 1, 1, 2, 2]
    assert [t.conv for t in again] != sorted(t.conv for t in again)  # random order (this seed)
    msgs = plan.messages(again[0], [("ignored", "ignored")])
    assert len(msgs) == 2 and msgs[1]["content"].startswith(plan.openings[again[0].conv])


def test_normalize_answer_respaces_glued_words() -> None:
    assert normalize_answer("w1w22 w3\n w4") == "w1 w22 w3 w4"


def _r(rnd: int, t: float, answer: str = "a", error: str = "") -> Result:
    return Result(0, rnd, t, 10, answer, error)


def test_round_stats_and_means() -> None:
    res = [_r(1, 1.0), _r(1, 3.0), _r(2, 0.1), _r(2, 0.2), _r(2, 0.3), _r(2, 0.4), _r(2, 9.0, error="x")]
    s1, s2 = round_stats(res)
    assert (s1.round, s1.n, s1.mean_s, s1.p50_s) == (1, 2, 2.0, 2.0)
    assert s2.n == 4 and s2.mean_s == pytest.approx(0.25) and s2.p50_s == pytest.approx(0.25)
    assert s2.p90_s == pytest.approx(0.37)
    assert mean_from_round(res) == pytest.approx(0.25)
    assert math.isnan(mean_from_round(res, 3))


def test_answers_equal_counts_turn_by_turn_and_failed_turns_never_equal() -> None:
    ref = [_r(1, 1, "a"), _r(1, 1, "b"), _r(2, 1, "c")]
    assert answers_equal(ref, ref) == (3, 3)
    assert answers_equal([_r(1, 1, "a"), _r(1, 1, "x"), _r(2, 1, "c", error="e")], ref) == (1, 3)


def _run(name: str, r1: float, r2: float) -> SetupRun:
    return SetupRun(name, [_r(1, r1), _r(2, r2), _r(3, r2)], {"prompt tokens": 30, "kvpack disk (tokens)": 12})


def test_targets_and_report() -> None:
    runs = [
        _run("no cache", 2.0, 2.0),
        _run("vLLM prefix caching", 2.0, 1.0),
        _run("vLLM PC + kvpack", 2.0, 0.4),
        SetupRun("vLLM PC + LMCache MP", skipped="cannot run"),
        _run("kvpack restarted (disk)", 0.5, 0.5),
    ]
    got = {what: (v, met) for what, _, v, met in targets(runs)}
    assert got["kvpack mean TTFT, rounds >= 2, x vLLM prefix caching"] == (pytest.approx(0.4), True)
    v, met = got["kvpack mean TTFT, rounds >= 2, x vLLM PC + LMCache MP"]
    assert math.isnan(v) and not met
    assert got["kvpack restarted (disk) mean TTFT x no cache (all rounds)"] == (pytest.approx(0.25), True)
    text = report(runs)
    assert "| vLLM PC + LMCache MP | skipped: cannot run |" in text
    assert "| vLLM PC + kvpack | 2 | 1 | 0.400 |" in text and "disk 12" in text and "3 of 3" in text


def test_report_shows_kvpack_loaded_tokens_beside_vllms_external_count_and_says_what_each_counts() -> None:
    kv = SetupRun("vLLM PC + kvpack", [_r(1, 1.0), _r(2, 0.5)])
    kv.tiers = {"prompt tokens": 300, "external": 100, "kvpack loaded tokens": 96, "kvpack memory (tokens)": 128}
    text = report([_run("no cache", 2.0, 2.0), kv])
    header = next(line for line in text.splitlines() if "kvpack loaded tokens" in line and line.startswith("|"))
    row = next(line for line in text.splitlines() if line.startswith("| vLLM PC + kvpack | 0.500"))
    cells = dict(zip(header.split("|"), row.split("|")))
    assert cells[" external (vLLM's count) "] == " 100 "
    assert cells[" kvpack loaded tokens "] == " 96 "
    assert cells[" kvpack objects read by tier (block-tokens) "] == " memory 128 "
    assert "not comparable" in text
    plain = next(line for line in text.splitlines() if line.startswith("| no cache | 2.000"))
    assert dict(zip(header.split("|"), plain.split("|")))[" kvpack loaded tokens "] == " - "


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "ttft.png"
    plot(out, [_run("no cache", 2.0, 2.0), _run("vLLM PC + kvpack", 2.0, 0.4), SetupRun("x", skipped="y")], "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_every_server_gets_the_dtype_lmcaches_too_and_float32_is_the_default(tmp_path: Path) -> None:
    from kvpack.tools.bench.chat_bench import Bench, _parse

    assert _parse([]).dtype == "float32"
    assert _parse(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        _parse(["--dtype", "float16"])
    plan = chat_plan(CHAT, 0)
    bench = Bench("m", plan, 2, 1 << 20, 512, tmp_path, tmp_path / "t.jinja", "m-draft", 2048, "bfloat16")
    for port in (0, 5555):
        extra, env = bench.server_args(port)
        assert extra[extra.index("--dtype") + 1] == "bfloat16"
        assert ("--kv-transfer-config" in extra) == bool(port) and bool(env) == bool(port)
    assert "--speculative-config" in bench.server_args()[0]
