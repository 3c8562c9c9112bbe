#!/usr/bin/env bash
# Every benchmark, each printing ratios measured in the same run.
# Results are recorded by hand in benchmarks/RESULTS.md with this command.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 MC_TCP_BIND_ADDRESS=127.0.0.1
vllm_venv="$(scripts/venv.sh vllm)"
sglang_venv="$(scripts/venv.sh sglang)"
for b in tiers copy mooncake vllm spec; do
  echo "=== kvpack bench $b"; "$vllm_venv/bin/python" -m kvpack.cli bench "$b"
done
echo "=== kvpack bench sglang"; "$sglang_venv/bin/python" -m kvpack.cli bench sglang
echo "=== kvpack bench sglang --busy-python"; "$sglang_venv/bin/python" -m kvpack.cli bench sglang --busy-python
echo "=== kvpack bench sglang --handoff"
"$sglang_venv/bin/python" -m kvpack.cli bench sglang --handoff --vllm-python "$vllm_venv/bin/python"
