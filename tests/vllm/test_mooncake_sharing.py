"""Two vLLM engines in separate processes share one Mooncake store (issue 4, test 6).

A real Mooncake master and segment holder on 127.0.0.1 (`mooncake_cluster`).
Each engine runs in its own child process with kvpack's memory and disk tiers
off, so the only place the first engine's KV can come from is Mooncake:
engine 1 serves a prompt (miss, stored), exits; engine 2 serves it again and
reuses n - 1 tokens with the same greedy tokens and log-probs. An unstored
prompt is the negative control (no hit).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from vllm_helpers import LOGPROB_TOL, prompt

from fixtures.warm_start import warm_starts

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

P = prompt(41, 301)
COLD = prompt(42, 301)

CHILD = r"""
import json, sys
from vllm_helpers import kv_config, make_llm, metrics, run
spec = json.loads(sys.argv[1])
llm = make_llm(spec["model"], kv_config(spec["extra"]))
out = {}
for name, ids in spec["prompts"].items():
    r = run(llm, ids)
    out[name] = {"tokens": list(r.tokens), "logprobs": list(r.logprobs), "cached": r.cached}
out["metrics"] = {k: v for k, v in metrics().items() if v}  # for the failure message
print("RESULT " + json.dumps(out), flush=True)
# the script simply ends, as a user's does: kvpack writes what it accepted before exit
"""


def _engine(model: Path, extra: dict, prompts: dict[str, list[int]], log: Path) -> dict:
    """`CHILD` as a script in a process of its own (`warm_start`): its RESULT line."""
    spec = json.dumps({"model": str(model), "extra": extra, "prompts": prompts})
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    )
    script = log.with_suffix(".py")
    script.write_text(CHILD)
    proc = warm_starts().run_script(sys.executable, [str(script), spec], env, log, timeout_s=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, (
        f"engine failed (rc={proc.returncode}); see {log}:\n{proc.stderr[-3000:]}"
    )
    return json.loads(line[len("RESULT ") :])


def test_second_engine_hits_the_first_engines_mooncake_entries(
    mooncake_cluster, tiny_llama: Path, tmp_path: Path
) -> None:
    mc = {
        "enabled": True,
        "master_server_address": mooncake_cluster.master_address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        "local_buffer_size": "16MiB",
        "staging_size": "64MiB",
        "timeout_ms": 3000,
    }
    extra = {"memory": {"enabled": False}, "disk": {"enabled": False}, "mooncake": mc}
    first = _engine(tiny_llama, extra, {"P": P}, tmp_path / "engine1.log")
    assert first["P"]["cached"] == 0
    second = _engine(tiny_llama, extra, {"P": P, "COLD": COLD}, tmp_path / "engine2.log")
    seen = f"engine 2: {second}\nengine 1: {first}"
    assert second["P"]["cached"] == len(P) - 1, seen  # 2 blocks + 44 of the 45-token tail, from Mooncake
    assert second["P"]["tokens"] == first["P"]["tokens"], seen
    assert all(abs(a - b) <= LOGPROB_TOL for a, b in zip(second["P"]["logprobs"], first["P"]["logprobs"])), seen
    assert second["COLD"]["cached"] == 0  # negative control
