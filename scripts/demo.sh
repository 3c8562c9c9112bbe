#!/usr/bin/env bash
# The README's main command (`make demo`): a real vLLM engine with kvpack, run
# twice on a shared-prefix workload; prints hits, tokens reused, TTFT saved,
# and checks the outputs match a run without kvpack. `make demo ARGS=--large`
# uses a bigger bf16 model (bigger savings, a few minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 TOKENIZERS_PARALLELISM=false
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-ERROR}"  # the demo's table, not vLLM's start-up log
venv="$(scripts/venv.sh vllm)"
exec "$venv/bin/python" -m kvpack.cli demo "$@"
