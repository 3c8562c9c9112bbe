"""One vLLM engine in a process of its own, as a user's script runs it (`vllm_helpers.engine_process`).

    python engine_run.py SPEC_JSON      # prints one line: RESULT {name: {tokens, logprobs, cached}}

SPEC: {"model", "extra" (kvpack config, or null: no connector), "prompts": {name: ids},
"preamble" (code run first, e.g. to force an attention ISA), "max_tokens", "engine"
(more `LLM` arguments), "salts" (optional: {name: cache_salt} for some prompts), "steps"
(optional: what to do in order, each a prompt name or {"exec": code run with ``llm`` in scope,
e.g. a weight update}; a name generated twice is reported as ``name``, ``name#2``, ...)}.
Without steps every prompt is generated once. The script then simply ends: no drain, no flush,
no shutdown.
Also run from the SGLang venv's tests with the vLLM venv's python (cross-engine reuse).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))


def main(raw: str) -> None:
    spec = json.loads(raw)
    exec(spec.get("preamble", ""))  # noqa: S102 - test code given by the test itself
    from vllm_helpers import kv_config, make_llm, run

    llm = make_llm(spec["model"], kv_config(spec["extra"]) if spec["extra"] is not None else None, **spec["engine"])
    out: dict[str, dict[str, object]] = {}
    for step in spec.get("steps") or list(spec["prompts"]):
        if isinstance(step, dict):
            exec(step["exec"], {"llm": llm})  # noqa: S102 - test code given by the test itself
            continue
        salt = spec.get("salts", {}).get(step)
        r = run(llm, spec["prompts"][step], max_tokens=spec["max_tokens"], **({"cache_salt": salt} if salt else {}))
        seen = sum(1 for k in out if k == step or k.startswith(step + "#"))
        out[step if not seen else f"{step}#{seen + 1}"] = {
            "tokens": list(r.tokens),
            "logprobs": list(r.logprobs),
            "cached": r.cached,
        }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
