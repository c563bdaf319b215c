#!/usr/bin/env bash
# The CUDA backend's check on a machine with an NVIDIA GPU (such as the H200 device machine):
#   tests/device/run_cuda_check.sh
# prints the environment, runs the CUDA tests (and the new-op test through the registry), a short benchmark, and
# a summary. Logs go to $OUT when set (the device tool's output folder), else /tmp/jitllm_cuda_check.
# Takes about two minutes. Exit status: that of the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/jitllm_cuda_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/plugins/cuda:$PWD/plugins/cpu_llvm${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JITLLM_CACHE_DIR="${JITLLM_CACHE_DIR:-/tmp/jitllm_cache}"
py=python3

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
$py - <<'PY'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for d in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "pluggy", "llvmlite"):
    try:
        print(f"{d} {m.version(d)}")
    except m.PackageNotFoundError:
        print(f"{d} MISSING")
PY
# entry points let the registry find the plugins (offline: no dependencies, no build isolation)
$py -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu_llvm -e plugins/cuda >"$out/pip.log" 2>&1 \
  || echo "(editable install failed, see pip.log; the registry-based tests may skip)"

echo "== tests"
$py -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_new_op.py 2>&1 | tee "$out/cuda_tests.log"
status=${PIPESTATUS[0]}

echo "== benchmark"
timeout 300 $py tests/device/cuda_bench.py 2>&1 | tee "$out/cuda_bench.log"

echo "== summary"
echo "tests: $(tail -1 "$out/cuda_tests.log")"
grep -E "GB/s|per run" "$out/cuda_bench.log" || echo "benchmark: no result (see cuda_bench.log)"
exit "$status"
