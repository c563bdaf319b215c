"""Cold and warm start on the CPU: `Engine()` and the first token, first with an empty kernel cache (a fresh
JITLLM_CACHE_DIR), then again with the cache it filled.

    python benchmarks/startup.py [-m MODEL]      (default: the default model)
"""
import argparse
import os
import subprocess
import sys
import tempfile

ONE = """
import sys, time
t = time.perf_counter()
import jitllm_core as jl
eng = jl.Engine(sys.argv[1] or None, devices=["cpu"])
t1 = time.perf_counter()
eng.generate("Once upon a time", max_tokens=1)
print(f"Engine() {t1 - t:.2f} s, first token {time.perf_counter() - t1:.3f} s")
"""

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("-m", "--model", default="", help="GGUF file (default: the default model)")
args = ap.parse_args()
with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "JITLLM_CACHE_DIR": cache}
    for what in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-c", ONE, args.model], env=env, capture_output=True, text=True,
                             check=True)
        print(f"{what}: {out.stdout.strip()}")
