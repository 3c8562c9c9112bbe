#!/usr/bin/env bash
# Run:  examples/vllm/prefill_decode.sh MODEL_DIR [STORE_DIR]
#
# Prefill/decode disaggregation through one shared store (a disk folder here;
# point both at a Mooncake master for several machines): a prefill instance
# (kv_producer) on port 8100, a decode instance (kv_consumer) on 8200, and
# `kvpack proxy` on 8000 in front. Send requests to the proxy:
#   curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model":"MODEL_DIR","prompt":"w1 w2 ... w700","max_tokens":64}'
# The proxy sends the prompt to the prefill instance (max_tokens 1,
# kv_transfer_params {"do_remote_decode": true}), then the request with the
# prefill instance's handoff (layout, tenant, token count, tail) to the decode
# instance, which loads n - 1 prompt tokens from the store, waiting at most
# handoff_wait_ms for objects still landing, and generates.
set -euo pipefail
MODEL=${1:?model directory}
STORE=${2:-/tmp/kvpack-pd-store}
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
serve() {  # role port
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$2" \
    --enable-prompt-tokens-details --shutdown-timeout 10 \
    --kv-transfer-config "{\"kv_connector\":\"KVPackConnector\",\"kv_role\":\"$1\",
      \"kv_connector_extra_config\":{\"disk\":{\"path\":\"$STORE\"},\"handoff_wait_ms\":2000}}" &
}
serve kv_producer 8100
serve kv_consumer 8200
trap 'kill $(jobs -p) 2>/dev/null' EXIT
python -m kvpack.cli proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 &
wait
