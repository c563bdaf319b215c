"""Lower a kernel IR to GLSL 450 compute shaders: one shader per dispatch.

Mapping (docs/backend-vulkan.md has the long form):
  - a kernel splits at its top-level Barriers into dispatches, separated by pipeline barriers; top-level
    statements that store get a one-invocation dispatch of their own (they run once, in order); the other
    top-level statements run redundantly in every invocation. Top-level Let/Local values that a later
    dispatch reads are spilled to the launch's control slots (two banks: a dispatch never reads a slot it writes);
  - a top-level parallel loop whose body holds a "reduce" Reduce, a vector Loop or a Barrier runs one workgroup
    per iteration ("wg" mode): vector loops and "reduce"/"vector" Reduces are split over the lanes, the rest
    runs redundantly on every lane (uniform), and stores there are done by lane 0 followed by a workgroup
    barrier (a read-modify-write happens once, and every lane reads back what was stored). Split reductions
    combine with subgroup ops + shared memory (or a shared-memory tree without subgroup arithmetic) and every
    lane gets the result. Other parallel loops run one invocation per iteration. Both walk their iterations
    with a grid stride, so any dispatch size is correct and the host only sizes it;
  - every buffer is an array of raw bits (uint, uint16_t, uint8_t, or uint words holding 2/4 small values when
    8/16-bit storage is missing or the buffer takes atomics); ld_/st_/at_ helpers convert to compute types.
    f16/bf16 conversions are integer code (exact, round to nearest even) rather than driver conversions;
  - a buffer larger than one descriptor may cover (maxStorageBufferRange) is bound as an array of chunk
    descriptors and accessed through a switch over constant chunk indices (no descriptor-indexing feature).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from jitllm_core import ir
from jitllm_core.errors import BackendError
from jitllm_core.interp import Interpreter


class LoweringError(BackendError):
    """The kernel uses a construct this backend cannot lower (the message says which)."""


@dataclass(frozen=True)
class Target:
    """What the lowering may use on one device (queried from it, or forced off by env vars)."""
    subgroup_size: int = 32
    subgroup_ops: bool = True      # GL_KHR_shader_subgroup_arithmetic in compute shaders
    storage16: bool = True         # 16-bit storage buffer access
    storage8: bool = True          # 8-bit storage buffer access
    max_range: int = 1 << 31       # bytes one storage-buffer descriptor may cover
    max_lanes: int = 256           # workgroup size cap (a power of two)
    wg_lanes: int = 256            # cap for workgroup-per-iteration loops (one subgroup on CPU devices)
    max_descriptors: int = 1 << 20  # storage-buffer descriptors one shader may use


@dataclass
class Dispatch:
    source: str                    # its local_size_x is baked in
    grid: list                     # [(extent Expr, iterations per workgroup)]; empty: one workgroup

    def groups(self, env: dict, cap: int) -> int:
        """Workgroups to launch (the shader strides over the rest, so capping is safe); an extent the host
        cannot evaluate gets the cap."""
        n = 1
        for extent, per in self.grid:
            v = host_value(extent, env)
            n = max(n, cap if v is None else -(-int(v) // per))
        return min(n, cap)


@dataclass
class Binding:
    param: str
    chunks: int                    # descriptors (1 unless the buffer exceeds max_range)
    chunk_bytes: int


@dataclass
class Lowered:
    dispatches: list[Dispatch]
    bindings: list[Binding]        # kernel buffer order; descriptor binding i + 1 (0 is the control buffer)
    slots: int                     # int32 control slots per launch: scalars, then two spill banks
    lets: list                     # top-level (name, Expr) Lets, for sizing dispatches
    deps: tuple                    # the scalars that dispatch sizes depend on; none: sizes are static
    _memo: dict = field(default_factory=dict)

    def group_counts(self, scalars: dict, cap: int) -> list[int]:
        """Workgroups per dispatch for these scalar values (memoized on the ones that matter)."""
        key = (cap,) + tuple(scalars[n] for n in self.deps)
        if key not in self._memo:
            env = dict(scalars)
            for name, e in self.lets:
                v = host_value(e, env)
                if v is not None:
                    env[name] = v
            self._memo[key] = [d.groups(env, cap) for d in self.dispatches]
        return self._memo[key]


# ----------------------------------------------------------------------------------------------- helpers
HELPERS = {  # emitted only when used, in this order
    "f16_f32": """float f16_f32(uint h) {
  uint s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0u) { float r = float(m) * 5.9604644775390625e-8; return s != 0u ? -r : r; }
  if (e == 31u) return uintBitsToFloat(s | 0x7f800000u | (m << 13));
  return uintBitsToFloat(s | ((e + 112u) << 23) | (m << 13));
}""",
    "f32_f16": """uint f32_f16(float f) {  // round to nearest even, in integers: exact on every driver
  uint x = floatBitsToUint(f), s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return s | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (a >= 0x477ff000u) return s | 0x7c00u;
  if (a < 0x38800000u) {
    uint e = a >> 23;
    if (e <= 101u) return s;
    uint m = (a & 0x7fffffu) | 0x800000u, sh = 126u - e, q = m >> sh, rem = m & ((1u << sh) - 1u), hf = 1u << (sh - 1u);
    return s | (q + ((rem > hf || (rem == hf && (q & 1u) == 1u)) ? 1u : 0u));
  }
  uint r = a - 0x38000000u;
  return s | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}""",
    "f32_bf16": """uint f32_bf16(float f) {
  uint b = floatBitsToUint(f);
  return ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16) & 0xffffu;
}""",
    "dot4": """int dot4(int a, int b) {  // IR dot4: a's bytes unsigned times b's signed
  int s = 0;
  for (int i = 0; i < 32; i += 8) s += int((uint(a) >> uint(i)) & 0xffu) * bitfieldExtract(b, i, 8);
  return s;
}""",
    "imod": "int imod(int a, int b) { return a - b * (a / b); }  // truncated, like C (GLSL % is not)",
    "fmod_": "float fmod_(float a, float b) { return a - b * trunc(a / b); }",
    "f2i": "int f2i(float x) { return abs(x) < 2147483648.0 ? int(x) : 0; }  // non-finite -> 0",
}
DECODE = {  # storage bits (uint) -> compute value
    "f32": "uintBitsToFloat({})", "i32": "int({})", "f16": "f16_f32({})", "bf16": "uintBitsToFloat({} << 16)",
    "u8": "int({})", "i8": "((int({}) << 24) >> 24)"}
ENCODE = {  # compute value -> storage bits (uint, only the low bits set)
    "f32": "floatBitsToUint({})", "i32": "uint({})", "f16": "f32_f16({})", "bf16": "f32_bf16({})",
    "u8": "(uint({}) & 0xffu)", "i8": "(uint({}) & 0xffu)"}
CTYPE = {"f32": "float", "i32": "int", "bool": "bool"}
UNARY_FN = {"abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "inversesqrt", "sin": "sin",
            "cos": "cos", "floor": "floor", "tanh": "tanh"}
BIN_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/", "and": "&", "or": "|", "xor": "^", "lt": "<",
          "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "land": "&&", "lor": "||"}
IDENTITY = {("add", "f32"): "0.0", ("add", "i32"): "0", ("max", "f32"): "uintBitsToFloat(0xff800000u)",
            ("max", "i32"): "(-2147483647 - 1)", ("min", "f32"): "uintBitsToFloat(0x7f800000u)",
            ("min", "i32"): "2147483647"}


def _combine(op, a, b):
    return f"({a} + {b})" if op == "add" else f"{op}({a}, {b})"


def _lit(c: ir.Const) -> str:
    if c.dtype == "bool":
        return "true" if c.value else "false"
    if c.dtype == "i32":
        v = int(c.value)
        return "(-2147483647 - 1)" if v == -2**31 else (f"({v})" if v < 0 else str(v))
    v = np.float32(c.value)
    if not np.isfinite(v):
        return f"uintBitsToFloat(0x{int(v.view(np.uint32)):08x}u)"
    s = str(v)  # shortest repr; glslang parses via double, so make sure that lands on v
    if np.float32(float(s)) != v or np.signbit(np.float32(float(s))) != np.signbit(v):
        s = repr(float(v))  # the exact value of v as a double
    if not any(ch in s for ch in ".e"):
        s += ".0"
    return f"({s})" if s.startswith("-") else s


def _walk_exprs(e):
    yield e
    for child in (getattr(e, f, None) for f in ("index", "a", "b", "cond", "extent", "value")):
        if isinstance(child, ir.Expr):
            yield from _walk_exprs(child)


def _walk(body):
    """Every statement and every expression node under body (recursively)."""
    for s in body:
        yield s
        for f in ("index", "value", "init", "extent", "start", "cond"):
            e = getattr(s, f, None)
            if isinstance(e, ir.Expr):
                yield from _walk_exprs(e)
        for sub in (getattr(s, "body", None), getattr(s, "then", None), getattr(s, "orelse", None)):
            if sub:
                yield from _walk(sub)


def _splits(n) -> bool:
    """Nodes that make a parallel iteration want a whole workgroup."""
    return (isinstance(n, ir.Reduce) and n.kind == "reduce") or (isinstance(n, ir.Loop) and n.kind == "vector") \
        or isinstance(n, ir.Barrier)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _san(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "v"
    return "v" + s if s[0].isdigit() or s.startswith("gl_") else s


class HostEval(Interpreter):
    """The reference interpreter's expression semantics, without buffers: sizes dispatches on the host."""

    def __init__(self):  # no kernel, no buffers; a Load raises KeyError like an unknown name
        pass

    def load(self, buf, i):
        raise KeyError(buf)


def host_value(e, env):
    """Value of a load-free expression over env, or None when it needs anything else."""
    try:
        return HostEval().ev(e, env)
    except (KeyError, ArithmeticError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------- buffers
class _Buf:
    """One buffer parameter: its GLSL block (raw bits) and its ld_/st_/at_ helpers."""

    def __init__(self, i, p: ir.BufferParam, t: Target, atomic: bool):
        self.p, self.binding, self.name = p, i + 1, f"b{i}_{_san(p.name)}"
        es = ir.STORAGE_DTYPES[p.dtype]
        native = es == 4 or (not atomic and (t.storage16 if es == 2 else t.storage8))
        self.bits = es * 8 if native else 32
        self.per_word = 1 if native else 4 // es        # values per array element
        nbytes = -(-p.size * es // 4) * 4               # allocations are rounded to words too
        if nbytes <= t.max_range:
            self.chunks, self.chunk_bytes = 1, nbytes
        else:
            self.chunk_bytes = 1 << (t.max_range.bit_length() - 1)
            self.chunks = -(-nbytes // self.chunk_bytes)
        self.chunk_elems = self.chunk_bytes * 8 // self.bits

    def decl(self, coherent: bool) -> str:
        qual = ("coherent " if coherent and self.p.write else "") + ("" if self.p.write else "readonly ")
        elem = {32: "uint", 16: "uint16_t", 8: "uint8_t"}[self.bits]
        arr = f"[{self.chunks}]" if self.chunks > 1 else ""
        return (f"layout(std430, set = 0, binding = {self.binding}) {qual}buffer B{self.binding} {{ {elem} d[]; }} "
                f"{self.name}{arr};  // {self.p.name}: {self.p.dtype}[{self.p.size}]")

    def _access(self, idx: str, body: str) -> str:
        """GLSL running `body` with '@' standing for array element `idx` (a switch over chunk descriptors
        when split: constant descriptor indices need no descriptor-indexing feature)."""
        if self.chunks == 1:
            return body.replace("@", f"{self.name}.d[{idx}]")
        sh = self.chunk_elems.bit_length() - 1
        cases = " ".join(f"case {c}: {{ {body.replace('@', f'{self.name}[{c}].d[j]')} }} break;"
                         for c in range(self.chunks))
        return f"int j = ({idx}) & {self.chunk_elems - 1}; switch (({idx}) >> {sh}) {{ {cases} }}"

    def helper(self, kind: str) -> str:
        dt = self.p.dtype
        T = CTYPE[ir.COMPUTE_OF[dt]]
        dec, enc = DECODE[dt].format, ENCODE[dt].format
        if self.per_word == 1:
            pre, word, bits = "", "i", "@" if self.bits == 32 else "uint(@)"
            merge = lambda o, b: b  # noqa: E731
        else:
            width = 32 // self.per_word
            mask = f"0x{(1 << width) - 1:x}u"
            pre = f"uint sh = uint(i & {self.per_word - 1}) * {width}u; "
            word, bits = f"i >> {self.per_word.bit_length() - 1}", f"((@ >> sh) & {mask})"
            merge = lambda o, b: f"(({o}) & ~({mask} << sh)) | ({b} << sh)"  # noqa: E731
        cas = lambda new: (f"uint o = @; while (true) {{ uint r = atomicCompSwap(@, o, {new}); "  # noqa: E731
                           f"if (r == o) break; o = r; }}")
        if kind == "ld":
            body = self._access(word, f"return {dec(bits)};")
            return f"{T} ld_{self.name}(int i) {{ {pre}{body} return {T}(0); }}"
        if kind == "st":
            if self.per_word == 1:
                bits_v = enc("v") if self.bits == 32 else f"uint{self.bits}_t({enc('v')})"
                body = f"@ = {bits_v};"
            else:  # one atomic read-modify-write: neighbours in the word may be stored concurrently
                body = cas(merge("o", "b"))
                pre += f"uint b = {enc('v')}; "
            return f"void st_{self.name}(int i, {T} v) {{ {pre}{self._access(word, body)} }}"
        if dt == "i32":
            body = "atomicAdd(@, uint(v));"
        else:  # f32 and small types: compare-and-swap (no float-atomics feature needed)
            old = "o" if self.per_word == 1 else f"((o >> sh) & {mask})"
            body = cas(merge("o", enc(_combine("add", dec(old), "v"))))
        return f"void at_{self.name}(int i, {T} v) {{ {pre}{self._access(word, body)} }}"


# ----------------------------------------------------------------------------------------------- emission
class _Segment:
    """Emits the shader of one dispatch. Modes: "top" (top-level statements: every invocation runs them; the
    ones that store have a one-invocation dispatch), "wg" (uniform part of a workgroup iteration: every lane
    runs it, lane 0 stores), "lane" (an iteration owned by one invocation), "split" (one lane's share of a split
    vector loop or reduce)."""

    def __init__(self, lw: "_Lowerer"):
        self.lw, self.t = lw, lw.t
        self.lines, self.depth, self.n = [], 1, 0
        self.used, self.bufs_used, self.red = set(), set(), set()
        self.grid, self.coherent, self.subgroups, self.unroll = [], False, False, False
        self.reread = set()  # buffers the current workgroup iteration loads

    # -- text
    def fresh(self, base) -> str:
        self.n += 1
        return f"{_san(base)}_{self.n}"

    def emit(self, line):
        self.lines.append("  " * self.depth + line)

    def open(self, head):
        self.emit(head + " {")
        self.depth += 1

    def close(self):
        self.depth -= 1
        self.emit("}")

    def buf(self, name, kind) -> str:
        b = self.lw.bufs[name]
        self.bufs_used.add(name)
        self.used.add((b.name, kind))
        return f"{kind}_{b.name}"

    # -- statements
    def block(self, body, mode, env):
        env = dict(env)
        for s in body:
            self.stmt(s, mode, env)

    def stmt(self, s, mode, env):
        x = lambda e: self.expr(e, mode, env)  # noqa: E731
        if isinstance(s, (ir.Let, ir.Local)):
            e = s.value if isinstance(s, ir.Let) else s.init
            v, name = x(e), self.fresh(s.name)
            self.emit(f"{CTYPE[e.dtype]} {name} = {v};")
            env[s.name] = name
        elif isinstance(s, ir.Assign):
            self.emit(f"{env[s.name]} = {x(s.value)};")
        elif isinstance(s, (ir.Store, ir.AtomicAdd)):
            i, v = x(s.index), x(s.value)
            fn = self.buf(s.buf, "st" if isinstance(s, ir.Store) else "at")
            if mode == "wg":  # one lane writes (a read-modify-write must happen once)...
                self.emit(f"if (lane == 0) {fn}({i}, {v});")
                if s.buf in self.reread:  # ...and every lane sees it before reading that buffer again
                    self.coherent = True
                    self.emit("memoryBarrierBuffer(); barrier();")
            else:
                self.emit(f"{fn}({i}, {v});")
        elif isinstance(s, ir.If):
            self.open(f"if ({x(s.cond)})")
            self.block(s.then, mode, env)
            if s.orelse:
                self.close()
                self.open("else")
                self.block(s.orelse, mode, env)
            self.close()
        elif isinstance(s, ir.Loop):
            if s.kind == "parallel":
                self.parallel(s, env)
            else:
                self.loop(s, mode, env)
        elif isinstance(s, ir.Barrier):
            if mode == "split":
                raise LoweringError(f"{self.lw.k.name}: Barrier inside a vector loop or a split reduce")
            if mode == "wg":  # lanes of one iteration see each other's stores
                self.coherent = True
                self.emit("memoryBarrierBuffer(); barrier();")
            # "top" (nested) and "lane": one invocation runs these statements in order: nothing to wait for
        elif not isinstance(s, ir.Prefetch):  # a hint GLSL has no way to give
            raise LoweringError(f"{self.lw.k.name}: cannot lower {s!r}")

    def loop(self, s, mode, env):
        split = mode == "wg" and s.kind == "vector"
        start, n, var = self.fresh("start"), self.fresh("n"), self.fresh(s.var)
        self.emit(f"int {start} = {self.expr(s.start, mode, env)}; int {n} = {self.expr(s.extent, mode, env)};")
        if split:
            j = self.fresh("j")
            self.open(f"for (int {j} = lane; {j} < {n}; {j} += LANES)")
            self.emit(f"int {var} = {start} + {j};")
        else:
            self.unroll |= s.kind == "unroll"
            self.open(f"{'[[unroll]] ' if s.kind == 'unroll' else ''}for (int {var} = {start}; {var} < {start} + {n}; "
                      f"{var}++)")
        self.block(s.body, "split" if split else mode, {**env, s.var: var})
        self.close()

    def parallel(self, s, env):
        wg = any(_splits(n) for n in _walk(s.body))
        start, n, it, var = self.fresh("start"), self.fresh("n"), self.fresh("it"), self.fresh(s.var)
        self.emit(f"int {start} = {self.expr(s.start, 'top', env)}; int {n} = {self.expr(s.extent, 'top', env)};")
        if wg:  # one workgroup per iteration, grid-stride over workgroups
            self.open(f"for (int {it} = int(gl_WorkGroupID.x); {it} < {n}; {it} += int(gl_NumWorkGroups.x))")
        else:   # one invocation per iteration, grid-stride over invocations
            self.open(f"for (int {it} = int(gl_GlobalInvocationID.x); {it} < {n}; "
                      f"{it} += int(gl_NumWorkGroups.x) * LANES)")
        self.grid.append((s.extent, 1 if wg else None))
        self.reread = {n.buf for n in _walk(s.body) if isinstance(n, ir.Load)}
        self.emit(f"int {var} = {start} + {it};")
        self.block(s.body, "wg" if wg else "lane", {**env, s.var: var})
        self.close()

    # -- expressions
    def expr(self, e, mode, env) -> str:
        x = lambda a: self.expr(a, mode, env)  # noqa: E731
        if isinstance(e, ir.Const):
            return _lit(e)
        if isinstance(e, ir.Var):
            return env[e.name]
        if isinstance(e, ir.Load):
            return f"{self.buf(e.buf, 'ld')}({x(e.index)})"
        if isinstance(e, ir.Bin):
            a, b = x(e.a), x(e.b)
            if e.op == "mod":
                return f"{'imod' if e.a.dtype == 'i32' else 'fmod_'}({a}, {b})"
            if e.op in ("min", "max", "dot4"):
                return f"{e.op}({a}, {b})"
            if e.op in ("shl", "shr"):
                return f"({a} {'<<' if e.op == 'shl' else '>>'} ({b} & 31))"
            return f"({a} {BIN_OP[e.op]} {b})"
        if isinstance(e, ir.Un):
            a = x(e.a)
            if e.op in ("neg", "not"):
                return f"({'-' if e.op == 'neg' else '!'}{a})"
            if e.op == "f16bits":
                return f"f16_f32(uint({a}) & 0xffffu)"
            if e.op == "f32bits":
                return f"intBitsToFloat({a})"
            if e.op == "bf16bits":
                return f"uintBitsToFloat((uint({a}) & 0xffffu) << 16)"
            return f"{UNARY_FN[e.op]}({a})"
        if isinstance(e, ir.Cast):
            a = x(e.a)
            if e.dtype == e.a.dtype:
                return a
            if (e.a.dtype, e.dtype) == ("f32", "i32"):
                return f"f2i({a})"
            return f"{CTYPE[e.dtype]}({a})"
        if isinstance(e, ir.Select):
            return f"({x(e.cond)} ? {x(e.a)} : {x(e.b)})"
        if isinstance(e, ir.Lut):
            return x(e.expanded())
        if isinstance(e, ir.Reduce):
            return self.reduce(e, mode, env)
        raise LoweringError(f"{self.lw.k.name}: cannot lower {e!r}")

    def reduce(self, e, mode, env) -> str:
        """Emit the reduction's loop before the current statement; return the variable holding the result."""
        split = mode == "wg" and e.kind in ("reduce", "vector")
        dt = e.value.dtype
        acc, n, j = self.fresh("acc"), self.fresh("n"), self.fresh(e.var)
        self.emit(f"{CTYPE[dt]} {acc} = {IDENTITY[(e.op, dt)]}; int {n} = {self.expr(e.extent, mode, env)};")
        if split:
            self.open(f"for (int {j} = lane; {j} < {n}; {j} += LANES)")
        else:
            self.unroll |= e.kind == "unroll"
            self.open(f"{'[[unroll]] ' if e.kind == 'unroll' else ''}for (int {j} = 0; {j} < {n}; {j}++)")
        v = self.expr(e.value, "split" if split else mode, {**env, e.var: j})
        self.emit(f"{acc} = {_combine(e.op, acc, v)};")
        self.close()
        if split:
            self.combine_lanes(acc, e.op, dt)
        return acc

    def combine_lanes(self, acc, op, dt):
        """Every lane ends with the op over all lanes' partials (uniform, like the IR's Let wants).
        Consecutive reductions use alternate halves of the shared array (`red_half` flips at run time), so the
        next reduction's barrier, not one of this reduction's own, is what lets this half be reused."""
        red = "red_f" if dt == "f32" else "red_i"
        self.red.add(dt)
        h = self.fresh("h")
        self.emit(f"int {h} = red_half * LANES; red_half ^= 1;")
        at = lambda i: f"{red}[{h} + {i}]"  # noqa: E731
        if self.t.subgroup_ops:
            self.subgroups = True
            self.emit(f"{acc} = subgroup{op.capitalize()}({acc});")
            self.open("if (gl_NumSubgroups > 1u)")  # uniform; one subgroup per workgroup needs no shared memory
            self.emit(f"if (subgroupElect()) {at('int(gl_SubgroupID)')} = {acc};")
            self.emit("barrier();")
            self.emit(f"{acc} = {at(0)};")
            self.emit(f"for (int s = 1; s < int(gl_NumSubgroups); s++) {acc} = {_combine(op, acc, at('s'))};")
            self.close()
        else:  # shared-memory tree (LANES is a power of two)
            self.emit(f"{at('lane')} = {acc};")
            self.emit("barrier();")
            self.emit(f"for (int s = LANES / 2; s > 0; s >>= 1) {{ if (lane < s) {at('lane')} = "
                      f"{_combine(op, at('lane'), at('lane + s'))}; barrier(); }}")
            self.emit(f"{acc} = {at(0)};")

    def source(self, lanes: int, body: list[str], title: str) -> str:
        exts = (["GL_EXT_control_flow_attributes"] * self.unroll
                + ["GL_KHR_shader_subgroup_arithmetic"] * self.subgroups
                + ["GL_EXT_shader_16bit_storage"] * any(self.lw.bufs[b].bits == 16 for b in self.bufs_used)
                + ["GL_EXT_shader_8bit_storage"] * any(self.lw.bufs[b].bits == 8 for b in self.bufs_used))
        out = ["#version 450"] + [f"#extension {e} : require" for e in exts] + [
            f"// {title}",
            f"layout(local_size_x = {lanes}) in;",
            f"const int LANES = {lanes};",
            "layout(push_constant) uniform PC { int base; } pc;  // this launch's first control slot",
            "layout(std430, set = 0, binding = 0) buffer Ctl { int v[]; } ctl;  // scalars, spills, dispatch sizes"]
        out += [b.decl(self.coherent) for name, b in self.lw.bufs.items() if name in self.bufs_used]
        out += [f"shared {CTYPE[dt]} red_{dt[0]}[2 * LANES];" for dt in ("f32", "i32") if dt in self.red]
        helpers = [b.helper(kind) for b in self.lw.bufs.values() for kind in ("ld", "st", "at")
                   if (b.name, kind) in self.used]
        text = "\n".join(helpers + body)
        out += [src for name, src in HELPERS.items() if re.search(rf"\b{name}\(", text)] + helpers
        out += ["void main() {", "  int lane = int(gl_LocalInvocationID.x);",
                "  bool once = gl_GlobalInvocationID.x == 0u;", "  int red_half = 0;"] + body + ["}"]
        return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------- driver
SPILL_DEC = {"f32": "intBitsToFloat({})", "i32": "{}", "bool": "({} != 0)"}
SPILL_ENC = {"f32": "floatBitsToInt({})", "i32": "{}", "bool": "int({})"}


class _Lowerer:
    def __init__(self, k: ir.Kernel, t: Target):
        self.k, self.t = k, t
        atomic = {s.buf for s in _walk(k.body) if isinstance(s, ir.AtomicAdd)}
        self.bufs = {name: _Buf(i, p, t, name in atomic) for i, (name, p) in enumerate(k.buffers.items())}


def _lanes(seg, t: Target) -> int:
    """Workgroup size of a dispatch: the widest split construct (rounded to a power of two, at least one
    subgroup, at most wg_lanes) for workgroup-per-iteration loops, 64 invocations otherwise; 1 with no
    parallel loop."""
    want = 1
    for s in seg:
        if not (isinstance(s, ir.Loop) and s.kind == "parallel"):
            continue
        if any(_splits(n) for n in _walk(s.body)):
            exts = [host_value(n.extent, {}) for n in _walk(s.body)
                    if (isinstance(n, ir.Reduce) and n.kind in ("reduce", "vector"))
                    or (isinstance(n, ir.Loop) and n.kind == "vector")]
            widest = t.max_lanes if None in exts else max(exts, default=1)
            want = max(want, _pow2(t.subgroup_size), min(_pow2(widest), t.wg_lanes))
        else:
            want = max(want, 64, _pow2(t.subgroup_size))
    return min(want, t.max_lanes)


def _dispatch_groups(body) -> list[list]:
    """Top-level statements grouped into dispatches: a top-level Barrier (a global one) ends a dispatch, and
    top-level statements that store run in a one-invocation dispatch of their own: once, in order, and
    visible to what follows. The other top-level statements run redundantly next to the parallel loops."""
    groups, serial = [], None
    for s in body:
        if isinstance(s, ir.Barrier):
            serial = None
            continue
        effect = not (isinstance(s, ir.Loop) and s.kind == "parallel") and \
            any(isinstance(n, (ir.Store, ir.AtomicAdd)) for n in _walk([s]))
        if serial is None or effect != serial:
            groups.append([])
        groups[-1].append(s)
        serial = effect
    return groups


def lower(k: ir.Kernel, t: Target) -> Lowered:
    """The dispatches of one kernel for one device target (same kernel + target -> same source)."""
    k = ir.expand_tile_dots(k.finish())
    lw = _Lowerer(k, t)
    segs = _dispatch_groups(k.body)
    n_desc = 1 + sum(b.chunks for b in lw.bufs.values())
    if n_desc > t.max_descriptors:
        raise LoweringError(f"{k.name}: needs {n_desc} storage-buffer descriptors (buffers split at "
                            f"{t.max_range} bytes), the device allows {t.max_descriptors} per shader")

    # top-level Let/Local values that a later dispatch needs travel through control slots
    defs = [{s.name: (s.value if isinstance(s, ir.Let) else s.init).dtype for s in seg
             if isinstance(s, (ir.Let, ir.Local))} for seg in segs]
    uses = [{n.name for n in _walk(seg) if isinstance(n, ir.Var)} | {n.name for n in _walk(seg)
            if isinstance(n, ir.Assign)} for seg in segs]
    live = []
    for i in range(len(segs)):
        before = {name: dt for d in defs[:i] for name, dt in d.items()}
        later = set().union(*uses[i:])
        live.append({name: dt for name, dt in before.items() if name in later})
    spilled = list(dict.fromkeys(name for lv in live for name in lv))
    nsc = len(k.scalars)
    slot = lambda i, name: nsc + (i % 2) * len(spilled) + spilled.index(name)  # noqa: E731

    dispatches = []
    for i, seg in enumerate(segs):
        sg = _Segment(lw)
        env = {}
        for j, name in enumerate(k.scalars):
            env[name] = sg.fresh(name)
            sg.emit(f"int {env[name]} = ctl.v[pc.base + {j}];")
        for name, dt in live[i].items():
            env[name] = sg.fresh(name)
            sg.emit(f"{CTYPE[dt]} {env[name]} = {SPILL_DEC[dt].format(f'ctl.v[pc.base + {slot(i, name)}]')};")
        for s in seg:
            sg.stmt(s, "top", env)
        if i + 1 < len(segs) and live[i + 1]:
            sg.open("if (once)")
            for name, dt in live[i + 1].items():
                sg.emit(f"ctl.v[pc.base + {slot(i + 1, name)}] = {SPILL_ENC[dt].format(env[name])};")
            sg.close()
        lanes = _lanes(seg, t)
        title = f"kernel {k.name}: dispatch {i + 1} of {len(segs)}"
        grid = [(ext, per or lanes) for ext, per in sg.grid]
        dispatches.append(Dispatch(sg.source(lanes, sg.lines, title), grid))
    bindings = [Binding(name, b.chunks, b.chunk_bytes) for name, b in lw.bufs.items()]
    lets = [(s.name, s.value) for s in k.body if isinstance(s, ir.Let)]
    names = {n.name for d in dispatches for ext, _ in d.grid for n in _walk_exprs(ext) if isinstance(n, ir.Var)}
    for name, e in reversed(lets):  # sizes that use a Let depend on what the Let uses
        if name in names:
            names |= {n.name for n in _walk_exprs(e) if isinstance(n, ir.Var)}
    deps = tuple(s for s in k.scalars if s in names)
    return Lowered(dispatches, bindings, nsc + 2 * len(spilled), lets, deps)
