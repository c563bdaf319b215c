#!/usr/bin/env bash
# Set up with the test dependencies (see scripts/setup.sh), then run the test suite.
#   scripts/test.sh [PYTEST ARGS...]     e.g. scripts/test.sh tests/test_cli.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
status=0
# the backends set-up installed must run here: their tests fail rather than skip when a device is missing
export JITLLM_REQUIRE_BACKENDS="${JITLLM_REQUIRE_BACKENDS-cpu,vulkan}"
python3 -m pytest -q "${@:-tests}" || status=$?
if [ "$status" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests" >&2
fi
exit "$status"
