#!/usr/bin/env bash
# One-shot GPU check of kvpack's copy path, for a lent CUDA machine (H200: Python 3.12,
# CUDA torch, nvcc, pytest, no vLLM, no network). Needs nothing installed but torch
# (and the core's small deps): kvpack is mapped from the checkout.
#   1. tests/ops/gpu_check.py: builds the CUDA extension, checks the kernels against
#      hand-written expectations for every layout, copy benchmark;
#   2. tests/ops/gpu_staging_check.py: the adapters' staging path (kvpack.staging:
#      pinned rows, side streams, events) with the compute stream busy, byte offsets
#      past 2^31, event-timed bandwidth over >= 1 GiB vs plain copies;
#   3. pytest tests/ops (includes the CUDA backend).
# The last line is the summary: GPU_CHECK PASS|FAIL <the staging check's figures>.
#
#   scripts/gpu_check.sh            # log to $OUT/gpu_check.log when $OUT is set
#   scripts/gpu_check.sh --dry-run  # no GPU: the staging check on the CPU (tests run this)
#   PYTHON=/path/python scripts/gpu_check.sh
#
# Budget: under 10 min (extension build ~1 min cold, 180 + 240 + 150 s of step timeouts).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-$root/.kvpack-work/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
# Build the extension in scratch, not in a shared home cache (a dry run uses the usual cache).
[ "$dry" -eq 1 ] || export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/kvpack-gpu-check-cache}"
export MAX_JOBS="${MAX_JOBS:-16}"

{
  status=0
  echo "== kvpack gpu_check $(date -u +%FT%TZ) in $root$([ "$dry" -eq 1 ] && echo ' (dry run, CPU)')"
  if [ "$dry" -eq 0 ]; then
    nvidia-smi -L 2>&1 || echo "nvidia-smi unavailable"
    command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc not on PATH"
  fi
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'

  if [ "$dry" -eq 0 ]; then
    echo "== kernels + benchmark (tests/ops/gpu_check.py)"
    timeout 180 "$py" "$root/tests/ops/gpu_check.py" --markdown "$out/RESULTS_copy_gpu.md"
    rc=$?
    echo "gpu_check.py exit status: $rc"
    [ "$rc" -eq 0 ] || status=1
  fi

  echo "== staging path (tests/ops/gpu_staging_check.py)"
  timeout 240 "$py" "$root/tests/ops/gpu_staging_check.py" $([ "$dry" -eq 1 ] && echo --cpu) | tee "$out/staging.txt"
  rc=${PIPESTATUS[0]}
  echo "gpu_staging_check.py exit status: $rc"
  [ "$rc" -eq 0 ] || status=1
  figures="$(grep '^GPU_STAGING ' "$out/staging.txt" | tail -n 1 | cut -d' ' -f3-)"

  if [ "$dry" -eq 0 ] && "$py" -c 'import pytest' 2>/dev/null; then
    echo "== pytest tests/ops (includes the CUDA backend)"
    (cd "$root" && timeout 150 "$py" -m pytest tests/ops -q -p no:cacheprovider --rootdir "$root" -o addopts="" -rf)
    rc=$?
    echo "pytest exit status: $rc"
    [ "$rc" -eq 0 ] || status=1
  fi
  echo "GPU_CHECK $([ "$status" -eq 0 ] && echo PASS || echo FAIL) ${figures:-no staging figures}"
  exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
