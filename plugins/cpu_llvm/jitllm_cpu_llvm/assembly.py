"""The machine code the CPU lowering makes of a kernel, for this CPU or for a named one the host need not be: how a
machine without VNNI sees the loops of one with it (compiled, not run). benchmarks/instructions.py counts them;
the tests check the VNNI loops from any x86 host."""
import re

import llvmlite.binding as llvm

from . import lower, runtime

# CPUs by LLVM's name, with the features the lowering picks instructions by (runtime.ISA) and AVX-512's width
TARGETS = {
    "icelake-server": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2"),
    "sapphirerapids": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni", "avx2"),
    "znver4": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2"),
    "znver3": ("avx2",),
}
SPILL = re.compile(r"vmov\w+\s+%[yz]mm\d+, -?\d+\(%rsp\)")  # a vector register stored to the stack (an xmm: a scalar)


def assembly(k, cpu=None):
    """x86 assembly (AT&T) of a program of kernel k alone, for `cpu` (a TARGETS name; None: this CPU)."""
    triple = llvm.get_process_triple()
    if cpu is None:
        tm, width, isa = runtime.target_machine(), runtime.simd_width(), runtime.isa()
    else:
        tm = runtime.target_machine(cpu)
        width = 16 if "avx512f" in TARGETS[cpu] else 8
        isa = frozenset(f for f in runtime.ISA if f in TARGETS[cpu])
    mod = llvm.parse_assembly(str(lower.program_module(
        [(k.key(), list(range(len(k.buffers))), list(range(len(k.scalars))), True)], [k], width, triple, isa)))
    runtime.optimize(mod, tm if cpu else None)
    return tm.emit_assembly(mod)


def loops(asm):
    """The instructions of each loop (a label and a backward branch to it), each as a list of their texts."""
    lines = asm.splitlines()
    labels = {ln.rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.LBB\d+_\d+:", ln)}
    for i, ln in enumerate(lines):
        m = re.match(r"\s+j\w+\s+(\.LBB\d+_\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            yield [x.strip() for x in lines[labels[m.group(1)]:i + 1] if x.startswith("\t") and not x.startswith("\t.")]


def product_loop(asm):
    """The innermost loop that multiplies (a decode matvec's loop over its weights)."""
    return min((b for b in loops(asm) if any(x.startswith(("vpdpbusd", "vpmaddubsw", "vfmadd")) for x in b)), key=len)


def spill_stores(body):
    """Vector registers a loop stores to the stack (spilled: its live values outnumber the registers)."""
    return sum(bool(SPILL.match(x)) for x in body)
