#!/usr/bin/env bash
# The CUDA backend's check on a machine with an NVIDIA GPU (such as the H200 device machine):
#   tests/device/run_cuda_check.sh [kernels|model|all]      (default all)
# kernels: the CUDA tests (every IR case against the interpreter, programs, transfers) and the new-op test through
#          the registry, then tests/device/cuda_bench.py (copy and kernel bandwidth, launch cost).
# model:   SmolLM2 on cuda:0 against transformers, a cpu + cuda split and live moves (tests/test_device_model.py),
#          `jitllm bench` decode on cuda:0 for SmolLM2 and for the 1B-shaped Q4_K_M model (written here by
#          scripts/make_bench_model.py while the tests run) with the measured HBM bandwidth, a per-kernel profile,
#          and `jitllm bench migrate` (all layers cpu:0 -> cuda:0 -> cpu:0).
# The model phase needs the default model: installed, or named by JITLLM_DEFAULT_MODEL. Logs go to $OUT when set
# (the device tool's output folder), else /tmp/jitllm_cuda_check. Exit status: that of the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase="${1:-all}"
out="${OUT:-/tmp/jitllm_cuda_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/plugins/cuda:$PWD/plugins/cpu_llvm${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JITLLM_CACHE_DIR="${JITLLM_CACHE_DIR:-/tmp/jitllm_cache}" JITLLM_PLUGINS=cpu,cuda
py=python3
jitllm() { $py -c "import sys; from jitllm_core.cli import main; sys.exit(main())" "$@"; }
status=0

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
$py - <<'PY'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for d in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "pluggy", "llvmlite", "gguf",
          "torch", "transformers"):
    try:
        print(f"{d} {m.version(d)}")
    except m.PackageNotFoundError:
        print(f"{d} MISSING")
PY
# entry points let the registry find the plugins (offline: no dependencies, no build isolation)
$py -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu_llvm -e plugins/cuda >"$out/pip.log" 2>&1 \
  || echo "(editable install failed, see pip.log; the registry-based tests may skip)"
jitllm devices 2>&1 | tee "$out/devices.log"

if [[ $phase == kernels || $phase == all ]]; then
  echo "== kernel tests"
  timeout 600 $py -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_new_op.py \
    -k "gpu_ or probe or new_op" 2>&1 \
    | tee "$out/cuda_tests.log"
  status=$((status | PIPESTATUS[0]))
  echo "== kernel benchmark"
  timeout 300 $py tests/device/cuda_bench.py 2>&1 | tee "$out/cuda_bench.log"
fi

if [[ $phase == model || $phase == all ]]; then
  big="${JITLLM_BENCH_1B:-/tmp/llama-3.2-1b-shape-Q4_K_M.gguf}"
  maker=""
  if [[ ! -f $big ]]; then
    timeout 900 $py scripts/make_bench_model.py --out "$big" >"$out/make_1b.log" 2>&1 &
    maker=$!
  fi
  echo "== model tests"
  timeout 600 $py -m pytest -q -rs -p no:cacheprovider tests/test_device_model.py -k cuda 2>&1 \
    | tee "$out/model_tests.log"
  status=$((status | PIPESTATUS[0]))
  echo "== bench: SmolLM2 on cuda:0"
  timeout 300 jitllm bench --device cuda:0 --threads 1 --no-llama-cpp --repeats 3 2>&1 | tee "$out/bench_smollm2.log"
  echo "== bench migrate"
  JITLLM_CPU_DEVICES=2 timeout 300 jitllm bench migrate --history 256 1800 2>&1 | tee "$out/bench_migrate.log"
  echo "== bench: 1B-shaped Q4_K_M on cuda:0"
  [[ -n $maker ]] && wait "$maker"
  tail -2 "$out/make_1b.log" 2>/dev/null
  timeout 300 jitllm bench -m "$big" --device cuda:0 --threads 1 --no-llama-cpp --repeats 3 --profile 2>&1 \
    | tee "$out/bench_1b.log"
fi

echo "== summary"
for f in cuda_tests model_tests; do [[ -f $out/$f.log ]] && echo "$f: $(tail -1 "$out/$f.log")"; done
grep -hE "GB/s|per run" "$out/cuda_bench.log" 2>/dev/null
grep -hA3 "^threads" "$out"/bench_*.log 2>/dev/null
exit "$status"
