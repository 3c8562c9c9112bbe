#!/usr/bin/env bash
# One-shot GPU check of kvpack's copy paths, for a lent CUDA machine (H200 image: Python 3.12,
# CUDA torch, nvcc, pytest, xxhash, prometheus-client, no vLLM or SGLang, no network, no
# installed kvpack). It runs from a plain checkout: kvpack is mapped from the checkout's
# folders when not installed (tests/kvpack_checkout.py). Through the device tool, one call:
#
#   run  command="bash scripts/gpu_check.sh --quick"  timeout_s=300
#        (add carry=[".kvpack-work/gpu-wheels"] after `scripts/gpu_check.sh --fetch-wheels`
#         here, so that a dependency missing from the image is unpacked from those wheels)
#
# Everything goes to $OUT (the tool's folder that comes back; .kvpack-work/gpu_check here):
# gpu_check.log (the whole output), summary.txt (the STEP lines and the last line: the
# figures for benchmarks/RESULTS.md), RESULTS_copy_gpu.md (kvpack bench copy's table).
#
# Steps, each printing `STEP NAME PASS|FAIL|MISSED|DRY|SKIP reason`:
#   env         python, torch, CUDA, nvcc, compiler, ninja, kvpack's deps (tests/ops/gpu_env_check.py)
#   kernels     builds the extension once (its cache is shared by the later steps), then every
#               layout x dtype against hand-written expectations (tests/ops/gpu_check.py)
#   vllm-views  vLLM 0.32+'s block views in its six stride orders (torch.as_strided, as vLLM
#               builds them; no vLLM needed), full attention and MLA, kernel-block splits: the
#               same canonical objects from every order, GPU kernel and torch path, and back
#               (tests/ops/gpu_views_check.py, same process; SKIP only in a dry run of a tree
#               without CanonicalGeometry.from_block_views)
#   copy-bench  kvpack bench copy on the GPU, into RESULTS_copy_gpu.md (same process)
#   staging     the adapters' staging path (pinned rows, side streams, events, offsets past
#               2^31), and bandwidth: event-timed ratios to plain copies, targets pinned
#               D2H/H2D >= 0.8x, D2D >= 0.7x (tests/ops/gpu_staging_check.py)
#   pytest      pytest tests/ops (the CUDA backend's tests); the check's own CPU self-tests
#               (test_gpu_staging_check, test_gpu_check_imports) are left out
# The last line: GPU_CHECK PASS|FAIL steps=N/N <figures>. PASS only when every step ran and
# passed and the bandwidth was measured: a missed target is said on the line (MISSED), and
# fails the check with --strict-targets. A step that needs a GPU and finds none says FAIL.
#
#   scripts/gpu_check.sh --quick     # < 5 min on an H200: bf16+fp8 kernels, 0.25 GiB timed
#                                    # calls, 3 repeats, the bench's GPU section, no nvcc re-compiles
#   scripts/gpu_check.sh             # everything (~10 min): all dtypes, 1 GiB calls, the CPU bench
#   scripts/gpu_check.sh --dry-run   # no GPU: imports, layouts on the CPU, the staging check on the
#                                    # CPU, pytest --collect-only tests/ops (the tests run this)
#   scripts/gpu_check.sh --fetch-wheels  # here, with a registry: cp312 wheels of numpy, xxhash,
#                                    # prometheus-client, ninja into .kvpack-work/gpu-wheels
#   PYTHON="/path/python -S" scripts/gpu_check.sh ...   # PYTHON may carry interpreter flags
# Options: --strict-targets, --budget SECONDS (the whole run's deadline: default 280 quick,
# 570 full; each step's timeout is cut to what is left, so the last line always prints).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r -a py <<<"${PYTHON:-python3}"
out="${OUT:-$root/.kvpack-work/gpu_check}"
wheels="${KVPACK_GPU_WHEELS:-$root/.kvpack-work/gpu-wheels}"
dry=0 quick=0 strict=0 fetch=0 budget=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --quick) quick=1 ;;
    --strict-targets) strict=1 ;;
    --fetch-wheels) fetch=1 ;;
    --budget) budget="${2:?--budget needs seconds}"; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--quick] [--dry-run] [--strict-targets] [--budget S] [--fetch-wheels]" >&2
       exit 2 ;;
  esac
  shift
done

if [ "$fetch" -eq 1 ]; then
  mkdir -p "$wheels"
  exec "${py[@]}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" numpy xxhash prometheus-client ninja
fi

mkdir -p "$out"
log="$out/gpu_check.log"
trap 'rm -rf "${TMPDIR:-/tmp}/kvpack-gpu-check-site-$$"' EXIT
[ -n "$budget" ] || budget=$([ "$quick" -eq 1 ] && echo 280 || echo 570)
deadline=$((SECONDS + budget))
# Build the extension in scratch, not in a shared home cache (a dry run uses the usual cache).
[ "$dry" -eq 1 ] || export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/kvpack-gpu-check-cache}"
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONDONTWRITEBYTECODE=1

# step NAME CAP -- COMMAND...: runs COMMAND with a timeout of min(CAP, the time left); a
# command that ends without printing its STEP line gets one saying how it ended.
step() {
  local name="$1" cap="$2"; shift 3
  local left=$((deadline - SECONDS - 5))
  echo "== $name"
  if [ "$left" -lt 10 ]; then
    echo "STEP $name FAIL not started: the --budget of ${budget}s is spent"
    return
  fi
  local t=$((cap < left ? cap : left)) began=$SECONDS
  local steplog="$out/.step-$name.txt"
  timeout "$t" "$@" 2>&1 | tee "$steplog"
  local rc=${PIPESTATUS[0]}
  echo "($name: exit status $rc, $((SECONDS - began)) s)"
  if [ "$rc" -eq 124 ]; then
    echo "STEP $name FAIL timed out after ${t}s"
  elif ! grep -q "^STEP $name " "$steplog"; then
    echo "STEP $name FAIL exit status $rc before its verdict (see above)"
  elif [ "$rc" -ne 0 ] && ! grep -q "^STEP $name FAIL" "$steplog"; then
    echo "STEP $name FAIL exit status $rc"
  fi
  rm -f "$steplog"
}

# A module missing from the image is unpacked from a carried wheel (--fetch-wheels) into scratch.
provide_missing() {
  local mod dist whl site="${TMPDIR:-/tmp}/kvpack-gpu-check-site-$$"
  for pair in numpy:numpy xxhash:xxhash prometheus_client:prometheus_client; do
    mod="${pair%%:*}" dist="${pair#*:}"
    "${py[@]}" -c "import $mod" 2>/dev/null && continue
    whl="$(ls "$wheels"/"$dist"-*.whl 2>/dev/null | head -n 1)"
    [ -n "$whl" ] || { echo "$mod missing, no wheel in $wheels"; continue; }
    "${py[@]}" -m zipfile -e "$whl" "$site" && echo "$mod missing: unpacked $(basename "$whl")"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  done
  if ! command -v ninja >/dev/null; then
    whl="$(ls "$wheels"/ninja-*.whl 2>/dev/null | head -n 1)"
    [ -n "$whl" ] || { echo "ninja missing, no wheel in $wheels"; return; }
    "${py[@]}" -m zipfile -e "$whl" "$site/ninja-wheel"
    local bin
    bin="$(dirname "$(ls "$site"/ninja-wheel/ninja-*.data/scripts/ninja)")"
    chmod +x "$bin/ninja" && export PATH="$bin:$PATH" && echo "ninja missing: unpacked $(basename "$whl")"
  fi
}

run_steps() {
  echo "== kvpack gpu_check $(date -u +%FT%TZ) in $root$([ "$dry" -eq 1 ] && echo ' (dry run, CPU)')$(
    [ "$quick" -eq 1 ] && echo ' (quick)'), budget ${budget}s"
  if [ "$dry" -eq 0 ]; then
    nvidia-smi -L 2>&1 || echo "nvidia-smi unavailable"
    provide_missing
  fi
  local flag=() quick_flag=()
  [ "$dry" -eq 1 ] && flag=(--dry-run)
  [ "$quick" -eq 1 ] && quick_flag=(--quick)
  step env 60 -- "${py[@]}" "$root/tests/ops/gpu_env_check.py" "${flag[@]}"
  step kernels "$([ "$quick" -eq 1 ] && echo 200 || echo 330)" -- \
    "${py[@]}" "$root/tests/ops/gpu_check.py" --markdown "$out/RESULTS_copy_gpu.md" "${quick_flag[@]}" "${flag[@]}"
  if [ "$dry" -eq 1 ]; then
    step staging 240 -- "${py[@]}" "$root/tests/ops/gpu_staging_check.py" --cpu --repeats 2
  elif [ "$quick" -eq 1 ]; then
    step staging 120 -- "${py[@]}" "$root/tests/ops/gpu_staging_check.py" --gib 0.25 --repeats 3
  else
    step staging 240 -- "${py[@]}" "$root/tests/ops/gpu_staging_check.py" --gib 1.0 --repeats 5
  fi
  local args=(tests/ops -q -p no:cacheprovider --rootdir "$root" -o addopts="" -rfE
    --ignore=tests/ops/test_gpu_staging_check.py --ignore=tests/ops/test_gpu_check_imports.py)
  [ "$quick" -eq 1 ] && args+=(--deselect "tests/ops/test_build.py::test_cuda_kernel_compiles_with_nvcc")
  if [ "$dry" -eq 1 ]; then
    step pytest 120 -- bash -c 'cd "$1" && shift && "$@" && echo "STEP pytest DRY tests/ops collected"' \
      _ "$root" "${py[@]}" -m pytest --collect-only -qq "${args[@]}"
  elif ! "${py[@]}" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "== pytest"
    echo "STEP pytest FAIL no CUDA device visible: its CUDA tests would all skip"
  else
    step pytest 240 -- bash -c 'cd "$1" && shift && "$@" && echo "STEP pytest PASS tests/ops passed on the GPU"' \
      _ "$root" "${py[@]}" -m pytest "${args[@]}"
  fi
}

# The verdict over the STEP lines: every expected step present and PASS (or DRY in a dry
# run; a MISSED bandwidth unless --strict-targets).
verdict() {
  local steps=(env kernels vllm-views copy-bench staging bandwidth pytest) ok=0 bad=() line v
  for s in "${steps[@]}"; do
    line="$(grep -a "^STEP $s " "$log" | tail -n 1)"
    v="$(echo "$line" | cut -d' ' -f3)"
    case "$v" in
      PASS) ok=$((ok + 1)) ;;
      DRY | SKIP) if [ "$dry" -eq 1 ]; then ok=$((ok + 1)); else bad+=("$s:$v"); fi ;;
      MISSED) if [ "$strict" -eq 0 ]; then ok=$((ok + 1)); else bad+=("$s:missed"); fi ;;
      "") bad+=("$s:did-not-run") ;;
      *) bad+=("$s:$v") ;;
    esac
  done
  local figures=""  # the bandwidth step's figures, when it measured any
  line="$(grep -a "^STEP bandwidth " "$log" | tail -n 1)"
  case "$(echo "$line" | cut -d' ' -f3)" in PASS | MISSED | DRY) figures="$(echo "$line" | cut -d' ' -f4-)" ;; esac
  local what="steps=$ok/${#steps[@]}"
  [ "$dry" -eq 1 ] && what="$what dry-run (no GPU: imports, CPU staging, collection only)"
  if [ ${#bad[@]} -eq 0 ]; then
    echo "GPU_CHECK PASS $what ${figures:-} ($((SECONDS)) s)"
  else
    echo "GPU_CHECK FAIL $what failed: ${bad[*]}; ${figures:-no bandwidth figures} ($((SECONDS)) s)"
  fi
}

run_steps 2>&1 | tee "$log"
final="$(verdict)"
echo "$final" | tee -a "$log"
{ grep -a "^STEP " "$log"; echo "$final"; } >"$out/summary.txt"
case "$final" in "GPU_CHECK PASS"*) exit 0 ;; *) exit 1 ;; esac
