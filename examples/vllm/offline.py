# Run twice:  HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 python examples/vllm/offline.py [MODEL_DIR] [STORE_DIR]
#
# Offline vllm.LLM with kvpack, as a user's script: generate, print, end. The
# first run computes the prompt and leaves its KV on disk (kvpack saves every
# block in the step that computes it and flushes before the process exits);
# the second run reuses it (whole blocks + the computed tail: n - 1 of n prompt
# tokens) and prints the same text. Without MODEL_DIR it builds the tiny test
# model under /tmp.
from __future__ import annotations

import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from kvpack.tools.tinymodel import build_tiny_llama

        model = str(build_tiny_llama("/tmp/kvpack-tiny-llama"))
    store = sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvpack-example-store"
    kv = {
        "kv_connector": "KVPackConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"disk": {"path": store}, "memory": {"capacity": "1GiB"}},
    }
    prompt = {"prompt_token_ids": [(7 * i) % 1900 + 3 for i in range(700)]}
    llm = LLM(model=model, kv_transfer_config=kv, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    print(f"{out.num_cached_tokens} of 700 prompt tokens reused from {store}; text: {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
