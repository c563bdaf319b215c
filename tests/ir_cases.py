"""Kernels that exercise every IR construct, with inputs; every backend is checked against the interpreter on
these (see tests/backend_check.py)."""
import numpy as np

from jitllm_core import ir
from jitllm_core.interp import NP_STORAGE, f32_to_bf16

F = ir.f32


def _rand(rng, dtype, n):
    if dtype == "f32":
        return rng.standard_normal(n).astype(np.float32)
    if dtype == "f16":
        return rng.standard_normal(n).astype(np.float16)
    if dtype == "bf16":
        return f32_to_bf16(rng.standard_normal(n))
    if dtype == "i32":
        return rng.integers(-1000, 1000, n).astype(np.int32)
    return rng.integers(0, 256, n).astype(np.uint8).view(NP_STORAGE[dtype])


def elementwise_f32(n=37):
    k = ir.Kernel("ew_f32")
    k.buffer("a", "f32", n), k.buffer("b", "f32", n), k.buffer("o", "f32", n * 16, True)
    with k.parallel("i", n) as i:
        a, b = k.load("a", i), k.load("b", i)
        pos = ir.Un("abs", a) + 0.5
        outs = [a + b, a - b, a * b, a / pos, ir.vmin(a, b), ir.vmax(a, b), -a, ir.Un("abs", b),
                ir.exp(a), ir.log(pos), ir.sqrt(pos), ir.rsqrt(pos), ir.sin(a), ir.cos(a),
                ir.Un("floor", a * 3.0) + ir.Un("tanh", b), ir.select(a < b, a, b * 2.0)]
        for j, v in enumerate(outs):
            k.store("o", i * 16 + j, v)
    return k


def integer_ops(n=29):
    k = ir.Kernel("int_ops")
    k.buffer("a", "i32", n), k.buffer("b", "i32", n), k.buffer("o", "i32", n * 12, True)
    with k.parallel("i", n) as i:
        a, b = k.load("a", i), k.load("b", i)
        nz = ir.select(b == 0, ir.as_expr(7), b)
        outs = [a + b, a - b, a * b, a // nz, a % nz, a & b, a | b, a ^ b, (a & 1023) << 3, a >> 2,
                ir.i32(F(a) * 0.37), ir.i32(ir.select(ir.Bin("land", a > 0, b > 0), ir.as_expr(1), ir.as_expr(0)))]
        for j, v in enumerate(outs):
            k.store("o", i * 12 + j, v)
    return k


def storage_types(n=33):
    k = ir.Kernel("storage")
    for d in ("f16", "bf16", "u8", "i8"):
        k.buffer(f"in_{d}", d, n)
        k.buffer(f"out_{d}", d, n, True)
    k.buffer("f", "f32", n * 4, True)
    with k.parallel("i", n) as i:
        for j, d in enumerate(("f16", "bf16", "u8", "i8")):
            v = k.load(f"in_{d}", i)
            k.store("f", i * 4 + j, F(v))
            k.store(f"out_{d}", i, v * 3.0 if v.dtype == "f32" else v + 1)
    return k


def half_bits(n=24):
    """f16/bf16 scalars stored inside a byte buffer, as quantized blocks hold them."""
    k = ir.Kernel("half_bits")
    k.buffer("raw", "u8", n * 2), k.buffer("o", "f32", n * 2, True)
    with k.parallel("i", n) as i:
        bits = k.load("raw", i * 2) | (k.load("raw", i * 2 + 1) << 8)
        k.store("o", i * 2, ir.f16bits(bits))
        k.store("o", i * 2 + 1, ir.bf16bits(bits))
    return k


def word_bits(n=12):
    """f32 scalars stored inside a byte buffer, as repacked quantized blocks hold them."""
    k = ir.Kernel("word_bits")
    k.buffer("raw", "u8", n * 4), k.buffer("o", "f32", n, True)
    with k.parallel("i", n) as i:
        bits = k.load("raw", i * 4) | (k.load("raw", i * 4 + 1) << 8) | (k.load("raw", i * 4 + 2) << 16)
        k.store("o", i, ir.f32bits(bits | (k.load("raw", i * 4 + 3) << 24)))
    return k


def lane_idioms(groups=3, n=16):
    """What interleaved quantized weights read inside a vector loop whose lanes are rows: 2- and 4-byte fields
    of a byte buffer at a lane stride of their size, floats of functions of 4 bits, an unrolled reduce inside
    a lane reduce, and a strided (scattered) masked store."""
    k = ir.Kernel("lane_idioms")
    k.buffer("h16", "u8", groups * n * 2), k.buffer("w32", "u8", groups * n * 4), k.buffer("q", "u8", groups * n * 8)
    k.buffer("x", "f32", 8), k.buffer("o", "f32", groups * n * 4, True)
    with k.parallel("g", groups) as g:
        with k.loop("l", n, "vector") as l:
            r = g * n + l
            h = ir.f16bits(k.load("h16", r * 2) | (k.load("h16", r * 2 + 1) << 8))
            w = k.load("w32", r * 4) | (k.load("w32", r * 4 + 1) << 8) | (k.load("w32", r * 4 + 2) << 16)
            w = ir.f32bits(w | (k.load("w32", r * 4 + 3) << 24))

            def step(j):
                b = k.load("q", (g * 8 + j) * n + l)
                return (F((b & 15) - 32) + F(((b >> 2) & 3) << 4) + F(b >> 4) * F((b & 7) * 3 + 1)) * k.load("x", j)
            dot = k.let("dot", ir.reduce("add", "s", 2, lambda s: h * ir.reduce("add", "j", 8, step, "unroll")
                                         + w * F(s)))
            k.store("o", r * 4, dot)
            with k.if_(k.load("x", l % 8) > 0.0):
                k.store("o", (groups * n - 1 - r) * 4 + 1, w - h)   # scattered, under a lane mask
    return k


def byte_dots(groups=2, n=16, steps=6):
    """dot4 as quantized dots use it: words of a byte buffer read by lanes 4 bytes apart, masked to nibbles, times
    uniform words (an unrolled reduce whose dot4s add into their chains), and the whole bytes so (IQ4's codes looked
    up: bytes above 127); lane-varying on both sides; scalar."""
    k = ir.Kernel("byte_dots")
    k.buffer("w", "u8", groups * steps * n * 4), k.buffer("x", "i32", steps * 2), k.buffer("a", "i32", groups * n)
    k.buffer("o", "i32", groups * n * 4, True), k.buffer("s", "i32", groups, True)
    with k.parallel("g", groups) as g:
        with k.loop("l", n, "vector") as l:
            def word(j):
                i = ((g * steps + j) * n + l) * 4
                return (k.load("w", i) | (k.load("w", i + 1) << 8) | (k.load("w", i + 2) << 16)
                        | (k.load("w", i + 3) << 24))

            def step(j):
                return ir.dot4(word(j) & 0x0F0F0F0F, k.load("x", 2 * j)) + \
                    ir.dot4((word(j) >> 4) & 0x0F0F0F0F, k.load("x", 2 * j + 1))
            r = g * n + l
            k.store("o", r * 4, ir.reduce("add", "j", steps, step, "unroll"))
            k.store("o", r * 4 + 1, ir.dot4(word(0), k.load("a", r)))
            k.store("o", r * 4 + 2, ir.dot4(k.load("a", r), k.load("x", l % (2 * steps))))
            k.store("o", r * 4 + 3, ir.reduce("add", "j", steps, lambda j: ir.dot4(word(j), k.load("x", j)), "unroll"))
        k.store("s", g, ir.dot4(k.load("a", g), k.load("x", g)))
    return k


def byte_shifts(groups=2, n=16):
    """Words' bytes shifted right, as nibbles and crumbs are unpacked: (w >> s) & each byte's low 8 - s bits for
    s = 1 .. 7 (a CPU may shift the bytes instead), and near misses (a mask one bit short, a shift of 8)."""
    k = ir.Kernel("byte_shifts")
    k.buffer("w", "u8", groups * n * 4), k.buffer("o", "i32", groups * n * 9, True)
    with k.parallel("g", groups) as g:
        with k.loop("l", n, "vector") as l:
            r = g * n + l
            w = (k.load("w", r * 4) | (k.load("w", r * 4 + 1) << 8) | (k.load("w", r * 4 + 2) << 16)
                 | (k.load("w", r * 4 + 3) << 24))
            for s in range(1, 8):
                k.store("o", r * 9 + s - 1, (w >> s) & (0xFF >> s) * 0x01010101)
            k.store("o", r * 9 + 7, (w >> 4) & 0x0F0F0F0E)
            k.store("o", r * 9 + 8, (w >> 8) & 0x00FF00FF)
    return k


def tile_dots(tiles=2, m=3, words=16):
    """TileDot: two tiles of m rows of signed bytes (rows 80 bytes apart, from an offset) by two tiles of 16 columns
    of unsigned weight words, three of the four products, into rows of 24 i32 (past the 16 written: untouched); a
    TileDot per iteration, in whole AMX tile rows (words a multiple of 16). Small: a Vulkan device of 256-byte
    storage ranges binds every piece."""
    k = ir.Kernel("tile_dots")
    stride = 4 * words + 16
    k.buffer("a", "u8", 8 + tiles * 2 * m * stride), k.buffer("b", "i32", tiles * 2 * words * 16)
    k.buffer("o", "i32", tiles * 3 * m * 24, True)
    with k.parallel("t", tiles) as t:
        k.tile_dot("a", [8 + (t * 2 + i) * m * stride for i in range(2)], stride,
                   "b", [(t * 2 + j) * words * 16 for j in range(2)],
                   "o", [(ai, bi, (t * 3 + n) * m * 24) for n, (ai, bi) in enumerate(((0, 0), (0, 1), (1, 1)))],
                   m, 16, words, 24)
    return k


# IQ4's non-linear levels, offset to bytes: the table lut16 serves, with bytes above 127
LEVELS = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)


def byte_lookups(groups=2, n=16):
    """lut16 as IQ4 dots use it: a word of nibbles from a byte buffer looked up 4 bytes at once, fed to dot4; its
    low byte alone (nbytes 1) as a float, as dequantization reads it; 2 and 3 bytes of lane-varying codes whose
    bytes are not below 16 (only their low 4 bits count); a uniform code (the same for every lane); a scalar."""
    k = ir.Kernel("byte_lookups")
    k.buffer("w", "u8", groups * n * 4), k.buffer("x", "i32", n), k.buffer("a", "i32", groups * n)
    k.buffer("o", "i32", groups * n * 4, True), k.buffer("f", "f32", groups * n, True), k.buffer("s", "i32", groups, True)
    with k.parallel("g", groups) as g:
        with k.loop("l", n, "vector") as l:
            r = g * n + l
            word = (k.load("w", r * 4) | (k.load("w", r * 4 + 1) << 8) | (k.load("w", r * 4 + 2) << 16)
                    | (k.load("w", r * 4 + 3) << 24))
            k.store("o", r * 4, ir.dot4(ir.lut16(word & 0x0F0F0F0F, LEVELS), k.load("x", l)))
            k.store("o", r * 4 + 1, ir.lut16(k.load("a", r), LEVELS, 2))
            k.store("o", r * 4 + 2, ir.lut16((word >> 4) & 0x0F0F0F0F, LEVELS, 3))
            k.store("o", r * 4 + 3, ir.lut16(k.load("a", g), LEVELS))
            k.store("f", r, F(ir.lut16(word >> 4, LEVELS, 1)) - 128.0)
        k.store("s", g, ir.lut16(k.load("a", g), LEVELS))
    return k


def reductions(rows=5, cols=45):
    k = ir.Kernel("reductions")
    k.buffer("x", "f32", rows * cols), k.buffer("o", "f32", rows * 8, True)
    n = k.scalar("n")
    with k.parallel("r", rows) as r:
        row = lambda c: k.load("x", r * cols + c)
        outs = [ir.reduce("add", "c", cols, row, "reduce"), ir.reduce("add", "c", cols, row, "vector"),
                ir.reduce("max", "c", cols, row, "reduce"), ir.reduce("min", "c", cols, row, "vector"),
                ir.reduce("add", "c", 7, row, "unroll"), ir.reduce("max", "c", n, row, "serial"),
                # a reduce of a vector reduce: the shape of a quantized dot product
                ir.reduce("add", "b", cols // 9, lambda b: ir.reduce("add", "j", 9, lambda j: row(b * 9 + j) * 2.0,
                                                                     "vector"), "reduce"),
                ir.reduce("add", "c", n, lambda c: F(k.load("x", r * cols + c) > 0.0), "vector")]
        for j, v in enumerate(outs):
            k.store("o", r * 8 + j, v)
    return k


def long_reduction(rows=3, cols=203):
    """Long enough for a backend to split the reduction over several accumulators; not a multiple of 16."""
    k = ir.Kernel("long_reduction")
    k.buffer("x", "f32", rows * cols), k.buffer("o", "f32", rows * 2, True)
    with k.parallel("r", rows) as r:
        k.store("o", r * 2, ir.reduce("add", "c", cols, lambda c: k.load("x", r * cols + c), "vector"))
        k.store("o", r * 2 + 1, ir.reduce("max", "c", cols, lambda c: k.load("x", r * cols + c), "vector"))
    return k


def vector_loops(n=50):
    k = ir.Kernel("vector_loops")
    k.buffer("x", "f32", n), k.buffer("idx", "i32", n), k.buffer("o", "f32", n * 3, True)
    with k.parallel("p", 1):
        with k.loop("i", n, "vector") as i:
            k.store("o", i, k.load("x", i) * 2.0 + 1.0)                       # contiguous
            k.store("o", n + (n - 1 - i), k.load("x", k.load("idx", i)))      # gather + reversed store
            k.store("o", 2 * n + i, ir.select(k.load("x", i) > 0.0, k.load("x", i), ir.as_expr(0.0)))
    return k


def store_then_load(groups=4, n=16):
    """An expression used again after a store to the buffer it reads: it reads the stored value (expressions are
    evaluated where they are used; a backend that keeps values it loaded must forget them after the store)."""
    k = ir.Kernel("store_then_load")
    k.buffer("y", "f32", groups * n, True), k.buffer("z", "f32", groups * n, True)
    with k.parallel("p", groups) as p:
        with k.loop("l", n, "vector") as l:
            old = k.load("y", p * n + l)
            k.store("y", p * n + l, old + 1.0)
            k.store("z", p * n + l, old * 2.0)
    return k


def locals_and_ifs(n=40):
    k = ir.Kernel("locals_ifs")
    k.buffer("x", "f32", n), k.buffer("o", "f32", n + 2, True), k.buffer("oi", "i32", 1, True)
    with k.parallel("p", 1):
        acc = k.local("acc", 0.0)
        best = k.local("best", 0)
        with k.loop("i", n, "serial") as i:
            k.assign(acc, acc + k.load("x", i))
            k.store("o", i, acc)                                            # prefix sum
            with k.if_(k.load("x", i) > k.load("x", best)):
                k.assign(best, i)                                           # argmax
        k.store("o", n, acc)
        k.store("oi", 0, best)
        k.emit(ir.If(acc > 0.0, [ir.Store("o", ir.as_expr(n + 1), ir.as_expr(1.0))],
                     [ir.Store("o", ir.as_expr(n + 1), ir.as_expr(-1.0))]))
    return k


def vector_ifs(n=40):
    """Stores in a vector loop under ifs: a condition the same for every lane (a branch around plain stores; a value
    first evaluated inside it is evaluated again after it, and a load after it of what it stored sees the store) and
    one that differs by lane (masked stores); each parallel iteration takes one side of the uniform one."""
    k = ir.Kernel("vector_ifs")
    k.buffer("x", "f32", n), k.buffer("o", "f32", 2 * 3 * n, True)
    m = k.scalar("m")
    with k.parallel("p", 2) as p:
        with k.loop("i", n, "vector") as i:
            o = p * (3 * n)
            with k.if_(p < m):
                k.store("o", o + i, k.load("x", i) + 1.0)
            k.store("o", o + n + i, (k.load("x", i) + 1.0) * k.load("o", o + i))
            with k.if_(k.load("x", i) > 0.0):
                k.store("o", o + 2 * n + i, k.load("x", i) * 2.0)
    return k


def barriers(n=64):
    """Phase 2 reads phase 1's results at other indices; inside an iteration, a scratch row is written by a
    vector loop and then reduced."""
    k = ir.Kernel("barriers")
    k.buffer("x", "f32", n), k.buffer("t", "f32", n, True), k.buffer("o", "f32", n, True)
    k.buffer("s", "f32", 4 * 16, True), k.buffer("m", "f32", 4, True)
    with k.parallel("i", n) as i:
        k.store("t", i, k.load("x", i) * k.load("x", i))
    k.barrier()
    with k.parallel("i", n) as i:
        k.store("o", i, k.load("t", (i + 17) % n) + k.load("t", (i * 5) % n))
    with k.parallel("g", 4) as g:
        with k.loop("j", 16, "vector") as j:
            k.store("s", g * 16 + j, k.load("x", g * 16 + j) + 1.0)
        k.barrier()
        k.store("m", g, ir.reduce("max", "j", 16, lambda j: k.load("s", g * 16 + (15 - j)), "reduce"))
    return k


def atomics(n=200, bins=8):
    k = ir.Kernel("atomics")
    k.buffer("x", "i32", n), k.buffer("h", "i32", bins, True), k.buffer("fs", "f32", bins, True)
    with k.parallel("i", n) as i:
        b = k.load("x", i) & (bins - 1)
        k.atomic_add("h", b, 1)
        k.atomic_add("fs", b, 0.25)
    return k


def scalar_params(n=30):
    k = ir.Kernel("scalars")
    k.buffer("x", "f32", n), k.buffer("o", "f32", n, True)
    m, off = k.scalar("m"), k.scalar("off")
    with k.parallel("i", m) as i:
        k.store("o", i, k.load("x", i + off) + F(m))
    k.store("o", n - 1, F(off))   # a top-level statement runs once
    return k


# name -> (builder, scalars)
CASES = {
    "elementwise_f32": (elementwise_f32, {}),
    "integer_ops": (integer_ops, {}),
    "storage_types": (storage_types, {}),
    "half_bits": (half_bits, {}),
    "word_bits": (word_bits, {}),
    "lane_idioms": (lane_idioms, {}),
    "byte_dots": (byte_dots, {}),
    "byte_shifts": (byte_shifts, {}),
    "byte_lookups": (byte_lookups, {}),
    "tile_dots": (tile_dots, {}),
    "reductions": (reductions, {"n": 13}),
    "long_reduction": (long_reduction, {}),
    "vector_loops": (vector_loops, {}),
    "store_then_load": (store_then_load, {}),
    "locals_and_ifs": (locals_and_ifs, {}),
    "vector_ifs": (vector_ifs, {"m": 1}),
    "barriers": (barriers, {}),
    "atomics": (atomics, {}),
    "scalar_params": (scalar_params, {"m": 20, "off": 6}),
}


def inputs_for(k: ir.Kernel, seed=0):
    """Random inputs for every buffer (write buffers zeroed), with per-case fixes."""
    rng = np.random.default_rng(seed)
    bufs = {}
    for p in k.buffers.values():
        bufs[p.name] = np.zeros(p.size, NP_STORAGE[p.dtype]) if p.write else _rand(rng, p.dtype, p.size)
    if "idx" in bufs:
        bufs["idx"] = rng.permutation(k.buffers["idx"].size).astype(np.int32)
    if k.name == "half_bits":  # avoid NaN patterns, whose payload is not portable
        bufs["raw"] = np.frombuffer(rng.standard_normal(k.buffers["raw"].size // 2).astype(np.float16).tobytes(),
                                    np.uint8).copy()
    if k.name == "word_bits":
        bufs["raw"] = rng.standard_normal(k.buffers["raw"].size // 4).astype(np.float32).view(np.uint8).copy()
    if k.name == "byte_dots":  # every bit pattern, the extreme bytes included
        for name in ("x", "a"):
            bufs[name] = rng.integers(-2**31, 2**31, k.buffers[name].size).astype(np.int32)
        bufs["x"][:2], bufs["a"][:2] = [-0x7F7F7F80, 0x7F7F7F7F], [-1, -1]
    if k.name == "tile_dots":  # the extreme bytes and words: the i32 sums at their largest
        bufs["a"][8:72], bufs["b"][:32] = [128] * 32 + [127] * 32, [-1] * 16 + [0x7F80FF01] * 16
    if k.name == "lane_idioms":
        bufs["h16"] = rng.standard_normal(k.buffers["h16"].size // 2).astype(np.float16).view(np.uint8).copy()
        bufs["w32"] = rng.standard_normal(k.buffers["w32"].size // 4).astype(np.float32).view(np.uint8).copy()
    return bufs
