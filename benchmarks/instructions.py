"""Instructions of the innermost loop of each packed layout's decode matvec, as LLVM emits them for this CPU:
how many, and of which kinds (the counts docs/benchmarks.md quotes).

    python benchmarks/instructions.py
"""
import collections
import re

import llvmlite.binding as llvm

from jitllm_core import ops, quant
from jitllm_cpu_llvm import lower, runtime

MATVECS = [("Q4_1", 1536, 576), ("Q4_K", 2048, 8192), ("Q6_K", 2048, 8192)]


def loop_body(asm):
    """The instruction mnemonics of the longest loop (a label and the backward branch to it)."""
    lines = asm.splitlines()
    labels = {ln.rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.LBB\d+_\d+:", ln)}
    best = []
    for i, ln in enumerate(lines):
        m = re.match(r"\s+j\w+\s+(\.LBB\d+_\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [x.split()[0] for x in lines[labels[m.group(1)]:i + 1] if x.startswith("\t") and not x.startswith("\t.")]
            best = max(best, body, key=len)
    return best


def main():
    for name, rows, cols in MATVECS:
        fmt = quant.packed_format(quant.get_format(name, cols), rows)
        k = ops.matmul(fmt, rows, cols, 1)
        mod = llvm.parse_assembly(str(lower.program_module(
            [(k.key(), list(range(len(k.buffers))), list(range(len(k.scalars))), True)], [k], runtime.simd_width(),
            llvm.get_process_triple(), runtime.isa())))
        runtime.optimize(mod)
        body = loop_body(runtime.target_machine().emit_assembly(mod))
        weights = fmt.block * quant.ROWS // fmt.pieces
        vector = [op for op in body if op.startswith("v") or op.startswith("prefetch")]
        print(f"{fmt.name:4} {rows} x {cols}: loop of {len(body)} instructions per {weights} weights, "
              f"{len(vector)} vector or prefetch")
        print("     " + ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(14)))


if __name__ == "__main__":
    main()
