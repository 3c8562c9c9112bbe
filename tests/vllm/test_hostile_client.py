"""A hostile client against the real vLLM OpenAI server: kvpack holds nothing beyond a request.

`kvpack bench hostile` at a small size (`hostile_bench.run`): vLLM's OpenAI server in its
default multi-process mode, kvpack on a disk store, hundreds of requests whose kvpack
fields (bogus handoffs, forged tenants and signatures, salts, deep values) are distinct
1 MiB strings, the engine-core process's RSS read by PID from the server's process tree.

Asserted: every request is answered and the server stays up; the default tenant's hit
survives with the same answer; the least-grown hostile phase grows the engine core by far
less than one field per request (kvpack before d33a67b kept every distinct refused handoff's
message whole: at least 3 in 10 of these requests' fields, in every phase; the engine's own
high-water marks for requests this size, as the padded benign phase shows, rise in steps);
kvpack logs at most one line per refusal reason, each short, and the log grows by
about what the same number of benign requests adds; every refusal is counted.
"""

from __future__ import annotations

import pytest

from kvpack.tools.bench.hostile_bench import Result, report, run
from kvpack.tools.bench.hostile_requests import Kind

pytest.importorskip("vllm")

REQUESTS = 100
"""Requests per phase."""
ROUNDS = 3
FIELD = 1 << 20
"""Characters of each large field."""
HANDOFF_KINDS = {k.value for k in Kind if k.value.startswith("handoff_")}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Result:
    work = tmp_path_factory.mktemp("hostile")
    out = run(work, REQUESTS, ROUNDS, FIELD, concurrency=4)
    print(report(out))
    return out


def test_every_request_is_answered_and_the_default_tenant_keeps_its_hit(result: Result) -> None:
    for phase in result.phases:
        assert phase.answered == phase.requests, (phase.name, phase.statuses)
    assert result.alive
    assert result.hit_tokens_before > 0 and result.hit_tokens_after >= result.hit_tokens_before
    assert result.same_answer


def test_refused_requests_do_not_grow_the_engine(result: Result) -> None:
    """What kvpack kept of each request would grow every hostile phase by about as much (each
    phase holds every kind); the engine's own high-water marks rise in steps instead, by as much
    for requests whose field kvpack never reads (the padded phase) and not in every phase (on a
    loaded machine: +6 / +28 / +6 MiB). So the least-grown hostile phase stays far below one
    field per request."""
    least = min(result.hostile(), key=lambda phase: phase.growth_kib)
    assert least.growth_kib * 1024 / least.requests < FIELD / 8, report(result)


def test_the_log_gets_a_line_per_reason_at_most(result: Result) -> None:
    hostile = result.hostile()
    lines = sum(p.kvpack_log_lines for p in hostile)
    assert lines <= len(Kind), report(result)
    assert max(p.longest_kvpack_line for p in hostile) < 2000, report(result)
    benign = result.phase("noise").log_bytes
    for phase in hostile:
        assert phase.log_bytes < 2 * benign + 8192, report(result)


def test_every_refusal_is_counted(result: Result) -> None:
    reached = sum(n for key, n in result.answers.items() if key.split()[0] in HANDOFF_KINDS and key.endswith(" 200"))
    refused = sum(v for k, v in result.refusals.items() if k.startswith("handoff_refused:"))
    assert refused == reached > 0, (result.answers, result.refusals)
    forged = sum(
        n
        for key, n in result.answers.items()
        if key in (f"{Kind.FORGED_TENANT.value} 200", f"{Kind.FORGED_SIGNATURE.value} 200")
    )
    assert result.refusals["kvpack_untrusted_tenants"] >= forged > 0, (result.answers, result.refusals)
