"""Instructions of the innermost loop of each packed layout's decode matvec and of the prefill gemm's register
tiles, as LLVM emits them for this CPU or for a named one (`--cpu icelake-server`: a VNNI machine's loops, compiled
here, not run): how many, of which kinds, the matvecs' prefetches per distance of lower.PREFETCH (one per cache
line the loop reads), their vector registers spilled (stores to the stack), and where `llvm-mca` is installed its
estimate of the loop's cycles per iteration for that CPU: the counts docs/benchmarks-history.md quotes.

    python benchmarks/instructions.py [--cpu NAME]    (with --cpu, the matvecs only)
"""
import argparse
import collections
import re
import shutil
import subprocess
import tempfile

from jitllm_core import ops, quant, registry
from jitllm_cpu_llvm import assembly, lower, runtime

MATVECS = [("Q4_1", 1536, 576), ("Q4_K", 2048, 8192), ("Q6_K", 2048, 8192), ("Q8_0", 49152, 576)]


def counts(body):
    return ", ".join(f"{op} {n}" for op, n in collections.Counter(x.split()[0] for x in body).most_common(14))


def mca_cycles(body, cpu):
    """llvm-mca's cycles per iteration of the loop body on cpu, or None (no llvm-mca, or it does not know cpu)."""
    if not shutil.which("llvm-mca"):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write("\n".join(x for x in body if not x.startswith(("j", "lock"))) + "\n")
        f.flush()
        out = subprocess.run(["llvm-mca", f"-mcpu={cpu}", "-iterations=100", f.name], capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", out.stdout)
    return int(m.group(1)) / 100 if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", choices=sorted(assembly.TARGETS), help="compile for this CPU (default: this one)")
    cpu = ap.parse_args().cpu
    print(f"loops as compiled for {cpu or runtime.host()[1] + ' (this CPU)'}")
    for name, rows, cols in MATVECS:
        fmt = quant.packed_format(quant.get_format(name, cols), rows)
        # as a decode program compiles it: tuned, so without the machine scheduler (runtime.machine_scheduled)
        body = assembly.product_loop(assembly.assembly(ops.matmul(fmt, rows, cols, 1), cpu, False))
        weights = fmt.block * quant.ROWS // fmt.pieces
        vector = [x for x in body if x.startswith("v") or x.startswith("prefetch")]
        prefetches = sum(x.startswith("prefetch") for x in body) // len(lower.PREFETCH)
        cycles = mca_cycles(body, cpu or runtime.host()[1])
        mca = f"; llvm-mca: {cycles:.0f} cycles, {weights / cycles:.1f} weights a cycle" if cycles else ""
        print(f"{fmt.name:4} {rows} x {cols}: loop of {len(body)} instructions per {weights} weights, "
              f"{len(vector)} vector or prefetch; {prefetches} prefetches per distance; "
              f"{assembly.spill_stores(body)} spill stores{mca}")
        print("     " + counts(body))
    if cpu:
        return
    # the prefill matmul's loops: its register tiles (a column each; the step's last tokens a smaller tile), and
    # the block's loop around them, most of it the dequantization of the block into scratch
    # (the tile this CPU gets: ops.gemm_tile of its registers)
    fmt = quant.packed_format(quant.get_format("Q4_K", 2048), 2048)
    tile = ops.gemm_tile(registry.device("cpu").caps.registers)
    groups = tile[0]
    bodies = list(assembly.loops(assembly.assembly(ops.prefill_matmul(fmt, 2048, 2048, 64, tile=tile))))
    loads = groups * quant.ROWS // runtime.simd_width()  # a column's weight vectors
    for body in bodies:
        mnemonics = [x.split()[0] for x in body]
        if mnemonics.count("vfmadd231ps") and "vaddps" not in mnemonics:  # the loops around it add its sums into y
            columns = max(1, mnemonics.count("vmovups") // loads)  # LLVM may unroll the column loop
            print(f"prefill tile of {groups * quant.ROWS} rows x {mnemonics.count('vbroadcastss') // columns} tokens: "
                  f"loop of {len(body)} instructions per {columns} column(s)")
            print("     " + counts(body))
    block = max(bodies, key=len)
    print(f"prefill block of {groups * quant.ROWS} rows x {ops.GEMM_BLOCK} columns of {fmt.name}: "
          f"{len(block)} instructions, the tile loops above once each, the dequantization into scratch, the tiles' "
          "sums into y")
    print("     " + counts(block))


if __name__ == "__main__":
    main()
