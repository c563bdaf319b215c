"""Kernel benchmarks behind docs/benchmarks.md, on the CPU device:

- decode matvecs of each packed layout (one token), weights from memory (copies rotated past the caches) and
  from cache (one copy repeated): GB/s and G weights/s, with the lowering options the device tuned for them;
- the 1B shape's dot4 decode matvecs from cache with 1, 2 and 3 digits of the input: what a digit costs;
- matvecs of the file's layouts, the dot in its CPU form and in the form GPUs get;
- the prefill matmuls of the 1B shape's matrices (a 64-token step);
- the core's f32 multiply-add peak (a bare loop of independent multiply-adds), the same with half its chains
  looking products up (AVX-512), its dot4 instruction's peak, and a prefill matmul whose weights stay in L2.

    python benchmarks/kernel_speed.py [--threads N] [--only decode|digits|file|prefill|ceiling] [--force prefetch=1]
"""
import argparse
import ctypes
import threading
import time

import llvmlite.binding as llvm
import numpy as np

from jitllm_core import llama, ops, quant, registry, tuning
from jitllm_core.plugin import Launch
from jitllm_cpu_llvm import runtime

DECODE = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q5_0", 1536, 576), ("Q8_0", 49152, 576), ("Q4_K", 8192, 2048),
          ("Q4_K", 2048, 8192), ("Q5_K", 2048, 8192), ("Q2_K", 2048, 8192), ("Q3_K", 2048, 8192),
          ("Q6_K", 2048, 8192), ("IQ4_XS", 2048, 8192), ("IQ4_NL", 2048, 8192)]
FILE = [("Q4_1", 1536, 576), ("Q8_0", 4096, 576), ("Q5_0", 4096, 576), ("Q5_1", 4096, 576), ("Q2_K", 2048, 2048),
        ("Q3_K", 2048, 2048), ("Q4_K", 2048, 2048), ("Q5_K", 2048, 2048), ("Q6_K", 2048, 2048), ("IQ4_XS", 2048, 2048)]
PREFILL = [("Q4_K", 8192, 2048), ("Q4_K", 2048, 2048), ("Q6_K", 2048, 8192), ("Q4_K", 2048, 8192), ("Q5_K", 2048, 8192),
           ("IQ4_XS", 2048, 8192)]
CACHED_BYTES = 384 << 10  # a matrix this size stays in a core's L2


def file_tensor(name, rows, cols, rng):
    """Random blocks of a GGUF format (finite f16 scales): (format, bytes)."""
    fmt = quant.get_format(name, cols)
    raw = rng.integers(0, 256, (rows * cols // fmt.block, fmt.unit)).astype(np.uint8)
    for o in fmt.halves:
        raw[:, o:o + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return fmt, raw.reshape(-1)


def packed_tensor(name, rows, cols, rng):
    """Random blocks of a GGUF format, in the layout the engine holds them on a CPU."""
    fmt, raw = file_tensor(name, rows, cols, rng)
    return quant.packed_format(fmt, rows), quant.repack(fmt, raw, rows)


def upload(dev, arr):
    b = dev.alloc(arr.nbytes)
    dev.upload(b, arr.view(np.uint8))
    return b


def seconds(prog, values, repeats=7):
    """Median seconds of a program's run, after one to warm it up."""
    prog.run(values)
    return float(np.median([_timed(lambda: prog.run(values)) for _ in range(repeats)]))


def decode_inputs(dev, fmt, rows, cols, rng):
    """A decode matvec's buffers but its weights, uploaded: x, y, and for a dot4 layout the input as quantize_input
    writes it (any digits do for timing)."""
    x = rng.standard_normal(cols).astype(np.float32)
    bufs = {"x": upload(dev, x), "y": dev.alloc(rows * 4)}
    if fmt.digits:
        bufs.update({"xq": upload(dev, rng.integers(0, 256, quant.DIGITS * cols).astype(np.uint8)),
                     "xd": upload(dev, np.full(cols // 32, 1e-9, np.float32)),
                     "xs": upload(dev, x.reshape(-1, 16).sum(1))})
    return bufs


def cached_rows(w, rows):
    """The first rows of packed matrix w (a packed tensor's row groups come in order) that fit in a core's L2."""
    return max(16, min(rows, CACHED_BYTES // (w.nbytes // rows)) // 16 * 16)


def decode(dev, rng):
    print("decode matvec, 1 token           from memory            from cache   tuned")
    for name, rows, cols in DECODE:
        fmt, w = packed_tensor(name, rows, cols, rng)
        copies = max(2, int(200e6 // w.nbytes))
        ws = [upload(dev, w) for _ in range(copies)]
        bufs = decode_inputs(dev, fmt, rows, cols, rng)
        k = ops.matmul(fmt, rows, cols, 1)
        tuning.tune(dev, [k])  # the options the engine's decode step gets on this machine
        launches = [Launch(k, {p: b for p, b in {**bufs, "w": wb}.items() if p in k.buffers}) for wb in ws]
        values = {"n_tokens": 1, "t0": 0}
        t_mem = seconds(dev.program(launches), values) / copies
        rc = cached_rows(w, rows)  # from cache
        kc = ops.matmul(fmt, rc, cols, 1)
        t_cache = seconds(dev.program([Launch(kc, {p: b for p, b in {**bufs, "w": ws[0]}.items()
                                                   if p in kc.buffers})] * 20), values) / 20
        print(f"{fmt.name:6} {rows:6d} x {cols:5d}   {w.nbytes / t_mem / 1e9:5.1f} GB/s {rows * cols / t_mem / 1e9:5.1f} Gw/s"
              f"   {rc * cols / t_cache / 1e9:5.1f} Gw/s   {dev.tuned.get(k.tune_tag)}")
        for b in ws + list(bufs.values()):
            dev.free(b)


def digits(dev, rng, rounds=15):
    """The 1B shape's dot4 decode matvecs from cache with 1, 2 and 3 digits of the input (the int8 mode's one, the
    exact mode's three), alternated round by round, the best of each: what each digit costs on this CPU (where its
    dot4 instruction is the bound, each adds as much as the first)."""
    print("\ndecode matvec from cache by digits of the input (best of %d rounds)   1 digit   2 digits   3 digits   "
          "ns per 1000 weights a digit" % rounds)
    for name, rows, cols in [("Q4_K", 2048, 8192), ("Q6_K", 2048, 8192)]:
        fmt, w = packed_tensor(name, rows, cols, rng)
        rc = cached_rows(w, rows)
        bufs = {"w": upload(dev, w), **decode_inputs(dev, fmt, rows, cols, rng)}
        progs = {}
        for d in (1, 2, 3):
            k = ops.matmul(fmt, rc, cols, 1, digits=d)
            tuning.tune(dev, [k])
            progs[d] = dev.program([Launch(k, {p: b for p, b in bufs.items() if p in k.buffers})] * 20)
        values, best = {"n_tokens": 1, "t0": 0}, {d: float("inf") for d in progs}
        for _ in range(rounds):
            for d, prog in progs.items():
                best[d] = min(best[d], _timed(lambda: prog.run(values)) / 20 / (rc * cols))
        print(f"{fmt.name:6} {rc:4d} x {cols:5d}" + " " * 44 + "   ".join(f"{1e-9 / best[d]:5.1f} Gw/s" for d in progs)
              + f"   {(best[3] - best[1]) / 2 * 1e12:5.0f}")
        for b in bufs.values():
            dev.free(b)


def file_layouts(dev, rng):
    """The file's layouts (a CPU reads them for row counts that are not multiples of 16): the dot's CPU form
    against the form GPUs get (Format.row_dot(wide=True)), from cache."""
    print("\nfile layout matvec, 1 token, from cache    CPU form        GPU form")
    for name, rows, cols in FILE:
        fmt, w = file_tensor(name, rows, cols, rng)
        bufs = {"w": upload(dev, w), "x": upload(dev, rng.standard_normal(cols).astype(np.float32)),
                "y": dev.alloc(rows * 4)}
        rates = [rows * cols / (seconds(dev.program([Launch(ops.matmul(fmt, rows, cols, 1, wide=wide), bufs)] * 5),
                                        {"n_tokens": 1, "t0": 0}) / 5) / 1e9 for wide in (False, True)]
        print(f"{fmt.name:6} {rows:6d} x {cols:5d}                  {rates[0]:5.1f} Gw/s      {rates[1]:5.1f} Gw/s")
        for b in bufs.values():
            dev.free(b)


def prefill_launches(dev, fmt, rows, cols, T, w, x, y, wdq):
    """The launches of a prefill matmul of T-token steps (its column chunks, with this device's tile) of weights w,
    input x, output y and scratch wdq (`prefill_scratch` elements at least), and the scalars they name."""
    launches, values = [], {}
    for k, at in llama.prefill_matmuls(fmt, rows, cols, T, tile=ops.gemm_tile(dev.caps.registers)):
        names = {s: f"{s}_{v}" for s, v in at.items()}
        launches.append(Launch(k, {"w": w, "x": x, "y": y, "wdq": wdq}, names))
        values.update({names[s]: v for s, v in at.items()})
    return launches, values


def prefill(dev, rng, T=64, n=64):
    print(f"\nprefill matmul (dequantize blocks into scratch, multiply by every token), {n} tokens")
    for name, rows, cols in PREFILL:
        fmt, w = packed_tensor(name, rows, cols, rng)
        x = rng.standard_normal(T * cols).astype(np.float32)
        wb, xb, yb = upload(dev, w), upload(dev, x), dev.alloc(T * rows * 4)
        wdq = dev.alloc(ops.prefill_scratch(fmt, rows, cols, T) * 4)
        launches, values = prefill_launches(dev, fmt, rows, cols, T, wb, xb, yb, wdq)
        t = seconds(dev.program(launches), {**values, "n_tokens": n, "t0": 0}, 5)
        print(f"{fmt.name:4} {rows:5d} x {cols:5d}  {t * 1e3:6.2f} ms  {2 * rows * cols * n / t / 1e9:5.1f} GFLOP/s")
        held = [wb, xb, yb, wdq]
        if dev.caps.tile_dots and ops.tile_dots_fit(fmt, rows, cols):  # a CPU with AMX: integer tiles too
            launches, values = tile_launches(dev, fmt, rows, cols, T, wb, xb, yb, held)
            t = seconds(dev.program(launches), {**values, "n_tokens": n, "t0": 0}, 5)
            print(f"{'':4} {'':5}   {'':5}  {t * 1e3:6.2f} ms  {2 * rows * cols * n / t / 1e9:5.1f} GFLOP/s  "
                  "integer tiles (ops.tile_matmul, the input's quantization included)")
        for b in held:
            dev.free(b)


def tile_launches(dev, fmt, rows, cols, T, w, x, y, held):
    """The launches of the integer tile matmul (`ops.tile_matmul`, its column chunks) of T-token steps: the input
    quantized (`Llama._inputs`), then the matmul; its buffers allocated and added to `held`."""
    q = ops.quantize_input(cols, T, quant.DIGITS, ops.TILE_SPAN, 32)
    Tp = ops.tile_tokens(T)  # the tile matmul's input holds whole TileDots of tokens
    bufs = {"xq": dev.alloc(Tp * quant.DIGITS * cols), "xd": dev.alloc(Tp * cols // ops.TILE_SPAN * 4),
            "xs": dev.alloc(Tp * cols // 32 * 4)}
    launches, values = [Launch(q, {"x": x, **bufs})], {}
    for k, at in llama.prefill_matmuls(fmt, rows, cols, T, tile_dots=True):
        scratch = {n: dev.alloc(k.buffers[n].size * 4) for n in ("wt", "wts")}
        held += scratch.values()
        names = {s: f"{s}_{v}" for s, v in at.items()}
        launches.append(Launch(k, {"w": w, "y": y, **bufs, **scratch}, names))
        values.update({names[s]: v for s, v in at.items()})
    held += bufs.values()
    return launches, values


def fma_peak(threads=1, iterations=20_000_000, lookups=0):
    """GFLOP/s of each of 5 runs of each of `threads` threads running at once nothing but independent f32
    multiply-adds of the CPU's vector width (a bare LLVM loop of accumulators that fit its registers: 16 of 16
    lanes with AVX-512, 12 of 8 with AVX2): what the cores' vector units can do, the bound for any f32 gemm (the
    cores of a shared machine need not run at one speed). lookups (AVX-512): that many of the chains instead look
    products up (`vpermps` of a vector of 16 multiples by 16 indices, then an add) -- exact products of a 4-bit
    weight without a multiply -- and their products count as multiply-adds: whether the lookups' pipes add to the
    multiply-adds' (docs/benchmarks-history.md, thirty-third session)."""
    W = runtime.simd_width()
    chains = 16 if W == 16 else 12
    v, fma = f"<{W} x float>", f"@llvm.fma.v{W}f32"
    perm = "@llvm.x86.avx512.permvar.sf.512"
    body = ""
    for i in range(chains):
        if i < chains - lookups:
            body += f"  %b{i} = call {v} {fma}({v} %a{i}, {v} splat (float 0.5), {v} splat (float 0.25))\n"
        else:  # table and indices: bits of the previous iteration's chains, so that nothing is hoisted or folded
            body += (f"  %x{i} = bitcast {v} %a{i - 1} to <16 x i32>\n"
                     f"  %p{i} = call {v} {perm}({v} %a0, <16 x i32> %x{i})\n  %b{i} = fadd {v} %a{i}, %p{i}\n")
    decls = f"declare {v} {fma}({v}, {v}, {v})\n" + (f"declare {v} {perm}({v}, <16 x i32>)\n" if lookups else "")
    return _chain_rates(decls, v, "float", ".0", "fadd", body, chains, 2 * W, threads, iterations)


def dot4_peak(threads=1, iterations=20_000_000):
    """G byte products a second of each of 5 runs of each of `threads` threads running at once nothing but
    independent dot4 instructions, the ones the decode matvecs' dots lower to: `vpdpbusd` where the CPU has
    AVX-512 VNNI (64 products), else `pmaddubsw` (32): the bound of the exact mode's decode where it is not the
    memory, three products a weight (one per digit of the input)."""
    if "avx512vnni" in runtime.isa():
        v, fn, n, b = "<16 x i32>", "@llvm.x86.avx512.vpdpbusd.512", 64, "<64 x i8>"  # its bytes as lower.py's
        decls = f"declare {v} {fn}({v}, {b}, {b})\n"
        step = lambda i: f"  %b{i} = call {v} {fn}({v} %a{i}, {b} splat (i8 1), {b} splat (i8 3))\n"
    else:
        v, fn, n = "<32 x i8>", "@llvm.x86.avx2.pmadd.ub.sw", 32
        decls = f"declare <16 x i16> {fn}({v}, {v})\n"
        step = lambda i: (f"  %p{i} = call <16 x i16> {fn}({v} %a{i}, {v} splat (i8 3))\n"
                          f"  %b{i} = bitcast <16 x i16> %p{i} to {v}\n")
    chains = 12
    body = "".join(step(i) for i in range(chains))
    return _chain_rates(decls, v, v.split()[-1][:-1], "", "add", body, chains, n, threads, iterations)


def _chain_rates(decls, v, scalar, suffix, add, body, chains, units, threads, iterations):
    """G units a second of each of 5 runs of each of `threads` threads at once of a loop of `chains` independent
    chains: `body` makes %b{i} of %a{i} (vectors of v, of `scalar`s; `units` per instruction), for `iterations`
    iterations; chain i starts at a splat of i + 1 (written with `suffix`: each its own, so that none is folded
    into another) and the chains are summed with `add` at the end."""
    phis = "".join(f"  %a{i} = phi {v} [splat ({scalar} {i + 1}{suffix}), %entry], [%b{i}, %loop]\n"
                   for i in range(chains))
    total = "".join(f"  %s{i} = {add} {v} %s{i - 1}, %b{i}\n" for i in range(1, chains))
    ir_text = (decls + f"define {scalar} @peak(i64 %n) {{\nentry:\n  br label %loop\nloop:\n"
               f"  %i = phi i64 [0, %entry], [%j, %loop]\n{phis}{body}  %j = add i64 %i, 1\n"
               f"  %c = icmp ult i64 %j, %n\n  br i1 %c, label %loop, label %done\ndone:\n"
               f"  %s0 = {add} {v} %b0, zeroinitializer\n{total}"
               f"  %r = extractelement {v} %s{chains - 1}, i32 0\n  ret {scalar} %r\n}}\n")
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(ir_text), runtime.target_machine())
    runtime.on_llvm_thread(engine.finalize_object)  # code generation: where the programs' own options are set
    ctype = {"float": ctypes.c_float, "i32": ctypes.c_int32, "i8": ctypes.c_int8}[scalar]
    peak = ctypes.CFUNCTYPE(ctype, ctypes.c_int64)(engine.get_function_address("peak"))
    rates = [[] for _ in range(threads)]

    def run(t):  # the ctypes call releases the GIL: the threads run the loop at once, 5 times
        rates[t] = [chains * iterations * units / _timed(lambda: peak(iterations)) / 1e9 for _ in range(5)]
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return rates


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ceiling(dev, rng, T=64):
    peaks = fma_peak(dev.threads)
    print(f"\nf32 multiply-add peak of {len(peaks)} thread(s) at once (independent chains, no loads), slowest and "
          "fastest of 5 runs: " + " / ".join(f"{min(r):.1f}-{max(r):.1f}" for r in peaks) + " GFLOP/s")
    if runtime.simd_width() == 16:
        mixed = fma_peak(dev.threads, lookups=8)
        print("the same with 8 of its 16 chains looking products up instead (vpermps and an add, products counted as "
              "multiply-adds): " + " / ".join(f"{min(r):.1f}-{max(r):.1f}" for r in mixed) + " GFLOP/s")
    dots = dot4_peak(dev.threads)
    print("dot4 instruction peak (vpdpbusd with AVX-512 VNNI, else pmaddubsw; independent chains, no loads): "
          + " / ".join(f"{min(r):.1f}-{max(r):.1f}" for r in dots) + " G byte products a second")
    print("prefill matmul of 64 rows x 2,048 columns of Q4_K (from L2), 64 tokens (best of 15)")
    fmt, w = packed_tensor("Q4_K", 64, 2048, rng)
    k = ops.prefill_matmul(fmt, 64, 2048, T, tile=ops.gemm_tile(dev.caps.registers))
    bufs = {"w": upload(dev, w), "x": upload(dev, rng.random(T * 2048, np.float32)), "y": dev.alloc(T * 64 * 4),
            "wdq": dev.alloc(k.buffers["wdq"].size * 4)}
    reps = max(1, 2 ** 28 // (64 * 2048 * T))
    prog, values = dev.program([Launch(k, bufs)] * reps), {"n_tokens": T, "t0": 0}
    prog.run(values)
    t = min(_timed(lambda: prog.run(values)) for _ in range(15)) / reps
    print(f"{2 * 64 * 2048 * T / t / 1e9:.1f} GFLOP/s")
    for b in bufs.values():
        dev.free(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["decode", "digits", "file", "prefill", "ceiling"], help="run one part")
    ap.add_argument("--force", nargs="*", default=[], metavar="OPTION=INDEX",
                    help="a tuned option's candidate for every kernel, whatever was measured (e.g. prefetch=1)")
    args = ap.parse_args()
    tuning.FORCED = {o: int(i) for o, i in (f.split("=") for f in args.force)}
    dev = registry.device("cpu")
    dev.configure(threads=args.threads)
    rng = np.random.default_rng(0)
    parts = {"decode": decode, "digits": digits, "file": file_layouts, "prefill": prefill, "ceiling": ceiling}
    for name, part in parts.items():
        if args.only in (None, name):
            part(dev, rng)


if __name__ == "__main__":
    main()
