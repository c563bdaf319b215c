"""Lower a kernel IR to CUDA C source.

Mapping (every kernel function uses blocks of BLOCK threads):
  - The kernel body is split at top-level Barriers into segments; each segment is one `__global__` function and
    the runtime launches them in order (a launch boundary is the global barrier).
  - Inside a segment, each top-level parallel loop is a task owning a range of blocks; the segment's other
    statements ("once" statements) form one more task run by a single thread. Tasks of a segment are unordered,
    as the IR allows.
  - A parallel loop whose body is one vector Loop of constant extent, with nothing in it that needs lanes, runs one
    thread per (iteration, vector index) pair: an elementwise op over a few tokens still fills the GPU.
  - A parallel loop whose body holds a "reduce"-kind Reduce, a vector Loop or a Barrier runs cooperatively: one
    block per iteration when its extent is a small constant or known only at run time (few iterations -- tokens,
    heads of a decode step: give each more lanes), else one warp per iteration. The lanes split the vector loops
    and the outermost "reduce" Reduces (warp shuffles, then shared memory across the block's warps); everything
    else runs redundantly on every lane, with stores and atomics by lane 0 (followed by a lane sync when the
    iteration also reads that buffer). Other parallel loops run one iteration per thread.
  - Extents known only at run time (they depend on scalars) use grid-stride loops over DYN_BLOCKS blocks, so a
    launch's grid never depends on the step's values.
  - Top-level Let/Local/Assign are replayed at the start of every later task (they are cheap and uniform).
  - Scalars are read from a device array (`jl_s`) that the runtime refreshes once per step.
  - A reduction a thread runs on its own (not split over lanes) reads 16 bytes at a time (one `uint4` load) from
    each buffer it walks element by element from an index that is a multiple of 16 bytes (buffers are 16-byte
    aligned: cuMemAlloc), its steps taken in the IR's order from the loaded words.
  - Storage conversions: f16 through cuda_fp16.h, bf16 by bit operations (round to nearest even), 8/16-bit
    atomics through a CAS on the enclosing 32-bit word. i32 add/sub/mul/neg/shl wrap (done in unsigned).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from jitllm_core import interp, ir
from jitllm_core.errors import BackendError

BLOCK = 128            # threads per block
DYN_BLOCKS = 512       # blocks given to a parallel loop whose extent is known only at run time
BLOCK_PER_ITER_MAX = 256   # cooperative loops with at most this many (constant) iterations get a block each

CTYPE = {"f32": "float", "i32": "int", "bool": "bool"}
STORAGE_CTYPE = {"f32": "float", "f16": "__half", "bf16": "unsigned short", "u8": "unsigned char",
                 "i8": "signed char", "i32": "int"}
DEFS = (ir.Let, ir.Local, ir.Assign)
VECTOR_BYTES = 16      # a uint4 load
STAGE_BYTES = 32 << 10  # shared memory a function may give to staged serial reductions (48 KB is the static limit)

PRELUDE = r"""#include <cuda_fp16.h>
#define JL_BLOCK 128
__shared__ float jl_shf[JL_BLOCK / 32];
__shared__ int jl_shi[JL_BLOCK / 32];
__device__ __forceinline__ float jl_bf16(unsigned v) { return __uint_as_float((v & 0xFFFFu) << 16); }
__device__ __forceinline__ unsigned short jl_to_bf16(float v) {
  unsigned u = __float_as_uint(v);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float jl_f16(unsigned v) { return __half2float(__ushort_as_half((unsigned short)v)); }
__device__ __forceinline__ int jl_f2i(float v) { return isfinite(v) ? (int)v : 0; }
__device__ __forceinline__ int jl_wadd(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int jl_wsub(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int jl_wmul(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int jl_shl(int a, int b) { return (int)((unsigned)a << (b & 31)); }
__device__ __forceinline__ int jl_dot4(int a, int b) {  // IR dot4: a's bytes unsigned times b's signed
  int s = 0;
  for (int i = 0; i < 32; i += 8) s += (int)(((unsigned)a >> i) & 0xFFu) * (int)(signed char)(b >> i);
  return s;
}
__device__ __forceinline__ float jl_add(float a, float b) { return a + b; }
__device__ __forceinline__ int jl_add(int a, int b) { return jl_wadd(a, b); }
__device__ __forceinline__ float jl_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ int jl_max(int a, int b) { return max(a, b); }
__device__ __forceinline__ float jl_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ int jl_min(int a, int b) { return min(a, b); }
// xor butterfly: every lane ends with the same value (each step is commutative)
template <typename T, T (*F)(T, T)> __device__ __forceinline__ T jl_warp_reduce(T v) {
  for (int o = 16; o > 0; o >>= 1) v = F(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T, T (*F)(T, T)> __device__ __forceinline__ T jl_block_reduce(T v, T* sh) {
  v = jl_warp_reduce<T, F>(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < JL_BLOCK / 32; w++) v = F(v, sh[w]);
  __syncthreads();
  return v;
}
// 8/16-bit atomic add: CAS on the aligned 32-bit word holding the element (allocations are 16-byte multiples)
template <typename T, unsigned (*F)(unsigned, T)> __device__ void jl_atomic_narrow(void* p, int bits, T v) {
  unsigned* w = (unsigned*)((size_t)p & ~(size_t)3);
  unsigned shift = (unsigned)((size_t)p & 3) * 8u, ones = (1u << bits) - 1u, mask = ones << shift;
  unsigned old = *w, seen;
  do {
    seen = old;
    unsigned nv = F((seen & mask) >> shift, v) & ones;
    old = atomicCAS(w, seen, (seen & ~mask) | (nv << shift));
  } while (old != seen);
}
__device__ unsigned jl_add_f16(unsigned h, float v) { return __half_as_ushort(__float2half_rn(jl_f16(h) + v)); }
__device__ unsigned jl_add_bf16(unsigned h, float v) { return jl_to_bf16(jl_bf16(h) + v); }
__device__ unsigned jl_add_8(unsigned x, int v) { return x + (unsigned)v; }
"""


@dataclass(frozen=True)
class Dispatch:
    name: str      # __global__ function in the source
    blocks: int    # grid size (BLOCK threads each)


@dataclass(frozen=True)
class Lowered:
    source: str
    dispatches: tuple  # Dispatch, in launch order
    scalars: tuple     # the kernel's scalar params, in the order the kernel reads them from jl_s


def lower(k: ir.Kernel) -> Lowered:
    """IR -> CUDA C. Deterministic: the same kernel always gives the same text."""
    k = ir.expand_tile_dots(k.finish())
    segments = [[]]
    for s in k.body:
        if isinstance(s, ir.Barrier):
            segments.append([])
        else:
            segments[-1].append(s)
    folder = _ConstFolder(k)
    out, dispatches, defs = [PRELUDE, f"// kernel {k.name} (IR {k.key()})"], [], []
    for seg in segments:
        tasks, earlier = [], list(defs)
        for s in seg:
            if _is_parallel(s):
                task = _parallel_task(s, list(defs), folder)
                if task.blocks:
                    tasks.append(task)
            elif isinstance(s, DEFS):
                defs.append(s)
                folder.define(s)
            else:
                _check_top_level(s, defs)
        if any(not isinstance(s, DEFS) and not _is_parallel(s) for s in seg):
            tasks.append(_Task("once", [s for s in seg if not _is_parallel(s)], earlier, 1))
        if tasks:
            name = f"jl_k{len(dispatches)}"
            out.append(_Function(k, name, tasks).render())
            dispatches.append(Dispatch(name, sum(t.blocks for t in tasks)))
    return Lowered("\n".join(out) + "\n", tuple(dispatches), tuple(k.scalars))


# ----------------------------------------------------------------------------------------------- planning
@dataclass
class _Task:
    mode: str          # "once" | "thread" | "flat" | "warp" | "block"
    body: list         # statements ("once") or [the parallel Loop]
    prelude: list      # top-level Let/Local/Assign that precede it
    blocks: int
    inner: int = 0     # "flat": the extent of the vector loop that is the parallel loop's body


def _is_parallel(s):
    return isinstance(s, ir.Loop) and s.kind == "parallel"


def _parallel_task(loop, prelude, folder) -> _Task:
    n, inner = folder.value(loop.extent), _flat_extent(loop, folder)
    if inner:
        mode = "flat"
    elif not _needs_lanes(loop.body):
        mode = "thread"
    else:
        mode = "block" if n is None or n <= BLOCK_PER_ITER_MAX else "warp"
    per_block = {"thread": BLOCK, "flat": BLOCK, "warp": BLOCK // 32, "block": 1}[mode]
    blocks = DYN_BLOCKS if n is None else -(-max(n * max(inner, 1), 0) // per_block)
    return _Task(mode, [loop], prelude, blocks, inner)


def _flat_extent(loop, folder) -> int:
    """The extent of the parallel loop's body when that is a single vector Loop of constant extent that needs no
    lanes itself (its iterations are independent threads), else 0."""
    if len(loop.body) != 1 or not isinstance(loop.body[0], ir.Loop) or loop.body[0].kind != "vector":
        return 0
    m = folder.value(loop.body[0].extent)
    return m if m and m > 0 and not _needs_lanes(loop.body[0].body) else 0


def _needs_lanes(body) -> bool:
    """A vector Loop, a Barrier or a "reduce"-kind Reduce anywhere inside: worth (and needing) cooperating lanes."""
    return any(isinstance(x, ir.Barrier) or (isinstance(x, ir.Loop) and x.kind == "vector")
               or (isinstance(x, ir.Reduce) and x.kind == "reduce") for x in _walk(body))


def _walk(node):
    """Every statement and expression under node (a statement list, a statement or an expression)."""
    if isinstance(node, list):
        for s in node:
            yield from _walk(s)
        return
    yield node
    if isinstance(node, (ir.Store, ir.AtomicAdd)):
        kids = [node.index, node.value]
    elif isinstance(node, (ir.Let, ir.Assign)):
        kids = [node.value]
    elif isinstance(node, ir.Local):
        kids = [node.init]
    elif isinstance(node, ir.Loop):
        kids = [node.start, node.extent, node.body]
    elif isinstance(node, ir.If):
        kids = [node.cond, node.then, node.orelse]
    elif isinstance(node, ir.Load):
        kids = [node.index]
    elif isinstance(node, ir.Bin):
        kids = [node.a, node.b]
    elif isinstance(node, (ir.Un, ir.Cast, ir.Lut)):
        kids = [node.a]
    elif isinstance(node, ir.Select):
        kids = [node.cond, node.a, node.b]
    elif isinstance(node, ir.Reduce):
        kids = [node.extent, node.value]
    else:
        kids = []
    for c in kids:
        yield from _walk(c)


def _element(dtype, word, shift):
    """The C value of a storage element `shift` bits into a 32-bit word of a uint4."""
    bits = f"(({word} >> {shift}) & 0xFFFFu)" if dtype in ("f16", "bf16") else f"(({word} >> {shift}) & 0xFFu)"
    return {"f32": f"__uint_as_float({word})", "i32": f"(int){word}", "f16": f"jl_f16({bits})",
            "bf16": f"jl_bf16({bits})", "u8": f"(int){bits}", "i8": f"(int)(signed char){bits}"}[dtype]


def _multiple_of(e, w) -> bool:
    """e is provably a multiple of w (an i32 index)."""
    if isinstance(e, ir.Const):
        return int(e.value) % w == 0
    if isinstance(e, ir.Bin) and e.op == "mul":
        return _multiple_of(e.a, w) or _multiple_of(e.b, w)
    if isinstance(e, ir.Bin) and e.op in ("add", "sub"):
        return _multiple_of(e.a, w) and _multiple_of(e.b, w)
    if isinstance(e, ir.Bin) and e.op == "shl" and isinstance(e.b, ir.Const):
        return _multiple_of(e.a, w) or (1 << int(e.b.value)) % w == 0
    return False


def _vector_loads(r: ir.Reduce, n, k):
    """Loads of reduction r (of constant extent n) that read element `base + r.var` of a buffer, base a multiple of
    16 bytes not naming r's own variables: {id(load): (buffer, base, elements per 16 bytes)}; n must be a multiple
    of the largest of those counts (the reduction's steps per iteration)."""
    inner = {x.var for x in _walk(r.value) if isinstance(x, ir.Reduce)} | {r.var}
    found = {}
    for x in _walk(r.value):
        if not isinstance(x, ir.Load) or not (isinstance(x.index, ir.Bin) and x.index.op == "add"):
            continue
        w = VECTOR_BYTES // ir.STORAGE_DTYPES[k.buffers[x.buf].dtype]
        for var, base in ((x.index.b, x.index.a), (x.index.a, x.index.b)):
            names = {v.name for v in _walk(base) if isinstance(v, ir.Var)}
            if isinstance(var, ir.Var) and var.name == r.var and not names & inner and _multiple_of(base, w) \
                    and n % w == 0:
                found[id(x)] = (x.buf, base, w)
                break
    step = max((w for _, _, w in found.values()), default=1)
    return found if n % step == 0 else {}


def _offset(e):
    """An index as (its non-constant summands, the sum of its constant ones)."""
    if isinstance(e, ir.Const):
        return [], int(e.value)
    if isinstance(e, ir.Bin) and e.op in ("add", "sub"):
        (ta, ca), (tb, cb) = _offset(e.a), _offset(e.b)
        if e.op == "add":
            return ta + tb, ca + cb
        if not tb:
            return ta, ca - cb
    if isinstance(e, ir.Select) and isinstance(e.cond, ir.Const):   # a choice made when the IR was built
        return _offset(e.a if e.cond.value else e.b)
    return [e], 0


def _sure_loads(e, inner):
    """The loads an expression always evaluates (not those of a Select's branch that a condition chooses, unless
    the condition is a constant), whose index names none of `inner` (variables bound inside it)."""
    if isinstance(e, ir.Select):
        if isinstance(e.cond, ir.Const):
            yield from _sure_loads(e.a if e.cond.value else e.b, inner)
        else:
            yield from _sure_loads(e.cond, inner)
        return
    if isinstance(e, ir.Reduce):
        return
    if isinstance(e, ir.Load):
        if not {v.name for v in _walk(e.index) if isinstance(v, ir.Var)} & inner:
            yield e
        return
    for c in (e.a, e.b) if isinstance(e, ir.Bin) else (e.a,) if isinstance(e, (ir.Un, ir.Cast, ir.Lut)) else ():
        yield from _sure_loads(c, inner)


def _merged_loads(value, k):
    """Loads of one reduction step that read whole aligned runs of neighbouring elements: [(buffer, base terms,
    first offset, run length in elements, {offset: [loads]})], a run being 16 bytes, or 4 for byte buffers; the
    base (the non-constant part of the index) provably a multiple of the run, the loads always evaluated."""
    inner = {x.var for x in _walk(value) if isinstance(x, ir.Reduce)}
    groups = {}
    for x in _sure_loads(value, inner):
        terms, c = _offset(x.index)
        if terms:
            groups.setdefault((x.buf, repr(terms)), (terms, {}))[1].setdefault(c, []).append(x)
    runs = []
    for (buf, _), (terms, at) in sorted(groups.items(), key=lambda kv: kv[0]):
        size = ir.STORAGE_DTYPES[k.buffers[buf].dtype]
        base = terms[0] if len(terms) == 1 else functools.reduce(lambda a, b: ir.Bin("add", a, b), terms)
        for n in sorted({VECTOR_BYTES // size, 4 // size} - {0, 1}, reverse=True):
            if not _multiple_of(base, n):
                continue
            for first in sorted({c - c % n for c in at}):
                if all(first + j in at for j in range(n)):
                    runs.append((buf, base, first, n, {first + j: at.pop(first + j) for j in range(n)}))
    return runs


def _check_top_level(s, defs):
    """Top-level locals are replayed per task, so a top-level If/Loop must not assign them."""
    top = {d.name for d in defs if isinstance(d, ir.Local)}
    hit = sorted({x.name for x in _walk(s) if isinstance(x, ir.Assign)} & top)
    if hit:
        raise BackendError(f"cuda: a top-level {type(s).__name__.lower()} assigns top-level local(s) {hit}; "
                           "move it inside a parallel loop of one iteration")


class _ConstFolder:
    """Values of expressions that are compile-time constants (through constant top-level definitions)."""

    def __init__(self, k):
        self.interp, self.env = interp.Interpreter(k), {}

    def value(self, e):
        try:
            return self.interp.ev(e, dict(self.env))
        except (KeyError, AttributeError, ZeroDivisionError):  # a scalar, a load or a bad constant
            return None

    def define(self, s):
        v = self.value(s.init if isinstance(s, ir.Local) else s.value)
        if v is None:
            self.env.pop(s.name, None)
        else:
            self.env[s.name] = v


# ----------------------------------------------------------------------------------------------- emission
def _const(c: ir.Const) -> str:
    if c.dtype == "bool":
        return "true" if c.value else "false"
    if c.dtype == "i32":
        v = (int(c.value) + 2**31) % 2**32 - 2**31
        return "(-2147483647 - 1)" if v == -2**31 else str(v)
    v = float(np.float32(c.value))
    if math.isnan(v):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(v):
        return "__int_as_float(0x7f800000)" if v > 0 else "__int_as_float(0xff800000)"
    return f"{v!r}f"   # the shortest repr of an f32-exact double parses back to the same f32


class _Function:
    """One __global__ function: its tasks, each in its own range of blocks."""

    def __init__(self, k, name, tasks):
        self.k, self.name, self.tasks = k, name, tasks
        self.lines, self.depth = [], 1
        self.scopes, self.used = [{}], {}
        self.bufs = {p.name: self.fresh(p.name, f"b{i}") for i, p in enumerate(k.buffers.values())}
        self.lanes = 1          # lanes cooperating on one iteration in the current task
        self.vector = {}        # id(Load) -> the C expression of its element in a uint4 loaded by a reduction
        self.coop = False       # code runs redundantly on all lanes of an iteration (stores by lane 0)
        self.loaded = set()     # buffers the current cooperative iteration reads
        self.staged = 0         # bytes of shared memory given to staged reductions

    # -- output and names
    def line(self, text):
        self.lines.append("  " * self.depth + text)

    def open(self, head, note=""):
        self.line(f"{head} {{".lstrip() + (f"  // {note}" if note else ""))
        self.depth += 1
        self.scopes.append({})

    def close(self, tail=""):
        self.scopes.pop()
        self.depth -= 1
        self.line("}" + tail)

    def fresh(self, name, prefix="v"):
        """A new C identifier for an IR name (IR names may repeat; C declarations in one function may not)."""
        base = f"{prefix}_{re.sub(r'[^0-9A-Za-z_]', '_', name)}"
        n = self.used.get(base, 0)
        self.used[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def bind(self, name, prefix="v"):
        c = self.scopes[-1][name] = self.fresh(name, prefix)
        return c

    def lookup(self, name):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise BackendError(f"cuda: kernel {self.k.name}: unknown name {name!r}")

    # -- function
    def render(self) -> str:
        params = [f"{'' if p.write else 'const '}{STORAGE_CTYPE[p.dtype]}* {self.bufs[p.name]}"
                  for p in self.k.buffers.values()] + ["const int* __restrict__ jl_s"]
        head = f'extern "C" __global__ void __launch_bounds__(JL_BLOCK) {self.name}({", ".join(params)}) {{'
        for i, s in enumerate(self.k.scalars):
            self.line(f"const int {self.bind(s)} = jl_s[{i}];")
        first = 0
        for j, t in enumerate(self.tasks):
            cond = "" if j == len(self.tasks) - 1 else f"if (blockIdx.x < {first + t.blocks}u)"
            self.open(" ".join(x for x in ("} else" if j else "", cond) if x), f"{t.mode} task")
            self.task(t, first)
            self.scopes.pop()
            self.depth -= 1
            first += t.blocks
        self.line("}")
        return "\n".join([head] + self.lines + ["}"])

    def task(self, t: _Task, first: int):
        self.lanes = {"once": 1, "thread": 1, "flat": 1, "warp": 32, "block": BLOCK}[t.mode]
        if t.mode == "once":
            self.open("if (threadIdx.x == 0)")
            self.block(t.prelude + t.body)
            self.close()
            return
        loop = t.body[0]
        self.block(t.prelude)
        per_block = BLOCK // self.lanes
        first_it = {"thread": f"(int)((blockIdx.x - {first}u) * {BLOCK}u + threadIdx.x)",
                    "flat": f"(int)((blockIdx.x - {first}u) * {BLOCK}u + threadIdx.x)",
                    "warp": f"(int)((blockIdx.x - {first}u) * {per_block}u + threadIdx.x / 32u)",
                    "block": f"(int)(blockIdx.x - {first}u)"}[t.mode]
        if self.lanes > 1:
            self.line(f"const int jl_lane = threadIdx.x % {self.lanes}u;")
        start, n = self.start(loop.start), self.ex(loop.extent)
        if t.mode == "flat":   # jl_it counts (iteration, vector index) pairs
            n = f"jl_wmul({n}, {t.inner})"
        self.open(f"for (int jl_it = {first_it}, jl_n = {n}; jl_it < jl_n; jl_it += {t.blocks * per_block})")
        if t.mode == "flat":
            vec = loop.body[0]
            self.line(f"const int {self.bind(loop.var)} = {start(f'(jl_it / {t.inner})')};")
            self.line(f"const int {self.bind(vec.var)} = {self.start(vec.start)(f'(jl_it % {t.inner})')};")
            self.block(vec.body)
            self.close()
            return
        self.line(f"const int {self.bind(loop.var)} = {start('jl_it')};")
        self.coop = self.lanes > 1
        self.loaded = {x.buf for x in _walk(loop.body) if isinstance(x, ir.Load)}
        self.block(loop.body)
        self.coop = False
        self.close()

    # -- statements
    def block(self, body):
        for s in body:
            self.stmt(s)

    def stmt(self, s):
        if isinstance(s, ir.Store):
            idx, val = self.ex(s.index), self.ex(s.value)
            self.guarded(s.buf, f"{self.bufs[s.buf]}[{idx}] = {self.to_storage(s.buf, val)};")
        elif isinstance(s, ir.AtomicAdd):
            idx, val = self.ex(s.index), self.ex(s.value)
            self.guarded(s.buf, self.atomic(s.buf, idx, val))
        elif isinstance(s, ir.Let):
            val = self.ex(s.value)
            self.line(f"const {CTYPE[s.value.dtype]} {self.bind(s.name)} = {val};")
        elif isinstance(s, ir.Local):
            val = self.ex(s.init)
            self.line(f"{CTYPE[s.init.dtype]} {self.bind(s.name)} = {val};")
        elif isinstance(s, ir.Assign):
            val = self.ex(s.value)
            self.line(f"{self.lookup(s.name)} = {val};")
        elif isinstance(s, ir.If):
            self.open(f"if ({self.ex(s.cond)})")
            self.block(s.then)
            if s.orelse:
                self.close(" else {")
                self.depth += 1
                self.scopes.append({})
                self.block(s.orelse)
            self.close()
        elif isinstance(s, ir.Loop):
            self.loop(s)
        elif isinstance(s, ir.Barrier):
            if self.lanes > 1 and not self.coop:
                raise BackendError(f"cuda: kernel {self.k.name}: barrier inside a vector loop")
            if self.coop:
                self.sync()
        elif not isinstance(s, ir.Prefetch):  # a hint; a warp's loads are already many in flight
            raise BackendError(f"cuda: kernel {self.k.name}: cannot lower {s!r}")

    def loop(self, s: ir.Loop):
        if s.kind == "parallel":
            raise BackendError(f"cuda: kernel {self.k.name}: nested parallel loop {s.var!r}")
        start, n = self.start(s.start), self.ex(s.extent)
        split = self.coop and s.kind == "vector"
        o, e = self.fresh("o", "jl"), self.fresh("e", "jl")   # iterate on the offset from start
        if s.kind == "unroll":
            self.line("#pragma unroll")
        self.open(f"for (int {o} = {'jl_lane' if split else 0}, {e} = {n}; {o} < {e}; "
                  f"{o} += {self.lanes if split else 1})")
        self.line(f"const int {self.bind(s.var)} = {start(o)};")
        saved, self.coop = self.coop, self.coop and not split
        self.block(s.body)
        self.coop = saved
        self.close()

    def start(self, start):
        """Evaluate a loop's start once, before the loop (as the IR does); returns offset -> loop variable."""
        if isinstance(start, ir.Const) and start.value == 0:
            return lambda o: o
        b = self.fresh("b", "jl")
        self.line(f"const int {b} = {self.ex(start)};")
        return lambda o: f"jl_wadd({b}, {o})"

    def sync(self):
        self.line("__syncwarp();" if self.lanes == 32 else "__syncthreads();")

    def guarded(self, buf, text):
        """A store or atomic of the iteration as a whole: lane 0 does it. If the iteration also reads that buffer,
        the other lanes must then see it, as in the IR's sequential reading: sync them."""
        if not self.coop:
            self.line(text)
            return
        self.line(f"if (jl_lane == 0) {text}")
        if buf in self.loaded:
            self.sync()

    def to_storage(self, buf, val):
        return {"f32": val, "i32": val, "f16": f"__float2half_rn({val})", "bf16": f"jl_to_bf16({val})",
                "u8": f"(unsigned char)({val})", "i8": f"(signed char)({val})"}[self.k.buffers[buf].dtype]

    def atomic(self, buf, idx, val):
        d, b = self.k.buffers[buf].dtype, self.bufs[buf]
        if d in ("f32", "i32"):
            return f"atomicAdd(&{b}[{idx}], {val});"
        fn, bits, t = {"f16": ("jl_add_f16", 16, "float"), "bf16": ("jl_add_bf16", 16, "float"),
                       "u8": ("jl_add_8", 8, "int"), "i8": ("jl_add_8", 8, "int")}[d]
        return f"jl_atomic_narrow<{t}, {fn}>(&{b}[{idx}], {bits}, {val});"

    # -- expressions (a Reduce first emits its loop as statements, then stands for its result variable)
    def ex(self, e) -> str:
        if isinstance(e, ir.Const):
            return _const(e)
        if isinstance(e, ir.Var):
            return self.lookup(e.name)
        if isinstance(e, ir.Load):
            if id(e) in self.vector:
                return self.vector[id(e)]
            raw = f"{self.bufs[e.buf]}[{self.ex(e.index)}]"
            return {"f32": raw, "i32": raw, "f16": f"__half2float({raw})", "bf16": f"jl_bf16({raw})",
                    "u8": f"(int){raw}", "i8": f"(int){raw}"}[self.k.buffers[e.buf].dtype]
        if isinstance(e, ir.Bin):
            return self.binary(e.op, self.ex(e.a), self.ex(e.b), e.a.dtype)
        if isinstance(e, ir.Un):
            return self.unary(e.op, self.ex(e.a), e.a.dtype)
        if isinstance(e, ir.Cast):
            a = self.ex(e.a)
            if e.dtype == e.a.dtype:
                return a
            if e.dtype == "i32":
                return f"jl_f2i({a})" if e.a.dtype == "f32" else f"(int)({a})"
            return f"(float)({a})" if e.dtype == "f32" else f"(({a}) != 0)"
        if isinstance(e, ir.Select):
            c, a, b = self.ex(e.cond), self.ex(e.a), self.ex(e.b)
            return f"({c} ? {a} : {b})"
        if isinstance(e, ir.Lut):
            return self.ex(e.expanded())
        if isinstance(e, ir.Reduce):
            return self.reduce(e)
        raise BackendError(f"cuda: kernel {self.k.name}: cannot lower {e!r}")

    @staticmethod
    def binary(op, a, b, dt):
        if dt == "i32" and op in ("add", "sub", "mul"):
            return f"jl_w{op}({a}, {b})"
        if op in ("shl", "dot4"):
            return f"jl_{op}({a}, {b})"
        if op in ("min", "max"):
            return f"jl_{op}({a}, {b})"
        if op == "mod" and dt == "f32":
            return f"fmodf({a}, {b})"
        if op == "shr":
            return f"({a} >> ({b} & 31))"
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%", "and": "&", "or": "|", "xor": "^",
               "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "land": "&&", "lor": "||"}
        return f"({a} {sym[op]} {b})"

    @staticmethod
    def unary(op, a, dt):
        if op == "neg":
            return f"jl_wsub(0, {a})" if dt == "i32" else f"(-{a})"
        if op == "abs":
            return f"fabsf({a})" if dt == "f32" else f"abs({a})"
        if op == "not":
            return f"(!{a})"
        if op == "rsqrt":
            return f"(1.0f / sqrtf({a}))"   # rsqrtf is approximate; keep IEEE sqrt and division
        if op == "f16bits":
            return f"jl_f16((unsigned)({a}) & 0xFFFFu)"
        if op == "f32bits":
            return f"__int_as_float({a})"
        if op == "bf16bits":
            return f"jl_bf16((unsigned)({a}))"
        return f"{op}f({a})"     # exp log sqrt sin cos floor tanh

    def reduce(self, e: ir.Reduce) -> str:
        dt, split = e.value.dtype, self.coop and e.kind == "reduce"
        t = self.fresh("r", "jl")
        ident = {"add": "0", "max": "(-2147483647 - 1)", "min": "2147483647"}[e.op] if dt == "i32" else \
            {"add": "0.0f", "max": "__int_as_float(0xff800000)", "min": "__int_as_float(0x7f800000)"}[e.op]
        n = self.ex(e.extent)
        self.line(f"{CTYPE[dt]} {t} = {ident};")
        const_n = e.extent.value if isinstance(e.extent, ir.Const) else None
        if self.coop and e.kind == "serial" and const_n is not None \
                and self.staged + 4 * BLOCK // self.lanes * int(const_n) <= STAGE_BYTES:
            return self.staged_reduce(e, t, int(const_n))
        loads = {} if split or const_n is None else _vector_loads(e, int(const_n), self.k)
        if loads:
            return self.vector_reduce(e, t, loads)
        if e.kind == "unroll":
            self.line("#pragma unroll")
        v, end = self.fresh(e.var), self.fresh("e", "jl")
        self.open(f"for (int {v} = {'jl_lane' if split else 0}, {end} = {n}; {v} < {end}; "
                  f"{v} += {self.lanes if split else 1})")
        self.scopes[-1][e.var] = v
        saved, self.coop = self.coop, False   # reductions nested in this one run inside each lane
        outer = self.vector
        if split:
            self.vector = dict(outer)
            self.merge_loads(e.value)
        val = self.ex(e.value)
        self.coop, self.vector = saved, outer
        self.line(f"{t} = jl_{e.op}({t}, {val});")
        self.close()
        if split and self.lanes == 32:
            self.line(f"{t} = jl_warp_reduce<{CTYPE[dt]}, jl_{e.op}>({t});")
        elif split:
            self.line(f"{t} = jl_block_reduce<{CTYPE[dt]}, jl_{e.op}>({t}, {'jl_shf' if dt == 'f32' else 'jl_shi'});")
        return t

    def staged_reduce(self, e: ir.Reduce, t: str, n: int) -> str:
        """A serial reduction that every lane of a group would run whole: the lanes compute its terms side by side
        into shared memory, then each adds them up in the IR's order. The same operations in the same order as one
        thread's loop, but the terms' loads and arithmetic are no longer on the chain of dependent steps."""
        groups = BLOCK // self.lanes
        self.staged += 4 * groups * n
        stage, o, j = self.fresh("stage", "jl"), self.fresh(e.var), self.fresh("j", "jl")
        self.line(f"__shared__ __align__(16) {CTYPE[e.value.dtype]} {stage}[{groups}][{n}];")
        mine = f"{stage}[threadIdx.x / {self.lanes}u]" if groups > 1 else f"{stage}[0]"
        self.open(f"for (int {o} = jl_lane; {o} < {n}; {o} += {self.lanes})")
        self.scopes[-1][e.var] = o
        saved, self.coop = self.coop, False
        self.line(f"{mine}[{o}] = {self.ex(e.value)};")
        self.coop = saved
        self.close()
        self.sync()
        w = 4 if n % 4 == 0 else 1   # 16-byte reads of the stage where its rows stay aligned
        self.line("#pragma unroll 8")
        self.open(f"for (int {j} = 0; {j} < {n}; {j} += {w})")
        if w == 4:
            q = self.fresh("q", "jl")
            self.line(f"const {CTYPE[e.value.dtype]}4 {q} = *({CTYPE[e.value.dtype]}4*)&{mine}[{j}];")
            for c in "xyzw":
                self.line(f"{t} = jl_{e.op}({t}, {q}.{c});")
        else:
            self.line(f"{t} = jl_{e.op}({t}, {mine}[{j}]);")
        self.close()
        self.sync()   # the stage is reused by the group's next iteration
        return t

    def merge_loads(self, value):
        """A lane's step of a split reduction (a GPU's row dot: a lane's few neighbouring bytes of a block and the
        inputs they multiply) reads each aligned run of neighbouring elements with one 16- or 4-byte load."""
        for buf, base, first, n, loads in _merged_loads(value, self.k):
            q = self.fresh("m", "jl")
            size, dtype = ir.STORAGE_DTYPES[self.k.buffers[buf].dtype], self.k.buffers[buf].dtype
            wide = n * size == VECTOR_BYTES
            self.line(f"const {'uint4' if wide else 'unsigned'} {q} = *(const {'uint4' if wide else 'unsigned'}*)"
                      f"&{self.bufs[buf]}[jl_wadd({self.ex(base)}, {first})];")
            for c, xs in loads.items():
                byte = (c - first) * size
                word = f"{q}.{'xyzw'[byte // 4]}" if wide else q
                for x in xs:
                    self.vector[id(x)] = _element(dtype, word, byte % 4 * 8)

    def vector_reduce(self, e: ir.Reduce, t: str, loads: dict) -> str:
        """A thread's reduction, `step` steps per iteration: uint4 loads of each buffer and base (16 bytes each,
        as many as the step needs), then the steps in order, each reading its elements out of the loaded words."""
        step, outer = max(w for _, _, w in loads.values()), self.vector   # outer: an enclosing one's elements
        o = self.fresh("o", "jl")
        self.open(f"for (int {o} = 0; {o} < {int(e.extent.value)}; {o} += {step})")
        words = {}   # C element at which a uint4 starts -> its variable
        for lid, (buf, base, w) in list(loads.items()):
            first, qs = self.ex(base), []
            for m in range(0, step, w):
                at = f"{self.bufs[buf]}[jl_wadd({first}, jl_wadd({o}, {m}))]"
                if at not in words:
                    words[at] = self.fresh("q", "jl")
                    self.line(f"const uint4 {words[at]} = *(const uint4*)&{at};")
                qs.append(words[at])
            loads[lid] = (buf, qs, w)
        for j in range(step):
            self.vector = dict(outer)
            for lid, (buf, qs, w) in loads.items():
                byte, dtype = j % w * (VECTOR_BYTES // w), self.k.buffers[buf].dtype
                self.vector[lid] = _element(dtype, f"{qs[j // w]}.{'xyzw'[byte // 4]}", byte % 4 * 8)
            self.scopes[-1][e.var] = f"jl_wadd({o}, {j})"
            saved, self.coop = self.coop, False
            val = self.ex(e.value)
            self.coop = saved
            self.line(f"{t} = jl_{e.op}({t}, {val});")
        self.vector = outer
        self.close()
        return t
