"""Prefill matmuls (`llama.prefill_matmuls`: the 1B shape's matrices, as a prefill step launches them) of variants
of the IR's builders or of the CPU lowering, alternated in one process (A B A B ...) like ab_decode.py's engines,
at several token counts of a step: a kernel's change measured where the engine's prompt tok/s would blur it
(a 32-token step's matmuls, say, whose dequantization weighs four times what it does in a 128-token one).
Each variant's launches rotate over copies of the weights larger together than the last-level cache, so that
the weights come from memory as in a step. Tokens 0: the dequantization alone.

    python benchmarks/ab_gemm.py --set ops.GEMM_BLOCK 256 128 [--tokens 0 32 128] [--threads 2] [--rounds 7]
    python benchmarks/ab_gemm.py --set lower.PREFETCH '((4096, 3), (10240, 0))' '()'
"""
import argparse
import ast

import numpy as np
from ab_decode import setter
from kernel_speed import PREFILL, packed_tensor, prefill_launches, seconds, upload

from jitllm_core import ops, registry

STEP = 128  # the engine's step (engine.STEP_TOKENS): the kernels' T
ROTATED = 96 << 20  # bytes of weight copies a variant's launches rotate over (past a 32 MB L3)


def variant_program(dev, fmt, rows, cols, copies, x, y, wdq):
    """One program: the matrix's prefill matmul launches over each copy of its weights in turn; its scalars."""
    launches = [prefill_launches(dev, fmt, rows, cols, STEP, w, x, y, wdq) for w in copies]
    return dev.program([ln for lns, _ in launches for ln in lns]), launches[0][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", nargs="+", required=True, metavar=("MODULE.ATTR", "VALUE"),
                    help="an attribute under jitllm_core or jitllm_cpu_llvm (module.name or module.Class.name) and its values")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128], help=f"tokens of the step (at most {STEP})")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    apply, values = setter(args.set[0]), [ast.literal_eval(v) for v in args.set[1:]]
    dev = registry.device("cpu")
    dev.configure(threads=args.threads)
    rng = np.random.default_rng(0)
    for name, rows, cols in PREFILL:
        fmt, w = packed_tensor(name, rows, cols, rng)
        copies = [upload(dev, w) for _ in range(max(2, -(-ROTATED // w.nbytes)))]
        x, y = upload(dev, rng.standard_normal(STEP * cols).astype(np.float32)), dev.alloc(STEP * rows * 4)
        progs, scratch = [], []
        for v in values:
            apply(v)  # a variant may size the scratch differently (its tile, its blocks)
            scratch.append(dev.alloc(ops.prefill_scratch(fmt, rows, cols, STEP) * 4))
            progs.append(variant_program(dev, fmt, rows, cols, copies, x, y, scratch[-1]))
        for n in args.tokens:
            times = [[] for _ in values]
            for _ in range(args.rounds):
                for (prog, at), t in zip(progs, times):
                    t.append(seconds(prog, {**at, "n_tokens": n, "t0": 0}, 1) / len(copies))
            rates = [f"{v!r}: {np.median(t) * 1e3:.3f} ms" + (f" {2 * rows * cols * n / np.median(t) / 1e9:.1f} GFLOP/s"
                                                               if n else "") for v, t in zip(values, times)]
            print(f"{fmt.name} {rows} x {cols}, {n} tokens, {args.threads} thread(s), medians of {args.rounds}: "
                  + " | ".join(rates), flush=True)
        for b in (*copies, x, y, *scratch):
            dev.free(b)


if __name__ == "__main__":
    main()
