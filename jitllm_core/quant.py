"""Weight formats, each described once: block layout, and how to read one element or dot a block, in IR.

A tensor row of `cols` elements is `cols / block` blocks of `unit` storage elements (bytes for quantized
formats, values for plain ones). `element(k, buf, base, j)` is element j of the block starting at storage index
`base`; `group_dot(k, buf, base, g, lane, x)` is the contribution of lane `lane` of group `g` of that block to
a dot product with x(j) -- written so that lanes are contiguous bytes, which is what makes it SIMD-friendly on
every backend. A new format added here works on every backend.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def row_units(self, cols):
        return cols // self.block * self.unit

    def nbytes(self, rows, cols):
        return rows * self.row_units(cols) * ir.STORAGE_DTYPES[self.storage]

    def element(self, k, buf, base, j):
        raise NotImplementedError

    def group_dot(self, k, buf, base, g, l, x):
        raise NotImplementedError

    def row_dot(self, k, buf, row, cols, x, kind="reduce"):
        """sum_c W[row, c] * x(c) as one Reduce over (block, group) of a vector Reduce over lanes."""
        nb, G = cols // self.block, self.groups

        def outer(bg):
            b, g = (bg, 0) if G == 1 else (bg // G, bg % G)
            base = (row * nb + b) * self.unit
            return ir.reduce("add", "l", self.lanes,
                             lambda l: self.group_dot(k, buf, base, g, l, lambda j: x(b * self.block + j)), "vector")
        return ir.reduce("add", "bg", nb * G, outer, kind)


class Plain(Format):
    def element(self, k, buf, base, j):
        return k.load(buf, base + j)

    def group_dot(self, k, buf, base, g, l, x):
        return k.load(buf, base + l) * x(l)


class Q8_0(Format):
    def element(self, k, buf, base, j):
        return _half(k, buf, base) * F(_i8(k.load(buf, base + 2 + j)))

    def group_dot(self, k, buf, base, g, l, x):
        return _half(k, buf, base) * F(_i8(k.load(buf, base + 2 + l))) * x(l)


class Q4_0(Format):
    def element(self, k, buf, base, j):
        q = (k.load(buf, base + 2 + j % 16) >> (j // 16 * 4)) & 15
        return _half(k, buf, base) * F(q - 8)

    def group_dot(self, k, buf, base, g, l, x):
        d, q = _half(k, buf, base), k.load(buf, base + 2 + l)
        return d * F((q & 15) - 8) * x(l) + d * F((q >> 4) - 8) * x(l + 16)


class Q4_1(Format):
    def element(self, k, buf, base, j):
        q = (k.load(buf, base + 4 + j % 16) >> (j // 16 * 4)) & 15
        return _half(k, buf, base) * F(q) + _half(k, buf, base + 2)

    def group_dot(self, k, buf, base, g, l, x):
        d, m, q = _half(k, buf, base), _half(k, buf, base + 2), k.load(buf, base + 4 + l)
        return (d * F(q & 15) + m) * x(l) + (d * F(q >> 4) + m) * x(l + 16)


def _k4_scale_min(k, buf, base, s):
    """6-bit scale and min of sub-block s (0..7) of a Q4_K block (llama.cpp's get_scale_min_k4)."""
    sc = lambda i: k.load(buf, base + 4 + i)
    lo = s < 4
    s4 = ir.select(lo, s, s - 4)  # keeps every index in range for both branches
    scale = ir.select(lo, sc(s4) & 63, (sc(s4 + 8) & 15) | ((sc(s4) >> 6) << 4))
    mn = ir.select(lo, sc(s4 + 4) & 63, (sc(s4 + 8) >> 4) | ((sc(s4 + 4) >> 6) << 4))
    return F(scale), F(mn)


class Q4_K(Format):
    # d, dmin (f16), 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles; 8 sub-blocks of 32
    def element(self, k, buf, base, j):
        p, hi, l = j // 64, (j // 32) % 2, j % 32
        sc, mn = _k4_scale_min(k, buf, base, p * 2 + hi)
        q = (k.load(buf, base + 16 + p * 32 + l) >> (hi * 4)) & 15
        return _half(k, buf, base) * sc * F(q) - _half(k, buf, base + 2) * mn

    def group_dot(self, k, buf, base, p, l, x):
        d, dmin = _half(k, buf, base), _half(k, buf, base + 2)
        sc0, m0 = _k4_scale_min(k, buf, base, p * 2)
        sc1, m1 = _k4_scale_min(k, buf, base, p * 2 + 1)
        q = k.load(buf, base + 16 + p * 32 + l)
        return ((d * sc0) * F(q & 15) - dmin * m0) * x(p * 64 + l) + \
               ((d * sc1) * F(q >> 4) - dmin * m1) * x(p * 64 + 32 + l)


class Q6_K(Format):
    # ql[128] low nibbles, qh[64] high 2-bit pairs, 16 int8 scales, d (f16); two halves of 128 elements
    def element(self, k, buf, base, j):
        n, r = j // 128, j % 128
        quarter, l = r // 32, r % 32
        ql = (k.load(buf, base + 64 * n + l + 32 * (quarter % 2)) >> (quarter // 2 * 4)) & 15
        qh = (k.load(buf, base + 128 + 32 * n + l) >> (2 * quarter)) & 3
        sc = _i8(k.load(buf, base + 192 + 8 * n + l // 16 + 2 * quarter))
        return _half(k, buf, base + 208) * F(sc) * F((ql | (qh << 4)) - 32)

    def group_dot(self, k, buf, base, g, j, x):
        n, h = g // 2, g % 2
        l = h * 16 + j
        d = _half(k, buf, base + 208)
        a, b = k.load(buf, base + 64 * n + l), k.load(buf, base + 64 * n + 32 + l)
        qh = k.load(buf, base + 128 + 32 * n + l)
        sc = lambda q: d * F(_i8(k.load(buf, base + 192 + 8 * n + h + 2 * q)))
        q = [(a & 15) | ((qh & 3) << 4), (b & 15) | (((qh >> 2) & 3) << 4),
             (a >> 4) | (((qh >> 4) & 3) << 4), (b >> 4) | (((qh >> 6) & 3) << 4)]
        terms = [sc(i) * F(q[i] - 32) * x(128 * n + 32 * i + l) for i in range(4)]
        return terms[0] + terms[1] + terms[2] + terms[3]


FORMATS = {
    "F32": Plain("F32", 32, 32, "f32", 1, 32),
    "F16": Plain("F16", 32, 32, "f16", 1, 32),
    "BF16": Plain("BF16", 32, 32, "bf16", 1, 32),
    "Q8_0": Q8_0("Q8_0", 32, 34, "u8", 1, 32),
    "Q4_0": Q4_0("Q4_0", 32, 18, "u8", 1, 16),
    "Q4_1": Q4_1("Q4_1", 32, 20, "u8", 1, 16),
    "Q4_K": Q4_K("Q4_K", 256, 144, "u8", 4, 32),
    "Q6_K": Q6_K("Q6_K", 256, 210, "u8", 4, 16),
}


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


def dequant_kernel(fmt: Format, rows: int, cols: int) -> ir.Kernel:
    """W -> f32 rows (used by tests and by the embedding lookup's definition)."""
    k = ir.Kernel(f"dequant_{fmt.name}_{rows}x{cols}")
    k.buffer("w", fmt.storage, rows * fmt.row_units(cols))
    k.buffer("out", "f32", rows * cols, True)
    nb = cols // fmt.block
    with k.parallel("rb", rows * nb) as rb:
        with k.loop("j", fmt.block, "vector") as j:
            k.store("out", rb * fmt.block + j, fmt.element(k, "w", rb * fmt.unit, j))
    return k.finish()
