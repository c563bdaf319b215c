"""Weight formats, each described once: block layout, and the values of a block, in IR.

A tensor row of `cols` elements is `cols / block` blocks of `unit` storage elements (bytes for quantized
formats, values for plain ones). A block is read as `groups` groups of `lanes` lanes: `terms(k, buf, base, g,
l)` lists, for lane l of group g of the block starting at storage index `base`, the (element index, value)
pairs that lane yields -- written so that lanes read contiguous bytes, which is what makes them SIMD-friendly
on every backend. Dot products (`row_dot`) and dequantization (`dequant_kernel`) are both derived from
`terms`, so a new format added here works everywhere, with no plugin change.

At load, the ggml formats are repacked (`repack`) into *row-interleaved* layouts of the same values (`Interleaved`:
R8, R4, R5, R40, R50, R4NL, R2K, R3K, R4K, R5K, R4XS, R6): ROWS rows stored together, each field of a block holding
the rows' bytes side by side, so that a vector whose lanes are rows reads every field -- scales as well as quants --
with one contiguous load and a dot product keeps each row's sum in its own lane (no horizontal sum per block, no
scale broadcast). All but R8 are *dot4 layouts*: their fields are words but a lone f16 scale (4 weights to a word:
4-bit ones in the file's nibble order, IQ4's codes looked up as bytes, 2-bit ones a shift apart, the top bits of 5-
and 3-bit ones in words of their own, Q6_K's q whole), and their dots multiply the weights' integers by the input's
(`ops.quantize_input`: 3 signed base-256 digits per element, each within 2^-24 of its span's largest) with
`ir.dot4`, 4 byte products to a lane per instruction where the CPU has VNNI, then apply the scales in f32 (d * scale
* sum q x + offset * sum x, the input's sums read for the offsets). Sizes are the file's (Q4_K's packed 6-bit scales
stay packed, unpacked a word at a time in the dot; Q4_0's, Q5_0's and IQ4_NL's offsets, -8 d, -16 d and -128 d,
computed in the dot), but Q6_K's 212 bytes a block instead of 210, to keep words whole, Q3_K's 116 instead of 110
and IQ4_XS's 140 instead of 136 (their scales unpacked).
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from dataclasses import dataclass

import numpy as np

from . import ir
from .errors import ModelFileError

F = ir.f32


def _u16(k, buf, i):
    return k.load(buf, i) | (k.load(buf, i + 1) << 8)


def _half(k, buf, i):
    return ir.f16bits(_u16(k, buf, i))


def _i8(v):
    return (v << 24) >> 24


@dataclass(frozen=True)
class Format:
    name: str
    block: int        # elements per block
    unit: int         # storage elements per block
    storage: str      # buffer dtype
    groups: int       # vector groups per block
    lanes: int        # lanes per group
    digits = False    # dots read the input as integer digits (Input.word), scales and sums (ops.quantize_input)
    halves = ()       # byte offsets of a file block's f16 fields (its scales): where random test blocks need finite ones
    interleave = 1    # rows stored together (Interleaved: ROWS)
    integer_tiles = False  # has the integer form of blocks of 256 that integer tile dots take (Interleaved.integers)

    def row_units(self, cols):
        return cols // self.block * self.unit

    def nbytes(self, rows, cols):
        return rows * self.row_units(cols) * ir.STORAGE_DTYPES[self.storage]

    def terms(self, k, buf, base, g, l):
        raise NotImplementedError

    def wide_terms(self, k, buf, base, e):
        """The (column, weight) pairs of lane e of a block in the wide form (e < wide_lanes): lane e of each group,
        unless a format splits its blocks otherwise."""
        return [t for g in range(self.groups) for t in self.terms(k, buf, base, g, e)]

    @property
    def wide_lanes(self):
        return self.lanes

    def row_dot(self, k, buf, row, cols, x, wide=False):
        """sum_c W[row, c] * x(c). Narrow (CPU lanes): a "reduce" Reduce over blocks of the sum over the block's
        groups (constants, so that scale lookups fold) of a vector Reduce over the group's lanes. Wide (a GPU's
        warp per row): one "reduce" Reduce over (block, lane) pairs, so that neighbouring lanes read neighbouring
        bytes of a block and all of them have work however few blocks a row has (on a CPU that form runs ~20x
        slower, its lanes gathering every block's scales: benchmarks/kernel_speed.py)."""
        nb = cols // self.block

        def terms(b, g, l):
            return [w * x(b * self.block + j) for j, w in self.terms(k, buf, (row * nb + b) * self.unit, g, l)]

        def total(ts):
            return sum(ts[1:], ts[0])
        if wide:
            n = self.wide_lanes
            return ir.reduce("add", "e", nb * n, lambda e: total(
                [w * x((e // n) * self.block + j)
                 for j, w in self.wide_terms(k, buf, (row * nb + e // n) * self.unit, e % n)]), "reduce")
        return ir.reduce("add", "b", nb, lambda b: total(
            [ir.reduce("add", f"l{g}", self.lanes, lambda l: total(terms(b, g, l)), "vector")
             for g in range(self.groups)]), "reduce")


class Plain(Format):
    def terms(self, k, buf, base, g, l):
        return [(l, k.load(buf, base + l))]


class Q8_0(Format):
    halves = (0,)
    def terms(self, k, buf, base, g, l):
        return [(l, _half(k, buf, base) * F(_i8(k.load(buf, base + 2 + l))))]


class Q4_0(Format):
    halves = (0,)
    def terms(self, k, buf, base, g, l):
        d, q = _half(k, buf, base), k.load(buf, base + 2 + l)
        return [(l, d * F((q & 15) - 8)), (l + 16, d * F((q >> 4) - 8))]


class Q4_1(Format):
    halves = (0, 2)
    def terms(self, k, buf, base, g, l):
        d, m = _half(k, buf, base), _half(k, buf, base + 2)
        q = k.load(buf, base + 4 + l)
        return [(l, d * F(q & 15) + m), (l + 16, d * F(q >> 4) + m)]


def _plus(index, i):
    """index + i, or index where i is None (a narrow lane's byte, which has no i)."""
    return index if i is None else index + i


def _bit5(qh, bit):
    """Bit `bit` of qh (a number or an expression) as the fifth bit of a 5-bit value: 0 or 16."""
    return ((qh >> bit) & 1) << 4


class Q5_0(Format):
    halves = (0,)
    # d (f16), qh: the 32 fifth bits (a little-endian u32, bit j for element j), 16 bytes of low nibbles
    def terms(self, k, buf, base, g, l):
        d, qh, q = _half(k, buf, base), _word(k, buf, base + 2), k.load(buf, base + 6 + l)
        return [(l, d * F(((q & 15) | _bit5(qh, l)) - 16)), (l + 16, d * F(((q >> 4) | _bit5(qh, l + 16)) - 16))]


class Q5_1(Format):
    halves = (0, 2)
    # d, m (f16), qh (u32), 16 bytes of low nibbles: d * q + m with q unsigned
    def terms(self, k, buf, base, g, l):
        d, m, qh, q = _half(k, buf, base), _half(k, buf, base + 2), _word(k, buf, base + 4), k.load(buf, base + 8 + l)
        return [(l, d * F((q & 15) | _bit5(qh, l)) + m), (l + 16, d * F((q >> 4) | _bit5(qh, l + 16)) + m)]


def _k4_scales_mins(word, piece):
    """(scales, mins) of sub-blocks 4 piece .. 4 piece + 3 of a Q4_K block, a byte each in a word, from its 12 bytes
    of packed 6-bit scales and mins (word(i): their word i; llama.cpp's get_scale_min_k4, 4 at once): piece 0's the
    low 6 bits of words 0 and 1; piece 1's the low and high nibbles of word 2 under the top 2 bits of words 0 and
    1's bytes. piece: 0 or 1, a number or an expression."""
    low = 0x3F3F3F3F - piece * 0x30303030            # 6 bits of word 0 or 1, or 4 of word 2
    tops = [((word(i) >> 2) & 0x30303030) * piece for i in range(2)]  # piece 1's bits 4-5
    first = [word(2 * piece), word(1 + piece) >> 4 * piece]  # words 0 and 1, or word 2 and its high nibbles
    return [(f & low) | t for f, t in zip(first, tops)]


def _k4_scale_min(k, buf, base, s):
    """6-bit scale and min of sub-block s (0..7, a number) of a Q4_K block in the file's layout."""
    sc, mn = _k4_scales_mins(lambda i: _word(k, buf, base + 4 + 4 * i), s // 4)
    return F((sc >> 8 * (s % 4)) & 255), F((mn >> 8 * (s % 4)) & 255)


class Q4_K(Format):
    halves = (0, 2)
    # d, dmin (f16), 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles; group p covers sub-blocks 2p, 2p+1
    def quants(self, k, buf, base, p, l, i=None):
        """q of elements 64p + l (+ i) and 64p + 32 + l (+ i): byte l (+ i) of group p's nibbles (i: which of a wide
        lane's 4 bytes from l)"""
        q = k.load(buf, _plus(base + 16 + p * 32 + l, i))
        return q & 15, q >> 4

    def terms(self, k, buf, base, p, l):
        d, dmin = _half(k, buf, base), _half(k, buf, base + 2)
        sc0, m0 = _k4_scale_min(k, buf, base, p * 2)
        sc1, m1 = _k4_scale_min(k, buf, base, p * 2 + 1)
        q0, q1 = self.quants(k, buf, base, p, l)
        return [(p * 64 + l, (d * sc0) * F(q0) - dmin * m0), (p * 64 + 32 + l, (d * sc1) * F(q1) - dmin * m1)]

    # wide form: 8 lanes a block, lane e reading bytes 4e..4e+3 of every group (32 weights), so that the scales a
    # lane decodes serve 32 weights, not 8 (lane e of each group, the default, decodes all 8 pairs for 8 weights)
    wide_lanes = 8

    def wide_terms(self, k, buf, base, e):
        d, dmin = _half(k, buf, base), _half(k, buf, base + 2)
        out = []
        for p in range(self.groups):
            sc0, m0 = _k4_scale_min(k, buf, base, p * 2)
            sc1, m1 = _k4_scale_min(k, buf, base, p * 2 + 1)
            for i in range(4):
                q0, q1 = self.quants(k, buf, base, p, e * 4, i)
                out += [(p * 64 + e * 4 + i, (d * sc0) * F(q0) - dmin * m0),
                        (p * 64 + 32 + e * 4 + i, (d * sc1) * F(q1) - dmin * m1)]
        return out


class Q5_K(Q4_K):
    # Q4_K's d, dmin and packed scales, then qh (32 bytes: bit 2p of byte l is the fifth bit of element l of
    # sub-block 2p, bit 2p + 1 of sub-block 2p + 1's) and the 128 bytes of low nibbles; Q4_K's values and wide form
    def quants(self, k, buf, base, p, l, i=None):
        qh, q = k.load(buf, _plus(base + 16 + l, i)), k.load(buf, _plus(base + 48 + p * 32 + l, i))
        return (q & 15) | _bit5(qh, 2 * p), (q >> 4) | _bit5(qh, 2 * p + 1)


class Q2_K(Format):
    halves = (80, 82)
    # 16 bytes of scales (sub-block s of 16: scale in the low nibble, min in the high), 64 bytes of 2-bit quants,
    # d, dmin (f16); group g = 4 n + j: sub-blocks 8 n + 2 j and 8 n + 2 j + 1, their quants bits 2j of bytes
    # 32 n + l and 32 n + 16 + l
    def terms(self, k, buf, base, g, l):
        n, j = g // 4, g % 4
        d, dmin = _half(k, buf, base + 80), _half(k, buf, base + 82)
        out = []
        for half in range(2):
            sc = k.load(buf, base + 8 * n + 2 * j + half)
            q = (k.load(buf, base + 16 + 32 * n + 16 * half + l) >> 2 * j) & 3
            out.append((128 * n + 32 * j + 16 * half + l, (d * F(sc & 15)) * F(q) - dmin * F(sc >> 4)))
        return out


class Q3_K(Format):
    halves = (108,)
    # hmask (32 bytes: bit 4 n + j of byte l set = no -4 for quant l (+16) of group (n, j)), 64 bytes of 2-bit
    # quants as Q2_K's, 12 bytes of 6-bit scales (low nibbles in bytes 0-7, top 2 bits in 8-11), d (f16);
    # value = d * (scale - 32) * (q - 4 * (hmask bit clear))
    def scale(self, k, buf, base, s):
        a, b = s // 4, s % 4
        low = (k.load(buf, base + 96 + 4 * (a % 2) + b) >> 4 * (a // 2)) & 15
        high = (k.load(buf, base + 104 + b) >> 2 * a) & 3
        return F((low | (high << 4)) - 32)

    def terms(self, k, buf, base, g, l):
        n, j = g // 4, g % 4
        d, out = _half(k, buf, base + 108), []
        for half in range(2):
            q = (k.load(buf, base + 32 + 32 * n + 16 * half + l) >> 2 * j) & 3
            h = (k.load(buf, base + 16 * half + l) >> 4 * n + j) & 1
            out.append((128 * n + 32 * j + 16 * half + l,
                        (d * self.scale(k, buf, base, 8 * n + 2 * j + half)) * F(q - 4 + 4 * h)))
        return out


class Q6_K(Format):
    halves = (208,)
    # ql[128] low nibbles, qh[64] high 2-bit pairs, 16 int8 scales, d (f16); group g = (half n, 16-lane part h)
    def scale(self, k, buf, base, i):
        """d * scale i of the block (the 16 sub-blocks' scales)."""
        return _half(k, buf, base + 208) * F(_i8(k.load(buf, base + 192 + i)))

    @staticmethod
    def quads(k, buf, base, n, l):
        """The 6-bit values of position l of half n: its 4 weights, 32 columns apart."""
        a, b = k.load(buf, base + 64 * n + l), k.load(buf, base + 64 * n + 32 + l)
        qh = k.load(buf, base + 128 + 32 * n + l)
        return [(a & 15) | ((qh & 3) << 4), (b & 15) | (((qh >> 2) & 3) << 4),
                (a >> 4) | (((qh >> 4) & 3) << 4), (b >> 4) | (((qh >> 6) & 3) << 4)]

    def terms(self, k, buf, base, g, j):
        n, h = g // 2, g % 2
        l = h * 16 + j
        q = self.quads(k, buf, base, n, l)
        return [(128 * n + 32 * i + l, self.scale(k, buf, base, 8 * n + h + 2 * i) * F(q[i] - 32)) for i in range(4)]

    # wide form: 8 lanes a block, lane e reading positions 4e..4e+3 of both halves (32 weights, whose 8 scales it
    # loads once; lane e of each group, the default, loads 16 scales for 16 weights)
    wide_lanes = 8

    def wide_terms(self, k, buf, base, e):
        out = []
        for n in range(2):
            sc = [self.scale(k, buf, base, 8 * n + e // 4 + 2 * i) for i in range(4)]
            for m in range(4):
                l = e * 4 + m
                q = self.quads(k, buf, base, n, l)
                out += [(128 * n + 32 * i + l, sc[i] * F(q[i] - 32)) for i in range(4)]
        return out


IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's, IQ4_XS's 16
IQ4_CODES = tuple(v + 128 for v in IQ4_LEVELS)  # the levels as bytes (u = level + 128): the lut16 table of IQ4's


def _level(q):
    """The IQ4 level of the code in q's low 4 bits, as f32."""
    return F(ir.lut16(q, IQ4_CODES, 1) - 128)


class IQ4_NL(Format):
    halves = (0,)
    # d (f16), 16 bytes of codes: element l in byte l's low nibble, l + 16 in its high one; value = d * level
    def terms(self, k, buf, base, g, l):
        d, q = _half(k, buf, base), k.load(buf, base + 2 + l)
        return [(l, d * _level(q)), (l + 16, d * _level(q >> 4))]


class IQ4_XS(Format):
    halves = (0,)
    # d (f16), scales_h (u16: bits 2s, 2s + 1 the top of sub-block s's 6-bit scale), scales_l (4 bytes: sub-block
    # s's low 4 bits in byte s // 2, nibble s % 2), 128 bytes of codes (sub-block s's 16 bytes as IQ4_NL's);
    # value = d * (scale - 32) * level; group s: sub-block s
    def scale(self, k, buf, base, s):
        low = (k.load(buf, base + 4 + s // 2) >> 4 * (s % 2)) & 15
        high = (_u16(k, buf, base + 2) >> 2 * s) & 3
        return _half(k, buf, base) * F((low | (high << 4)) - 32)

    def terms(self, k, buf, base, s, l):
        sc, q = self.scale(k, buf, base, s), k.load(buf, base + 8 + 16 * s + l)
        return [(32 * s + l, sc * _level(q)), (32 * s + 16 + l, sc * _level(q >> 4))]


ROWS = 16  # rows stored together in the interleaved layouts: a vector of lanes, one row each
NIBBLES = 0x0F0F0F0F
DIGITS = 3  # signed base-256 digits of an activation's integer in the dot4 layouts' dots (ops.quantize_input)
INT8 = 1    # digits of the optional int8-activation mode (as llama.cpp quantizes activations)


class Input:
    """A token's row of a matmul's input as the dot of a block at element c0 = b * size reads it: `x(e)`, element
    c0 + e; for the dot4 layouts (`Format.digits`, inputs written by `ops.quantize_input`), `word(i, e)`, digit i
    (of `digits`) of the integers of elements c0 + e .. c0 + e + 3, a byte each; `scale(e)`, the scale of those
    integers in the span of 32 holding c0 + e; `sum(e)`, the sum of the 16 elements from c0 + e as quantized."""

    def __init__(self, k, t, cols, digits=DIGITS, b=0, size=0):
        self.k, self.t, self.cols, self.digits, self.b, self.size = k, t, cols, digits, b, size

    def block(self, b, size):
        return Input(self.k, self.t, self.cols, self.digits, b, size)

    def x(self, e):
        return self.k.load("x", self.t * self.cols + self.b * self.size + e)

    def word(self, i, e):
        return _word(self.k, "xq", (self.t * self.digits + i) * self.cols + self.b * self.size + e)

    def scale(self, e):
        return self.k.load("xd", self.t * (self.cols // 32) + self.b * (self.size // 32) + e // 32)

    def sum(self, e):
        return self.k.load("xs", self.t * (self.cols // 16) + self.b * (self.size // 16) + e // 16)


class Interleaved(Format):
    """ROWS rows stored together, block by block. A block is a list of fields, each `size` bytes per row at
    offset `off` (in bytes per row); field (off, size) of row r lies at byte off * ROWS + r * size of the
    block's group, so that lanes that are rows load it contiguously. Row counts must be multiples of ROWS.
    A format gives, for one block of one row (`at`: its fields' byte indices), `block_dot` -- the dot product of
    a piece of it with the input's block (an `Input`) -- and `piece_values`, a piece's elements."""
    interleave = ROWS
    pieces = 1  # a block's dot in pieces, an iteration each: fewer values live at once (a whole R6 block spilled)

    def at(self, rg, b, nb, r):
        """field (off, size) of row r of block b of row group rg -> its byte index"""
        return lambda off, size: (rg * nb + b) * (self.unit * ROWS) + off * ROWS + r * size

    def lane_dot(self, k, buf, rg, r, cols, inp):
        """Row r (a vector lane) of row group rg dotted with the Input inp."""
        nb, m = cols // self.block, self.pieces

        def piece(bp):
            b = bp // m if m > 1 else bp
            return self.block_dot(k, buf, self.at(rg, b, nb, r), inp.block(b, self.block), bp % m if m > 1 else 0)
        return ir.reduce("add", "b", nb * m, piece)

    def values(self, k, buf, rg, r, cols, b, piece=None):
        """[(element of the block, value)] of row r of group rg, block b: of its piece `piece` (an expression),
        or of every piece"""
        at = self.at(rg, b, cols // self.block, r)
        pieces = range(self.pieces) if piece is None else [piece]
        return [ev for p in pieces for ev in self.piece_values(k, buf, at, p)]

    def block_dot(self, k, buf, at, inp, piece):
        """the dot of piece `piece` (0 .. pieces - 1, an expression) of the block"""
        raise NotImplementedError

    def piece_values(self, k, buf, at, piece):
        """[(element of the block, value)] of the block's piece `piece` (an expression)"""
        raise NotImplementedError

    def integers(self, k, buf, at, piece):
        """The block's piece `piece` (a number) as integers, where the format has that form (`integer_tiles`): (d,
        [(element, u)], [(span, offset)]) with each value = d * u + the offset of its span of 32, d one per block of
        256, u an i32 in [0, 2^14] -- two bytes of weights for integer tile dots (`ops.tile_matmul`)."""
        raise NotImplementedError


def _word(k, buf, i):
    return _u16(k, buf, i) | (_u16(k, buf, i + 2) << 16)


def _byte_of(piece, n, j):
    """(word, byte in it) of sub-block piece * n + j's byte in a field of a byte per sub-block, 4 to a word: the
    byte a plain number, so n (the sub-blocks of a piece) is a multiple of 4"""
    if n % 4:
        raise ValueError(f"a piece of {n} sub-blocks: pieces must hold whole words of 4 sub-blocks")
    return piece * (n // 4) + j // 4, j % 4


def _digit_dot(sums):
    """sum q * integer over a sub-block, from its sums per digit (each exact in i32: at most 32 4-bit or 16 6-bit
    q times a digit; the low two's sum stays in i32 too)."""
    parts = [F((sums[1] << 8) + sums[0]) if len(sums) > 1 else F(sums[0])]
    parts += [F(s) * float(256 ** i) for i, s in enumerate(sums) if i > 1]
    return sum(parts[1:], parts[0])


def _spread4(bits, to=4):
    """4 bits (0..15) -> a word whose byte j holds bit j at bit `to`: the top bits of 4 elements in place."""
    return ((bits * 0x00204081) & 0x01010101) << to


def _quants(k, buf, at, off, fifth, w, table=None):
    """The two words of q of word w of a sub-block: elements 4w .. 4w + 3 and 16 + 4w .. 16 + 4w + 3, a byte each:
    the word's low and high nibbles, or'ed with their fifth bits (byte w of the word at field `fifth`: the
    first four elements' in bits 0-3, the others' in bits 4-7) when the sub-block has them, or looked up in
    `table` (lut16) when its nibbles are codes."""
    q = _word(k, buf, at(off + 4 * w, 4))
    low, high = q & NIBBLES, (q >> 4) & NIBBLES
    if table is not None:
        return ir.lut16(low, table), ir.lut16(high, table)
    if fifth is None:
        return low, high
    h = _word(k, buf, at(fifth, 4)) >> 8 * w
    return low | _spread4(h & 15), high | _spread4((h >> 4) & 15)


def _quad_dot(q, inp, e0):
    """sum q * x over the 16 elements from e0 whose q are the 4 words q (byte j of word i: element 4i + j), q
    unscaled: a dot4 of each word with each digit of the input."""
    sums = [sum((ir.dot4(q[i], inp.word(g, e0 + 4 * i)) for i in range(1, 4)), ir.dot4(q[0], inp.word(g, e0)))
            for g in range(inp.digits)]
    return _digit_dot(sums) * inp.scale(e0)


def _nibble_dot(k, buf, at, off, inp, e0, fifth=None, table=None):
    """sum q * x over the 32 elements from e0 of a 4- or 5-bit sub-block whose 4 words of nibbles start at field
    `off` (word w: elements 4w .. 4w + 3 in its low nibbles, 16 + 4w .. in its high ones; fifth bits and codes:
    `_quants`), q unscaled: a dot4 of each word's quants with each digit of the input."""
    def digit(i):
        def step(w):
            low, high = _quants(k, buf, at, off, fifth, w, table)
            return ir.dot4(low, inp.word(i, e0 + 4 * w)) + ir.dot4(high, inp.word(i, e0 + 16 + 4 * w))
        return ir.reduce("add", "w", 4, step, "unroll")
    return _digit_dot([digit(i) for i in range(inp.digits)]) * inp.scale(e0)


def _nibbles(k, buf, at, off, fifth=None, table=None):
    return [(e, F(q)) for e, q in _nibble_ints(k, buf, at, off, fifth, table)]


def _nibble_ints(k, buf, at, off, fifth=None, table=None):
    """[(element, q)] of a sub-block of 32 whose nibble words start at field `off` (`_quants`), q an i32."""
    out = []
    for w in range(4):
        if fifth is None:  # each value a shift and a mask (or a lookup) away
            q = _word(k, buf, at(off + 4 * w, 4))
            code = lambda e, j: q >> (8 * j + 4 * (e // 16))
            out += [(e + 4 * w + j, code(e, j) & 15 if table is None else ir.lut16(code(e, j), table, 1))
                    for e in (0, 16) for j in range(4)]
            continue
        for e, q in zip((0, 16), _quants(k, buf, at, off, fifth, w)):
            out += [(e + 4 * w + j, (q >> 8 * j) & 31) for j in range(4)]
    return out


class Affine4(Interleaved):
    """4- or 5-bit sub-blocks of 32 (nibble words, and a word of fifth bits, as `_nibble_dot` reads them), each
    value = scale * q + offset; q the nibble's (and fifth bit's) number, or its code's byte in `table` (IQ4's
    levels + 128, offset -128 scale)."""
    digits = True
    table = None

    def subs(self, k, buf, at, piece):
        """[(scale, offset, field of the 4 nibble words, field of the fifth bits or None, first element)] of the
        piece's sub-blocks"""
        raise NotImplementedError

    def block_dot(self, k, buf, at, inp, piece):
        parts = [scale * _nibble_dot(k, buf, at, off, inp, e0, fifth, self.table)
                 + offset * (inp.sum(e0) + inp.sum(e0 + 16))
                 for scale, offset, off, fifth, e0 in self.subs(k, buf, at, piece)]
        return sum(parts[1:], parts[0])

    def piece_values(self, k, buf, at, piece):
        return [(e0 + e, scale * q + offset) for scale, offset, off, fifth, e0 in self.subs(k, buf, at, piece)
                for e, q in _nibbles(k, buf, at, off, fifth, self.table)]


class R4(Affine4):
    """Q4_1's blocks of 32: [d f16, m f16][4 words of nibbles] per row; value = d * q + m. R5 (Q5_1): [d, m][a word
    of fifth bits][4 words of nibbles]."""
    fifth = None

    def subs(self, k, buf, at, piece):
        dm = _word(k, buf, at(0, 4))
        return [(ir.f16bits(dm), ir.f16bits(dm >> 16), 4 if self.fifth is None else 8, self.fifth, 0)]


class R5(R4):
    fifth = 4


class R40(Affine4):
    """Blocks of 32 whose values are d * (q - zero) (Q4_0's, zero 8): [d f16][4 words of nibbles] per row, the
    file's 18 bytes -- the offset -zero * d computed in the dot, not stored. R50 (Q5_0's, zero 16): [d][a word of
    fifth bits][4 words of nibbles], 22 bytes. R4NL (IQ4_NL's): R40's, the codes' bytes looked up (`Affine4`: u =
    level + 128, zero 128)."""
    zero, fifth = 8, None

    def subs(self, k, buf, at, piece):
        d = _half(k, buf, at(0, 2))
        return [(d, d * float(-self.zero), 2 if self.fifth is None else 6, self.fifth, 0)]


class R50(R40):
    zero, fifth = 16, 2


class R4NL(R40):
    zero, table = 128, IQ4_CODES


class R4XS(Affine4):
    """IQ4_XS's super-blocks of 256: [d f16, 2 bytes unused][8 signed scales (the file's 6-bit ones less 32)][8 x 4
    words of codes, a sub-block's as R4NL's] per row (140 bytes for the file's 136); sub-block s's value = d *
    scale_s * level = d * scale_s * u - 128 d * scale_s. Pieces: sub-blocks 0-3, 4-7, each piece's scales a word."""
    pieces = 2
    table = IQ4_CODES

    def subs(self, k, buf, at, piece):
        d, sw = ir.f16bits(_word(k, buf, at(0, 4))), _word(k, buf, at(4 + 4 * piece, 4))
        scales = [d * F((sw << 24 - 8 * j) >> 24) for j in range(4)]
        return [(sc, sc * -128.0, 12 + 16 * (4 * piece + j), None, 32 * (4 * piece + j))
                for j, sc in enumerate(scales)]


class R4K(Affine4):
    """Q4_K's super-blocks of 256: [d f16, dmin f16][the file's 12 bytes of 6-bit scales and mins][8 x 4 words of
    nibbles] per row (the file's 144 bytes); sub-block s's value = d * scale_s * q - dmin * min_s. One piece, the
    whole block an iteration (in halves, a matvec's loop spent a sixth of its instructions on the half's addresses
    and prefetched some lines twice: the 1B shape's decode on an AMX Xeon 14.26 -> 15.10 tok/s on one thread, 27.31
    -> 28.45 on two, `ab_decode.py --set quant.R4K.pieces 2 1`); each 4 sub-blocks' scales and mins a word of bytes
    made from the packed words (`_k4_scales_mins`). R5K (Q5_K, the file's 176 bytes): [d, dmin][scales and
    mins][8 words of fifth bits, a sub-block's each][8 x 4 words of nibbles], whole too: against halves, a Q5_K_M
    1B shape's decode on an AMX Xeon 15.68 -> 17.48 tok/s on one thread, 28.89 -> 31.39 on two (`ab_decode.py
    --set quant.R5K.pieces 2 1`, 5 rounds, though its VNNI loop stores 5 vectors to the stack; halves had been
    faster while decode programs ran LLVM's machine scheduler, which spilled the whole block more)."""
    pieces = 1
    fifth = None
    integer_tiles = True

    def subs(self, k, buf, at, piece):
        d, dmin, subs = self.integer_subs(k, buf, at, piece)
        return [(d * F(sc), -(dmin * F(mn)), off, fifth, e0) for sc, mn, off, fifth, e0 in subs]

    def integer_subs(self, k, buf, at, piece):
        """(d, dmin, [(6-bit scale, 6-bit min (i32s), field of the nibble words, of the fifth bits or None, first
        element)]) of the piece's sub-blocks: value = d * scale * q - dmin * min"""
        dm = _word(k, buf, at(0, 4))
        n = 8 // self.pieces
        fours = [_k4_scales_mins(lambda i: _word(k, buf, at(4 + 4 * i, 4)), piece * (n // 4) + h)
                 for h in range(n // 4)]  # (scales, mins) words of each 4 of the piece's sub-blocks
        byte = lambda j, m: (fours[j // 4][m] >> 8 * (j % 4)) & 255  # m: 0 sub-block j's scale, 1 its min
        quants = 16 if self.fifth is None else 48
        return ir.f16bits(dm), ir.f16bits(dm >> 16), [
            (byte(j, 0), byte(j, 1), quants + 16 * (piece * n + j),
             None if self.fifth is None else self.fifth + 4 * (piece * n + j), 32 * (piece * n + j)) for j in range(n)]

    def block_dot(self, k, buf, at, inp, piece):
        """d and dmin multiplied in once a piece, the mins' products with the input's sums a chain of multiply-adds
        (`Affine4.block_dot` scales each sub-block's terms apart, 3 instructions a sub-block more; the 1B shape's
        decode on an AMX Xeon 15.44 -> 15.70 tok/s on one thread, 30.13 / 29.94 on two, `ab_decode.py`, 5 rounds)"""
        d, dmin, subs = self.integer_subs(k, buf, at, piece)
        dots = [F(sc) * _nibble_dot(k, buf, at, off, inp, e0, fifth) for sc, _, off, fifth, e0 in subs]
        mins = [t for _, mn, _, _, e0 in subs for t in (F(mn) * inp.sum(e0), F(mn) * inp.sum(e0 + 16))]
        return d * sum(dots[1:], dots[0]) + (-dmin) * sum(mins[1:], mins[0])

    def integers(self, k, buf, at, piece):
        d, dmin, subs = self.integer_subs(k, buf, at, piece)
        ints = [(e0 + e, sc * q) for sc, _, off, fifth, e0 in subs for e, q in _nibble_ints(k, buf, at, off, fifth)]
        return d, ints, [(piece * len(subs) + j, -(dmin * F(mn))) for j, (_, mn, _, _, _) in enumerate(subs)]


class R5K(R4K):
    fifth = 16


class R2K(Interleaved):
    """Q2_K's super-blocks of 256: [d f16, dmin f16][16 bytes: sub-block s's scale in the low nibble, its min in
    the high][16 words of 2-bit q, sub-block s's a word: bits 2i of byte j for its element 4i + j] per row (the
    file's 84 bytes); value = d * scale_s * q - dmin * min_s. Pieces: quarters of 4 sub-blocks of 16."""
    digits = True
    pieces = 4

    def subs(self, k, buf, at, piece):
        """[(scale, offset, field of the q word, first element)] of the piece's 4 sub-blocks"""
        dm = _word(k, buf, at(0, 4))
        d, dmin = ir.f16bits(dm), ir.f16bits(dm >> 16)
        sm = _word(k, buf, at(4 + 4 * piece, 4))
        return [(d * F((sm >> 8 * j) & 15), -(dmin * F((sm >> 8 * j + 4) & 15)), 20 + 4 * (4 * piece + j),
                 16 * (4 * piece + j)) for j in range(4)]

    @staticmethod
    def crumbs(k, buf, at, off):
        """the 4 words of q of a sub-block, byte j of word i: element 4 i + j"""
        w = _word(k, buf, at(off, 4))
        return [(w >> 2 * i) & 0x03030303 for i in range(4)]

    def block_dot(self, k, buf, at, inp, piece):
        parts = []
        for scale, offset, off, e0 in self.subs(k, buf, at, piece):
            parts.append(scale * _quad_dot(self.crumbs(k, buf, at, off), inp, e0) + offset * inp.sum(e0))
        return sum(parts[1:], parts[0])

    def piece_values(self, k, buf, at, piece):
        return [(e0 + 4 * i + j, scale * F((q >> 8 * j) & 3) + offset)
                for scale, offset, off, e0 in self.subs(k, buf, at, piece)
                for i, q in enumerate(self.crumbs(k, buf, at, off)) for j in range(4)]


class R3K(Interleaved):
    """Q3_K's super-blocks of 256: [d f16, 2 bytes unused][16 signed scales (the file's 6-bit ones less 32)][16
    words of the low 2 bits of q + 4, as R2K's][8 words of their third bits: word t sub-blocks 2t (bits 0-15) and
    2t + 1 (16-31), bit 4i + j for element 4i + j] per row (116 bytes for the file's 110); value = d * scale_s *
    (u - 4), u = q + 4 in 0..7. A dot reads u (crumbs or'ed with the spread third bits) and subtracts 4 times the
    input's sums. Pieces: quarters of 4 sub-blocks of 16."""
    digits = True
    pieces = 4

    def subs(self, k, buf, at, piece):
        """[(scale, field of the crumb word, field of the third bits, their shift, first element)] of the piece's
        4 sub-blocks"""
        d = ir.f16bits(_word(k, buf, at(0, 4)))
        sw = _word(k, buf, at(4 + 4 * piece, 4))
        return [(d * F((sw << 24 - 8 * j) >> 24), 20 + 4 * s, 84 + 4 * (s // 2), 16 * (s % 2), 16 * s)
                for j, s in ((j, 4 * piece + j) for j in range(4))]

    @staticmethod
    def quads(k, buf, at, off, hoff, shift):
        """the 4 words of u of a sub-block, byte j of word i: element 4 i + j"""
        h = _word(k, buf, at(hoff, 4)) >> shift
        return [q | _spread4((h >> 4 * i) & 15, 2) for i, q in enumerate(R2K.crumbs(k, buf, at, off))]

    def block_dot(self, k, buf, at, inp, piece):
        parts = []
        for scale, off, hoff, shift, e0 in self.subs(k, buf, at, piece):
            parts.append(scale * (_quad_dot(self.quads(k, buf, at, off, hoff, shift), inp, e0) - 4.0 * inp.sum(e0)))
        return sum(parts[1:], parts[0])

    def piece_values(self, k, buf, at, piece):
        return [(e0 + 4 * i + j, scale * F(((q >> 8 * j) & 7) - 4))
                for scale, off, hoff, shift, e0 in self.subs(k, buf, at, piece)
                for i, q in enumerate(self.quads(k, buf, at, off, hoff, shift)) for j in range(4)]


class R8(Interleaved):
    """Q8_0's blocks of 32: [d f16][32 bytes of int8] per row; value = d * q."""
    def block_dot(self, k, buf, at, inp, piece):
        step = lambda j: F(_i8(k.load(buf, at(2, 1) + j * ROWS))) * inp.x(j)
        return _half(k, buf, at(0, 2)) * ir.reduce("add", "j", 32, step, "unroll")

    def piece_values(self, k, buf, at, piece):
        return [(j, _half(k, buf, at(0, 2)) * F(_i8(k.load(buf, at(2 + j, 1))))) for j in range(32)]


class R6(Interleaved):
    """Q6_K's super-blocks of 256: [d f16, 2 bytes unused][16 scales i8][16 sub-blocks x 3 words] per row. The 3
    words of sub-block s (16 elements, scale s) hold its 6-bit q: byte j of word k (k = 0, 1, 2) q of element
    4 k + j in its low 6 bits, and bits 2 k, 2 k + 1 of element 12 + j's q in its top 2; value = d * scale_s *
    (q - 32). A dot reads 3 quads of q with one mask each, the fourth from the words' tops, and subtracts 32
    times the input's sums. One piece, the whole block an iteration: quarters, once faster than halves (whose
    values spilled), left the 1B shape's decode on an AMX Xeon 2-3 % slower (12.98 against 13.37 tok/s on one
    thread, 24.20 against 24.76 on two, `ab_decode.py --set quant.R6.pieces 4 1`, decode programs compiled without
    the machine scheduler, which spilled the whole block's values; a matvec alone with the deep prefetch 11.1
    against 12.8 GB/s, though with the non-temporal one quarters were the faster, 6.5 against 6.0)."""
    digits = True
    pieces = 1
    integer_tiles = True

    def quads(self, k, buf, at, s):
        """the 4 words of q of sub-block s (an expression), byte j of word i: element 4 i + j"""
        w = [_word(k, buf, at(20 + 12 * s + 4 * i, 4)) for i in range(3)]
        return [x & 0x3F3F3F3F for x in w] + \
            [((w[0] >> 6) & 0x03030303) | ((w[1] >> 4) & 0x0C0C0C0C) | ((w[2] >> 2) & 0x30303030)]

    def scale(self, k, buf, at, s4, j):
        """scale of sub-block 4 s4 + j (an i32)"""
        return (_word(k, buf, at(4 + 4 * s4, 4)) << 24 - 8 * j) >> 24

    def block_dot(self, k, buf, at, inp, piece):
        d, subs, n = ir.f16bits(_word(k, buf, at(0, 4))), [], 16 // self.pieces
        for j in range(n):
            s, e0 = piece * n + j, piece * 16 * n + 16 * j
            subs.append((d * F(self.scale(k, buf, at, *_byte_of(piece, n, j))))
                        * (_quad_dot(self.quads(k, buf, at, s), inp, e0) - 32.0 * inp.sum(e0)))
        return sum(subs[1:], subs[0])

    def piece_values(self, k, buf, at, piece):
        d, out, n = ir.f16bits(_word(k, buf, at(0, 4))), [], 16 // self.pieces
        for j in range(n):
            s = piece * n + j
            sc = d * F(self.scale(k, buf, at, *_byte_of(piece, n, j)))
            out += [(16 * s + 4 * i + b, sc * F(((q >> 8 * b) & 63) - 32))
                    for i, q in enumerate(self.quads(k, buf, at, s)) for b in range(4)]
        return out

    def integers(self, k, buf, at, piece):
        """value = d * (u - 4096): u = scale * (q - 32) + 4096, in [32, 8192]"""
        d, ints, n = ir.f16bits(_word(k, buf, at(0, 4))), [], 16 // self.pieces
        for j in range(n):
            s, sc = piece * n + j, self.scale(k, buf, at, *_byte_of(piece, n, j))
            ints += [(16 * s + 4 * i + b, sc * (((q >> 8 * b) & 63) - 32) + 4096)
                     for i, q in enumerate(self.quads(k, buf, at, s)) for b in range(4)]
        spans = range(piece * n // 2, (piece + 1) * n // 2)  # spans of 32: two sub-blocks each
        return d, ints, [(j, d * -4096.0) for j in spans]


FORMATS = {
    "F32": Plain("F32", 32, 32, "f32", 1, 32),
    "F16": Plain("F16", 32, 32, "f16", 1, 32),
    "BF16": Plain("BF16", 32, 32, "bf16", 1, 32),
    "Q8_0": Q8_0("Q8_0", 32, 34, "u8", 1, 32),
    "Q2_K": Q2_K("Q2_K", 256, 84, "u8", 8, 16),
    "Q3_K": Q3_K("Q3_K", 256, 110, "u8", 8, 16),
    "Q4_0": Q4_0("Q4_0", 32, 18, "u8", 1, 16),
    "Q4_1": Q4_1("Q4_1", 32, 20, "u8", 1, 16),
    "Q5_0": Q5_0("Q5_0", 32, 22, "u8", 1, 16),
    "Q5_1": Q5_1("Q5_1", 32, 24, "u8", 1, 16),
    "Q4_K": Q4_K("Q4_K", 256, 144, "u8", 4, 32),
    "Q5_K": Q5_K("Q5_K", 256, 176, "u8", 4, 32),
    "Q6_K": Q6_K("Q6_K", 256, 210, "u8", 4, 16),
    "IQ4_NL": IQ4_NL("IQ4_NL", 32, 18, "u8", 1, 16),
    "IQ4_XS": IQ4_XS("IQ4_XS", 256, 136, "u8", 8, 16),
}


PACKED = {
    "R8": R8("R8", 32, 34, "u8", 1, ROWS),
    "R4": R4("R4", 32, 20, "u8", 1, ROWS),
    "R5": R5("R5", 32, 24, "u8", 1, ROWS),
    "R40": R40("R40", 32, 18, "u8", 1, ROWS),
    "R50": R50("R50", 32, 22, "u8", 1, ROWS),
    "R4K": R4K("R4K", 256, 144, "u8", 1, ROWS),
    "R5K": R5K("R5K", 256, 176, "u8", 1, ROWS),
    "R6": R6("R6", 256, 212, "u8", 1, ROWS),
    "R2K": R2K("R2K", 256, 84, "u8", 1, ROWS),
    "R3K": R3K("R3K", 256, 116, "u8", 1, ROWS),
    "R4NL": R4NL("R4NL", 32, 18, "u8", 1, ROWS),
    "R4XS": R4XS("R4XS", 256, 140, "u8", 1, ROWS),
}


def _interleave(rows, fields, byte_fields):
    """Blocks' fields, each (rows * nb, size) bytes, and runs of 1-byte fields, each (rows * nb, count) (a
    field per column) -> the interleaved layout's bytes: per row group and block, each field's rows side by
    side, in the order given."""
    def grouped(a):
        return a.reshape(rows // ROWS, ROWS, a.shape[0] // rows, a.shape[1])
    parts = [grouped(f).transpose(0, 2, 1, 3) for f in fields]
    parts += [grouped(f).transpose(0, 2, 3, 1) for f in byte_fields]
    return np.concatenate([p.reshape(p.shape[0], p.shape[1], -1) for p in parts], axis=2).reshape(-1)


def _pack_q8_0(b, rows):
    return _interleave(rows, [b[:, 0:2]], [b[:, 2:34]])


def _words(rows, b):
    """Blocks' bytes (rows * nb, unit), unit a multiple of 4 -> interleaved with every field a word: per row group
    and block, word j of each of the ROWS rows side by side (moved as words: a tenth of the time bytes take)."""
    nb = len(b) // rows
    w = np.ascontiguousarray(b).view("<u4").reshape(rows // ROWS, ROWS, nb, -1)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).view(np.uint8).reshape(-1)


def _fields(rows, b, sizes):
    """Blocks' bytes (rows * nb, sum of sizes) cut into fields of these sizes -> interleaved (`_interleave`)."""
    cuts = np.cumsum([0, *sizes])
    return _interleave(rows, [b[:, a:z] for a, z in zip(cuts, cuts[1:])], [])


def _d_word(b, off):
    """A block's f16 d at byte off and 2 unused bytes: a word, so that the fields after it stay words."""
    return np.concatenate([b[:, off:off + 2], np.zeros((len(b), 2), np.uint8)], axis=1)


def _signed6(low, high):
    """6-bit scales from their low 4 and top 2 bits, less 32, as int8 bytes (Q3_K's, IQ4_XS's)."""
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)


def _crumb_words(qs):
    """Q2_K's and Q3_K's 64 bytes of 2-bit q (bits 2j of byte 32 n + 16 h + l: element l of sub-block 8n + 2j + h)
    -> a word per sub-block, bits 2i of byte j for its element 4i + j (`R2K.crumbs`)."""
    shifts = 2 * np.arange(4, dtype=np.uint8)
    q = (qs.reshape(-1, 2, 1, 2, 16) >> shifts[None, None, :, None, None]) & 3  # [n][j][h][l]
    q = q.reshape(-1, 16, 4, 4)                                                # [s][i][j]: element 4i + j
    return (q << shifts[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _pack_q4_0(b, rows):
    return _fields(rows, b, [2, 4, 4, 4, 4])  # IQ4_NL's too: d and 16 bytes of codes


def _pack_q4_1(b, rows):
    return _words(rows, b)


def _fifth_words(h):
    """Fifth bits h (blocks, sub-blocks, 32 elements; 0 or 1) -> a word per sub-block as `_quants` reads it: byte
    w holds elements 4w .. 4w + 3 in bits 0-3, 16 + 4w .. 16 + 4w + 3 in bits 4-7."""
    h = h.reshape(h.shape[0], h.shape[1], 2, 4, 4)  # [block][sub-block][half][w][j]
    bits = (h << np.arange(4, dtype=np.uint8)).sum(axis=4, dtype=np.uint8)  # [half][w]: 4 bits
    return (bits[:, :, 0] | (bits[:, :, 1] << 4)).reshape(len(h), -1)


def _file_fifth_bits(qh):
    """Q5_0 / Q5_1's qh (a little-endian u32 per block: bit j for element j) -> (blocks, 1, 32) bits."""
    return ((qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)[:, None, :]


def _pack_q5_0(b, rows):
    return _fields(rows, np.concatenate([b[:, 0:2], _fifth_words(_file_fifth_bits(b[:, 2:6])), b[:, 6:22]], axis=1),
                   [2] + [4] * 5)


def _pack_q5_1(b, rows):
    return _words(rows, np.concatenate([b[:, 0:4], _fifth_words(_file_fifth_bits(b[:, 4:8])), b[:, 8:24]], axis=1))


def _pack_q5_k(b, rows):
    qh = b[:, 16:48]  # bit s of byte j: element j of sub-block s
    h = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    nibbles = _word_bytes(b, lambda word, half: _k_nibble_words(word, 48))
    return _words(rows, np.concatenate([b[:, 0:16], _fifth_words(h), nibbles], axis=1))


def _pack_q2_k(b, rows):
    return _words(rows, np.concatenate([b[:, 80:84], b[:, 0:16], _crumb_words(b[:, 16:80])], axis=1))


def _q3_k_scales(sc):
    """Q3_K's 12 bytes of packed 6-bit scales -> the 16 scales less 32 (`_signed6`): scale 4a + b's low nibble from
    byte 4 (a % 2) + b (its high nibble for a >= 2), its top 2 bits from byte 8 + b, bits 2a."""
    a, b = np.arange(16) // 4, np.arange(16) % 4
    low = (sc[:, 4 * (a % 2) + b] >> (4 * (a // 2)).astype(np.uint8)) & 15
    high = (sc[:, 8 + b] >> (2 * a).astype(np.uint8)) & 3
    return _signed6(low, high)


def _pack_q3_k(b, rows):
    hm = b[:, 0:32].reshape(-1, 1, 1, 2, 16)  # bit 4n + j of byte 16 h + l: element l of sub-block 8n + 2j + h
    shifts = 4 * np.arange(2, dtype=np.uint8)[:, None] + np.arange(4, dtype=np.uint8)
    high = (hm >> shifts[None, :, :, None, None]) & 1                         # [n][j][h][l]
    bits = (high.reshape(-1, 8, 2, 16).astype(np.uint32) << np.arange(32, dtype=np.uint32).reshape(2, 16)).sum(
        axis=(2, 3), dtype=np.uint32)                                          # word t: sub-blocks 2t, 2t + 1
    return _words(rows, np.concatenate([_d_word(b, 108), _q3_k_scales(b[:, 96:108]),
                                        _crumb_words(b[:, 32:96]), bits.astype("<u4").view(np.uint8)], axis=1))


# Layouts whose words are each an expression of the file block's 32-bit words (`BLOCK_WORDS`): written once, run by
# NumPy over every block at once (`_np_words`) or as an IR kernel on the device that holds the weights
# (`repack_kernel`). word(off): the block's word at byte off (a multiple of 4); half(off): its 16 bits at byte off.
# Every right shift is masked, so an arithmetic shift (the IR's) and a logical one (NumPy's) agree.

def _k_nibble_words(word, off):
    """A k-quant's 128 bytes of nibbles at byte off (each 32 bytes: sub-block 2p in the low nibbles, 2p + 1 in the
    high) -> 32 words, a sub-block's 16 bytes each, element j low and j + 16 high, as `_nibble_dot` reads them."""
    out = []
    for p in range(4):
        lo = [word(off + 32 * p + 4 * m) for m in range(4)]       # elements 0-15 of sub-blocks 2p, 2p + 1
        hi = [word(off + 32 * p + 16 + 4 * m) for m in range(4)]  # their elements 16-31
        out += [(a & NIBBLES) | ((z & NIBBLES) << 4) for a, z in zip(lo, hi)]
        out += [((a >> 4) & NIBBLES) | (((z >> 4) & NIBBLES) << 4) for a, z in zip(lo, hi)]
    return out


def _q4_k_words(word, half):
    return [word(4 * i) for i in range(4)] + _k_nibble_words(word, 16)


def _q6_k_words(word, half):
    """[d, 2 zero bytes][16 scales][per sub-block of 16 elements 3 words (`R6`)] from the file's ql (low nibbles),
    qh (top 2 bits), scales and d: element e's 6 bits from ql byte 64 h + 32 (c % 2) + l (its low nibble for c < 2)
    and qh byte 32 h + l (bits 2c), e = 128 h + 32 c + l."""
    out = [half(208), *(word(192 + 4 * i) for i in range(4))]
    for s in range(16):
        q = []  # word w: elements 16 s + 4 w .. + 3, a byte each
        for w in range(4):
            e = 16 * s + 4 * w
            h, c, l = e // 128, e % 128 // 32, e % 32
            low = word(64 * h + 32 * (c % 2) + l)
            q.append((low if c < 2 else low >> 4) & NIBBLES | ((word(128 + 32 * h + l) >> 2 * c) & 0x03030303) << 4)
        out += [q[w] | ((q[3] >> 2 * w) & 0x03030303) << 6 for w in range(3)]
    return out


# Q4_1's R4 is the file's words, which NumPy moves at the memory's speed: no kernel to compile for it
BLOCK_WORDS = {"Q4_K": _q4_k_words, "Q6_K": _q6_k_words}


def _np_words(b, block_words):
    """block_words over blocks b (n, unit bytes) at once: each word an (n,) uint32 array."""
    n, unit = b.shape
    if unit % 4:
        b = np.concatenate([b, np.zeros((n, -unit % 4), np.uint8)], axis=1)
    planar = np.ascontiguousarray(np.ascontiguousarray(b).view("<u4").T)  # [word][block]
    return block_words(lambda off: planar[off // 4], lambda off: (planar[off // 4] >> 8 * (off % 4)) & 0xFFFF)


def _word_bytes(b, block_words):
    """block_words' words of blocks b, as (n, 4 x words) bytes."""
    return np.stack(_np_words(b, block_words), axis=1).astype("<u4", copy=False).view(np.uint8)


def _word_packer(block_words):
    return lambda b, rows: _words(rows, _word_bytes(b, block_words))


@functools.cache  # kernels are immutable once finished
def repack_kernel(fmt: Format, rows: int, cols: int) -> ir.Kernel:
    """The kernel that writes a tensor of fmt (`rows` x `cols`) in packed_format(fmt, rows)'s layout, for a format
    of BLOCK_WORDS: "raw", the file's bytes as words (and one more: a block may end mid-word), "out" the layout's
    words. The rows of a group are a vector's lanes, as the layout stores them."""
    nb, words = cols // fmt.block, packed_format(fmt, rows).unit // 4
    k = ir.Kernel(f"repack_{fmt.name}_{rows}x{cols}")
    k.buffer("raw", "i32", rows * nb * fmt.unit // 4 + 1)
    k.buffer("out", "i32", rows * nb * words, write=True)
    with k.parallel("g", rows // ROWS) as g, k.loop("b", nb) as b, k.loop("r", ROWS, "vector") as r:
        at = k.let("at", ((g * ROWS + r) * nb + b) * fmt.unit)  # the block's first byte
        loaded = {}

        def word(off):  # each word loaded once; a block that starts mid-word (Q6_K's 210 bytes) has its words
            if off not in loaded:  # from two
                w = k.load("raw", (at >> 2) + off // 4)
                if fmt.unit % 4:
                    after = k.load("raw", (at >> 2) + off // 4 + 1)
                    w = ir.select((at & 3) == 0, w, ((w >> 16) & 0xFFFF) | (after << 16))
                loaded[off] = k.let(f"w{off}", w)
            return loaded[off]
        half = lambda off: (word(off - off % 4) >> 8 * (off % 4)) & 0xFFFF
        for j, w in enumerate(BLOCK_WORDS[fmt.name](word, half)):
            k.store("out", ((g * nb + b) * words + j) * ROWS + r, w)
    return k.finish()


def _pack_iq4_xs(b, rows):
    s = np.arange(8)
    low = (b[:, 4 + s // 2] >> (4 * (s % 2)).astype(np.uint8)) & 15
    high = (b[:, 2:4].copy().view("<u2") >> (2 * s).astype(np.uint16)) & 3
    return _words(rows, np.concatenate([_d_word(b, 0), _signed6(low, high), b[:, 8:136]], axis=1))


REPACK = {"Q8_0": ("R8", _pack_q8_0), "Q4_0": ("R40", _pack_q4_0), "Q4_1": ("R4", _pack_q4_1),
          "Q5_0": ("R50", _pack_q5_0), "Q5_1": ("R5", _pack_q5_1),
          "Q2_K": ("R2K", _pack_q2_k), "Q3_K": ("R3K", _pack_q3_k), "Q4_K": ("R4K", _word_packer(_q4_k_words)),
          "Q5_K": ("R5K", _pack_q5_k),
          "Q6_K": ("R6", _word_packer(_q6_k_words)), "IQ4_NL": ("R4NL", _pack_q4_0), "IQ4_XS": ("R4XS", _pack_iq4_xs)}


def packed_format(fmt: Format, rows: int) -> Format:
    """The layout a device holds fmt's tensors of `rows` rows in (fmt itself when it has no repacked form, or
    the row count is not a multiple of an interleaved layout's ROWS)."""
    packed = PACKED[REPACK[fmt.name][0]] if fmt.name in REPACK else fmt
    return fmt if isinstance(packed, Interleaved) and rows % ROWS else packed


# the most file bytes one call of a layout's packer takes: its NumPy passes then run over intermediates in the
# caches, not in memory (a 1B model's 800 MB: 1.0 GB/s on two threads, 0.36 over whole tensors; parts of 64 KB
# spent more in NumPy's calls than they saved)
REPACK_PART_BYTES = 1 << 20


@functools.cache
def _pool():
    return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="jitllm-repack")


def repack(fmt: Format, raw: np.ndarray, rows: int, out=None) -> np.ndarray:
    """raw bytes of fmt's blocks (a tensor of `rows` rows) -> the same values in packed_format(fmt, rows)'s
    layout (uint8), into `out` if given (when it repacks). Whole row groups are packed on every
    core at once (NumPy releases the GIL), each thread's a cache's worth at a time: a model's load is mostly this."""
    packed = packed_format(fmt, rows)
    if packed is fmt:
        return raw
    blocks, pack = np.asarray(raw, np.uint8).reshape(-1, fmt.unit), REPACK[fmt.name][1]
    per_row, groups = len(blocks) // rows, rows // ROWS
    step = ROWS * max(1, REPACK_PART_BYTES // (ROWS * per_row * fmt.unit))  # rows a call of pack takes
    n = max(1, min(os.cpu_count() or 1, groups))
    bounds = [ROWS * (groups * i // n) for i in range(n + 1)]
    out = np.empty(rows * per_row * packed.unit, np.uint8) if out is None else out

    def part(i):
        for r0 in range(bounds[i], bounds[i + 1], step):
            r1 = min(bounds[i + 1], r0 + step)
            out[r0 * per_row * packed.unit:r1 * per_row * packed.unit] = \
                np.asarray(pack(blocks[r0 * per_row:r1 * per_row], r1 - r0)).reshape(-1)
    list(_pool().map(part, range(n)))
    return out


def get_format(type_name, cols, where=""):
    """The format for a tensor; plain formats use a block that divides the row."""
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise ModelFileError(where or "model", f"tensor type {type_name} is not supported "
                                               f"(supported: {', '.join(FORMATS)})")
    if isinstance(fmt, Plain) and cols % fmt.block:
        fmt = Plain(fmt.name, 1, 1, fmt.storage, 1, 1)
    if cols % fmt.block:
        raise ModelFileError(where or "model", f"row length {cols} is not a multiple of {type_name}'s block {fmt.block}")
    return fmt


def dequant_rows(k: ir.Kernel, fmt: Format, buf: str, rg, b0, nb: int, cols: int, store):
    """Emit the dequantization of rows [ROWS rg, ROWS rg + ROWS) of a matrix of `cols` columns in layout fmt,
    blocks [b0, b0 + nb): store(b, e, r, value) for element e of block b0 + b of row ROWS rg + r. An interleaved
    format's rows are a vector's lanes (contiguous fields); a file format's are one after another, its block's
    lanes the vector's."""
    if isinstance(fmt, Interleaved):
        with k.loop("b", nb, "serial") as b:
            with k.loop("p", fmt.pieces, "serial") as p:
                with k.loop("r", ROWS, "vector") as r:
                    for e, v in fmt.values(k, buf, rg, r, cols, b0 + b, p):
                        store(b, e, r, v)
        return
    with k.loop("r", ROWS, "serial") as r:
        with k.loop("b", nb, "serial") as b:
            base = k.let("base", ((rg * ROWS + r) * (cols // fmt.block) + b0 + b) * fmt.unit)
            for g in range(fmt.groups):
                with k.loop("l", fmt.lanes, "vector") as l:
                    for e, v in fmt.terms(k, buf, base, g, l):
                        store(b, e, r, v)


@functools.cache  # kernels are immutable once finished
def dequant_kernel(fmt: Format, rows: int, cols: int) -> ir.Kernel:
    """W -> f32 rows: the reference definition of a format's values (the tests hold it to gguf's dequantizers).
    An interleaved format's rows come out interleaved as it stores them: out[row // ROWS, col, row % ROWS]."""
    k = ir.Kernel(f"dequant_{fmt.name}_{rows}x{cols}")
    k.buffer("w", fmt.storage, rows * fmt.row_units(cols))
    k.buffer("out", "f32", rows * cols, True)
    nb = cols // fmt.block
    if isinstance(fmt, Interleaved):
        with k.parallel("gb", rows // ROWS * nb) as gb:
            g, b = gb // nb, gb % nb
            dequant_rows(k, fmt, "w", g, b, 1, cols,
                         lambda _, e, r, v: k.store("out", (g * cols + b * fmt.block + e) * ROWS + r, v))
        return k.finish()
    with k.parallel("rbg", rows * nb * fmt.groups) as rbg:
        rb, g = (rbg, 0) if fmt.groups == 1 else (rbg // fmt.groups, rbg % fmt.groups)
        with k.loop("l", fmt.lanes, "vector") as l:
            for j, w in fmt.terms(k, "w", rb * fmt.unit, g, l):
                k.store("out", rb * fmt.block + j, w)
    return k.finish()
