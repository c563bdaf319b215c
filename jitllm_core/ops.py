"""The model's ops, as IR builders. Each returns a finished Kernel; dimensions are baked in, `pos` (position of
the step's first token), `n_tokens` and `t0` (first token whose logits are wanted) are per-step scalars.

Activations are f32, row-major [token, feature], sized for `T` tokens per step. Builders are cached: a kernel is
immutable once finished, and a model asks for the same one many times.
"""
from __future__ import annotations

import functools
import math

from . import ir
from .quant import DIGITS, ROWS, Format, Input, Interleaved, dequant_rows

F = ir.f32


@functools.cache
def embed(fmt: Format, vocab: int, dim: int, T: int, scale=1.0) -> ir.Kernel:
    """The tokens' rows of the embedding, times scale (Gemma's sqrt(dim))."""
    k = ir.Kernel(f"embed_{fmt.name}_{vocab}x{dim}_T{T}{f'_x{scale:g}' if scale != 1.0 else ''}")
    scaled = (lambda v: v * scale) if scale != 1.0 else (lambda v: v)
    k.w_read = lambda n_tokens: n_tokens * fmt.row_units(dim)
    k.buffer("tok", "i32", T), k.buffer("w", fmt.storage, vocab * fmt.row_units(dim))
    k.buffer("x", "f32", T * dim, True)
    n = k.scalar("n_tokens")
    nb = dim // fmt.block
    if isinstance(fmt, Interleaved):
        with k.parallel("tb", n * nb) as tb:
            t, b = tb // nb, tb % nb
            row = k.let("row", k.load("tok", t))
            for e, v in fmt.values(k, "w", row // ROWS, row % ROWS, dim, b):
                k.store("x", t * dim + b * fmt.block + e, scaled(v))
        return k.finish()
    with k.parallel("tbg", n * nb * fmt.groups) as tbg:
        tb, g = (tbg, 0) if fmt.groups == 1 else (tbg // fmt.groups, tbg % fmt.groups)
        t, b = tb // nb, tb % nb
        base = (k.load("tok", t) * nb + b) * fmt.unit
        with k.loop("l", fmt.lanes, "vector") as l:
            for j, w in fmt.terms(k, "w", base, g, l):
                k.store("x", t * dim + b * fmt.block + j, scaled(w))
    return k.finish()


NORM_LANES = ROWS  # tokens whose sums of squares a prefill step's rmsnorm takes at once: a vector's lanes


@functools.cache
def rmsnorm(dim: int, T: int, eps: float, wide=False) -> ir.Kernel:
    """x[t] / rms(x[t]) * w for the tokens from t0 (the first whose output is wanted). Each token's sum of squares
    is taken in order: with an f16 KV cache the logits sit near the 5e-2 bound (from the cache's rounding), and a
    vectorized order of this sum measured 0.0504 on one reference prompt, the serial one 0.026. One sum is a
    chain of dependent additions, so on a device of few threads (not `wide`) whole groups of NORM_LANES tokens
    run at once, a lane each (the same sums, bit for bit: 1B shape, a 128-token step's 33 norms on one thread
    8.8 -> 4.4 ms), each token's scale kept in its row of `out` until the row is written; the rest (a decode
    step's one token), and a wide device's every token (a GPU's block, whose lanes stage the terms), one an
    iteration."""
    k = ir.Kernel(f"rmsnorm_{dim}_T{T}_{eps:g}{'_wide' if wide else ''}")
    k.buffer("x", "f32", T * dim), k.buffer("w", "f32", dim), k.buffer("out", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    square_sum = lambda t: _square_sum(k, "x", t * dim, dim)
    scale = lambda ss: _inverse_rms(ss, dim, eps)

    def normed(t, r):
        with k.loop("i", dim, "vector") as i:
            k.store("out", t * dim + i, k.load("x", t * dim + i) * r * k.load("w", i))
    L, rest = NORM_LANES, t0
    if T >= NORM_LANES and not wide:
        with k.parallel("g", (n - t0) // L) as g:
            with k.loop("l", L, "vector") as l:
                t = t0 + g * L + l
                k.store("out", t * dim, scale(k.let("ss", square_sum(t))))
            with k.loop("j", L, "serial") as j:
                t = k.let("t", t0 + g * L + j)
                normed(t, k.let("r", k.load("out", t * dim)))
        rest = t0 + (n - t0) // L * L
    with k.parallel("j", n - rest) as j:
        t = k.let("t", rest + j)
        normed(t, k.let("r", scale(square_sum(t))))
    return k.finish()


def _square_sum(k, buf, at, n):
    """The sum of squares of buf[at:at + n], in order (`rmsnorm`)."""
    return ir.reduce("add", "i", n, lambda i: k.load(buf, at + i) * k.load(buf, at + i), "serial")


def _inverse_rms(square_sum, n, eps):
    return ir.rsqrt(square_sum / float(n) + eps)


def head_rmsnorm(n_heads: int, head_dim: int, T: int, eps: float) -> ir.Kernel:
    """Each head of q (T tokens of n_heads heads) / its rms * w, in place, for the tokens from t0: Qwen3's query and
    key norms, before the rope. A head is small (64-128 values), so a head is an iteration."""
    k = ir.Kernel(f"head_rmsnorm_{n_heads}x{head_dim}_T{T}_{eps:g}")
    k.buffer("q", "f32", T * n_heads * head_dim, True), k.buffer("w", "f32", head_dim)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("th", (n - t0) * n_heads) as th:
        base = k.let("base", (t0 * n_heads + th) * head_dim)
        r = k.let("r", _inverse_rms(_square_sum(k, "q", base, head_dim), head_dim, eps))
        with k.loop("i", head_dim, "vector") as i:
            k.store("q", base + i, k.load("q", base + i) * r * k.load("w", i))
    return k.finish()


# tokens a tile of the int8 mode's prefill matmuls dots at once (`matmul(tokens=...)`): on a Zen 5, engines built
# each way in one process, alternated, the 1B shape's 256-token prompt ran 149 tok/s token by token, 202 in tiles
# of 2, 218 of 4, 210 of 8 (docs/benchmarks-history.md)
INT8_TOKENS = 4


@functools.cache
def matmul(fmt: Format, rows: int, cols: int, T: int, accumulate=False, bias=False, wide=False,
           digits=DIGITS, tokens=1, experts=0, used=0) -> ir.Kernel:
    """y[t, r] (+)= W[r, :] . x[t, :] (+ b[r]) for t in [t0, n_tokens); one quantized row per iteration (an
    interleaved format's: ROWS rows, a vector lane each), reused across the step's tokens while it is in cache.
    The dot4 layouts (`Format.digits`) read the input as `quantize_input(cols, T, digits)` writes it. wide: the
    row's dot in the form for a device of many threads (Format.row_dot). tokens: an interleaved format's tokens
    in tiles of this many, their dots sibling reduces over the row's blocks (one loop: each weight loaded and
    unpacked once for the tile), the rest in tiles of half as many, and so on to one. experts: W is that many
    matrices of rows x cols one after another, token t's the one sel[t * used + slot] names (`moe_route`'s
    choice; slot a scalar), so each token reads its own rows (no tiles)."""
    k = ir.Kernel(f"matmul_{fmt.name}_{rows}x{cols}_T{T}{'_acc' if accumulate else ''}{'_bias' if bias else ''}"
                  f"{'_wide' if wide else ''}{f'_d{digits}' if fmt.digits and digits != DIGITS else ''}"
                  f"{f'_t{tokens}' if tokens > 1 else ''}{f'_e{experts}x{used}' if experts else ''}")
    k.buffer("w", fmt.storage, max(1, experts) * rows * fmt.row_units(cols)), k.buffer("x", "f32", T * cols)
    if fmt.digits:
        k.buffer("xq", "u8", T * digits * cols), k.buffer("xd", "f32", T * cols // 32)
        k.buffer("xs", "f32", T * cols // 16)
    if bias:
        k.buffer("b", "f32", rows)
    k.buffer("y", "f32", T * rows, True)
    k.flops = lambda n_tokens: 2 * rows * cols * n_tokens  # (an expert launch's: one matrix a token)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    if experts:
        k.buffer("sel", "i32", T * used)
        slot = k.scalar("slot")
        tokens = 1

    def row(t, r):  # row r of token t's matrix (an interleaved format's: row group r)
        return r + k.load("sel", t * used + slot) * (rows // ROWS if isinstance(fmt, Interleaved) else rows) \
            if experts else r

    def put(t, r, v):
        if bias:
            v = v + k.load("b", r)
        if accumulate:
            v = k.load("y", t * rows + r) + v
        k.store("y", t * rows + r, v)
    if isinstance(fmt, Interleaved):
        k.tune_as(f"matvec_{fmt.name}", n_tokens=1, t0=0)  # tuned for the decode step, where weights stream
        with k.parallel("rg", rows // ROWS) as rg:
            def dots(t, ri, n):  # tokens t .. t + n - 1 by the group's rows (lanes ri)
                vs = [k.let(f"dot{j}", fmt.lane_dot(k, "w", row(t + j, rg), ri, cols, Input(k, t + j, cols, digits)))
                      for j in range(n)]
                for j, v in enumerate(vs):
                    put(t + j, rg * ROWS + ri, v)
            tiled = t0
            while tokens > 1:  # tiles of `tokens`, then of half as many ... (a batch of 3: a tile of 2 and one)
                with k.loop(f"tt{tokens}", (n - tiled) // tokens, "serial") as tt:
                    with k.loop("ri", ROWS, "vector") as ri:
                        dots(tiled + tt * tokens, ri, tokens)
                tiled = k.let(f"tiled{tokens}", n - (n - tiled) % tokens)
                tokens //= 2
            with k.loop("t", n - tiled, "serial", start=tiled) as t:
                with k.loop("ri", ROWS, "vector") as ri:
                    dots(t, ri, 1)
        return k.finish()
    with k.parallel("r", rows) as r:
        with k.loop("t", n - t0, "serial", start=t0) as t:
            put(t, r, fmt.row_dot(k, "w", row(t, r), cols, lambda c: k.load("x", t * cols + c), wide))
    return k.finish()


@functools.cache
def moe_route(experts: int, used: int, T: int, normalize: bool) -> ir.Kernel:
    """A mixture of experts' router for the tokens from t0: the `used` experts of token t's largest logits r[t, :]
    (the first of equal ones) into sel[t * used + j], likeliest first, and their weights into wt: softmax(r)'s,
    divided by their sum where normalize (Mixtral's, Qwen3-MoE's; OLMoE's not). A chosen logit is scored out of r
    as it is taken."""
    k = ir.Kernel(f"moe_route_{experts}x{used}_T{T}{'_norm' if normalize else ''}")
    k.buffer("r", "f32", T * experts, True), k.buffer("sel", "i32", T * used, True)
    k.buffer("wt", "f32", T * used, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:
        t = k.let("t", t0 + j)
        logit = lambda e: k.load("r", t * experts + e)
        top = k.let("top", ir.reduce("max", "e", experts, logit))
        weights = []
        for i in range(used):
            m = top if i == 0 else k.let(f"m{i}", ir.reduce("max", "e", experts, logit))
            at = k.let(f"at{i}", ir.i32(ir.reduce("min", "e", experts,
                                                 lambda e: ir.select(logit(e) == m, ir.f32(e), float(experts)))))
            k.store("sel", t * used + i, at)
            weights.append(k.let(f"p{i}", exp(m - top)))
            k.store("r", t * experts + at, OUT)
        # the softmax's sum: the chosen ones', or every expert's (the chosen now scored out of r: added back)
        total = sum(weights[1:], weights[0])
        if not normalize:
            total = total + ir.reduce("add", "e", experts, lambda e: exp(logit(e) - top))
        for i, w in enumerate(weights):
            k.store("wt", t * used + i, w / total)
    return k.finish()


def digit_max(digits: int) -> int:
    """The largest integer of an input element in `digits` digits (exact in f32; its digits in range)."""
    top = 127 * (256 ** digits - 1) // 255
    return top if top < 1 << 24 else 1 << 8 * digits - 2


@functools.cache
def quantize_input(cols: int, T: int, digits: int = DIGITS, span: int = 32, sums: int = 16) -> ir.Kernel:
    """x -> what the dot4 layouts' dots read of it (quant.Input), once per input instead of once per row: per span
    of 32 elements (or `span`: 256 for `tile_matmul`) a scale, max |x| / digit_max, and each element's integer
    round(x / scale) as `digits` balanced base-256 digits (each in [-128, 127], an int8 for dot4; digit i of a
    token's elements in a row of bytes, 4 consecutive elements a word); per span of 16 (or `sums`) the sum of those
    values. With DIGITS (3), each element within 2^-24 of its span's largest |x|: the error of one f32 rounding of
    the span's largest product, so a dot's
    error stays that of f32 arithmetic (logits as close to transformers' as with 4 digits, 6.8e-5 against 7.1e-5
    on SmolLM2), for three quarters of the integer products of 4 digits (each element's own 24 bits, 30 of the
    largest). With INT8 (1), as llama.cpp quantizes activations: SmolLM2's logits move by ~1."""
    top_int = digit_max(digits)
    k = ir.Kernel(f"quantize_input_{cols}_T{T}" + (f"_d{digits}" if digits != DIGITS else "")
                  + (f"_s{span}" if span != 32 else "") + (f"_m{sums}" if sums != 16 else ""))
    k.buffer("x", "f32", T * cols), k.buffer("xq", "u8", T * digits * cols, True)
    k.buffer("xd", "f32", T * cols // span, True), k.buffer("xs", "f32", T * cols // sums, True)
    spans = cols // span
    with k.parallel("ts", k.scalar("n_tokens") * spans) as ts:  # span ts of the step's inputs
        t, c0 = ts // spans, ts % spans * span
        x = lambda j: k.load("x", ts * span + j)
        top = k.let("top", ir.reduce("max", "j", span, lambda j: ir.Un("abs", x(j)), "vector"))
        scale = k.let("scale", top * (1.0 / top_int))
        k.store("xd", ts, scale)
        inv = k.let("inv", float(top_int) / ir.vmax(top, 1e-30))  # a span of zeros stays zeros
        # clamped: x / scale rounds to f32 first, and the span's largest could come out a step beyond
        integer = lambda j: ir.i32(ir.Un("floor", ir.vmin(ir.vmax(x(j) * inv, -top_int), top_int) + 0.5))
        for h in range(span // sums):  # sums of the quantized values: offsets then weigh the same input as the dots
            k.store("xs", ts * (span // sums) + h,
                    ir.reduce("add", "j", sums, lambda j: F(integer(sums * h + j)), "vector") * scale)
        with k.loop("j", span, "vector") as j:
            v = integer(j)
            for i in range(digits):  # digit i is v's low byte (stored); v - digit, over 256, is the rest
                k.store("xq", (t * digits + i) * cols + c0 + j, v)
                v = (v + 128) >> 8
    return k.finish()


# The prefill matmul's register tile, (row groups, tokens): 4 x 6 accumulators take 10 loads per 24 multiply-adds,
# 2 x 8 10 per 16 -- yet 2 x 8 measured faster on a Zen 5 (GEMM_WIDE); a step runs tiles of N and N - 1 tokens
# wherever its count is such a sum
GEMM_GROUPS = 4         # groups of ROWS rows (a vector of lanes each) in the tile where GEMM_WIDE does not fit, at most
GEMM_TOKENS = 6         # tokens of that tile: a weight vector feeds 6 accumulators, a token's value 4
GEMM_TILE = (GEMM_GROUPS, GEMM_TOKENS)  # the tile of a device that does not say its registers
# the tile where it fits the registers (AVX-512): 2 groups x 8 tokens -- a 32-token step 4 tiles instead of 6, and a
# block's scratch (32 KB) in L1. ab_gemm.py, one thread, 32 / 128 tokens, against 4 x 6: R4K 8192 x 2048 5.75 ->
# 5.19 / 19.3 -> 18.8 ms, R6 2048 x 8192 5.83 -> 5.38 / 19.7 -> 19.9; prompts (ab_decode.py, alternated): the 1B's
# 32 tokens 97.8 -> 104.1 tok/s, 256 tokens 114.0 -> 115.4; SmolLM2's 37 tokens 2 x 8 against 3 x 8 862.7 / 816.6
# (two threads 1605 / 1537). 2 x 12 and 2 x 14 (140 GFLOP/s) slower
GEMM_WIDE = (2, 8)
GEMM_BLOCK = 256        # columns of W dequantized at a time (2 x 16 rows x 256 columns of f32: 32 KB, in L1)
GEMM_SLICES = 32        # parallel iterations of a prefill matmul (each with its own scratch block)


def gemm_block(fmt: Format, width: int) -> int:
    """Columns of the prefill matmul's blocks: whole blocks of fmt, up to GEMM_BLOCK (or one), dividing width."""
    return next(b for b in range(max(GEMM_BLOCK, fmt.block) // fmt.block * fmt.block, 0, -fmt.block)
                if width % b == 0)


def gemm_tile(registers: int) -> tuple[int, int]:
    """(row groups, tokens) of the prefill matmul's register tile on a device whose thread holds `registers` f32
    values in vector registers (Caps.registers): GEMM_WIDE where its accumulators and a weight vector per group fit
    (AVX-512's 32 x 16), else as many groups of GEMM_TOKENS as fit (AVX2's 16 x 8: one group, whose block of
    scratch then stays in L1 for every token tile -- 71-72 against 50-64 GFLOP/s for 4 groups split into loops
    that fit), at least one; not said (0): GEMM_TILE."""
    if not registers:
        return GEMM_TILE
    groups, tokens = GEMM_WIDE
    if groups * ROWS * (tokens + 1) <= registers:
        return GEMM_WIDE
    return next((g for g in range(GEMM_GROUPS, 0, -1) if g * ROWS * (GEMM_TOKENS + 1) <= registers), 1), GEMM_TOKENS


def _prefill_tiles(fmt: Format, rows: int, width: int, groups: int) -> tuple[int, int, int]:
    """(row groups of a tile, columns of a block, parallel slices) of a prefill matmul over `width` columns."""
    G = next(g for g in range(groups, 0, -1) if rows % (g * ROWS) == 0)
    return G, gemm_block(fmt, width), min(GEMM_SLICES, rows // (G * ROWS))


def _slice_scratch(G: int, blk: int, width: int, T: int) -> int:
    """f32 elements of one parallel slice's scratch: a block of its tile's rows, dequantized, and where the
    block is not the whole width, the tile's partial sums for every token of the step."""
    return G * ROWS * blk + (T * G * ROWS if width > blk else 0)


def prefill_scratch(fmt: Format, rows: int, width: int, T: int) -> int:
    """f32 elements of a prefill matmul's `wdq` scratch: each slice's (`_slice_scratch`), for a tile of as many
    row groups as any device's (`gemm_tile`: GEMM_WIDE's or at most GEMM_GROUPS)."""
    most = max(GEMM_GROUPS, GEMM_WIDE[0])
    return max(s * _slice_scratch(G, blk, width, T) for G, blk, s in (_prefill_tiles(fmt, rows, width, g)
                                                                      for g in range(1, most + 1)))


@functools.cache
def prefill_matmul(fmt: Format, rows: int, cols: int, T: int, accumulate=False, bias=False, chunk_cols=0,
                   tile=GEMM_TILE) -> ir.Kernel:
    """y[t, r] (+)= sum_c W[r, c] x[t, c] (+ b[r]) for t in [t0, n_tokens), W in layout fmt: a prefill step's matmul,
    whose weights are read once for all of the step's tokens. Each parallel iteration (a slice of the rows) takes
    a register tile's rows at a time (`tile`: groups of ROWS rows x tokens, `gemm_tile`) and, block by block of
    columns, dequantizes them into f32 scratch of its own (`wdq`: interleaved, W[r // ROWS, c, r % ROWS]), then
    multiplies that block by every token of the step: per column, one vector load per group (a lane per row)
    and one broadcast input value per token, the tile's tokens at a time, each value feeding the others'
    multiply-adds. A block's sums add to the earlier blocks' in the slice's scratch (after its block:
    `_slice_scratch`), the last block's into y (contiguous rows: a vector each). Tokens outside [t0,
    n_tokens) compute on what x holds and store nothing. With `chunk_cols`, only columns [col0, col0 +
    chunk_cols) (a sum over the rest is another launch's)."""
    width = chunk_cols or cols
    if rows % ROWS:
        raise ir.IRError(f"prefill matmul {rows}x{cols}: {rows} rows are not whole groups of {ROWS}")
    groups, tokens = tile
    G, blk, slices = _prefill_tiles(fmt, rows, width, groups)
    N, tile_rows = min(T, tokens), G * ROWS
    k = ir.Kernel(f"gemm_{fmt.name}_{rows}x{cols}_T{T}_{tile_rows}x{N}_b{blk}"
                  f"{f'_k{chunk_cols}' if chunk_cols else ''}{'_acc' if accumulate else ''}{'_bias' if bias else ''}")
    k.tune_as(f"gemm_{fmt.name}_{tile_rows}", n_tokens=T, t0=0)  # a device may tune it (the engine tunes decode's)
    k.buffer("w", fmt.storage, rows * fmt.row_units(cols)), k.buffer("x", "f32", T * cols)
    k.w_read = lambda n_tokens: rows * fmt.row_units(width)
    k.flops = lambda n_tokens: 2 * rows * width * n_tokens
    if bias:
        k.buffer("b", "f32", rows)
    k.buffer("y", "f32", T * rows, True), k.buffer("wdq", "f32", prefill_scratch(fmt, rows, width, T), True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    col0 = k.scalar("col0") if chunk_cols else 0
    # tiles of N tokens from the first wanted; the rest of the step in tiles of N and N - 1 where it is such a sum
    # (short tiles of N - 1 make up what N leaves over, if there are tokens enough: every count from (N - 1)(N - 2)
    # up, and many below -- with N = 8 a 64-token step 8 tiles of 8, a 37-token one 2 of 8 and 3 of 7, no token
    # run that the step does not hold), else whole tiles of N and one of `tail` (T % N) tokens where the step
    # reaches it: no token runs twice, and no tile reads past the step's last row
    tail, first = T % N, t0 // N
    full, short = (n - tail + N - 1) // N, 0  # where the tiles of N end; tiles of N - 1 after them
    m = n - first * N
    shorter = N > 2  # whether a step can hold tiles of N - 1
    if shorter:
        over = (N - m % N) % N
        short = ir.select(m >= over * (N - 1), over, 0)
        full = ir.select(short > 0, first + (m - short * (N - 1)) // N, full)
    blocks = width // blk
    with k.parallel("s", slices) as s:
        scratch = k.let("scratch", s * _slice_scratch(G, blk, width, T))
        sums = scratch + tile_rows * blk  # the tile's partial sums, [token, row of the tile], where blocks > 1
        rt0 = k.let("rt0", s * (rows // tile_rows) // slices)
        with k.loop("rt", (s + 1) * (rows // tile_rows) // slices - rt0, "serial", start=rt0) as rt:
            with k.loop("cb", blocks, "serial") as cb:
                b0 = k.let("b0", col0 // fmt.block + cb * (blk // fmt.block))
                # scratch[i, c, r]: row group i, column c of the block, row r of the group; the groups (and the
                # format's pieces) in loops, not unrolled: the same speed, a fifth of the code and of its
                # compile time (Q4_K 8192 x 2048: 3.1 -> 0.6 s)
                with k.loop("g", G, "serial") as i:
                    at = lambda b, e, r: scratch + i * (blk * ROWS) + b * (fmt.block * ROWS) + e * ROWS + r
                    dequant_rows(k, fmt, "w", rt * G + i, b0, blk // fmt.block, cols,
                                 lambda b, e, r, v: k.store("wdq", at(b, e, r), v))
                k.barrier()
                xb = col0 + cb * blk

                def tile(start, size):  # tokens [start, start + size) of the step by the block's rows
                    with k.loop("l", ROWS, "vector") as l:
                        c = ir.Var("c")
                        xs = [k.let(f"x{size}_{t}", (start + t) * cols + xb) for t in range(size)]
                        dot = lambda i, t: ir.Reduce("add", "c", ir.as_expr(blk), k.load(
                            "wdq", scratch + i * (blk * ROWS) + c * ROWS + l) * k.load("x", xs[t] + c))
                        # token by token, so that each broadcast input feeds its row groups and dies
                        dots = {(i, t): k.let(f"d{size}_{i}_{t}", dot(i, t)) for t in range(size) for i in range(G)}
                        for t in range(size):
                            tok = start + t
                            wanted = ir.Bin("land", tok >= t0, tok < n)
                            # a block's sums add to the earlier blocks' in the slice's scratch, the last
                            # block's into y: y's rows for the step's tokens lie 8-32 KB apart and share a few
                            # cache sets (sampled, the adds into y after every block took 5 % of the gemm;
                            # the 1B prompt on one and two threads, alternated: 1.3 and 1.5 % faster)
                            last = ir.Bin("land", wanted, cb == blocks - 1) if blocks > 1 else wanted
                            for i in range(G):
                                r, at = rt * tile_rows + i * ROWS + l, sums + tok * tile_rows + i * ROWS + l
                                v = dots[i, t]
                                if blocks > 1:
                                    v = v + ir.select(cb > 0, k.load("wdq", at), 0.0)
                                    with k.if_(ir.Bin("land", wanted, cb < blocks - 1)):
                                        k.store("wdq", at, v)
                                with k.if_(last):
                                    out = v + k.load("y", tok * rows + r) if accumulate else v
                                    k.store("y", tok * rows + r, out + k.load("b", r) if bias else out)
                with k.loop("tt", ir.vmax(full, first) - first, "serial", start=first) as tt:
                    tile(tt * N, N)
                if shorter:
                    with k.loop("ts", short, "serial") as ts:
                        tile(full * N + ts * (N - 1), N - 1)
                if tail:
                    with k.if_(full * N + short * (N - 1) < n):
                        tile(full * N, tail)
                k.barrier()  # before the next block overwrites the scratch
    return k.finish()


# The prefill matmul of integer tiles (`tile_matmul`): TILE_TOKENS tokens' DIGITS digits are a tile of input rows
# (15 of an AMX tile's 16), TILE_INPUTS such tiles a TileDot's (each weights tile loaded once for both: 2 input, 2
# weights and 4 accumulator tiles fill AMX's 8), against weights of a format's integer form (`Format.integers`) in
# blocks of TILE_SPAN columns: one scale a row (d) and one a token (the input's, quantized in spans of TILE_SPAN), so
# that a tile sums a whole block before the scales, and each row's integer takes two bytes (TILE_PLANES tiles).
# On a Sapphire Rapids core with random weights and inputs (2048 x 2048 Q4_K by 128 tokens, best of 5, alternated with
# the f32 prefill matmul): 12.0-13.1 ms against 13.2-14.2; on all-zero data 7.2-9.0 against 9.4-11.9 -- AMX runs
# faster on zeros, so measure with real data (`benchmarks/kernel_speed.py --only prefill` prints both kinds)
TILE_TOKENS = 5
TILE_INPUTS = 2
TILE_SPAN = 256
TILE_PLANES = 2
_TILE_WORDS = TILE_SPAN // 4 * ROWS                    # i32 words of one plane of a block of a row group
_TILE_OUT = TILE_TOKENS * DIGITS * ROWS                 # i32 sums of one input tile by one plane: input rows x rows
_TILE_SCALES = (1 + TILE_SPAN // 32) * ROWS             # f32 of a block of a row group: d, the spans' offsets


def tile_tokens(T: int) -> int:
    """Tokens an input of a step of T tokens holds for `tile_matmul`: whole TileDots, the last one's past T unused."""
    n = TILE_TOKENS * TILE_INPUTS
    return -(-T // n) * n


def tile_dots_fit(fmt: Format, rows: int, cols: int) -> bool:
    """Whether a matmul of weights in layout fmt goes through `tile_matmul`."""
    return fmt.integer_tiles and fmt.block == TILE_SPAN and rows % ROWS == 0 and cols % TILE_SPAN == 0


def _tile_slices(rows):
    return min(GEMM_SLICES, rows // ROWS)


def tile_scratch(rows: int, width: int) -> tuple[int, int]:
    """(i32, f32) elements of a tile matmul's scratch (`wt`, `wts`): each slice's integer planes and sums, its
    scales and offsets, for a row group's blocks over `width` columns, and its tokens' sums so far."""
    blocks, slices = width // TILE_SPAN, _tile_slices(rows)
    return (slices * blocks * TILE_PLANES * (_TILE_WORDS + TILE_INPUTS * _TILE_OUT),
            slices * (blocks * _TILE_SCALES + TILE_INPUTS * TILE_TOKENS * ROWS))


@functools.cache
def tile_matmul(fmt: Format, rows: int, cols: int, T: int, accumulate=False, bias=False, chunk_cols=0) -> ir.Kernel:
    """`prefill_matmul`'s product by integer tile dots, for a device that runs TileDot as matrix instructions: each
    parallel iteration (a slice of the row groups) writes a row group's blocks in the format's integer form (d,
    the offsets of its spans of 32, and each weight's integer as two planes of bytes: `Format.integers`), then
    takes the step's tokens TILE_TOKENS at a time: per block one TileDot of their digits (the input as
    `quantize_input(span=TILE_SPAN, sums=32)` writes it) by each plane, exact in i32, and per token and row the sum over
    blocks of d x the token's block scale x (its digits' and planes' sums, weighed) + the offsets x the token's
    span sums. Values as exact as the f32 product (digits within 2^-24 of their span's largest; dots in i32).
    Tokens outside [t0, n_tokens) compute on what the input holds and store nothing."""
    width = chunk_cols or cols
    if not tile_dots_fit(fmt, rows, width):
        raise ir.IRError(f"tile matmul {rows}x{cols}: {fmt.name} rows in groups of {ROWS} by blocks of {TILE_SPAN}")
    nb, slices, Tp = width // TILE_SPAN, _tile_slices(rows), tile_tokens(T)
    k = ir.Kernel(f"tilemm_{fmt.name}_{rows}x{cols}_T{T}{f'_k{chunk_cols}' if chunk_cols else ''}"
                  f"{'_acc' if accumulate else ''}{'_bias' if bias else ''}")
    k.buffer("w", fmt.storage, rows * fmt.row_units(cols))
    k.buffer("xq", "u8", Tp * DIGITS * cols), k.buffer("xd", "f32", Tp * cols // TILE_SPAN)
    k.buffer("xs", "f32", Tp * cols // 32)
    k.w_read = lambda n_tokens: rows * fmt.row_units(width)
    k.flops = lambda n_tokens: 2 * rows * width * n_tokens
    if bias:
        k.buffer("b", "f32", rows)
    k.buffer("y", "f32", T * rows, True)
    words, scales = tile_scratch(rows, width)
    k.buffer("wt", "i32", words, True), k.buffer("wts", "f32", scales, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    col0 = k.scalar("col0") if chunk_cols else 0
    groups, G = rows // ROWS, TILE_TOKENS * TILE_INPUTS  # G: the tokens of a TileDot
    first = t0 // G
    with k.parallel("s", slices) as s:
        planes = k.let("planes", s * (words // slices))  # [block, plane, word, lane]
        sums = planes + nb * TILE_PLANES * _TILE_WORDS   # [block, input tile, plane, input row, lane]
        sc = k.let("sc", s * (scales // slices))          # [block, d / span offsets, lane]
        g0 = k.let("g0", s * groups // slices)
        with k.loop("rg", (s + 1) * groups // slices - g0, "serial", start=g0) as rg:
            with k.loop("b", nb, "serial") as b:
                for p in range(fmt.pieces):  # unrolled: the elements' places, and so their words, are numbers
                    with k.loop("l", ROWS, "vector") as l:
                        d, ints, offsets = fmt.integers(k, "w", fmt.at(rg, col0 // fmt.block + b, cols // fmt.block, l),
                                                        p)
                        k.store("wts", sc + b * _TILE_SCALES + l, d)
                        for j, o in offsets:
                            k.store("wts", sc + b * _TILE_SCALES + (1 + j) * ROWS + l, o)
                        u = dict(ints)
                        for e in sorted(u)[::4]:  # a word of 4 elements' bytes per plane
                            for plane in range(TILE_PLANES):
                                byte = lambda q: (u[e + q] >> 8 * plane) & 255 if plane + 1 < TILE_PLANES \
                                    else u[e + q] >> 8 * plane
                                word = byte(0) | (byte(1) << 8) | (byte(2) << 16) | (byte(3) << 24)
                                k.store("wt", planes + ((b * TILE_PLANES + plane) * (TILE_SPAN // 4) + e // 4) * ROWS
                                        + l, word)
            k.barrier()
            def block(b, tt, tok, l):  # token tok's (the TileDot's tt-th) dot with row lane l over block b
                at = lambda plane, i: sums + ((b * TILE_INPUTS + tt // TILE_TOKENS) * TILE_PLANES + plane) \
                    * _TILE_OUT + (tt % TILE_TOKENS * DIGITS + i) * ROWS + l
                ints = [sum((k.load("wt", at(pl, i)) << 8 * pl for pl in range(1, TILE_PLANES)), k.load("wt", at(0, i)))
                        for i in range(DIGITS)]
                dot = sum((F(v) * float(256 ** i) for i, v in enumerate(ints) if i), F(ints[0]))
                span0 = tok * (cols // 32) + (col0 + b * TILE_SPAN) // 32
                offs = [k.load("wts", sc + b * _TILE_SCALES + (1 + j) * ROWS + l) * k.load("xs", span0 + j)
                        for j in range(TILE_SPAN // 32)]
                scaled = k.load("wts", sc + b * _TILE_SCALES + l) * k.load(
                    "xd", tok * (cols // TILE_SPAN) + (col0 + b * TILE_SPAN) // TILE_SPAN) * dot
                return sum(offs, scaled)

            with k.loop("g", (n - first * G + G - 1) // G, "serial", start=first) as g:
                # block b's tile dots, then block b - 1's sums scaled and added up: the tile multiplies run in
                # AMX's unit while the vector instructions of the block before go on beside them
                with k.loop("b", nb + 1, "serial") as b:
                    with k.if_(b < nb):
                        tiles = [(i, plane) for i in range(TILE_INPUTS) for plane in range(TILE_PLANES)]
                        k.tile_dot("xq", [(g * G + i * TILE_TOKENS) * (DIGITS * cols) + col0 + b * TILE_SPAN
                                          for i in range(TILE_INPUTS)], cols, "wt",
                                   [planes + (b * TILE_PLANES + plane) * _TILE_WORDS for plane in range(TILE_PLANES)],
                                   "wt", [(i, plane, sums + (b * len(tiles) + j) * _TILE_OUT)
                                          for j, (i, plane) in enumerate(tiles)],
                                   TILE_TOKENS * DIGITS, ROWS, TILE_SPAN // 4, ROWS)
                    k.barrier()
                    with k.if_(b > 0), k.loop("l", ROWS, "vector") as l:
                        for tt in range(G):
                            tok = g * G + tt
                            part = sc + nb * _TILE_SCALES + tt * ROWS + l  # the sum of the blocks so far
                            v = k.let(f"v{tt}", block(b - 1, tt, tok, l) + ir.select(b > 1, k.load("wts", part), 0.0))
                            with k.if_(b < nb):
                                k.store("wts", part, v)
                            r = rg * ROWS + l
                            with k.if_(ir.Bin("land", b == nb, ir.Bin("land", tok >= t0, tok < n))):
                                out = v + k.load("y", tok * rows + r) if accumulate else v
                                k.store("y", tok * rows + r, out + k.load("b", r) if bias else out)
                    k.barrier()
            k.barrier()
    return k.finish()


def _positions(k, max_pages, batched):
    """(token t's position, entry p of token t's page table, the step's first position or None) as IR: a step of
    one sequence's tokens, at positions pos, pos + 1, ... with one page table; or a decode step of up to `batched`
    sequences, a token each, token t at tpos[t] with its sequence's table in row t of ptab (`Engine._decode`).
    (max_pages 0: no page table.)"""
    if batched:
        k.buffer("tpos", "i32", batched)
        if max_pages:
            k.buffer("ptab", "i32", batched * max_pages)
        return (lambda t: k.load("tpos", t)), (lambda t, p: k.load("ptab", t * max_pages + p)), None
    if max_pages:
        k.buffer("ptab", "i32", max_pages)
    pos = k.scalar("pos")
    return (lambda t: pos + t), (lambda t, p: k.load("ptab", p)), pos


@functools.cache
def rope(n_heads: int, head_dim: int, T: int, positions: int, batched=0) -> ir.Kernel:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by (pos + t) * freq[i] (GGUF llama layout; batched: `_positions`),
    the angle's cosine and sine read from `rot` ([positions, head_dim / 2, 2], `llama.rope_table`): computed once
    for the engine, not twice a token and pair in every step and layer (1B prefill step's ropes on one thread 4.9
    -> 4.1 ms)."""
    half = head_dim // 2
    k = ir.Kernel(f"rope_{n_heads}x{head_dim}_T{T}_p{positions}{f'_b{batched}' if batched else ''}")
    k.buffer("q", "f32", T * n_heads * head_dim, True), k.buffer("rot", "f32", positions * half * 2)
    position = _positions(k, 0, batched)[0]
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("ti", (n - t0) * half) as ti:  # tokens from t0, the first whose output is wanted
        t, i = t0 + ti // half, ti % half
        at = (position(t) * half + i) * 2
        c, s = k.let("c", k.load("rot", at)), k.let("s", k.load("rot", at + 1))
        with k.loop("h", n_heads, "serial") as h:
            base = t * (n_heads * head_dim) + h * head_dim + 2 * i
            x0, x1 = k.let("x0", k.load("q", base)), k.let("x1", k.load("q", base + 1))
            k.store("q", base, x0 * c - x1 * s)
            k.store("q", base + 1, x0 * s + x1 * c)
    return k.finish()


def _v_index(pg, slot, kvh, n_kv, head_dim, page):
    """Element index of the value in `slot` of pool page pg, kv head kvh (dimension 0; V pages are
    [pages, page, n_kv, head_dim])."""
    return ((pg * page + slot) * n_kv + kvh) * head_dim


def _k_index(pg, slot, kvh, d, n_kv, head_dim, page):
    """Element index of dimension d of the key in `slot` of pool page pg, kv head kvh: K pages are stored
    transposed, [pages, n_kv, head_dim, page], so that a page's keys are contiguous for each dimension (the scores
    of a page's positions, a vector of lanes, then read vectors rather than gather)."""
    return ((pg * n_kv + kvh) * head_dim + d) * page + slot


@functools.cache
def kv_store(n_kv: int, head_dim: int, T: int, page: int, n_pages: int, max_pages: int, kv_dtype: str,
             batched=0) -> ir.Kernel:
    """The step's keys and values into their pages of the pool (batched: a token of its own sequence each,
    `_positions`)."""
    k = ir.Kernel(f"kvstore_{n_kv}x{head_dim}_T{T}_p{page}x{n_pages}_{kv_dtype}{f'_b{batched}' if batched else ''}")
    width = n_kv * head_dim
    k.buffer("k", "f32", T * width), k.buffer("v", "f32", T * width)
    position, ptab, pos = _positions(k, max_pages, batched)
    k.buffer("kc", kv_dtype, n_pages * page * width, True), k.buffer("vc", kv_dtype, n_pages * page * width, True)
    n = k.scalar("n_tokens")

    def store(at, pg, h, src):  # position at's values of KV head h, from src on, into page pg
        with k.loop("d", head_dim, "vector") as d:
            k.store("kc", _k_index(pg, at % page, h, d, n_kv, head_dim, page), k.load("k", src + d))
            k.store("vc", _v_index(pg, at % page, h, n_kv, head_dim, page) + d, k.load("v", src + d))
    if batched:  # pages of different sequences: an iteration per (token, KV head)
        with k.parallel("th", n * n_kv) as th:
            t, h = th // n_kv, th % n_kv
            at = k.let("at", position(t))
            store(at, k.let("pg", ptab(t, at // page)), h, t * width + h * head_dim)
        return k.finish()
    # an iteration per (page, KV head), its positions in turn: a transposed K page interleaves its positions'
    # values in each cache line, which threads storing a position each would pass back and forth (a 1B prefill
    # step's stores on two threads: 2.9 ms against 0.5 on one)
    first = pos // page
    with k.parallel("ph", ((pos + n - 1) // page - first + 1) * n_kv) as ph:
        p, h = first + ph // n_kv, ph % n_kv
        pg = k.let("pg", ptab(0, p))
        start = k.let("start", ir.vmax(pos, p * page))
        with k.loop("at", ir.vmin(pos + n, p * page + page) - start, "serial", start=start) as at:
            store(at, pg, h, (at - pos) * width + h * head_dim)
    return k.finish()


def exp(x):
    """e^x from IR arithmetic alone (range reduction to [-ln2/2, ln2/2], a degree-7 polynomial, and 2^n built
    in the exponent bits), so that it vectorizes on every backend; relative error ~2e-7 over [-87, 88]."""
    x = ir.vmin(ir.vmax(x, -87.0), 88.0)
    n = ir.Un("floor", x * 1.4426950408889634 + 0.5)
    r = x - n * 0.693145751953125 - n * 1.428606765330187e-06
    p = 1.0 / 5040.0
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + c
    return p * ir.bf16bits((ir.i32(n) + 127) << 7)


# pages ahead whose keys (and values) of its KV head attention prefetches, into L2: 2 KB (f16) of each 16 KB pool
# page, where the hardware's prefetchers fell behind (the 1B shape's 16 attention launches of a decode step at
# 3,000 positions, one thread: 13.5 -> 7.2 ms; 2 pages ahead, or into L1, 7.7-8.1; docs/benchmarks-history.md)
KV_AHEAD = 4
SCORE_CHAINS = 8  # multiply-add chains of the scores of a KV head's group of heads (each head's split in parts)


@functools.cache
def attention(n_head: int, n_kv: int, head_dim: int, T: int, page: int, n_pages: int, max_pages: int,
              kv_dtype: str, wide=False, window=0, scale=None, softcap=0.0, batched=0) -> ir.Kernel:
    """Causal attention of each new token over the layer's paged KV cache (K pages transposed, `_k_index`):
    scores for every position into a scratch row, softmax over the row (vectorizable), then the weighted sum of
    values. Page by page (a page's positions a vector of lanes), the heads that share a KV head in one parallel
    iteration, each key and value vector read (and widened from f16) once for all of them; or, wide (a device of
    many threads, whose lanes of a head outnumber a page's positions), a head an iteration, every position at
    once and each value dimension over all of them. window: a sliding window's width (0: none) -- a token at
    position q sees the keys of (q - window, q], from their first page on, the positions before them in that
    page scored out. scale: of the scores (None: 1 / sqrt(head_dim)); softcap: scores -> softcap * tanh(scores /
    softcap) (Gemma 2's; 0: none). batched: a token of its own sequence each (`_positions`)."""
    k = ir.Kernel(f"attn_{n_head}_{n_kv}x{head_dim}_T{T}_p{page}x{n_pages}_{kv_dtype}{'_wide' if wide else ''}"
                  f"{f'_w{window}' if window else ''}{f'_s{scale:g}' if scale else ''}"
                  f"{f'_cap{softcap:g}' if softcap else ''}{f'_b{batched}' if batched else ''}")
    qw, kw, ctx = n_head * head_dim, n_kv * head_dim, max_pages * page
    k.buffer("q", "f32", T * qw)
    position, ptab, _ = _positions(k, max_pages, batched)
    k.buffer("kc", kv_dtype, n_pages * page * kw), k.buffer("vc", kv_dtype, n_pages * page * kw)
    k.buffer("s", "f32", T * n_head * ctx, True), k.buffer("out", "f32", T * qw, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")  # queries from t0, the first wanted
    scale = scale or 1.0 / math.sqrt(head_dim)
    group = n_head // n_kv
    if wide:
        with k.parallel("th", (n - t0) * n_head) as th:
            t, h = t0 + th // n_head, th % n_head
            qo, so = t * qw + h * head_dim, (t * n_head + h) * ctx
            keys = k.let("keys", position(t) + 1) if batched else position(t) + 1
            first = k.let("first", ir.vmax(keys - window, 0)) if window else 0  # the first key it sees
            with k.loop("j", keys - first if window else keys, "vector", start=first) as j:
                key = _k_index(ptab(t, j // page), j % page, h // group, 0, n_kv, head_dim, page)
                k.store("s", so + j, _scores(k, [qo], key, page, head_dim, scale, 4, softcap)[0])
            inv = _softmax(k, so, keys, first=first)
            value = lambda j: k.load("s", so + j) * k.load(
                "vc", _v_index(ptab(t, j // page), j % page, h // group, n_kv, head_dim, page) + d)
            with k.loop("d", head_dim, "vector") as d:
                sum_v = ir.reduce("add", "j", keys - first, lambda j: value(first + j)) if window else \
                    ir.reduce("add", "j", keys, value)
                k.store("out", qo + d, sum_v * inv)
        return k.finish()
    with k.parallel("tk", (n - t0) * n_kv) as tk:
        t, kvh = k.let("t", t0 + tk // n_kv), tk % n_kv
        at = k.let("at", position(t)) if batched else position(t)  # (pos + t: an expression, as before batches)
        keys, pages = at + 1, (at + page) // page
        first = k.let("first", ir.vmax(keys - window, 0)) if window else 0  # the first key it sees ...
        p0 = k.let("p0", first // page) if window else 0  # ... on its page: the pages before are not read
        # where each head's q and scores start
        heads = [(t * qw + (kvh * group + i) * head_dim, (t * n_head + kvh * group + i) * ctx) for i in range(group)]

        def prefetch(p, rows):  # the step's first query: its pages come from memory; the later ones' from cache
            ahead = lambda: rows(k.let(f"ahead_{p.name}", ptab(t, ir.vmin(p + KV_AHEAD, pages - 1))))
            if batched:  # every query its own sequence's pages
                ahead()
                return
            with k.if_(t == t0):
                ahead()
        # scores, a lane per position: each dimension's keys one vector, each head's q a broadcast; positions past
        # the last key too (the softmax selects them out)
        with k.loop("p", pages - p0 if window else pages, start=p0) as p:
            pg = k.let("pg", ptab(t, p))
            prefetch(p, lambda pg: k.prefetch("kc", _k_index(pg, 0, kvh, 0, n_kv, head_dim, page), head_dim * page,
                                              near=False))
            with k.loop("slot", page, "vector") as slot:
                key = _k_index(pg, slot, kvh, 0, n_kv, head_dim, page)
                scores = _scores(k, [qo for qo, so in heads], key, page, head_dim, scale, max(1, SCORE_CHAINS // group),
                                 softcap)
                for (qo, so), sc in zip(heads, scores):
                    # a window's first page: the positions before it scored out (their exponentials are 0)
                    k.store("s", so + p * page + slot, ir.select(p * page + slot < first, OUT, sc) if window else sc)
        invs = [_softmax(k, so, keys, pages * page, f"{i}", p0 * page if window else 0)
                for i, (qo, so) in enumerate(heads)]
        for qo, so in heads:
            with k.loop("d", head_dim, "vector") as d:
                k.store("out", qo + d, 0.0)
        # values page by page, a lane per dimension: a page's weighted sums in registers, added to out once
        def values(p, last):
            pg = k.let(f"pg{'_last' if last else ''}", ptab(t, p))
            with k.loop("d", head_dim, "vector") as d:
                v = lambda slot: k.load("vc", _v_index(pg, slot, kvh, n_kv, head_dim, page) + d)
                if last:  # slots past the last key hold whatever the pool held (NaN times zero is NaN): selected out
                    v = lambda slot, v=v: ir.select(p * page + slot < keys, v(slot), 0.0)
                sums = [k.let(f"pv{i}", ir.reduce("add", "slot", page, lambda slot, so=so: k.load(
                    "s", so + p * page + slot) * v(slot))) for i, (qo, so) in enumerate(heads)]
                for (qo, so), pv in zip(heads, sums):
                    k.store("out", qo + d, k.load("out", qo + d) + pv)
        def value_rows(pg):
            with k.loop("vs", page) as slot:
                k.prefetch("vc", _v_index(pg, slot, kvh, n_kv, head_dim, page), head_dim, near=False)
        # the pages before the last whole, unselected (a select of each loaded vector -- a masked load -- made the
        # 1B shape's attention in a 128-token prefill step at 2,944 positions 17-20 % slower)
        with k.loop("vp", pages - 1 - p0 if window else pages - 1, start=p0) as p:
            prefetch(p, value_rows)
            values(p, False)
        values(pages - 1, True)
        for (qo, so), inv in zip(heads, invs):
            with k.loop("d", head_dim, "vector") as d:
                k.store("out", qo + d, k.load("out", qo + d) * inv)
    return k.finish()


def _dots(k, qo, key, stride, head_dim, parts=4, name=""):
    """Lets of q . key for the head whose q starts at qo, the key's dimension d at key + d * stride: in `parts` sums
    of a slice of the dimensions each, so that as many multiply-add chains run at once."""
    parts = parts if head_dim % parts == 0 else 1
    span = head_dim // parts
    return [k.let(f"qk{name}{i}", ir.reduce("add", "d", span, lambda d, i=i: k.load("q", qo + i * span + d)
                                           * k.load("kc", key + (i * span + d) * stride))) for i in range(parts)]


def _scores(k, qos, key, stride, head_dim, scale, parts, softcap=0.0):
    """Lets of q . key * scale (capped: `attention`) of the heads whose q start at qos against one key, each in
    `parts` chains: every head's sums first, one after another, so that a CPU sums them in one loop, each key
    vector loaded (and widened from f16) once for all."""
    dots = [_dots(k, qo, key, stride, head_dim, parts, f"{i}_") for i, qo in enumerate(qos)]
    capped = (lambda s: _capped(s, softcap)) if softcap else (lambda s: s)
    return [k.let(f"sc{i}", capped(sum(d[1:], d[0]) * scale)) for i, d in enumerate(dots)]


def _capped(x, cap):
    """cap * tanh(x / cap): Gemma 2's soft cap of scores and logits."""
    return ir.tanh(x * (1.0 / cap)) * cap


OUT = -3.0e38  # the score of a position out of a sliding window: its exponential is 0


def _softmax(k, so, keys, end=None, name="", first=0):
    """Scores [so + first, so + keys) -> their exponentials less the largest (and zeros on to `end` where given: a
    weighted sum over whole pages reads them); returns 1 / their sum. (first: 0, a number, or a sliding window's
    first position read, an expression.)"""
    k.barrier()
    if isinstance(first, int) and first == 0:  # written as before the windows came, so the same kernels
        extent, at, end = keys, (lambda j: so + j), end
    else:
        extent, at, end = keys - first, (lambda j: so + first + j), None if end is None else end - first
    m = k.let(f"m{name}", ir.reduce("max", "j", extent, lambda j: k.load("s", at(j)), "reduce"))
    k.barrier()
    with k.loop("j", extent if end is None else end, "vector") as j:
        e = exp(k.load("s", at(j)) - m)
        k.store("s", at(j), e if end is None else ir.select(j < extent, e, 0.0))
    k.barrier()
    return k.let(f"inv{name}", 1.0 / ir.reduce("add", "j", extent, lambda j: k.load("s", at(j)), "reduce"))


GELU_C = math.sqrt(2.0 / math.pi)


@functools.cache
def gelu_mul(dim: int, T: int) -> ir.Kernel:
    """h = gelu(g) * u, GELU in its tanh form (Gemma's gelu_pytorch_tanh), for the tokens from t0."""
    k = ir.Kernel(f"gelu_mul_{dim}_T{T}")
    k.buffer("g", "f32", T * dim), k.buffer("u", "f32", T * dim), k.buffer("h", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:
        t = t0 + j
        with k.loop("i", dim, "vector") as i:
            g = k.load("g", t * dim + i)
            gelu = 0.5 * g * (1.0 + ir.tanh(GELU_C * (g + 0.044715 * g * g * g)))
            k.store("h", t * dim + i, gelu * k.load("u", t * dim + i))
    return k.finish()


@functools.cache
def add(dim: int, T: int, scale=1.0, used=0) -> ir.Kernel:
    """x += y for the tokens from t0, times scale, and where used times wt[t * used + slot] (slot a scalar): a
    block's output joining the residual, normed (Gemma's sandwich norms), scaled (Granite's residual multiplier)
    and/or weighted (an expert's, by the router's weight for the token: `moe_route`)."""
    k = ir.Kernel(f"add_{dim}_T{T}{f'_x{scale:g}' if scale != 1.0 else ''}{f'_u{used}' if used else ''}")
    k.buffer("y", "f32", T * dim)
    if used:
        k.buffer("wt", "f32", T * used)
    k.buffer("x", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:
        if used:
            w = k.load("wt", (t0 + j) * used + k.scalar("slot"))
            w = k.let("w", w * scale if scale != 1.0 else w)
        else:
            w = scale
        with k.loop("i", dim, "vector") as i:
            at = (t0 + j) * dim + i
            k.store("x", at, k.load("x", at) + (k.load("y", at) * w if used or scale != 1.0 else k.load("y", at)))
    return k.finish()


@functools.cache
def add_gated(dim: int, T: int) -> ir.Kernel:
    """x += y * sigmoid(xin . w) for the tokens from t0: a shared expert's output joining the residual, gated by
    the dot of its input with w (Qwen2-MoE's shared_expert_gate)."""
    k = ir.Kernel(f"add_gated_{dim}_T{T}")
    k.buffer("y", "f32", T * dim), k.buffer("xin", "f32", T * dim), k.buffer("w", "f32", dim)
    k.buffer("x", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:
        t = k.let("t", t0 + j)
        z = k.let("z", ir.reduce("add", "i", dim, lambda i: k.load("xin", t * dim + i) * k.load("w", i)))
        gate = k.let("gate", 1.0 / (exp(-z) + 1.0))
        with k.loop("i", dim, "vector") as i:
            k.store("x", t * dim + i, k.load("x", t * dim + i) + k.load("y", t * dim + i) * gate)
    return k.finish()


@functools.cache
def softcap(dim: int, T: int, cap: float) -> ir.Kernel:
    """x -> cap * tanh(x / cap) in place for the tokens from t0 (Gemma 2's final logits)."""
    k = ir.Kernel(f"softcap_{dim}_T{T}_{cap:g}")
    k.buffer("x", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:
        with k.loop("i", dim, "vector") as i:
            at = (t0 + j) * dim + i
            k.store("x", at, _capped(k.load("x", at), cap))
    return k.finish()


@functools.cache
def silu_mul(dim: int, T: int) -> ir.Kernel:
    k = ir.Kernel(f"silu_mul_{dim}_T{T}")
    k.buffer("g", "f32", T * dim), k.buffer("u", "f32", T * dim), k.buffer("h", "f32", T * dim, True)
    n, t0 = k.scalar("n_tokens"), k.scalar("t0")
    with k.parallel("j", n - t0) as j:  # tokens from t0, the first whose output is wanted
        t = t0 + j  # an expression, not a Let: the loop stays one elementwise vector loop (a GPU's thread per element)
        with k.loop("i", dim, "vector") as i:
            g = k.load("g", t * dim + i)
            k.store("h", t * dim + i, g / (exp(-g) + 1.0) * k.load("u", t * dim + i))  # exp in IR: vectorizes
    return k.finish()
