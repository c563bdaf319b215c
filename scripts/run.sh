#!/usr/bin/env bash
# Set up (see scripts/setup.sh), then generate a reply from the default model on this machine's devices.
#   scripts/run.sh ["PROMPT"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jitllm run -p "${1:-Write a haiku about compilers.}" --max-tokens 64
