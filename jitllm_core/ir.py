"""The kernel IR: one small language that every backend lowers.

A Kernel has buffer parameters (storage dtype, read/write), i32 scalar parameters and a body.

Types. Buffers have a *storage* dtype (f32, f16, bf16, u8, i8, i32). Expressions have a *compute* dtype:
f32, i32 or bool. A Load converts storage -> compute (f16/bf16 -> f32, u8/i8 -> i32) and a Store converts
compute -> storage (f32 -> f16 rounds to nearest even). Backends therefore never need half arithmetic.
Indices are flat element indices (i32). i32 has bitwise ops besides arithmetic, `dot4` (a sum of 4 byte
products, exact: quantized weights times int8 digits of activations) and `lut16` (each byte looked up in a table
of 16 bytes: 4-bit codes to non-linear levels; `Lut.expanded` is its portable form for a backend without a native one).

Structure. The top-level statements of a kernel run in order. A top-level `Loop(kind="parallel")` spreads its
iterations over threads / workgroups; iterations must be independent. A top-level `Barrier()` waits until every
statement before it is complete everywhere; without one, two top-level parallel loops are not ordered. Other
top-level statements run once. Inside a parallel iteration:
  - `Loop(kind="serial"|"unroll")`: in order.
  - `Loop(kind="vector")`: iterations independent (no loop-carried state; each writes its own elements), so a
    backend may run them as SIMD lanes or split them over the threads cooperating on the iteration.
  - `Reduce(op, var, extent, value, kind)`: an expression; kind "reduce" may be split across lanes/threads,
    "vector" may use SIMD, "serial"/"unroll" run in order. Float addition order is the backend's choice.
  - `Barrier()` inside an iteration: the threads cooperating on that iteration see each other's stores.
  - `Let` binds an immutable local; `Local` / `Assign` give a mutable one (lowered to registers).
  - `TileDot`: a tile of integer matrix products (int8 digits of activations by unsigned weight bytes), a
    statement that a CPU with matrix units runs as a few instructions and others as loops of dot4 (`expanded`).
Model dimensions are baked into kernels as constants; per-step values (pos, n_tokens) are scalars.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

STORAGE_DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1, "i32": 4}
COMPUTE_OF = {"f32": "f32", "f16": "f32", "bf16": "f32", "u8": "i32", "i8": "i32", "i32": "i32"}
LOOP_KINDS = ("serial", "parallel", "vector", "unroll")
REDUCE_KINDS = ("reduce", "vector", "serial", "unroll")
REDUCE_OPS = ("add", "max", "min")
ARITH = ("add", "sub", "mul", "div", "mod", "min", "max")
BITWISE = ("and", "or", "xor", "shl", "shr", "dot4")  # dot4: see `dot4`
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC = ("land", "lor")
UNARY = {  # name -> (argument dtype or None for "same", result dtype or None for "same")
    "neg": (None, None), "abs": (None, None),
    "exp": ("f32", "f32"), "log": ("f32", "f32"), "sqrt": ("f32", "f32"), "rsqrt": ("f32", "f32"),
    "sin": ("f32", "f32"), "cos": ("f32", "f32"), "floor": ("f32", "f32"), "tanh": ("f32", "f32"),
    "f16bits": ("i32", "f32"),   # low 16 bits of an i32 read as an IEEE half
    "bf16bits": ("i32", "f32"),  # low 16 bits of an i32 read as a bfloat16
    "f32bits": ("i32", "f32"),   # the 32 bits of an i32 read as an IEEE single
    "not": ("bool", "bool"),
}


class IRError(Exception):
    """A kernel is malformed (type error, unknown name, misplaced construct)."""


# ----------------------------------------------------------------------------------------------- expressions
class Expr:
    dtype: str

    def _bin(self, op, other, swap=False):
        other = as_expr(other, self.dtype)
        return Bin(op, other, self) if swap else Bin(op, self, other)

    __add__ = lambda s, o: s._bin("add", o)
    __radd__ = lambda s, o: s._bin("add", o, True)
    __sub__ = lambda s, o: s._bin("sub", o)
    __rsub__ = lambda s, o: s._bin("sub", o, True)
    __mul__ = lambda s, o: s._bin("mul", o)
    __rmul__ = lambda s, o: s._bin("mul", o, True)
    __truediv__ = lambda s, o: s._bin("div", o)
    __rtruediv__ = lambda s, o: s._bin("div", o, True)
    __floordiv__ = lambda s, o: s._bin("div", o)
    __mod__ = lambda s, o: s._bin("mod", o)
    __and__ = lambda s, o: s._bin("and", o)
    __or__ = lambda s, o: s._bin("or", o)
    __xor__ = lambda s, o: s._bin("xor", o)
    __lshift__ = lambda s, o: s._bin("shl", o)
    __rshift__ = lambda s, o: s._bin("shr", o)
    __lt__ = lambda s, o: s._bin("lt", o)
    __le__ = lambda s, o: s._bin("le", o)
    __gt__ = lambda s, o: s._bin("gt", o)
    __ge__ = lambda s, o: s._bin("ge", o)
    __eq__ = lambda s, o: s._bin("eq", o)   # builds an expression; IR nodes are compared by identity
    __ne__ = lambda s, o: s._bin("ne", o)
    __neg__ = lambda s: Un("neg", s)
    __hash__ = object.__hash__


@dataclass(frozen=True, eq=False)
class Const(Expr):
    value: float | int | bool
    dtype: str = "i32"


@dataclass(frozen=True, eq=False)
class Var(Expr):
    """A loop variable, scalar parameter, Let or Local, by name."""
    name: str
    dtype: str = "i32"


@dataclass(frozen=True, eq=False)
class Load(Expr):
    buf: str
    index: Expr
    dtype: str = "f32"  # compute dtype, filled in by Kernel.load


@dataclass(frozen=True, eq=False)
class Bin(Expr):
    op: str
    a: Expr
    b: Expr
    # set once: as a property it was worked out again down the whole left spine of a chain of sums at every use
    dtype: str = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "dtype", "bool" if self.op in COMPARE or self.op in LOGIC else self.a.dtype)


@dataclass(frozen=True, eq=False)
class Un(Expr):
    op: str
    a: Expr
    dtype: str = field(init=False, repr=False)  # set once, as Bin's

    def __post_init__(self):  # an unknown op is `check`'s to report
        object.__setattr__(self, "dtype", UNARY.get(self.op, (None, None))[1] or self.a.dtype)


@dataclass(frozen=True, eq=False)
class Cast(Expr):
    """f32 <-> i32 (f32 -> i32 truncates toward zero); bool -> i32/f32 gives 0/1."""
    dtype: str
    a: Expr


@dataclass(frozen=True, eq=False)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr

    @property
    def dtype(self):
        return self.a.dtype


@dataclass(frozen=True, eq=False)
class Lut(Expr):
    """Byte j of the result is table[byte j of a & 15] for j < nbytes, 0 above (`lut16`)."""
    a: Expr
    table: tuple  # 16 values in 0..255
    nbytes: int = 4

    @property
    def dtype(self):
        return "i32"

    def expanded(self) -> Expr:
        """The same value from shifts, masks and selects: each byte's code picks one of the table's 4 words (two
        selects) and its byte in it (a shift)."""
        words = [int.from_bytes(bytes(self.table[4 * w:4 * w + 4]), "little", signed=True) for w in range(4)]
        out = None
        for j in range(self.nbytes):
            i = (self.a >> 8 * j) & 15 if j else self.a & 15
            word = select(i < 8, select(i < 4, words[0], words[1]), select(i < 12, words[2], words[3]))
            v = (word >> ((i & 3) << 3)) & 255
            v = v << 8 * j if j else v
            out = v if out is None else out | v
        return out


@dataclass(frozen=True, eq=False)
class Reduce(Expr):
    op: str
    var: str
    extent: Expr
    value: Expr
    kind: str = "serial"

    @property
    def dtype(self):
        return self.value.dtype


def as_expr(x, dtype=None) -> Expr:
    """Wrap a Python number; an int becomes `dtype` (i32 when None), a float always f32."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return Const(x, "bool")
    if isinstance(x, float) or dtype == "f32":
        return Const(float(x), "f32")
    return Const(int(x), "i32")


def f32(x) -> Expr:
    return Cast("f32", x) if isinstance(x, Expr) and x.dtype != "f32" else as_expr(float(x) if not isinstance(x, Expr) else x, "f32")


def i32(x) -> Expr:
    return Cast("i32", x) if isinstance(x, Expr) and x.dtype != "i32" else as_expr(x, "i32")


def select(c, a, b) -> Expr:
    a = as_expr(a, b.dtype if isinstance(b, Expr) else "i32")
    return Select(as_expr(c), a, as_expr(b, a.dtype))


def dot4(a, b) -> Expr:
    """The sum of the products of a's 4 bytes, read unsigned, with b's 4 bytes, read signed (byte i with byte i):
    4 quantized weights times 4 int8 digits of activations, summed exactly in i32. One lane of x86's VNNI
    vpdpbusd, CUDA's dp4a.u32.s32; plain integer arithmetic elsewhere."""
    return Bin("dot4", as_expr(a), as_expr(b))


def lut16(a, table, nbytes=4) -> Expr:
    """Each of the low `nbytes` bytes of i32 a replaced by table[its low 4 bits] (16 byte values), the bytes above
    0: 4 weights' 4-bit codes to their levels at once (IQ4's non-linear ones). One byte shuffle a vector on x86
    (pshufb); shifts and selects elsewhere (`Lut.expanded`)."""
    table = tuple(int(v) for v in table)
    if len(table) != 16 or not all(0 <= v <= 255 for v in table) or nbytes not in (1, 2, 3, 4):
        raise IRError(f"lut16 needs 16 byte values and 1-4 bytes, got {len(table)} values, {nbytes} bytes")
    return Lut(as_expr(a), table, nbytes)


def vmin(a, b):
    return as_expr(a)._bin("min", b) if isinstance(a, Expr) else as_expr(b)._bin("min", a)


def vmax(a, b):
    return as_expr(a)._bin("max", b) if isinstance(a, Expr) else as_expr(b)._bin("max", a)


def exp(a): return Un("exp", f32(a))
def sqrt(a): return Un("sqrt", f32(a))
def rsqrt(a): return Un("rsqrt", f32(a))
def sin(a): return Un("sin", f32(a))
def cos(a): return Un("cos", f32(a))
def log(a): return Un("log", f32(a))
def tanh(a): return Un("tanh", f32(a))
def f16bits(a): return Un("f16bits", a)
def bf16bits(a): return Un("bf16bits", a)
def f32bits(a): return Un("f32bits", a)


def reduce(op, var, extent, fn, kind="serial") -> Reduce:
    """reduce("add", "i", n, lambda i: x[i] * y[i]) -> Reduce expression."""
    v = Var(var)
    return Reduce(op, var, as_expr(extent), as_expr(fn(v), "f32"), kind)


# ----------------------------------------------------------------------------------------------- statements
class Stmt:
    pass


@dataclass(eq=False)
class Store(Stmt):
    buf: str
    index: Expr
    value: Expr


@dataclass(eq=False)
class AtomicAdd(Stmt):
    buf: str
    index: Expr
    value: Expr


@dataclass(eq=False)
class Let(Stmt):
    name: str
    value: Expr


@dataclass(eq=False)
class Local(Stmt):
    name: str
    init: Expr


@dataclass(eq=False)
class Assign(Stmt):
    name: str
    value: Expr


@dataclass(eq=False)
class Loop(Stmt):
    var: str
    extent: Expr
    kind: str
    body: list
    start: Expr = field(default_factory=lambda: Const(0))


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    then: list
    orelse: list = field(default_factory=list)


@dataclass(eq=False)
class Barrier(Stmt):
    pass


@dataclass(eq=False)
class Prefetch(Stmt):
    """A hint, no effect on results: elements [index, index + count) of buf (count a constant) will be read soon;
    near: into the nearest cache, else only as near as a much later read needs. A backend may ignore it."""
    buf: str
    index: Expr
    count: int
    near: bool = True


@dataclass(eq=False)
class TileDot(Stmt):
    """Integer matrix products of tiles of input rows by tiles of weights: for each (ai, bi, o0) of `outs`, i < m,
    j < n, out[o0 + i * o_stride + j] = sum over p < words of dot4(b[b0s[bi] + p * n + j], the word of bytes
    a[a0s[ai] + i * a_stride + 4 p .. + 3]) -- m rows of int8 digits of activations (a, a byte buffer, its u8
    storage read as signed) against n columns of 4-byte words of unsigned weights (b, i32, word p of column j at
    p * n + j), each exact in i32 (out). One AMX tile multiply per 64 bytes of a row and output on a CPU that has
    them (each input and weight tile loaded once for all the outputs that use it); loops of dot4 elsewhere
    (`expanded`)."""
    a: str
    a0s: tuple  # where each tile of input rows starts
    a_stride: int
    b: str
    b0s: tuple  # where each tile of weights starts
    out: str
    outs: tuple  # ((ai, bi, o0), ...): which input and weights, and where their products go
    m: int
    n: int
    words: int
    o_stride: int

    def expanded(self, tag) -> list:
        """The same as loops (`tag`: a prefix for their variables, unique in the kernel)."""
        i, j = Var(f"{tag}i"), Var(f"{tag}j")

        def word(a0, p):
            at = a0 + i * self.a_stride + p * 4
            return Load(self.a, at, "i32") | (Load(self.a, at + 1, "i32") << 8) | (Load(self.a, at + 2, "i32") << 16) \
                | (Load(self.a, at + 3, "i32") << 24)
        body = [Store(self.out, o0 + i * self.o_stride + j,
                      reduce("add", f"{tag}p", self.words, lambda p, a0=self.a0s[ai], b0=self.b0s[bi]: dot4(
                          Load(self.b, b0 + p * self.n + j, "i32"), word(a0, p))))
                for ai, bi, o0 in self.outs]
        return [Loop(i.name, Const(self.m), "serial", [Loop(j.name, Const(self.n), "vector", body)])]


def expand_tile_dots(k: "Kernel", keep=lambda s: False) -> "Kernel":
    """k with each TileDot as its loops (`TileDot.expanded`), for a backend without matrix units (keep: those it
    runs as they are); k itself where it has none to expand."""
    count = iter(range(1 << 30))

    def body(stmts):
        out = []
        for s in stmts:
            if isinstance(s, TileDot) and not keep(s):
                out += s.expanded(f"tile{next(count)}_")
            elif isinstance(s, Loop):
                out.append(Loop(s.var, s.extent, s.kind, body(s.body), s.start))
            elif isinstance(s, If):
                out.append(If(s.cond, body(s.then), body(s.orelse)))
            else:
                out.append(s)
        return out
    new = body(k.body)
    if next(count) == 0:
        return k
    e = copy.copy(k)  # the same parameters, profile counts and tuning tag
    e.body, e._hash = new, None
    return e.finish()


# ----------------------------------------------------------------------------------------------- kernels
WEIGHTS = "w"  # the buffer of a kernel's weights: what a step streams from memory (profiles count its bytes)


@dataclass(frozen=True)
class BufferParam:
    name: str
    dtype: str      # storage dtype
    size: int       # elements
    write: bool = False


class Kernel:
    """A kernel under construction; builders use `with k.parallel(...)` etc. and `k.store(...)`."""

    def __init__(self, name: str):
        self.name = name
        self.buffers: dict[str, BufferParam] = {}
        self.scalars: list[str] = []
        self.body: list[Stmt] = []
        self._stack = [self.body]
        self._hash = None
        # elements of buffer WEIGHTS one launch reads, given n_tokens, where that is not the whole buffer (an
        # embedding's rows, a chunk of a matrix): what profiles count as its weight bytes
        self.w_read = None
        self.flops = None  # given n_tokens, the multiply-adds x 2 of a launch (a matmul's), for profiles' GFLOP/s
        # kernels of one tag share the lowering options a device tunes by measurement (Device.tunables,
        # jitllm_core.tuning), measured on the tag's kernels run with these scalar values
        self.tune_tag, self.tune_scalars = None, {}

    # -- parameters
    def buffer(self, name, dtype, size, write=False) -> str:
        if dtype not in STORAGE_DTYPES:
            raise IRError(f"{self.name}: unknown storage dtype {dtype!r} for buffer {name!r}")
        self.buffers[name] = BufferParam(name, dtype, int(size), write)
        return name

    def scalar(self, name) -> Var:
        self.scalars.append(name)
        return Var(name, "i32")

    # -- expressions
    def load(self, buf, index) -> Load:
        return Load(buf, i32(index), COMPUTE_OF[self.buffers[buf].dtype])

    # -- statements
    def emit(self, stmt):
        self._stack[-1].append(stmt)
        return stmt

    def store(self, buf, index, value):
        dt = COMPUTE_OF[self.buffers[buf].dtype]
        self.emit(Store(buf, i32(index), as_expr(value, dt)))

    def prefetch(self, buf, index, count, near=True):
        self.emit(Prefetch(buf, i32(index), int(count), near))

    def atomic_add(self, buf, index, value):
        dt = COMPUTE_OF[self.buffers[buf].dtype]
        self.emit(AtomicAdd(buf, i32(index), as_expr(value, dt)))

    def let(self, name, value) -> Var:
        value = as_expr(value)
        self.emit(Let(name, value))
        return Var(name, value.dtype)

    def local(self, name, init) -> Var:
        init = as_expr(init)
        self.emit(Local(name, init))
        return Var(name, init.dtype)

    def assign(self, var: Var, value):
        self.emit(Assign(var.name, as_expr(value, var.dtype)))

    def barrier(self):
        self.emit(Barrier())

    def tile_dot(self, a, a0s, a_stride, b, b0s, out, outs, m, n, words, o_stride):
        """Emit a `TileDot` (a0s, b0s: indices into a and b; outs: [(ai, bi, o0)], o0 an index into out)."""
        self.emit(TileDot(a, tuple(map(i32, a0s)), int(a_stride), b, tuple(map(i32, b0s)), out,
                          tuple((int(ai), int(bi), i32(o0)) for ai, bi, o0 in outs), int(m), int(n), int(words),
                          int(o_stride)))

    def loop(self, var, extent, kind="serial", start=0):
        return _Block(self, Loop(var, i32(as_expr(extent)), kind, [], i32(as_expr(start))), var)

    def parallel(self, var, extent):
        return self.loop(var, extent, "parallel")

    def if_(self, cond):
        return _Block(self, If(cond, []), None)

    def tune_as(self, tag, **scalars):
        """Tag the kernel for tuning (Kernel.tune_tag); scalars: the values its measurement runs it with."""
        self.tune_tag, self.tune_scalars = tag, scalars

    def finish(self) -> "Kernel":
        check(self)
        return self

    # -- identity
    def key(self) -> str:
        """Stable hash of the kernel's full definition (cache key for compiled code)."""
        if self._hash is None:
            self._hash = hashlib.sha256(dump(self).encode()).hexdigest()[:24]
        return self._hash


class _Block:
    def __init__(self, k, stmt, var):
        self.k, self.stmt, self.var = k, stmt, var

    def __enter__(self):
        self.k.emit(self.stmt)
        self.k._stack.append(self.stmt.body if isinstance(self.stmt, Loop) else self.stmt.then)
        return Var(self.var) if self.var else None

    def __exit__(self, *exc):
        self.k._stack.pop()


# ----------------------------------------------------------------------------------------------- checking
def check(k: Kernel):
    """Type-check a kernel and enforce the placement rules above; raises IRError."""
    env = {s: "i32" for s in k.scalars}
    # node id -> (node, the env it was checked in, its dtype): a kernel's expressions share subexpressions (a tile
    # matmul's 1.27 million visits were of 3,357 statements' trees; the 1B shape's 26 kernels took 0.49 s of every
    # start to check). An env only gains names, so a node checked in it stays checked, unless a name is bound
    # again to another dtype (then `st` forgets them all).
    checked = {}

    def ex(e, env):
        if isinstance(e, Const):
            return e.dtype
        if isinstance(e, Var):
            if e.name not in env:
                raise IRError(f"{k.name}: unknown name {e.name!r}")
            return env[e.name]
        seen = checked.get(id(e))
        if seen is not None and seen[1] is env:
            return seen[2]
        dtype = _ex(e, env)
        checked[id(e)] = (e, env, dtype)
        return dtype

    def _ex(e, env):
        if isinstance(e, Load):
            if e.buf not in k.buffers:
                raise IRError(f"{k.name}: unknown buffer {e.buf!r}")
            _want(ex(e.index, env), "i32", "load index")
            return e.dtype
        if isinstance(e, Bin):
            a, b = ex(e.a, env), ex(e.b, env)
            if a != b:
                raise IRError(f"{k.name}: {e.op} of {a} and {b}")
            if e.op in BITWISE and a != "i32":
                raise IRError(f"{k.name}: bitwise {e.op} on {a}")
            if e.op in LOGIC and a != "bool":
                raise IRError(f"{k.name}: {e.op} on {a}")
            if e.op not in ARITH + BITWISE + COMPARE + LOGIC:
                raise IRError(f"{k.name}: unknown op {e.op}")
            return e.dtype
        if isinstance(e, Un):
            if e.op not in UNARY:
                raise IRError(f"{k.name}: unknown unary {e.op}")
            a = ex(e.a, env)
            want = UNARY[e.op][0]
            if want:
                _want(a, want, e.op)
            return e.dtype
        if isinstance(e, Cast):
            ex(e.a, env)
            return e.dtype
        if isinstance(e, Lut):
            _want(ex(e.a, env), "i32", "lut16 argument")
            return "i32"
        if isinstance(e, Select):
            _want(ex(e.cond, env), "bool", "select condition")
            a, b = ex(e.a, env), ex(e.b, env)
            if a != b:
                raise IRError(f"{k.name}: select of {a} and {b}")
            return a
        if isinstance(e, Reduce):
            if e.op not in REDUCE_OPS or e.kind not in REDUCE_KINDS:
                raise IRError(f"{k.name}: bad reduce {e.op}/{e.kind}")
            _want(ex(e.extent, env), "i32", "reduce extent")
            return ex(e.value, {**env, e.var: "i32"})
        raise IRError(f"{k.name}: not an expression: {e!r}")

    def _want(got, want, what):
        if got != want:
            raise IRError(f"{k.name}: {what} must be {want}, got {got}")

    def st(body, env, depth):
        for s in body:
            if isinstance(s, (Store, AtomicAdd)):
                if s.buf not in k.buffers:
                    raise IRError(f"{k.name}: unknown buffer {s.buf!r}")
                if not k.buffers[s.buf].write:
                    raise IRError(f"{k.name}: store to read-only buffer {s.buf!r}")
                _want(ex(s.index, env), "i32", "store index")
                _want(ex(s.value, env), COMPUTE_OF[k.buffers[s.buf].dtype], f"value stored to {s.buf}")
            elif isinstance(s, (Let, Local)):
                if s.name in k.scalars:  # backends bind scalars once per launch; a Let cannot rebind one
                    raise IRError(f"{k.name}: {type(s).__name__.lower()} {s.name!r} shadows the scalar parameter")
                dtype = ex(s.value if isinstance(s, Let) else s.init, env)
                if env.get(s.name, dtype) != dtype:
                    checked.clear()
                env[s.name] = dtype
            elif isinstance(s, Assign):
                if s.name not in env:
                    raise IRError(f"{k.name}: assign to unknown {s.name!r}")
                _want(ex(s.value, env), env[s.name], f"assign to {s.name}")
            elif isinstance(s, Loop):
                if s.kind not in LOOP_KINDS:
                    raise IRError(f"{k.name}: unknown loop kind {s.kind!r}")
                if s.kind == "parallel" and depth > 0:
                    raise IRError(f"{k.name}: parallel loop {s.var!r} must be at the kernel's top level")
                _want(ex(s.extent, env), "i32", "loop extent")
                st(s.body, {**env, s.var: "i32"}, depth + 1)
            elif isinstance(s, If):
                _want(ex(s.cond, env), "bool", "if condition")
                st(s.then, dict(env), depth + 1)
                st(s.orelse, dict(env), depth + 1)
            elif isinstance(s, Prefetch):
                if s.buf not in k.buffers:
                    raise IRError(f"{k.name}: unknown buffer {s.buf!r}")
                _want(ex(s.index, env), "i32", "prefetch index")
            elif isinstance(s, TileDot):
                if depth == 0:
                    raise IRError(f"{k.name}: a tile dot must be inside a parallel iteration")
                for buf, dts in ((s.a, ("u8",)), (s.b, ("i32",)), (s.out, ("i32",))):
                    if buf not in k.buffers or k.buffers[buf].dtype not in dts:
                        raise IRError(f"{k.name}: tile dot buffer {buf!r} must be a buffer of {' or '.join(dts)}")
                if not k.buffers[s.out].write:
                    raise IRError(f"{k.name}: store to read-only buffer {s.out!r}")
                for e in (*s.a0s, *s.b0s, *(o0 for _, _, o0 in s.outs)):
                    _want(ex(e, env), "i32", "tile dot index")
                if not all(0 <= ai < len(s.a0s) and 0 <= bi < len(s.b0s) for ai, bi, _ in s.outs):
                    raise IRError(f"{k.name}: a tile dot's output names an input or weights tile it does not have")
            elif not isinstance(s, Barrier):
                raise IRError(f"{k.name}: not a statement: {s!r}")

    st(k.body, env, 0)


# ----------------------------------------------------------------------------------------------- printing
def dump(k: Kernel) -> str:
    """A readable, deterministic text form (also the hash input)."""
    out = [f"kernel {k.name}("]
    out += [f"  {b.name}: {b.dtype}[{b.size}]{' rw' if b.write else ''}" for b in k.buffers.values()]
    out += [f"  {s}: i32" for s in k.scalars] + [")"]

    # an expression's text, by node: a kernel's trees share subexpressions (the 1B shape's 33 kernels' 7.4 MB of
    # text are 1.29 million visits of 4,459 statements' trees without it)
    text = {}

    def ex(e):
        if isinstance(e, Var):
            return e.name
        s = text.get(id(e))
        if s is None:
            s = text[id(e)] = _ex(e)
        return s

    def _ex(e):
        if isinstance(e, Const):
            return f"{e.value!r}:{e.dtype}"
        if isinstance(e, Load):
            return f"{e.buf}[{ex(e.index)}]"
        if isinstance(e, Bin):
            return f"({ex(e.a)} {e.op} {ex(e.b)})"
        if isinstance(e, Un):
            return f"{e.op}({ex(e.a)})"
        if isinstance(e, Cast):
            return f"{e.dtype}({ex(e.a)})"
        if isinstance(e, Select):
            return f"({ex(e.cond)} ? {ex(e.a)} : {ex(e.b)})"
        if isinstance(e, Lut):
            return f"lut16.{e.nbytes}({ex(e.a)}, {bytes(e.table).hex()})"
        if isinstance(e, Reduce):
            return f"{e.op}.{e.kind}({e.var} < {ex(e.extent)}: {ex(e.value)})"
        raise IRError(repr(e))

    def st(body, ind):
        for s in body:
            p = "  " * ind
            if isinstance(s, Store):
                out.append(f"{p}{s.buf}[{ex(s.index)}] = {ex(s.value)}")
            elif isinstance(s, AtomicAdd):
                out.append(f"{p}{s.buf}[{ex(s.index)}] atomic+= {ex(s.value)}")
            elif isinstance(s, Let):
                out.append(f"{p}let {s.name} = {ex(s.value)}")
            elif isinstance(s, Local):
                out.append(f"{p}var {s.name} = {ex(s.init)}")
            elif isinstance(s, Assign):
                out.append(f"{p}{s.name} := {ex(s.value)}")
            elif isinstance(s, Loop):
                out.append(f"{p}for.{s.kind} {s.var} in [{ex(s.start)}, +{ex(s.extent)}):")
                st(s.body, ind + 1)
            elif isinstance(s, If):
                out.append(f"{p}if {ex(s.cond)}:")
                st(s.then, ind + 1)
                if s.orelse:
                    out.append(f"{p}else:")
                    st(s.orelse, ind + 1)
            elif isinstance(s, Barrier):
                out.append(f"{p}barrier")
            elif isinstance(s, Prefetch):
                out.append(f"{p}prefetch{'' if s.near else '.far'} {s.buf}[{ex(s.index)}, +{s.count}]")
            elif isinstance(s, TileDot):
                tiles = ", ".join(f"{s.out}[{ex(o0)}] <- {s.a}[{ex(s.a0s[ai])}] . {s.b}[{ex(s.b0s[bi])}]"
                                  for ai, bi, o0 in s.outs)
                out.append(f"{p}tiledot {s.m}x{s.n}x{s.words} a+{s.a_stride}/row o+{s.o_stride}/row: {tiles}")

    st(k.body, 1)
    return "\n".join(out)
