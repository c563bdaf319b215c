"""A decode step's matmuls against the read bandwidth measured beside them: the step's launches timed in
sequence (the profile's way, `Device.timed_program`), then the bandwidth kernel `jitllm bench` divides by,
alternated, so that both see the machine in the same moment. Prints, per repetition, the matmuls' GB/s and
their fraction of that bandwidth, the LM head's GB/s, the other kernels' time, and the whole step's fraction.

    python benchmarks/decode_stream.py [-m MODEL] [--threads N] [--repeats R]
"""
import argparse

import jitllm_core as jl
from jitllm_core.planner import bandwidth_meter
from jitllm_core.profile import profile_decode


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    eng = jl.Engine(args.model, devices=["cpu"], threads=args.threads, max_context=512)
    with bandwidth_meter(eng.devices["cpu"], rows=16384) as measure:  # the bench's meter: 256 MB of f32
        for _ in range(args.repeats):
            rows, whole, _ = profile_decode(eng, prompt_tokens=32, repeats=3)
            bw = measure(3)
            mm = [(s, b) for u, name, s, b, _ in rows if name.startswith("matmul")]
            t, nbytes = sum(s for s, _ in mm), sum(b for _, b in mm)
            head_s, head_b = next((s, b) for u, name, s, b, _ in rows if u == "head" and name.startswith("matmul"))
            other = sum(s for _, name, s, _, _ in rows if not name.startswith("matmul"))
            print(f"{args.threads} thread(s): read bandwidth {bw / 1e9:5.1f} GB/s; matmuls "
                  f"{nbytes / t / 1e9:5.1f} GB/s ({nbytes / t / bw:.0%}), LM head {head_b / head_s / 1e9:5.1f}; "
                  f"other kernels {other * 1e3:.2f} ms; whole step {whole * 1e3:.1f} ms "
                  f"({nbytes / whole / bw:.0%} of the bandwidth)")
    eng.close()


if __name__ == "__main__":
    main()
