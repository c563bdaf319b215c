"""Instructions of the innermost loop of each packed layout's decode matvec and of the prefill gemm's register
tiles, as LLVM emits them for this CPU: how many, of which kinds, the matvecs' prefetches per distance of
lower.PREFETCH (one per cache line the loop reads) and their vector registers spilled (stores to the stack): the
counts docs/benchmarks.md quotes.

    python benchmarks/instructions.py
"""
import collections
import re

import llvmlite.binding as llvm

from jitllm_core import ops, quant, registry
from jitllm_cpu_llvm import lower, runtime

MATVECS = [("Q4_1", 1536, 576), ("Q4_K", 2048, 8192), ("Q6_K", 2048, 8192), ("Q8_0", 49152, 576)]


def loops(asm):
    """The instructions of each loop (a label and the backward branch to it), each as its text."""
    lines = asm.splitlines()
    labels = {ln.rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.LBB\d+_\d+:", ln)}
    for i, ln in enumerate(lines):
        m = re.match(r"\s+j\w+\s+(\.LBB\d+_\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            yield [x.strip() for x in lines[labels[m.group(1)]:i + 1] if x.startswith("\t") and not x.startswith("\t.")]


def assembly(k):
    mod = llvm.parse_assembly(str(lower.program_module(
        [(k.key(), list(range(len(k.buffers))), list(range(len(k.scalars))), True)], [k], runtime.simd_width(),
        llvm.get_process_triple(), runtime.isa())))
    runtime.optimize(mod)
    return runtime.target_machine().emit_assembly(mod)


def counts(body):
    return ", ".join(f"{op} {n}" for op, n in collections.Counter(x.split()[0] for x in body).most_common(14))


def spills(body):
    """Vector registers stored to the stack (spilled: the loop's live values outnumber the registers)."""
    return sum(bool(re.match(r"vmov\w+\s+%[xyz]mm\d+, -?\d+\(%rsp\)", x)) for x in body)


def main():
    for name, rows, cols in MATVECS:
        fmt = quant.packed_format(quant.get_format(name, cols), rows)
        body = max(loops(assembly(ops.matmul(fmt, rows, cols, 1))), key=len)
        weights = fmt.block * quant.ROWS // fmt.pieces
        vector = [x for x in body if x.startswith("v") or x.startswith("prefetch")]
        prefetches = sum(x.startswith("prefetch") for x in body) // len(lower.PREFETCH)
        print(f"{fmt.name:4} {rows} x {cols}: loop of {len(body)} instructions per {weights} weights, "
              f"{len(vector)} vector or prefetch; {prefetches} prefetches per distance; {spills(body)} spill stores")
        print("     " + counts(body))
    # the prefill matmul's loops: its register tiles (a column each; the step's last tokens a smaller tile), and
    # the block's loop around them, most of it the dequantization of the block into scratch
    # (the tile this CPU gets: ops.tile_groups of its registers)
    fmt = quant.packed_format(quant.get_format("Q4_K", 2048), 2048)
    groups = ops.tile_groups(registry.device("cpu").caps.registers)
    bodies = list(loops(assembly(ops.prefill_matmul(fmt, 2048, 2048, 64, groups=groups))))
    for body in bodies:
        mnemonics = [x.split()[0] for x in body]
        if mnemonics.count("vfmadd231ps") and "vaddps" not in mnemonics:  # the loops around it add its sums into y
            print(f"prefill tile of {groups * quant.ROWS} rows x {mnemonics.count('vbroadcastss')} tokens: loop "
                  f"of {len(body)} instructions per column")
            print("     " + counts(body))
    block = max(bodies, key=len)
    print(f"prefill block of {groups * quant.ROWS} rows x {ops.GEMM_BLOCK} columns of {fmt.name}: "
          f"{len(block)} instructions, the tile loops above once each, the dequantization into scratch, the tiles' "
          "sums into y")
    print("     " + counts(block))


if __name__ == "__main__":
    main()
