#!/usr/bin/env bash
# Run:  examples/vllm/server.sh MODEL_DIR [STORE_DIR] [PORT]
#
# The OpenAI-compatible server with kvpack (found by name through the
# vllm.general_plugins entry point). Memory tier 4 GiB + a disk store; repeat a
# request and "cached_tokens" in its usage shows the reuse:
#   curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model":"MODEL_DIR","prompt":"w1 w2 w3 ...","max_tokens":16}'
set -euo pipefail
MODEL=${1:?model directory}
STORE=${2:-$HOME/.cache/kvpack/store}
PORT=${3:-8000}
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --enable-prompt-tokens-details --no-enable-prefix-caching --shutdown-timeout 10 \
  --kv-transfer-config "{\"kv_connector\":\"KVPackConnector\",\"kv_role\":\"kv_both\",
    \"kv_connector_extra_config\":{\"memory\":{\"capacity\":\"4GiB\"},\"disk\":{\"path\":\"$STORE\"}}}"
# --shutdown-timeout 10: on Ctrl-C vLLM gives its engine that long before it kills it, so
# kvpack writes what is still queued (vLLM's default, 0, kills it at once).
# --no-enable-prefix-caching only makes the demo visible (every reuse is kvpack's);
# in production keep vLLM's prefix cache on: kvpack serves what it no longer holds.
