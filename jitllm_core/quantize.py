"""NumPy quantizers that write ggml's block byte layouts (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS).

They follow llama.cpp's reference quantizers (`quantize_row_*_ref` in ggml-quants.c; Q2_K, Q3_K and the IQ4s a
plainer fit of the same layouts), vectorized over blocks, so files written with them load in llama.cpp and the gguf
package. Each block quantizer comes in two steps: `_parts_<type>` computes scales and integer quants in natural element order, `_quant_<type>` packs
them into ggml's bytes; tests rebuild the values from the parts and compare them with gguf's dequantizers.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .quant import IQ4_LEVELS

QK_K = 256
# type -> (elements per block, bytes per block), as ggml defines them
BLOCK = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136),
}
_CHUNK = 1 << 17  # elements per work item: temporaries stay in cache, and numpy's per-call cost stays small


def quantize(x, type_name):
    """Quantize a 2-D float array row by row; returns uint8 of shape (rows, row_bytes) in ggml's layout."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize wants a 2-D array, got shape {x.shape}")
    if type_name not in BLOCK:
        raise ValueError(f"unknown quant type {type_name!r}; known: {', '.join(BLOCK)}")
    bs, ts = BLOCK[type_name]
    rows, cols = x.shape
    if cols % bs:
        raise ValueError(f"{type_name} needs rows that are a multiple of {bs} elements, got {cols}")
    out = np.empty((rows, cols // bs * ts), np.uint8)
    blocks, dst = x.reshape(-1, bs), out.reshape(-1, ts)
    fn = _QUANTIZERS[type_name]
    step = max(1, _CHUNK // bs)

    def work(i):
        dst[i:i + step] = fn(blocks[i:i + step])

    starts = range(0, len(blocks), step)
    if len(starts) > 1:  # numpy drops the GIL inside its loops, so threads use every core
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(work, starts))
    else:
        for i in starts:
            work(i)
    return out


def _f16(v):
    return np.asarray(v, np.float32).astype(np.float16)


def _bytes(*arrays):
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(len(a), -1) for a in arrays], axis=1)


def _round_away(v):
    """roundf(): halves away from zero, as llama.cpp's Q8_0 reference rounds (np.rint rounds to even)."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + np.floor(2 * (a - f)), v)


def _div(a, b):
    """a / b, and 0 where b is 0 (the references skip all-zero blocks this way)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, np.float32(a) / b).astype(np.float32)


# ---- plain floats ----

def _quant_f32(b):
    return b.view(np.uint8)


def _quant_f16(b):
    return b.astype(np.float16).view(np.uint8)


def _quant_bf16(b):
    n = b.view(np.uint32).astype(np.uint64)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + 0x7FFF + ((n >> 16) & 1)) >> 16  # round to nearest even, as ggml_compute_fp32_to_bf16
    return np.where(nan, (n >> 16) | 64, rounded).astype(np.uint16).view(np.uint8)


# ---- 32-element blocks ----

def _parts_q8_0(b):
    d = np.abs(b).max(axis=1) / 127
    q = _round_away(b * _div(1, d)[:, None]).astype(np.int8)
    return _f16(d), q


def _parts_q4_0(b):
    # the element of largest magnitude maps to -8, so the full 16-level range is used
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = mx / -8
    q = np.minimum(15, np.trunc(b * _div(1, d)[:, None] + 8.5)).astype(np.uint8)
    return _f16(d), q


def _parts_q4_1(b):
    mn, mx = b.min(axis=1), b.max(axis=1)
    d = (mx - mn) / 15
    q = np.minimum(15, np.trunc((b - mn[:, None]) * _div(1, d)[:, None] + 0.5)).astype(np.uint8)
    return _f16(d), _f16(mn), q


def _pack_nibbles32(q):
    """ggml's 32-element 4-bit order: byte j holds element j (low nibble) and element j+16 (high)."""
    return q[:, :16] | (q[:, 16:] << 4)


def _quant_q8_0(b):
    return _bytes(*_parts_q8_0(b))


def _quant_q4_0(b):
    d, q = _parts_q4_0(b)
    return _bytes(d, _pack_nibbles32(q))


def _quant_q4_1(b):
    d, m, q = _parts_q4_1(b)
    return _bytes(d, m, _pack_nibbles32(q))


# ---- k-quants: 256-element super-blocks ----

def _rowsums(p):
    """Sums over the last axis of a stack of arrays, as one BLAS matrix-vector product (numpy's reduction is
    slow on short rows); float64 so that the error expansions below do not cancel."""
    sums = p.reshape(-1, p.shape[-1]) @ np.ones(p.shape[-1], np.float32)
    return tuple(sums.reshape(p.shape[:-1]).astype(np.float64))


def _grid(v, lo, hi):
    """nearest_int, clamped to [lo, hi], in place."""
    np.rint(v, out=v)
    return np.clip(v, lo, hi, out=v)


def _make_qkx2(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants over the last axis: weighted least squares for x ~ scale*L - min, L in [0, nmax].

    Tries nstep+1 stretched grids, fits scale and min in closed form for each and keeps the best. Returns
    (scale, min) with min >= 0. The weighted error is expanded in the reduced sums, which saves passes over
    the data per trial.
    """
    lo = np.minimum(x.min(axis=-1), 0)
    hi = x.max(axis=-1)
    flat = hi == lo
    hi = np.where(flat, lo + 1, hi)
    sw, swx, swx2 = _rowsums(np.stack([w, w * x, w * x * x]))
    # trials reuse these buffers: fresh large temporaries cost more in page faults than the arithmetic
    L, p = np.empty_like(x), np.empty((3,) + x.shape, np.float32)

    def fit(iscale, m):
        np.subtract(x, m[..., None], out=L)
        _grid(np.multiply(L, iscale[..., None], out=L), 0, nmax)
        np.multiply(w, L, out=p[0])
        np.multiply(p[0], L, out=p[1])
        np.multiply(p[0], x, out=p[2])
        return _rowsums(p)

    def error(s, m, sl, sl2, sxl):
        return s * s * sl2 + m * m * sw + swx2 + 2 * s * m * sl - 2 * s * sxl - 2 * m * swx

    best_s, best_m = ((hi - lo) / nmax).astype(np.float64), lo.astype(np.float64)
    best_e = error(best_s, best_m, *fit(nmax / (hi - lo), lo))
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(nstep + 1):
            # like the reference, each trial's grid starts from the best min found so far
            m32 = best_m.astype(np.float32)
            sl, sl2, sxl = fit((rmin + rdelta * i + nmax) / (hi - m32), m32)
            D = sw * sl2 - sl * sl
            s = (sw * sxl - swx * sl) / D
            m = (sl2 * swx - sl * sxl) / D
            pos = m > 0  # the min is clamped to <= 0; refit the scale alone
            s = np.where(pos, sxl / sl2, s)
            m = np.where(pos, 0, m)
            e = error(s, m, sl, sl2, sxl)
            better = (D > 0) & (e < best_e)
            best_s, best_m, best_e = np.where(better, s, best_s), np.where(better, m, best_m), np.where(better, e, best_e)
    best_s, best_m = np.where(flat, 0, best_s), np.where(flat, lo, best_m)
    return best_s.astype(np.float32), (-best_m).astype(np.float32)


def _parts_q4_k(b):
    """quantize_row_q4_K_ref: 8 sub-blocks of 32, 4-bit quants, 6-bit scales and mins under f16 d, dmin."""
    return _parts_affine_k(b, 15, -1.0, 20)


def _parts_q5_k(b):
    """quantize_row_q5_K_ref: Q4_K's with 5-bit quants (and its own search grid)."""
    return _parts_affine_k(b, 31, -0.5, 15)


def _parts_affine_k(b, nmax, rmin, nstep):
    """8 sub-blocks of 32, quants 0..nmax, 6-bit scales and mins under f16 d, dmin."""
    x = b.reshape(-1, 8, 32)
    av = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    scale, mn = _make_qkx2(x, av + np.abs(x), nmax, rmin, 0.1, nstep)
    max_s, max_m = scale.max(axis=1), mn.max(axis=1)
    ls = np.minimum(63, np.rint(scale * _div(63, max_s)[:, None])).astype(np.uint8)
    lm = np.minimum(63, np.rint(mn * _div(63, max_m)[:, None])).astype(np.uint8)
    d, dmin = _f16(max_s / 63), _f16(max_m / 63)
    # requantize against the scales as stored, so rounding of d, sc, m is absorbed by the quants
    ds = d.astype(np.float32)[:, None] * ls
    dm = dmin.astype(np.float32)[:, None] * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint((x + dm[..., None]) / ds[..., None]), 0, nmax)
    q = np.where(ds[..., None] == 0, 0, q).astype(np.uint8)
    return d, dmin, ls, lm, q


def _k_scales(ls, lm):
    """12 scale bytes: 6-bit scales and mins of sub-blocks 0-3 in bytes 0-7, their top 2 bits carry the high
    bits of sub-blocks 4-7, whose low 4 bits fill bytes 8-11 (get_scale_min_k4)."""
    hi_s, hi_m = ls[:, 4:], lm[:, 4:]
    return np.concatenate([ls[:, :4] | ((hi_s >> 4) << 6), lm[:, :4] | ((hi_m >> 4) << 6),
                           (hi_s & 0xF) | ((hi_m & 0xF) << 4)], axis=1)


def _low_nibbles(q):
    """Each 32 bytes hold two consecutive sub-blocks of 32: low then high nibble."""
    q = (q & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _quant_q4_k(b):
    d, dmin, ls, lm, q = _parts_q4_k(b)
    return _bytes(d, dmin, _k_scales(ls, lm), _low_nibbles(q))


def _quant_q5_k(b):
    d, dmin, ls, lm, q = _parts_q5_k(b)
    # qh: bit k of byte j is the fifth bit of element j of sub-block k
    qh = ((q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return _bytes(d, dmin, _k_scales(ls, lm), qh, _low_nibbles(q))


def _make_qx(x, nmax):
    """make_qx_quants(rmse_type=1) over the last axis: symmetric scale for L in [-nmax, nmax-1], x^2-weighted.

    The element of largest magnitude maps to -nmax; 18 slightly stretched grids are tried as well.
    """
    mx = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    zero = np.abs(mx) < 1e-15
    mx = np.where(zero, 1, mx)
    w = x * x
    wx = w * x
    L, p = np.empty_like(x), np.empty((2,) + x.shape, np.float32)
    best_s = best = None
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in [0] + [i for i in range(-9, 10) if i]:
            _grid(np.multiply(x, (-(nmax + np.float32(0.1) * i) / mx)[..., None], out=L), -nmax, nmax - 1)
            np.multiply(wx, L, out=p[0])
            np.multiply(w, L, out=p[1])
            np.multiply(p[1], L, out=p[1])
            slx, sl2 = _rowsums(p)
            s = np.where(sl2 > 0, slx / sl2, 0)
            if best is None:
                best_s, best = s, s * slx
            else:
                better = (sl2 > 0) & (slx * slx > best * sl2)
                best_s, best = np.where(better, s, best_s), np.where(better, s * slx, best)
    return np.where(zero, 0, best_s).astype(np.float32)


def _parts_q6_k(b):
    """quantize_row_q6_K_ref: 16 sub-blocks of 16, 6-bit quants, int8 scales under an f16 d."""
    x = b.reshape(-1, 16, 16)
    scale = _make_qx(x, 32)
    max_s = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    iscale = _div(-128, np.where(np.abs(max_s) < 1e-15, 0, max_s))
    d = _f16(_div(1, iscale))
    sc = np.minimum(127, np.rint(iscale[:, None] * scale)).astype(np.int8)
    ds = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(x / ds[..., None]), -32, 31)
    q = np.where(ds[..., None] == 0, 0, q).astype(np.int8)
    return d, sc, q


def _parts_q2_k(b):
    """Q2_K: 16 sub-blocks of 16, 2-bit quants, 4-bit scales and mins under f16 d, dmin -- each sub-block's
    min-max fit (not llama.cpp's search: a plainer, larger error)."""
    x = b.reshape(-1, 16, 16)
    mn = np.minimum(x.min(axis=-1), 0)
    scale = (x.max(axis=-1) - mn) / 3
    d, dmin = _f16(scale.max(axis=1) / 15), _f16(-mn.min(axis=1) / 15)
    ls = np.minimum(15, np.rint(scale * _div(1, d.astype(np.float32))[:, None])).astype(np.uint8)
    lm = np.minimum(15, np.rint(-mn * _div(1, dmin.astype(np.float32))[:, None])).astype(np.uint8)
    ds = d.astype(np.float32)[:, None] * ls
    dm = dmin.astype(np.float32)[:, None] * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint((x + dm[..., None]) / ds[..., None]), 0, 3)
    return d, dmin, ls, lm, np.where(ds[..., None] == 0, 0, q).astype(np.uint8)


def _crumbs(q):
    """2-bit quants (blocks, 256) in ggml's order: bits 2j of byte 32 n + l hold element 128 n + 32 j + l."""
    q = q.reshape(-1, 2, 4, 32)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _quant_q2_k(b):
    d, dmin, ls, lm, q = _parts_q2_k(b)
    return _bytes(ls | (lm << 4), _crumbs(q), d, dmin)


def _parts_q3_k(b):
    """Q3_K: 16 sub-blocks of 16, quants -4..3, 6-bit signed scales under an f16 d -- each sub-block's largest
    magnitude to -4 (not llama.cpp's search)."""
    x = b.reshape(-1, 16, 16)
    scale = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0] / -4
    max_s = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    iscale = _div(-32, max_s)
    d = _f16(_div(1, iscale))
    sc = np.clip(np.rint(iscale[:, None] * scale), -32, 31).astype(np.int8)
    ds = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(x / ds[..., None]), -4, 3)
    return d, sc, np.where(ds[..., None] == 0, 0, q).astype(np.int8)


def _quant_q3_k(b):
    d, sc, q = _parts_q3_k(b)
    u = (q.reshape(-1, 256) + 4).astype(np.uint8)  # 0..7: the high bit set means "no -4"
    hm = (u >> 2).reshape(-1, 8, 32)  # [4 n + j][l]: bit 4 n + j of byte l
    hmask = (hm << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    s = (sc.astype(np.int16) + 32).astype(np.uint8)  # 6 bits: low nibbles of 0-7 / 8-15, top bits by 4s
    low = s[:, :8] & 15 | ((s[:, 8:] & 15) << 4)
    high = ((s >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1,
                                                                                                 dtype=np.uint8)
    return _bytes(hmask, _crumbs(u & 3), low, high, d)


def _quant_q6_k(b):
    d, sc, q = _parts_q6_k(b)
    u = (q.reshape(-1, 2, 4, 32) + 32).astype(np.uint8)  # per 128-element half: 4 runs of 32
    lo, hi = u & 0xF, u >> 4
    ql = (lo[:, :, :2] | (lo[:, :, 2:] << 4)).reshape(-1, 128)  # runs 0,1 low nibbles; runs 2,3 high nibbles
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return _bytes(ql, qh, sc, d)


# ---- IQ4: 4-bit codes of 16 non-linear levels ----

def _levels(x):
    """The IQ4 level nearest each of x (in level units), as int8 values."""
    levels = np.array(IQ4_LEVELS, np.float32)
    i = np.clip(np.searchsorted((levels[1:] + levels[:-1]) / 2, x), 0, 15)
    return levels[i].astype(np.int8)


def _codes(values):
    """IQ4 levels -> their 4-bit codes"""
    return np.searchsorted(np.array(IQ4_LEVELS), values.astype(np.int16)).astype(np.uint8)


def _extreme(x):
    """Each row's (last axis') element of the largest magnitude, signed."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _parts_iq4_nl(b):
    """IQ4_NL: blocks of 32, levels under an f16 d -- the largest magnitude to level -127 (not llama.cpp's search)."""
    d = _f16(_extreme(b) / -127)
    return d, _levels(b * _div(1, d.astype(np.float32))[:, None])


def _quant_iq4_nl(b):
    d, q = _parts_iq4_nl(b)
    return _bytes(d, _pack_nibbles32(_codes(q)))


def _parts_iq4_xs(b):
    """IQ4_XS: 8 sub-blocks of 32, levels under 6-bit signed scales (-32..31) under an f16 d -- each sub-block's
    largest magnitude to level -127, the largest scale to -32 (not llama.cpp's search)."""
    x = b.reshape(-1, 8, 32)
    scale = _extreme(x) / -127
    d = _f16(_extreme(scale) / -32)
    sc = np.clip(np.rint(scale * _div(1, d.astype(np.float32))[:, None]), -32, 31).astype(np.int8)
    ds = d.astype(np.float32)[:, None] * sc
    return d, sc, _levels(x * _div(1, ds)[..., None])


def _quant_iq4_xs(b):
    d, sc, q = _parts_iq4_xs(b)
    ls = (sc.astype(np.int16) + 32).astype(np.uint16)                       # 0..63
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return _bytes(d, high, low.astype(np.uint8), _pack_nibbles32(_codes(q).reshape(-1, 32)).reshape(len(b), -1))


_QUANTIZERS = {
    "F32": _quant_f32, "F16": _quant_f16, "BF16": _quant_bf16,
    "Q8_0": _quant_q8_0, "Q4_0": _quant_q4_0, "Q4_1": _quant_q4_1,
    "Q2_K": _quant_q2_k, "Q3_K": _quant_q3_k, "Q4_K": _quant_q4_k, "Q5_K": _quant_q5_k, "Q6_K": _quant_q6_k,
    "IQ4_NL": _quant_iq4_nl, "IQ4_XS": _quant_iq4_xs,
}
