#!/usr/bin/env bash
# Run:  examples/vllm/prefill_decode.sh MODEL_DIR [STORE_DIR]
#
# Two instances sharing one disk store: a prefill instance (kv_producer: only
# stores) on port 8100 and a decode instance (kv_consumer: only loads) on 8200.
# Send the prompt to the prefill instance with max_tokens=1, then the same
# prompt to the decode instance: it reuses n - 1 prompt tokens from the store.
#   P='{"model":"MODEL_DIR","prompt":"w1 w2 ... w700","max_tokens":1}'
#   curl -s 127.0.0.1:8100/v1/completions -H 'Content-Type: application/json' -d "$P"
#   curl -s 127.0.0.1:8200/v1/completions -H 'Content-Type: application/json' -d "${P/\"max_tokens\":1/\"max_tokens\":64}"
set -euo pipefail
MODEL=${1:?model directory}
STORE=${2:-/tmp/kvpack-pd-store}
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
serve() {  # role port
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$2" \
    --enable-prompt-tokens-details \
    --kv-transfer-config "{\"kv_connector\":\"KVPackConnector\",\"kv_role\":\"$1\",
      \"kv_connector_extra_config\":{\"memory\":{\"enabled\":false},\"disk\":{\"path\":\"$STORE\"}}}" &
}
serve kv_producer 8100
serve kv_consumer 8200
trap 'kill $(jobs -p) 2>/dev/null' EXIT
wait
