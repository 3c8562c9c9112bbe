#!/usr/bin/env bash
# One-shot GPU check of kvpack.ops (issue 6), for a lent CUDA machine (H200: CUDA
# torch, nvcc, no network). Builds the CUDA extension, checks gather/scatter
# against the hand-written expectation for every layout, prints bandwidth vs
# pinned H2D/D2H and d2d copies, then runs tests/ops under pytest if available.
# Needs nothing installed but torch: kvpack is mapped from the checkout.
#
#   scripts/gpu_check.sh            # log to $OUT/gpu_check.log when $OUT is set
#   PYTHON=/path/python scripts/gpu_check.sh
#
# Budget: about 1-2 min (extension build ~1 min cold); every step has a timeout.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-$root/.kvpack-work/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
# Build the extension in $out-adjacent scratch, not in a shared home cache.
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/kvpack-gpu-check-cache}"
export MAX_JOBS="${MAX_JOBS:-16}"

status=0
{
  echo "== kvpack gpu_check $(date -u +%FT%TZ) in $root"
  nvidia-smi -L 2>&1 || echo "nvidia-smi unavailable"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc not on PATH"
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'

  echo "== correctness + benchmark (tests/ops/gpu_check.py)"
  timeout 180 "$py" "$root/tests/ops/gpu_check.py" --markdown "$out/RESULTS_copy_gpu.md"
  rc=$?
  echo "gpu_check.py exit status: $rc"
  [ "$rc" -eq 0 ] || status=1

  if "$py" -c 'import pytest' 2>/dev/null; then
    echo "== pytest tests/ops (includes the CUDA backend)"
    (cd "$root" && timeout 110 "$py" -m pytest tests/ops -q -p no:cacheprovider --rootdir "$root" -o addopts="" -rf)
    rc=$?
    echo "pytest exit status: $rc"
    [ "$rc" -eq 0 ] || status=1
  else
    echo "== pytest not installed: skipped (gpu_check.py covered the GPU paths)"
  fi
  echo "== done: $([ "$status" -eq 0 ] && echo PASS || echo FAIL)"
  exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
