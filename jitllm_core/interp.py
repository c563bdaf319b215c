"""Reference interpreter of the kernel IR: the definition of what a kernel means.

Slow and simple on purpose (one Python step per IR node, f32 arithmetic through NumPy scalars); every backend's
lowering is tested against it on small shapes.
"""
from __future__ import annotations

import math

import numpy as np

from . import ir

NP_STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "u8": np.uint8, "i8": np.int8,
              "i32": np.int32}


def bf16_to_f32(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even, as every backend's bf16 store does."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _wrap(v: int) -> int:
    return ((v + 2**31) & 0xFFFFFFFF) - 2**31


def _f(x):
    return np.float32(x)


def _unary(op, a):
    if op == "neg":
        return -a if isinstance(a, np.float32) else _wrap(-a)
    if op == "abs":
        return abs(a)
    if op == "not":
        return not a
    if op == "f16bits":
        return np.float32(np.array([a & 0xFFFF], np.uint16).view(np.float16)[0])
    if op == "bf16bits":
        return bf16_to_f32([a & 0xFFFF])[0]
    if op == "f32bits":
        return np.array([a], np.int32).view(np.float32)[0]
    with np.errstate(all="ignore"):
        if op == "rsqrt":
            return _f(1.0) / np.sqrt(a)
        return _f({"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
                   "floor": np.floor, "tanh": np.tanh}[op](a))


def _binary(op, a, b):
    if isinstance(a, np.float32):
        with np.errstate(all="ignore"):
            if op in ("add", "sub", "mul", "div"):
                return _f({"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[op])
            if op == "mod":
                return _f(np.fmod(a, b))
            if op == "min":
                return min(a, b)
            if op == "max":
                return max(a, b)
    elif isinstance(a, bool) and op in ("land", "lor", "eq", "ne"):
        return {"land": a and b, "lor": a or b, "eq": a == b, "ne": a != b}[op]
    else:
        if op == "add":
            return _wrap(a + b)
        if op == "sub":
            return _wrap(a - b)
        if op == "mul":
            return _wrap(a * b)
        if op in ("div", "mod"):
            if b == 0:
                raise ZeroDivisionError("integer division by zero in kernel")
            q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
            return q if op == "div" else a - b * q
        if op in ("min", "max"):
            return min(a, b) if op == "min" else max(a, b)
        if op in ("and", "or", "xor"):
            return {"and": a & b, "or": a | b, "xor": a ^ b}[op]
        if op == "shl":
            return _wrap(a << (b & 31))
        if op == "shr":
            return a >> (b & 31)
        if op == "dot4":
            return sum(((a >> 8 * i) & 255) * ((((b >> 8 * i) & 255) ^ 128) - 128) for i in range(4))
    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op]


class Interpreter:
    def __init__(self, kernel: ir.Kernel):
        self.k = kernel.finish()

    def run(self, buffers: dict, scalars: dict | None = None):
        """Execute in place on `buffers` (name -> 1-D NumPy array of the storage dtype)."""
        for name, p in self.k.buffers.items():
            arr = buffers[name]
            if arr.dtype != NP_STORAGE[p.dtype] or arr.ndim != 1 or arr.size < p.size:
                raise ValueError(f"buffer {name}: want {p.dtype}[{p.size}], got {arr.dtype}{arr.shape}")
        self.bufs = buffers
        env = {s: int(scalars[s]) for s in self.k.scalars}
        self.block(self.k.body, env)
        return buffers

    # -- statements
    def block(self, body, env):
        for s in body:
            if isinstance(s, ir.Store):
                self.store(s.buf, self.ev(s.index, env), self.ev(s.value, env))
            elif isinstance(s, ir.AtomicAdd):
                i = self.ev(s.index, env)
                self.store(s.buf, i, _binary("add", self.load(s.buf, i), self.ev(s.value, env)))
            elif isinstance(s, (ir.Let, ir.Local, ir.Assign)):
                env[s.name] = self.ev(s.init if isinstance(s, ir.Local) else s.value, env)
            elif isinstance(s, ir.Loop):
                start, n = self.ev(s.start, env), self.ev(s.extent, env)
                inner = dict(env)
                for i in range(start, start + n):
                    inner[s.var] = i
                    self.block(s.body, inner)
                    if s.kind == "serial" or s.kind == "unroll":
                        # mutable locals assigned in a serial loop stay visible after it
                        env.update({k: v for k, v in inner.items() if k in env})
            elif isinstance(s, ir.If):
                inner = dict(env)
                self.block(s.then if self.ev(s.cond, env) else s.orelse, inner)
                env.update({k: v for k, v in inner.items() if k in env})
            elif isinstance(s, ir.TileDot):
                self.tile_dot(s, env)
            # Barrier: iterations run one after another here, so it is always satisfied; Prefetch: a hint.

    def tile_dot(self, s, env):
        """A TileDot as one integer matrix product per output (the definition, not its loops)."""
        K = 4 * s.words
        for ai, bi, o0 in s.outs:
            a0, b0, o0 = self.ev(s.a0s[ai], env), self.ev(s.b0s[bi], env), self.ev(o0, env)
            rows = np.stack([self.bufs[s.a][a0 + i * s.a_stride:][:K] for i in range(s.m)]).view(np.int8)
            words = self.bufs[s.b][b0:b0 + s.words * s.n].reshape(s.words, s.n)
            w = words.view(np.uint8).reshape(s.words, s.n, 4).transpose(0, 2, 1).reshape(K, s.n)
            prod = (rows.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)  # i32 arithmetic wraps
            for i in range(s.m):
                self.bufs[s.out][o0 + i * s.o_stride:][:s.n] = prod[i]

    def load(self, buf, i):
        p, arr = self.k.buffers[buf], self.bufs[buf]
        if not 0 <= i < p.size:
            raise IndexError(f"kernel {self.k.name}: load {buf}[{i}] outside [0, {p.size})")
        v = arr[i]
        if p.dtype == "bf16":
            return bf16_to_f32([v])[0]
        return np.float32(v) if p.dtype in ("f32", "f16") else int(v)

    def store(self, buf, i, v):
        p, arr = self.k.buffers[buf], self.bufs[buf]
        if not 0 <= i < p.size:
            raise IndexError(f"kernel {self.k.name}: store {buf}[{i}] outside [0, {p.size})")
        if p.dtype == "bf16":
            arr[i] = f32_to_bf16([v])[0]
        elif p.dtype in ("u8", "i8"):
            arr[i] = np.array(v).astype(NP_STORAGE[p.dtype])  # wraps like a C store
        else:
            arr[i] = v

    # -- expressions
    def ev(self, e, env):
        if isinstance(e, ir.Const):
            return np.float32(e.value) if e.dtype == "f32" else (bool(e.value) if e.dtype == "bool" else int(e.value))
        if isinstance(e, ir.Var):
            return env[e.name]
        if isinstance(e, ir.Load):
            return self.load(e.buf, self.ev(e.index, env))
        if isinstance(e, ir.Bin):
            return _binary(e.op, self.ev(e.a, env), self.ev(e.b, env))
        if isinstance(e, ir.Un):
            return _unary(e.op, self.ev(e.a, env))
        if isinstance(e, ir.Cast):
            a = self.ev(e.a, env)
            if e.dtype == "f32":
                return np.float32(a)
            if e.dtype == "i32":
                return 0 if isinstance(a, np.float32) and not math.isfinite(a) else int(a)
            return bool(a)
        if isinstance(e, ir.Select):
            return self.ev(e.a, env) if self.ev(e.cond, env) else self.ev(e.b, env)
        if isinstance(e, ir.Lut):  # from the definition, not Lut.expanded: the backends' forms are checked against it
            a = self.ev(e.a, env)
            return _wrap(sum(e.table[(a >> 8 * j) & 15] << 8 * j for j in range(e.nbytes)))
        if isinstance(e, ir.Reduce):
            n = self.ev(e.extent, env)
            inner = dict(env)
            acc = None
            for i in range(n):
                inner[e.var] = i
                v = self.ev(e.value, inner)
                acc = v if acc is None else _binary(e.op, acc, v)
            if acc is None:  # empty reduction: the op's identity
                f = e.value.dtype == "f32"
                return {"add": np.float32(0) if f else 0, "max": np.float32(-np.inf) if f else -2**31,
                        "min": np.float32(np.inf) if f else 2**31 - 1}[e.op]
            return acc
        raise ir.IRError(f"cannot evaluate {e!r}")


def run(kernel, buffers, scalars=None):
    return Interpreter(kernel).run(buffers, scalars or {})
