"""A system prompt pinned through a trusted front end survives pressure that evicts everything else.

A real vLLM engine (fp32, block 32, in-process) over a 1 MiB disk store, without a memory tier (every
hit below comes from the disk folder) and with a 1 MiB one in the worker (evicting by the same pins). A proxy-style front end names tenant ``acme`` (trusted) and asks
``kvpack_pin`` on acme's 4-block system prompt; a client that is not trusted asks the same for its
own prompt. Then 2 MiB of other prompts go through the 1 MiB folder: the untrusted prompt is
evicted (a miss), acme's system prompt is still a hit with the greedy tokens and logprobs of its
cold run, and `kvpack pin` lists it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import Run, close_llm, kv_config, make_llm, metric, prompt, same_output

from kvpack.cli import main

pytestmark = pytest.mark.vllm

BS = 32
SYSTEM = prompt(701, 4 * BS)
"""acme's system prompt: 4 whole blocks of 64 KiB each (2 layers x K, V x 2 heads x 64 x fp32 x 32)."""
OTHER = prompt(702, 4 * BS)
"""The untrusted client's prompt, as long."""


def ask(llm: Any, ids: list[int], **params: Any) -> Run:
    """One greedy request whose ``kv_transfer_params`` are `params` (what a front end sets)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params else None
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=0, extra_args=extra)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    lps = tuple(float(lp[t].logprob) for lp, t in zip(comp.logprobs, comp.token_ids))
    return Run(tuple(comp.token_ids), lps, int(out.num_cached_tokens or 0))


def pins(store: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["pin", "--json", "--disk", str(store)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory+disk"])
def test_pinned_system_prompt_survives_pressure_that_evicts_everything_else(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], memory: bool
) -> None:
    store = tmp_path / "kv"
    extra = {
        "memory": {"capacity": "1MiB"} if memory else {"enabled": False},
        "disk": {"path": str(store), "capacity": "1MiB"},
        "trusted_tenants": ["acme"],
        "eviction": {"pinned_bytes_per_tenant": "512KiB"},
    }
    llm = make_llm(tiny_llama, kv_config(extra), block_size=BS)
    try:
        cold = ask(llm, SYSTEM + prompt(703, 5), kvpack_tenant="acme")
        assert cold.cached == 0
        # every request of the system prompt asks for the pin; each pins the blocks it finds
        # stored (under load the cold run's saves land over several of these requests: the first
        # pin may hold one block, a later one all four). 20 requests' tails take 200 KiB of 1 MiB.
        for i in range(20):
            ask(llm, SYSTEM + prompt(710 + i, 5), kvpack_tenant="acme", kvpack_pin=True)
            if pins(store, capsys)["tenants"].get("acme", {}).get("groups") == 4:
                break
        listed = pins(store, capsys)
        assert listed["tenants"]["acme"]["groups"] == 4 and 4 * 64 << 10 <= listed["tenants"]["acme"]["bytes"]
        before = metric("untrusted_pins", role="SCHEDULER")  # this process's live connectors, an earlier test's too
        for _ in range(2):
            ask(llm, OTHER + prompt(704, 5), kvpack_tenant="mallory", kvpack_pin=True)
        assert metric("untrusted_pins", role="SCHEDULER") - before == 2
        assert set(pins(store, capsys)["tenants"]) == {"acme"}  # the untrusted pin was ignored
        for i in range(8):  # 8 x 5 blocks of 64 KiB through a 1 MiB folder
            ask(llm, prompt(800 + i, 5 * BS + 3), **({"kvpack_tenant": "acme"} if i % 2 else {}))
        assert ask(llm, OTHER + prompt(705, 5)).cached == 0  # evicted with everything else
        warm = ask(llm, SYSTEM + prompt(703, 5), kvpack_tenant="acme")
        assert warm.cached >= 4 * BS
        assert same_output(warm, cold)
    finally:
        close_llm(llm)
