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
print(t1 - t, time.perf_counter() - t1)
"""


def start_seconds(model=""):
    """{"cold": (Engine() s, first token s), "warm": (...)}, each in a fresh process: cold with an empty kernel
    cache, warm with the cache the cold start filled."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JITLLM_CACHE_DIR": cache}
        for what in ("cold", "warm"):
            run = subprocess.run([sys.executable, "-c", ONE, model or ""], env=env, capture_output=True, text=True,
                                 check=True)
            out[what] = tuple(float(v) for v in run.stdout.split()[-2:])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="", help="GGUF file (default: the default model)")
    args = ap.parse_args()
    for what, (engine_s, first_s) in start_seconds(args.model).items():
        print(f"{what}: Engine() {engine_s:.2f} s, first token {first_s:.3f} s")


if __name__ == "__main__":
    main()
