"""GGUF v2/v3 reader: metadata as Python values, tensors as views into a read-only memory map.

Model files are untrusted input, so every count and length in the header is checked against the file
size before it is used: a lying header gives a ModelFileError, never a hang or a huge allocation.
"""

import mmap
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import ModelFileError


class GGMLType(NamedTuple):
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


# ggml type id -> layout; ids missing here were removed from ggml and are rejected.
GGML_TYPES = {
    0: GGMLType("F32", 1, 4), 1: GGMLType("F16", 1, 2), 2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20), 6: GGMLType("Q5_0", 32, 22), 7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34), 9: GGMLType("Q8_1", 32, 40), 10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110), 12: GGMLType("Q4_K", 256, 144), 13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210), 15: GGMLType("Q8_K", 256, 292), 16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74), 18: GGMLType("IQ3_XXS", 256, 98), 19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18), 21: GGMLType("IQ3_S", 256, 110), 22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136), 24: GGMLType("I8", 1, 1), 25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4), 27: GGMLType("I64", 1, 8), 28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56), 30: GGMLType("BF16", 1, 2), 34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66), 39: GGMLType("MXFP4", 32, 17),
}
GGML_TYPE_IDS = {t.name: i for i, t in GGML_TYPES.items()}

MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple  # numpy (row-major) order: (rows, cols) for a 2-D weight
    ggml_type: int
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


# Metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                  10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8  # arrays of arrays: bounded so a crafted file cannot exhaust the Python stack


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads little-endian values from the mapped header, turning any overrun into a ModelFileError."""

    def __init__(self, path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, problem):
        raise ModelFileError(self.path, problem)

    def need(self, n, what):
        if n > self.size - self.pos:
            self.fail(f"truncated file: {what} at byte {self.pos} needs {n} bytes, "
                      f"but the file has only {self.size} bytes")

    def unpack(self, fmt, what):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, what, min_item_bytes):
        """A u64 count whose items take at least min_item_bytes each: it must fit in the rest of the file."""
        n = self.unpack("<Q", what)
        if n * min_item_bytes > self.size - self.pos:
            self.fail(f"truncated or corrupt file: {what} {n} cannot fit in the remaining "
                      f"{self.size - self.pos} bytes")
        return n

    def string(self, what):
        n = self.unpack("<Q", f"length of {what}")
        self.need(n, what)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, n, what):
        """n strings in a row (a vocabulary and its merges: ~100 k), read in a loop of locals: a `string` call for
        each made SmolLM2's header take 0.22 s instead of 0.12."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for _ in range(n):
            m = _U64.unpack_from(buf, pos)[0] if size - pos >= 8 else size  # (no room for the length: fails below)
            if m > size - pos - 8:
                self.pos = pos
                self.string(what)  # raises, naming what is cut short
            out.append(buf[pos + 8:pos + 8 + m].decode("utf-8", errors="replace"))
            pos += 8 + m
        self.pos = pos
        return out

    def value(self, vtype, what, depth=0):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.unpack("<I", f"element type of {what}")
            if itype in _NUMPY_SCALARS:  # numeric arrays (scores, token types) in one go
                dtype = np.dtype(_NUMPY_SCALARS[itype])
                n = self.count(f"array length of {what}", dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype, n, self.pos)
                self.pos += n * dtype.itemsize
                return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
            if itype not in (_STRING, _ARRAY):
                self.fail(f"unknown array element type {itype} in {what}")
            if depth >= _MAX_NESTING:
                self.fail(f"arrays nested deeper than {_MAX_NESTING} levels in {what}")
            n = self.count(f"array length of {what}", 8)  # a string or array takes >= 8 bytes
            if itype == _STRING:
                return self.strings(n, what)
            return [self.value(itype, what, depth + 1) for _ in range(n)]
        self.fail(f"unknown value type {vtype} for {what}")


class GGUFFile:
    """One GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `raw(name)` bytes."""

    def __init__(self, path):
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
                if magic != b"GGUF":
                    raise ModelFileError(self.path, f"bad magic {magic!r}: not a GGUF file")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(self.path, f"cannot read: {e.strerror or e}") from e
        self._data = np.frombuffer(self._mmap, dtype=np.uint8)
        self._parse(_Cursor(self.path, self._mmap), len(self._mmap))

    def _parse(self, cur, size):
        cur.pos = 4  # after the magic
        self.version = cur.unpack("<I", "version")
        if self.version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            kind = "big-endian GGUF" if swapped in (2, 3) else f"GGUF version {self.version}"
            cur.fail(f"unsupported {kind} (supported: little-endian versions 2 and 3)")
        n_tensors = cur.count("tensor count", 8 + 4 + 4 + 8)  # name length, n_dims, type, offset
        n_kv = cur.count("metadata count", 8 + 4)  # key length, value type

        self.metadata = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.unpack("<I", f"value type of metadata key {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata key {key!r}")

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            cur.fail(f"general.alignment must be a power of two, got {self.alignment!r}")

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.unpack("<I", f"dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                cur.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [cur.unpack("<Q", f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", f"type of tensor {name!r}")
            offset = cur.unpack("<Q", f"data offset of tensor {name!r}")
            infos.append((name, dims, ggml_type, offset))

        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = {}
        for name, dims, ggml_type, offset in infos:
            self.tensors[name] = self._tensor_info(cur, size, data_start, name, dims, ggml_type, offset)

    def _tensor_info(self, cur, size, data_start, name, dims, ggml_type, offset):
        if name in self.tensors:
            cur.fail(f"duplicate tensor name {name!r}")
        if ggml_type not in GGML_TYPES:
            cur.fail(f"tensor {name!r} has unknown ggml type id {ggml_type}")
        t = GGML_TYPES[ggml_type]
        row = dims[0] if dims else 1
        if row % t.block_size:
            cur.fail(f"tensor {name!r}: row length {row} is not a multiple of the {t.name} block size {t.block_size}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = n_elements // t.block_size * t.type_size
        if offset % self.alignment:
            cur.fail(f"tensor {name!r}: data offset {offset} is not aligned to {self.alignment} bytes")
        start = data_start + offset
        if start + nbytes > size:
            cur.fail(f"tensor {name!r}: data (bytes {start}..{start + nbytes}) lies beyond the end of the "
                     f"file ({size} bytes)")
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, t.name, start, nbytes)

    def get(self, key, default=MISSING):
        """A metadata value; without a default, a missing key is a ModelFileError naming it."""
        if key in self.metadata:
            return self.metadata[key]
        if default is MISSING:
            raise ModelFileError(self.path, f"missing metadata key {key!r}")
        return default

    def raw(self, name):
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(self.path, f"no tensor named {name!r}")
        return self._data[info.offset:info.offset + info.nbytes]
