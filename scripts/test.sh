#!/usr/bin/env bash
# The README's test command (`make test`). On a fresh machine it installs what
# the tests need (apt libibverbs1, two venvs from requirements/pins.txt), then
# runs every suite with the real parts: vLLM CPU, Mooncake, SGLang classes.
#
#   scripts/test.sh            # everything CI runs
#   scripts/test.sh -k tail    # extra args go to both pytest runs
#
# Suites in the vLLM venv: tests/common tests/ops tests/vllm tests/mooncake tests/soak (short form)
# Suites in the SGLang venv: tests/sglang
# On a machine with two or more cores the suites run in two lanes at once (most
# engine tests in one; the core, ops, Mooncake and soak suites, a few engine test
# files and the SGLang suite in the other, whose output is printed when it ends): the suite spends about half its
# time in single-threaded start-ups, so the second core would otherwise idle.
# Prints one combined 'N passed, N failed, N skipped' line at the end.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 MC_TCP_BIND_ADDRESS=127.0.0.1
export TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1

vllm_venv="$(scripts/venv.sh vllm)" || { echo "could not build the vLLM venv" >&2; exit 1; }
sglang_venv="$(scripts/venv.sh sglang)" || { echo "could not build the SGLang venv" >&2; exit 1; }

# the SGLang suite's cross-engine test runs a vLLM engine with this venv's python
export KVPACK_VLLM_PYTHON="$vllm_venv/bin/python"

reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0

run_suite() {  # name venv dirs...
  local name="$1" venv="$2"; shift 2
  local dirs=()
  for d in "$@"; do [[ "$d" == -* || -e "$d" ]] && dirs+=("$d"); done  # paths that exist, and options
  [ ${#dirs[@]} -gt 0 ] || return 0
  echo "=== $name: ${dirs[*]} ($venv)"
  local began=$SECONDS
  # --durations: the slowest tests of each suite, so a slower CI run says where its time went
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra --durations=15 --junitxml="$reports/$name.xml" \
    "${dirs[@]}" "${PYTEST_ARGS[@]}"
  local rc=$?
  echo "=== $name: $((SECONDS - began)) s"
  # 5: nothing collected, which a filter (-k EXPR) may leave of a suite
  [ $rc -eq 0 ] || { [ $rc -eq 5 ] && [ ${#PYTEST_ARGS[@]} -gt 0 ]; } || status=1
}

PYTEST_ARGS=("$@")
# Engine test files that run in the second lane (after the core suites, before SGLang's) to
# balance the two: each starts its own engines, so it moves whole. The rest of tests/vllm
# stays in the first lane (the commit that moved one gives the per-file times).
moved=(tests/vllm/test_kv_events.py)
# And the other way: a file of the other suites that runs in the first lane, for the same reason.
to_first=(tests/ops/test_gpu_check_imports.py)
lane_engines() {
  local keep=() f
  for f in tests/vllm/test_*.py; do [[ " ${moved[*]} " == *" $f "* ]] || keep+=("$f"); done
  run_suite vllm-engines "$vllm_venv" "${keep[@]}" "${to_first[@]}"
}
lane_rest() {
  run_suite vllm-venv "$vllm_venv" tests/common tests/ops tests/mooncake tests/soak "${to_first[@]/#/--ignore=}"
  run_suite vllm-engines-2 "$vllm_venv" "${moved[@]}"
  run_suite sglang-venv "$sglang_venv" tests/sglang
  return $status
}
began=$SECONDS
if [ "$(nproc)" -ge 2 ]; then
  lane_log="$reports/lane.log"
  echo "=== two lanes: tests/vllm here; the other suites in the background (their output follows when they end)"
  lane_rest >"$lane_log" 2>&1 &
  lane_pid=$!
  lane_engines
  wait "$lane_pid" || status=1
  cat "$lane_log"
else
  lane_engines
  lane_rest || status=1
fi
echo "=== all suites: $((SECONDS - began)) s"

python3 - "$reports" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
tests = failures = errors = skipped = 0
for f in pathlib.Path(sys.argv[1]).glob("*.xml"):
    for suite in ET.parse(f).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0)); failures += int(suite.get("failures", 0))
        errors += int(suite.get("errors", 0)); skipped += int(suite.get("skipped", 0))
passed = tests - failures - errors - skipped
print(f"kvpack: {passed} passed, {failures + errors} failed, {skipped} skipped")
sys.exit(0 if tests and not (failures or errors) else 1)
PY
[ $? -eq 0 ] || status=1
exit $status
