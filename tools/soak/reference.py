"""The no-cache reference: greedy outputs of every soak prompt from vLLM without kvpack.

Run as a child process (``python -m kvpack.tools.soak.reference IN.json OUT.json``)
so the soak's own process never imports vLLM and a crash here cannot take the
harness down. The engine is the same vLLM build, model and settings as the
soak's server (eager, prefix caching off, same max_model_len), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and without a KV connector: a run with
no cache at all, which is what a cached run must reproduce token by token.

Why offline and not a second server: it needs one engine start-up, shorter
than a server's, runs while the soak's server boots,
and every prompt is known in advance. The same engine code and dtype compute
both, but not the same batches (all prompts in one call here, whatever
arrives together on the server), so for every position the reference also
records the margin between the best and second-best log-probability: a
divergence where that margin is below the tolerance (batch-order float noise
can flip it) is reported as a near-tie, not hidden and not failed. See
`kvpack.tools.soak` for the measurements behind running both in fp32.

Input: ``{"model": PATH, "max_tokens": N, "max_model_len": L, "prompts":
[[ids...], ...], "followups": [[doc+q ids, f_ids], ...]}``. Output:
``{"outputs": {key: {"tokens": [...], "margins": [...]}}}`` with ``key =
",".join(prompt ids)``; follow-up prompts are ``doc+q + reply + f``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vllm.config.model import ModelDType


def key_of(prompt: Sequence[int]) -> str:
    return ",".join(str(int(t)) for t in prompt)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        kv_cache_memory_bytes=256 << 20,
        max_model_len=int(spec["max_model_len"]),
        dtype=cast("ModelDType", str(spec.get("dtype", "auto"))),  # vLLM checks the value
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
    )
    sp = SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=0, ignore_eos=True, logprobs=2)
    outputs: dict[str, Any] = {}

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        replies = []
        for p, out in zip(prompts, outs):
            comp = out.outputs[0]
            margins = []
            for lp in comp.logprobs or []:
                vals = sorted((v.logprob for v in lp.values()), reverse=True)
                margins.append(float(vals[0] - vals[1]) if len(vals) > 1 else float("inf"))
            outputs[key_of(p)] = {"tokens": list(comp.token_ids), "margins": margins}
            replies.append(list(comp.token_ids))
        return replies

    prompts = [list(map(int, p)) for p in spec["prompts"]]
    generate(prompts)
    follow = []
    for first, f in spec.get("followups", []):
        reply = outputs[key_of(first)]["tokens"]
        follow.append(list(first) + reply + list(f))
    if follow:
        generate(follow)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {"outputs": outputs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvpack.tools.soak.reference IN.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    result = run(spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
