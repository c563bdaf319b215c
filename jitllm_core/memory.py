"""The engine's own account of each device's memory, with an optional cap (`mem=` / `--mem`), so that a model can
be made not to fit, and so that leaks show up as a non-zero balance."""
from __future__ import annotations

import re

from .errors import BackendError, JitllmError

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(v) -> int:
    if isinstance(v, (int, float)):
        return int(v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).upper() not in _UNITS:
        raise JitllmError(f"cannot read {v!r} as a size (e.g. 60MB, 2GB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class Arena:
    def __init__(self, dev, cap=None):
        self.dev, self.used = dev, 0
        self.cap = min(parse_bytes(cap), dev.caps.memory_bytes) if cap is not None else dev.caps.memory_bytes

    def alloc(self, nbytes):
        if self.used + nbytes > self.cap:
            raise BackendError(f"{self.dev.name}: out of memory: {self.used + nbytes} bytes needed, "
                               f"capacity {self.cap}")
        buf = self.dev.alloc(nbytes)
        self.used += buf.nbytes
        return buf

    def free(self, buf):
        self.used -= buf.nbytes
        self.dev.free(buf)

    @property
    def free_bytes(self):
        return self.cap - self.used
