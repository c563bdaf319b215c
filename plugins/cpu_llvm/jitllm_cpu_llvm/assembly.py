"""The machine code the CPU lowering makes of a kernel, for this CPU or for a named one the host need not be: how a
machine without VNNI sees the loops of one with it (compiled, not run). benchmarks/instructions.py counts them;
the tests check the VNNI loops from any x86 host, and run a named CPU's programs here (`device`), what this CPU
lacks emulated."""
import re

import llvmlite.binding as llvm

from . import lower, runtime

# CPUs by LLVM's name, with the features the lowering picks their vector width and instructions by
TARGETS = {
    "icelake-server": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2"),
    "sapphirerapids": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni", "avx2"),
    "znver4": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2"),
    "znver3": ("avx2",),
}
SPILL = re.compile(r"vmov\w+\s+%[yz]mm\d+, -?\d+\(%rsp\)")  # a vector register stored to the stack (an xmm: a scalar)


def features(cpu):
    """The features a TARGETS CPU's programs are lowered by, as runtime.simd_width and runtime.isa take them."""
    return dict.fromkeys(TARGETS[cpu], True)


def device(cpu, threads=1):
    """A CPU device ("cpu") that makes the programs of `cpu` (a TARGETS name: its vector width and instructions) and
    runs them on this CPU, what it lacks emulated (emulation.py)."""
    feats = features(cpu)
    return runtime.CpuDevice("cpu", threads, runtime.total_memory(), runtime.simd_width(feats), runtime.isa(feats))


def module(k, width, isa, options=None):
    """Kernel k's module, lowered for `width` lanes and instructions `isa` and linked with its support (options: its
    tuned lowering options, as CpuDevice.tune gives them), as a compile process gets it before its passes."""
    mod = llvm.parse_assembly(str(lower.kernel_module(k, f"k_{k.name}", width, llvm.get_process_triple(), isa)))
    mod.link_in(llvm.parse_assembly(lower.support_ir(options)))
    return mod


def assembly(k, cpu=None, schedule=True):
    """x86 assembly (AT&T) of kernel k's module, for `cpu` (a TARGETS name; None: this CPU), with LLVM's
    machine scheduler or without (generated on LLVM's thread, where the option is set for each module)."""
    feats = None if cpu is None else features(cpu)
    tm = runtime.target_machine(cpu)
    mod = module(k, runtime.simd_width(feats), runtime.isa(feats))
    runtime.optimize(mod, tm if cpu else None)
    return runtime.on_llvm_thread(lambda: tm.emit_assembly(mod), schedule)


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
