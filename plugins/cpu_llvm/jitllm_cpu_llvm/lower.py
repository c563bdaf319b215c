"""Lower kernel IR to LLVM IR (llvmlite.ir) for the host CPU.

Each kernel becomes `void k(ptr buf..., i32 scalar..., i32 tid, i32 nth, ptr barrier, ptr counters)`. A top-level
parallel loop runs half its iterations in one contiguous share per thread and hands out the rest in chunks claimed
from a counter (each streaming at least CLAIM_BYTES of weights); other top-level effects run on thread 0; a
top-level Barrier calls the native barrier. `vector` loops and reduces become SIMD code with W lanes when their
bodies allow it (affine indices become contiguous vector loads/stores, others gathers/scatters); a reduce whose
value is a vector reduce of the same op keeps one vector accumulator across both loops (a quantized dot product then
does one horizontal sum per row, not per block), each summand accumulating with its own multiply-add. Inside a
vector loop, reduces over a uniform loop run across the lanes (outer-loop vectorization), sibling ones in one loop
sharing what they load, two vectors of lanes per iteration, unrolled reduces inside them spread over four chains
(sums of dot4s that read the same words, one per digit of the input, computed together word by word; sums written
out, each for every vector in turn; other unrolled reduces iteration by iteration for every vector: an input
broadcast feeds all vectors at once); stores under a lane-varying `if` are masked. What quantized weights need is
recognized in the IR rather than written per format: a little-endian field assembled from bytes is one wide load, a
float of a function of 4 bits is one table lookup (vpermps), addresses keep each index term's offset visible, and a
sum of `dot4`s accumulates each into the sum so far (VNNI's vpdpbusd; where the CPU has no VNNI and the bytes are
provably small, pmaddubsw's pair sums add up as i16 as far as their bound allows, then widen once). Weights streamed
from memory are prefetched a few KB ahead (into L1) and further (non-temporally), once per cache line, where the
device's tuning keeps it (CpuDevice.tunables): by a call of `jl_prefetch_ahead`, which the module's support
(`support_ir`) defines for the tuned distances, so that the tuner's variants of a kernel are one lowering.
Each kernel is a module of its own (`kernel_module`), compiled once for every program that launches it, with an entry
that takes its buffers and scalars from a program's slots. A program is data, not code: a table of its launches
(entry, slots, claim counters, a barrier after it or not) that `jl_run` (RUNNER_IR, compiled once) walks, calling
each entry in turn -- so that making a program compiles nothing (a 1B model's prefill step: 5,888 launches).
"""
from __future__ import annotations

import functools
import operator
import platform
import sys

from llvmlite import ir as L

from jitllm_core import ir

I1, I8, I16, I32, I64 = L.IntType(1), L.IntType(8), L.IntType(16), L.IntType(32), L.IntType(64)
F32, F16, PTR, VOID = L.FloatType(), L.HalfType(), L.PointerType(), L.VoidType()
COMPUTE = {"f32": F32, "i32": I32, "bool": I1, "i64": I64}  # i64: addresses only
STORAGE = {"f32": F32, "f16": F16, "bf16": I16, "u8": I8, "i8": I8, "i32": I32}
FM = ("contract",)  # lets LLVM fuse multiply-add; reductions are reassociated only by this lowering
UNROLL_MAX = 64
UNROLL_ACCS = 4  # vector accumulators of a long reduction
JAM = 2  # vectors of lanes per iteration of a vector loop that holds reduces (register tiles)
LANE_BLOCK = 256  # iterations of a reduce across lanes summed before joining its total
# bytes ahead that contiguous loads of a kernel's packed weights prefetch (they stream from DRAM; other buffers,
# and f32 tiles reused from cache, are left alone), and how (LLVM's locality: 3 into all cache
# levels, 1 into L2 and out, 0 non-temporal: x86's prefetchnta). Measured on a Zen 5, engines alternated in one
# process: the far prefetch non-temporal at 10 KB against into L2 at 16 KB, one thread's 1B decode 38.0 -> 46.6
# tok/s, SmolLM2's 306 -> 327 (two threads 334 -> 381); into L2 at 6-12 KB, or non-temporal alone, in between
PREFETCH = ((4096, 3), (10240, 0))  # (distance, locality); untuned kernels' (a prefill gemm's); decode matvecs'
# are tuned per kernel tag (CpuDevice.tunables, PREFETCH_DEEP unless another measures faster) among this, the earlier
# default (the far prefetch into L2, so that the near one's L1 fill waits on L2, not DRAM: what an Ice Lake and an
# Emerald Rapids were measured with), a deeper one and none
PREFETCH_L2 = ((4096, 3), (16384, 1))
# and a third distance, 32 KB into L2: on a Zen 5 host busy enough that one thread read 26 GB/s (40 before), the
# 1B shape's decode 23.6 -> 29.1 tok/s on one thread, 30.7 -> 37.0 on two, against PREFETCH_L2 (ab_decode.py, 5 rounds)
PREFETCH_DEEP = ((4096, 3), (16384, 1), (32768, 1))
# or two, both further ahead: into L1 12 KB ahead, into L2 24 KB. On an AMX Xeon (its decode loops shortened by
# GFNI's byte shifts), the 1B shape's decode 16.89 -> 18.68 tok/s on one thread against PREFETCH_DEEP with the
# near one at 4 KB, 19.81 -> 20.24 against it at 8 KB (ab_decode.py, 4-5 rounds); an R4K matvec over 1 GB of
# copies 14.0 -> 16.0 GB/s on one thread, 27.0 -> 29.2 on two
PREFETCH_FAR = ((12288, 3), (24576, 1))
# "large": a matrix streamed from DRAM in a decode step, however small (a step reads the whole model, which does
# not stay in the caches): SmolLM2's 69-207 KB projections too, whose threads' short streams the hardware's
# prefetcher barely starts on (two threads' decode +2-6 %, one thread's unchanged: docs/benchmarks-history.md)
PREFETCH_MIN = 32 << 10
# a parallel loop that streams no weights and has at most this many iterations a thread (a decode step's ropes,
# norms, input quantizations, attention heads) is cut into even contiguous shares, nothing claimed: its claimed
# chunks were of one or two iterations, whose atomics and writes to cache lines the other thread also wrote cost
# more than the balance they bought (SmolLM2's two-thread decode step: its ropes 0.184 -> 0.044 ms, its input
# quantizations 0.218 -> 0.145; decode 240.9 -> 259.9 tok/s, ab_decode.py, 7 rounds, every pair faster). Longer
# ones (a prompt's attention, whose later tokens see more keys) keep the claims
STATIC_ITERATIONS = 128
CLAIMS = 4  # chunks per thread of a parallel loop's claimed half
# the least a claimed chunk streams of a loop's weights (its ir.WEIGHTS buffer): a chunk starts a new stream, whose
# first lines wait on DRAM before its prefetches run ahead. SmolLM2's matvecs (its chunks were 35 KB) on a Zen 5's
# two threads: decode 315 -> 346 / 355 / 338 tok/s at 64 / 128 / 256 KB; the 1B's (chunks of 605 KB) unchanged.
# Never more than a thread's even part of the claimed half (a prefill matmul's few slices: uncapped, SmolLM2's
# 256-token prompt on two threads ran 1410 against 1591 tok/s capped)
CLAIM_BYTES = 128 << 10
CLAIM_STRIDE = 16  # i32s between two parallel loops' claim counters (a cache line each)
LINE = 64  # bytes of a cache line
PREFETCHED = "prefetched"  # memo entry: the cache lines a body has prefetched, one set for all its vectors
PREFETCH_AHEAD = "jl_prefetch_ahead"  # a streamed weight's prefetches (support_ir), inlined where it is called
LANE0 = "first lane"  # venv entry (no IR name has a space): the vector's first lane within the loop's iteration

# what every module links in: the barrier. A thread that arrives before the others spins while they are expected
# soon, for as long as the Workers say (bar[18], in the CPU's timestamp ticks), then sleeps in Linux's futex on the
# generation word until the last one in wakes the sleepers (bar[17] counts them: no system call when none sleeps);
# where there is no futex it yields its CPU instead. On a CPU that other tasks want, a wait spent spinning costs the
# thread the share the scheduler then withholds from it (runtime.SPIN_TICKS).
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform.startswith("linux") else None
SLEEP = f"""  %a = atomicrmw add ptr %sleepp, i32 1 seq_cst
  %g64 = zext i32 %g to i64
  %r = call i64 (i64, ...) @syscall(i64 {FUTEX}, ptr %genp, i64 128, i64 %g64, ptr null)
  %b = atomicrmw sub ptr %sleepp, i32 1 seq_cst
""" if FUTEX else "  %y = call i32 @sched_yield()\n"  # 128: FUTEX_WAIT_PRIVATE, 129 below: FUTEX_WAKE_PRIVATE
WAKE = f"""  %s = load atomic i32, ptr %sleepp seq_cst, align 4
  %any = icmp ne i32 %s, 0
  br i1 %any, label %wake, label %done
wake:
  %w = call i64 (i64, ...) @syscall(i64 {FUTEX}, ptr %genp, i64 129, i64 2147483647)
""" if FUTEX else ""
SUPPORT_IR = f"""
{"declare i64 @syscall(i64, ...)" if FUTEX else "declare i32 @sched_yield()"}
declare i64 @llvm.readcyclecounter()
define void @jl_barrier(ptr %bar, i32 %nth) noinline {{
entry:
  %single = icmp sle i32 %nth, 1
  br i1 %single, label %done, label %go
go:
  %genp = getelementptr i32, ptr %bar, i32 16
  %sleepp = getelementptr i32, ptr %bar, i32 17
  %budgetp = getelementptr i32, ptr %bar, i32 18
  %g = load atomic i32, ptr %genp acquire, align 4
  %c = atomicrmw add ptr %bar, i32 1 acq_rel
  %last1 = sub i32 %nth, 1
  %last = icmp eq i32 %c, %last1
  br i1 %last, label %release, label %wait
release:
  store atomic i32 0, ptr %bar monotonic, align 4
  %g1 = add i32 %g, 1
  store atomic i32 %g1, ptr %genp seq_cst, align 4
{WAKE}  br label %done
wait:
  %t0 = call i64 @llvm.readcyclecounter()
  br label %spin
spin:
  %since = phi i64 [%t0, %wait], [%since, %spun], [%t1, %sleep]
  %cur = load atomic i32, ptr %genp acquire, align 4
  %same = icmp eq i32 %cur, %g
  br i1 %same, label %spun, label %done
spun:
  %t = call i64 @llvm.readcyclecounter()
  %dt = sub i64 %t, %since
  %budget = load atomic i32, ptr %budgetp monotonic, align 4
  %budget64 = zext i32 %budget to i64
  %long = icmp ugt i64 %dt, %budget64
  br i1 %long, label %sleep, label %spin
sleep:
{SLEEP}  %t1 = call i64 @llvm.readcyclecounter()
  br label %spin
done:
  ret void
}}
"""
# `jl_run(table, bufs, scalars, tid, nth, barrier, counters)`: a program's launches, as every thread runs them. The
# table (i64s): the launches' count, the timestamps (a timed program's, else null), the claim counters' bytes, then
# per launch its entry, its slots (i32 buffer and scalar slots, in the kernel's parameter order), the offset of its
# claim counters (i32s: CLAIM_STRIDE apart, each launch's own, all zero when a step starts) and whether a barrier
# follows it. Thread 0 zeroes the counters once the last barrier is passed. A timed program's thread 0 stamps the
# time once every thread is in (the first launch is not charged their wake-up), then after each launch's barrier
# (jl_stamp).
RUNNER_IR = """
declare void @jl_barrier(ptr, i32)
declare i32 @clock_gettime(i32, ptr)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
define void @jl_stamp(ptr %ts, i32 %i, i32 %tid) noinline {
entry:
  %first = icmp eq i32 %tid, 0
  br i1 %first, label %stamp, label %done
stamp:
  %spec = alloca [2 x i64], align 8
  %r = call i32 @clock_gettime(i32 1, ptr %spec)
  %nsp = getelementptr i64, ptr %spec, i32 1
  %sec = load i64, ptr %spec, align 8
  %ns = load i64, ptr %nsp, align 8
  %sns = mul i64 %sec, 1000000000
  %t = add i64 %sns, %ns
  %at = getelementptr i64, ptr %ts, i32 %i
  store i64 %t, ptr %at, align 8
  br label %done
done:
  ret void
}
define void @jl_run(ptr %table, ptr %bufs, ptr %scal, i32 %tid, i32 %nth, ptr %bar, ptr %counters) {
entry:
  %n = load i64, ptr %table, align 8
  %tsp = getelementptr i64, ptr %table, i64 1
  %ts = load ptr, ptr %tsp, align 8
  %cbp = getelementptr i64, ptr %table, i64 2
  %cb = load i64, ptr %cbp, align 8
  %timed = icmp ne ptr %ts, null
  br i1 %timed, label %first, label %head
first:
  call void @jl_barrier(ptr %bar, i32 %nth)
  call void @jl_stamp(ptr %ts, i32 0, i32 %tid)
  br label %head
head:
  %i = phi i64 [0, %entry], [0, %first], [%i1, %stamp], [%i1, %note]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %launch, label %done
launch:
  %at = mul i64 %i, 4
  %at3 = add i64 %at, 3
  %rec = getelementptr i64, ptr %table, i64 %at3
  %fn = load ptr, ptr %rec, align 8
  %slp = getelementptr i64, ptr %rec, i64 1
  %slots = load ptr, ptr %slp, align 8
  %cop = getelementptr i64, ptr %rec, i64 2
  %coff = load i64, ptr %cop, align 8
  %syp = getelementptr i64, ptr %rec, i64 3
  %sync = load i64, ptr %syp, align 8
  %mine = getelementptr i32, ptr %counters, i64 %coff
  call void %fn(ptr %bufs, ptr %scal, ptr %slots, i32 %tid, i32 %nth, ptr %bar, ptr %mine)
  %i1 = add i64 %i, 1
  %wait = icmp ne i64 %sync, 0
  br i1 %wait, label %barrier, label %stamp
barrier:
  call void @jl_barrier(ptr %bar, i32 %nth)
  br label %stamp
stamp:
  br i1 %timed, label %note, label %head
note:
  %i32 = trunc i64 %i1 to i32
  call void @jl_stamp(ptr %ts, i32 %i32, i32 %tid)
  br label %head
done:
  %zero = icmp eq i32 %tid, 0
  br i1 %zero, label %clear, label %out
clear:
  call void @llvm.memset.p0.i64(ptr %counters, i8 0, i64 %cb, i1 false)
  br label %out
out:
  ret void
}
"""


class NotVectorizable(Exception):
    pass


class VVal:
    """A value inside a W-lane vector body: uniform scalar ('u'), affine base+stride*lane ('lin'), or vector ('v')."""
    __slots__ = ("kind", "val", "stride")

    def __init__(self, kind, val, stride=0):
        self.kind, self.val, self.stride = kind, val, stride


def _const(dtype, v):
    return L.Constant(COMPUTE[dtype], v)


def _identity(op, dtype):
    if dtype == "f32":
        return {"add": 0.0, "max": float("-inf"), "min": float("inf")}[op]
    return {"add": 0, "max": -2**31, "min": 2**31 - 1}[op]


class Dot4Sum:
    """An i32 sum of dot4s and other i32 terms, built as one chain: with VNNI each dot4 adds into the sum
    (vpdpbusd); without it, the pmaddubsw pair sums of dot4s whose x bytes are provably small add up as i16 while
    their bound stays within i16 (8 dot4s of nibbles by signed bytes: 8 x 2 x 15 x 128 = 30720), then widen into
    the sum with one pmaddwd -- the same integers, one widening per run instead of per dot4. Bytes of x up to 255
    (IQ4's codes looked up as levels + 128) in their two nibbles (`KernelLowering.nibbles`): the low ones here, the
    high ones in a sum of their own (`high`), 16 times it added at the end -- each a run of 8 dot4s to a widening,
    where the bytes' low 7 bits would take a widening each."""

    def __init__(self, low):
        self.low, self.acc, self.pairs, self.bound, self.high = low, None, None, 0, None

    def add(self, t, venv):
        low = self.low
        if not _is_dot4(t):
            self._into(low.to_vec(low.vexpr(t, venv), "i32"))
            return
        x, y = (low.to_vec(low.vexpr(a, venv), "i32") for a in (t.a, t.b))
        self.add_dot4(x, y, _byte_max(t.a))

    def add_dot4(self, x, y, top):
        """dot4 of x (bytes at most top) and y into the sum, bytes above 127 nibble by nibble where pmaddubsw
        takes the nibbles."""
        low = self.low
        if top >= 128 and low.pairs_exact(x, 15):
            x, high = low.nibbles(x)
            self.high = self.high or Dot4Sum(low)
            self.high.add_bytes(high, y, 15)
            top = 15
        self.add_bytes(x, y, top)

    def add_bytes(self, x, y, top):
        """dot4 of x (bytes at most top) and y into the sum."""
        low = self.low
        pairs = low.dot4_pairs(x, y, top)
        if pairs is None:
            self.acc = low.dot4(x, y, self.acc, top)
            return
        bound = 2 * 128 * top  # |x0 y0 + x1 y1| with y's bytes signed
        if self.bound + bound > 32767:
            self._flush()
        self.pairs = pairs if self.pairs is None else low.b.add(self.pairs, pairs)
        self.bound += bound

    def _into(self, v):
        self.acc = v if self.acc is None else self.low.b.add(self.acc, v)

    def _flush(self):
        if self.pairs is not None:
            self._into(self.low.widen_pairs(self.pairs))
        self.pairs, self.bound = None, 0

    def value(self):
        self._flush()
        if self.high is not None:
            high = self.high.value()
            self._into(self.low.b.shl(high, self.low.splat_like(high, I32, 4)))
        return self.acc


_PURE = ("add", "sub", "mul", "sdiv", "srem", "udiv", "urem", "and_", "or_", "xor", "shl", "lshr", "ashr", "fadd",
         "fsub", "fmul", "fdiv", "frem", "fneg", "neg", "not_", "icmp_signed", "icmp_unsigned", "fcmp_ordered",
         "fcmp_unordered", "select", "sext", "zext", "trunc", "bitcast", "fpext", "fptrunc", "sitofp", "uitofp",
         "fptosi", "fptoui", "gep", "extract_element", "insert_element", "shuffle_vector")


def _operand_key(a):
    """What makes an instruction's operand the same as another's: a constant's type and value, a type's text, any
    other value itself. Chosen by the operand's class (`_KEYS`): keys are made for every operand of every pure
    instruction, a fifth of a kernel's lowering when each asked isinstance of each class in turn."""
    key = _KEYS.get(type(a))
    if key is None:
        key = _KEYS[type(a)] = _key_of_class(a)
    return key(a)


def _constant_key(a):
    c = a.constant
    if isinstance(c, list):  # a vector's: scalar constants, or their values
        c = tuple(x.constant if isinstance(x, L.Constant) else x for x in c)
    return str(a.type), c


def _key_of_class(a):
    if isinstance(a, L.Constant):
        return _constant_key
    if isinstance(a, (list, tuple)):
        return lambda s: tuple(map(_operand_key, s))
    if isinstance(a, L.Type):
        return str
    return (lambda v: v) if isinstance(a, (int, float, str, bool, type(None))) else id


_KEYS = {}


class _Builder(L.IRBuilder):
    """An IRBuilder that makes each pure instruction once a basic block: asked again for one with the same operands,
    it returns the first. The IR's unrolled bodies compute the same addresses and fields many times over (a 6-bit
    embedding row's module had 76,000 instructions, 29 % of them literal repeats), and every copy costs lowering, text
    and LLVM's parse. Instructions are only ever appended at a block's end, so the first one dominates each reuse."""

    def __init__(self, block):
        super().__init__(block)
        self.made = {}


def _memoized(name):
    make = getattr(L.IRBuilder, name)

    def method(self, *args, **kw):
        kw.pop("name", None)
        key = (self.block, name, _operand_key(args), _operand_key(sorted(kw.items())) if kw else ())
        v = self.made.get(key)
        if v is None:
            v = self.made[key] = make(self, *args, **kw)
        return v
    return method


for _name in _PURE:
    setattr(_Builder, _name, _memoized(_name))


class KernelLowering:
    def __init__(self, module: L.Module, kernel: ir.Kernel, width: int, isa=frozenset(), name=None):
        self.k, self.W, self.isa = kernel, width, isa
        self.fn = L.Function(module, kernel_type(kernel), name=name or f"k_{kernel.name}_{kernel.key()}")
        self.k = kernel = ir.expand_tile_dots(kernel, lambda s: amx_fits(s, isa))
        self.fn.attributes.add("noinline")
        # allocas live in their own entry block so that two builders never insert into one block
        self.alloca_b = L.IRBuilder(self.fn.append_basic_block("entry"))
        self.start = self.fn.append_basic_block("start")
        self.b = _Builder(self.start)
        a = self.fn.args
        nb, ns = len(kernel.buffers), len(kernel.scalars)
        self.ptrs = dict(zip(kernel.buffers, a[:nb]))
        self.tid, self.nth, self.bar, self.counters = a[nb + ns:nb + ns + 4]
        self.env = {name: a[nb + i] for i, name in enumerate(kernel.scalars)}
        self.mutable = {}  # Local name -> alloca
        self.memo = {}  # IR node id -> VVal within one vector body (a block's bytes are loaded once)
        self.loaded = _loaded_buffers(kernel.body)  # stores to other buffers keep what memo holds
        self.read_sets = {}  # IR node id -> the buffers it loads from (`reads`)
        self.vectorizable = {}  # IR node id -> (node, `vectorizable_expr`)
        self.tile_shape = None  # the tile configuration that the parallel iteration loaded (`parallel`)
        self.module = module

    # ------------------------------------------------------------------ helpers
    def alloca(self, ty):
        return self.alloca_b.alloca(ty)

    def declare(self, name, ret, args):
        """The module's declaration of function `name`, added on first use."""
        return self.module.globals.get(name) or L.Function(self.module, L.FunctionType(ret, args), name=name)

    def prefetch(self, ptr, locality):
        """A data prefetch (a read) of ptr into the cache levels LLVM's `locality` names (3: all, 1: L2 and out, 0:
        non-temporal)."""
        fn = self.declare("llvm.prefetch.p0", VOID, [PTR, I32, I32, I32])
        self.b.call(fn, [ptr, L.Constant(I32, 0), L.Constant(I32, locality), L.Constant(I32, 1)])

    def intrinsic(self, name, ty, nargs=1, ret=None):
        """Declare llvm.<op>.<type> (llvmlite cannot mangle vector types itself)."""
        full = f"{name}.{_mangle(ret)}.{_mangle(ty)}" if ret else f"{name}.{_mangle(ty)}"
        return self.declare(full, ret or ty, [ty] * nargs)

    def loop(self, start, end, body, step=1):
        """for (i = start; i < end; i += step) body(i)"""
        b = self.b
        var = self.alloca(I32)
        b.store(start, var)
        cond, blk, done = (self.fn.append_basic_block(n) for n in ("cond", "body", "done"))
        b.branch(cond)
        b.position_at_end(cond)
        i = b.load(var, typ=I32)
        b.cbranch(b.icmp_signed("<", i, end), blk, done)
        b.position_at_end(blk)
        body(i)
        b.store(b.add(b.load(var, typ=I32), L.Constant(I32, step), flags=("nsw",)), var)
        b.branch(cond)
        b.position_at_end(done)

    def if_then(self, cond, then, orelse=None):
        with self.b.if_else(cond) as (t, e):
            with t:
                then()
            with e:
                if orelse:
                    orelse()

    # ------------------------------------------------------------------ kernel
    def lower(self):
        zero = L.Constant(I32, 0)
        claims = 0
        for s in self.k.body:
            if isinstance(s, ir.Loop) and s.kind == "parallel":
                counter = self.b.gep(self.counters, [L.Constant(I32, claims * CLAIM_STRIDE)], source_etype=I32)
                self.parallel(s, counter)
                claims += 1
            elif isinstance(s, ir.Barrier):
                self.b.call(self.module.get_global("jl_barrier"), [self.bar, self.nth])
            elif isinstance(s, (ir.Let, ir.Local, ir.Assign)):
                self.stmt(s)
            else:
                self.if_then(self.b.icmp_signed("==", self.tid, zero), lambda s=s: self.stmt(s))
        self.b.ret_void()
        self.alloca_b.branch(self.start)
        return self.fn

    def parallel(self, s, counter):
        """A top-level parallel loop: each thread first runs a contiguous share of half the iterations (no
        atomics), then all claim the rest a chunk at a time from the launch's counter, so that a thread slowed by
        whatever else its core runs does less of it instead of holding up the barrier (CLAIMS chunks a thread, each
        at least CLAIM_BYTES of the loop's weights, but at most a thread's even part of the claimed half: a few
        long iterations, a prefill matmul's slices, still go to every thread); short loops that stream no weights
        only the even shares (STATIC_ITERATIONS). The body is emitted once."""
        b, one = self.b, L.Constant(I32, 1)
        start, ext = self.expr(s.start), self.expr(s.extent)
        end = b.add(start, ext)
        share = b.select(b.icmp_signed("==", self.nth, one), ext, b.sdiv(ext, b.mul(self.nth, L.Constant(I32, 2))))
        weightless = self.streamed_weights() is None and STATIC_ITERATIONS
        if weightless:  # a short loop that streams no weights: contiguous even shares, nothing claimed
            static = b.icmp_signed("<=", ext, b.mul(self.nth, L.Constant(I32, STATIC_ITERATIONS)))
            share = b.select(static, b.sdiv(b.add(ext, b.sub(self.nth, one)), self.nth), share)
        first = b.add(start, b.mul(self.nth, share))  # where the claimed chunks begin
        claimed = b.sub(end, first)
        chunk = b.sdiv(claimed, b.mul(self.nth, L.Constant(I32, CLAIMS)))
        least = L.Constant(I32, self.streamed_iterations(s, CLAIM_BYTES))
        chunk = b.select(b.icmp_signed("<", chunk, least), least, chunk)
        most = b.sdiv(b.add(claimed, b.sub(self.nth, one)), self.nth)
        chunk = b.select(b.icmp_signed(">", chunk, most), most, chunk)
        chunk = b.select(b.icmp_signed("<", chunk, one), one, chunk)
        i, hi = self.alloca(I32), self.alloca(I32)
        lo = b.add(start, b.mul(self.tid, share))
        top = b.add(lo, share)
        b.store(lo, i), b.store(b.select(b.icmp_signed("<", top, end), top, end), hi)
        test, claim, work, done = (self.fn.append_basic_block(n) for n in ("next", "claim", "work", "all_done"))
        b.branch(test)
        b.position_at_end(test)
        b.cbranch(b.icmp_signed("<", b.load(i, typ=I32), b.load(hi, typ=I32)), work, claim)
        b.position_at_end(claim)
        if weightless:
            go = self.fn.append_basic_block("claim_chunk")
            b.cbranch(static, done, go)
            b.position_at_end(go)
        c0 = b.add(first, b.mul(b.atomic_rmw("add", counter, one, "monotonic"), chunk))
        c1 = b.add(c0, chunk)
        b.store(c0, i), b.store(b.select(b.icmp_signed("<", c1, end), c1, end), hi)
        b.cbranch(b.icmp_signed("<", c0, end), work, done)
        b.position_at_end(work)
        cur = b.load(i, typ=I32)
        # a tile configuration takes ~120 ns to load (on a Sapphire Rapids, against ~10 per tile multiply): once per
        # iteration where its tile dots all have one shape
        shapes = {amx_shape(t) for t in _tile_dots(s.body)}
        self.tile_shape = shapes.pop() if len(shapes) == 1 else None
        if self.tile_shape:
            b.call(self.declare("llvm.x86.ldtilecfg", VOID, [PTR]), [self.tile_config(*self.tile_shape)])
        self.block(s.body, {s.var: cur})
        b.store(b.add(cur, one, flags=("nsw",)), i)
        b.branch(test)
        b.position_at_end(done)

    def streamed_iterations(self, s, nbytes):
        """Iterations of parallel loop s that read nbytes of its kernel's weights (ir.WEIGHTS as packed bytes,
        spread evenly over a constant extent), at least 1 and at most all of them; 1 where there are none."""
        w = self.streamed_weights()
        ext = s.extent.value if isinstance(s.extent, ir.Const) else None
        if not w or not ext:
            return 1
        return max(1, min(ext, -(-nbytes * ext // w.size)))

    def streamed_weights(self):
        """The kernel's weights (ir.WEIGHTS) where they are packed bytes it only reads, which a step streams from
        DRAM; else None (f32 weights are a norm's few, or a dequantized copy reused from cache)."""
        w = self.k.buffers.get(ir.WEIGHTS)
        return w if w and w.dtype == "u8" and not w.write else None

    def block(self, body, bind):
        saved = dict(self.env)
        self.env.update(bind)
        for s in body:
            self.stmt(s)
        self.env = saved

    def stmt(self, s):
        b = self.b
        if isinstance(s, ir.Store):
            self.store(s.buf, [self.expr(t) for t in _index_terms(s.index)], self.expr(s.value))
        elif isinstance(s, ir.AtomicAdd):
            dt = self.k.buffers[s.buf].dtype
            if dt not in ("f32", "i32"):
                raise ir.IRError(f"{self.k.name}: atomic add on {dt} buffer {s.buf}")
            ptr = b.gep(self.ptrs[s.buf], [self.expr(s.index)], source_etype=STORAGE[dt])
            op = "fadd" if dt == "f32" else "add"
            b.atomic_rmw(op, ptr, self.expr(s.value), "monotonic")
        elif isinstance(s, ir.Let):
            self.env[s.name] = self.expr(s.value)
        elif isinstance(s, ir.Local):
            v = self.expr(s.init)
            self.mutable[s.name] = slot = self.alloca(v.type)
            b.store(v, slot)
        elif isinstance(s, ir.Assign):
            b.store(self.expr(s.value), self.mutable[s.name])
        elif isinstance(s, ir.Loop):
            self.loop_stmt(s)
        elif isinstance(s, ir.If):
            self.if_then(self.expr(s.cond), lambda: self.block(s.then, {}),
                         (lambda: self.block(s.orelse, {})) if s.orelse else None)
        elif isinstance(s, ir.Barrier):
            pass  # one thread runs a whole parallel iteration: its own stores are already visible
        elif isinstance(s, ir.Prefetch):  # each cache line of the elements once (LLVM's locality 3: into L1, 2: L2)
            dt = self.k.buffers[s.buf].dtype
            first = b.gep(self.ptrs[s.buf], [self.expr(s.index)], source_etype=STORAGE[dt])
            for line in range(0, s.count * ir.STORAGE_DTYPES[dt], LINE):
                self.prefetch(b.gep(first, [L.Constant(I32, line)], source_etype=I8), 3 if s.near else 2)
        elif isinstance(s, ir.TileDot):  # the others were expanded into loops (__init__)
            self.amx_tile_dot(s)
        else:
            raise ir.IRError(f"cannot lower {s!r}")

    def amx_tile_dot(self, s):
        """A TileDot on AMX (`amx_shape`): its input tiles first, then its weights tiles, each loaded once per 64
        bytes of the rows, then one accumulator per output, stored once at the end."""
        b, tile = self.b, lambda t: L.Constant(I8, t)
        call = lambda name, args: b.call(self.declare(f"llvm.x86.{name}", VOID, [a.type for a in args]), args)
        shape = amx_shape(s)
        if self.tile_shape != shape:  # else loaded once for the iteration (`parallel`)
            call("ldtilecfg", [self.tile_config(*shape)])
        na, nb = len(s.a0s), len(s.b0s)
        for t in range(len(s.outs)):
            call("tilezero", [tile(na + nb + t)])
        a0s, b0s, row = [self.expr(a) for a in s.a0s], [self.expr(w) for w in s.b0s], L.Constant(I64, 4 * s.n)
        for step in range(s.words // AMX_WORDS):
            for t, a0 in enumerate(a0s):
                call("tileloadd64", [tile(t), self.element(s.a, [a0, L.Constant(I32, 4 * AMX_WORDS * step)]),
                                     L.Constant(I64, s.a_stride)])
            for t, b0 in enumerate(b0s):
                call("tileloadd64", [tile(na + t), self.element(s.b, [b0, L.Constant(I32, AMX_WORDS * step * s.n)]),
                                     row])
            for t, (ai, bi, _) in enumerate(s.outs):
                call("tdpbsud", [tile(na + nb + t), tile(ai), tile(na + bi)])
        for t, (_, _, o0) in enumerate(s.outs):
            call("tilestored64", [tile(na + nb + t), self.element(s.out, [self.expr(o0)]),
                                  L.Constant(I64, 4 * s.o_stride)])

    def tile_config(self, m, na, nb, outs):
        """The module's AMX tile configuration for `amx_tile_dot`s of m input rows, na input tiles, nb weights tiles
        and `outs` outputs: palette 1; input and output tiles m rows of 64 bytes, weights tiles 16 rows of 64."""
        name = f"amx_config_{m}_{na}_{nb}_{outs}"
        if name in self.module.globals:
            return self.module.globals[name]
        cfg = [0] * 64
        cfg[0] = 1
        for t, rows in enumerate([m] * na + [AMX_WORDS] * nb + [m] * outs):
            cfg[16 + 2 * t], cfg[48 + t] = 64, rows
        g = L.GlobalVariable(self.module, L.ArrayType(I8, 64), name)
        g.global_constant, g.linkage, g.align = True, "internal", 64
        g.initializer = L.Constant(L.ArrayType(I8, 64), cfg)
        return g

    def loop_stmt(self, s):
        start, ext = self.expr(s.start), self.expr(s.extent)
        if s.kind == "unroll" and isinstance(ext, L.Constant) and ext.constant <= UNROLL_MAX:
            for j in range(ext.constant):
                self.block(s.body, {s.var: self.b.add(start, L.Constant(I32, j))})
            return
        if s.kind == "vector" and self.vectorizable_body(s.body):
            self.vector_loop(s, start, ext)
            return
        self.loop(start, self.b.add(start, ext), lambda i: self.block(s.body, {s.var: i}))

    # ------------------------------------------------------------------ memory
    def element(self, buf, parts, etype=None):
        """Pointer to element sum(parts) of buf (i32 values). Each part is sign-extended and added on its own:
        an i32 sum extended once would hide its constant offsets and loop-invariant parts from the addressing
        modes (LLVM cannot split it once reassociation has dropped the no-overflow flags)."""
        ptr = self.ptrs[buf]
        for v in parts:
            ptr = self.b.gep(ptr, [self.b.sext(v, I64)], source_etype=etype or STORAGE[self.k.buffers[buf].dtype])
        return ptr

    def load(self, buf, parts):
        """Element sum(parts) of buf, in its compute type."""
        dt = self.k.buffers[buf].dtype
        return self.from_storage(dt, self.b.load(self.element(buf, parts), typ=STORAGE[dt]))

    def from_storage(self, dt, v):
        b, ty = self.b, _shaped_like(v)
        if dt == "f16":
            return b.fpext(v, ty(F32))
        if dt == "bf16":
            return b.bitcast(b.shl(b.zext(v, ty(I32)), self.splat_like(v, I32, 16)), ty(F32))
        if dt == "u8":
            return b.zext(v, ty(I32))
        if dt == "i8":
            return b.sext(v, ty(I32))
        return v

    def to_storage(self, dt, v):
        b, ty = self.b, _shaped_like(v)
        if dt == "f16":
            return b.fptrunc(v, ty(F16))
        if dt == "bf16":  # round to nearest even
            bits = b.bitcast(v, ty(I32))
            odd = b.and_(b.lshr(bits, self.splat_like(v, I32, 16)), self.splat_like(v, I32, 1))
            r = b.add(b.add(bits, self.splat_like(v, I32, 0x7FFF)), odd)
            return b.trunc(b.lshr(r, self.splat_like(v, I32, 16)), ty(I16))
        if dt in ("u8", "i8"):
            return b.trunc(v, ty(I8))
        return v

    def shift_bytes(self, v, s):
        """each byte of the i32 vector v shifted right by s: one instruction where the CPU has GFNI (an affine map
        of each byte), else the word shift and mask that (v >> s) & mask is anyway"""
        bt = L.VectorType(I8, 4 * v.type.count)
        return self.b.bitcast(self.b.lshr(self.b.bitcast(v, bt), L.Constant(bt, [s] * bt.count)), v.type)

    def splat_like(self, v, t, c):
        if isinstance(v.type, L.VectorType):
            return L.Constant(L.VectorType(t, v.type.count), [c] * v.type.count)
        return L.Constant(t, c)

    def store(self, buf, parts, v):
        """v into element sum(parts) of buf."""
        self.b.store(self.to_storage(self.k.buffers[buf].dtype, v), self.element(buf, parts))

    # ------------------------------------------------------------------ scalar expressions
    def expr(self, e):
        b = self.b
        if isinstance(e, ir.Const):
            return _const(e.dtype, float(e.value) if e.dtype == "f32" else int(e.value))
        if isinstance(e, ir.Var):
            if e.name in self.mutable:
                return b.load(self.mutable[e.name], typ=COMPUTE[e.dtype])
            return self.env[e.name]
        if isinstance(e, ir.Load):
            return self.load(e.buf, [self.expr(t) for t in _index_terms(e.index)])
        if isinstance(e, ir.Bin):
            return self.binop(e.op, self.expr(e.a), self.expr(e.b), e.a.dtype)
        if isinstance(e, ir.Un):
            return self.unop(e.op, self.expr(e.a), e.a.dtype)
        if isinstance(e, ir.Cast):
            return self.cast(self.expr(e.a), e.a.dtype, e.dtype)
        if isinstance(e, ir.Select):
            return b.select(self.expr(e.cond), self.expr(e.a), self.expr(e.b))
        if isinstance(e, ir.Lut):
            return self.expr(e.expanded())
        if isinstance(e, ir.Reduce):
            return self.reduce(e)
        raise ir.IRError(f"cannot lower {e!r}")

    def binop(self, op, x, y, dt):
        b = self.b
        if dt == "f32":
            if op in ("add", "sub", "mul", "div"):
                return {"add": b.fadd, "sub": b.fsub, "mul": b.fmul, "div": b.fdiv}[op](x, y, flags=FM)
            if op == "mod":
                return b.frem(x, y)
            if op == "min":
                return b.select(b.fcmp_ordered("<", y, x), y, x)
            if op == "max":
                return b.select(b.fcmp_ordered(">", y, x), y, x)
            return b.fcmp_ordered({"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[op], x, y)
        if op in ("add", "sub", "mul"):  # nsw: the IR leaves i32 overflow undefined, so indices can widen
            return {"add": b.add, "sub": b.sub, "mul": b.mul}[op](x, y, flags=("nsw",))
        if op in ("and", "or", "xor"):
            return {"and": b.and_, "or": b.or_, "xor": b.xor}[op](x, y)
        if op == "land":
            return b.and_(x, y)
        if op == "lor":
            return b.or_(x, y)
        if op in ("div", "mod"):
            if not (isinstance(y, L.Constant) and y.constant not in (0, -1)):
                safe = b.or_(b.icmp_signed("==", y, self.splat_like(y, I32, 0)),
                             b.icmp_signed("==", y, self.splat_like(y, I32, -1)))
                # x/-1 and x%-1 computed without the trap on INT_MIN/-1; x/0 is defined as 0 here
                neg = b.select(b.icmp_signed("==", y, self.splat_like(y, I32, -1)), b.sub(self.splat_like(y, I32, 0), x),
                               self.splat_like(y, I32, 0))
                q = b.sdiv(x, b.select(safe, self.splat_like(y, I32, 1), y))
                r = b.srem(x, b.select(safe, self.splat_like(y, I32, 1), y))
                return b.select(safe, neg if op == "div" else self.splat_like(y, I32, 0), q if op == "div" else r)
            return b.sdiv(x, y) if op == "div" else b.srem(x, y)
        if op == "dot4":
            return self.dot4(x, y)
        if op in ("shl", "shr"):
            amt = b.and_(y, self.splat_like(y, I32, 31))
            return b.shl(x, amt) if op == "shl" else b.ashr(x, amt)
        if op in ("min", "max"):
            return b.select(b.icmp_signed("<" if op == "min" else ">", y, x), y, x)
        return b.icmp_signed({"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[op], x, y)

    def dot4(self, x, y, acc=None, top=255):
        """IR dot4 of x and y (plus acc): one vpdpbusd where the CPU has VNNI for the vector's width (the add into
        acc included); where it has not, pmaddubsw and pmaddwd (a Dot4Sum of one dot4: bytes of x above 127 nibble by
        nibble) where the CPU has them; else the bytes widened, multiplied and summed in fours."""
        b = self.b
        n = x.type.count if isinstance(x.type, L.VectorType) else 1
        bt = L.VectorType(I8, 4 * n)
        if self.vnni(n):
            fn = self.declare(f"llvm.x86.avx512.vpdpbusd.{32 * n}", x.type, [x.type, bt, bt])
            return b.call(fn, [L.Constant(x.type, None) if acc is None else acc, b.bitcast(x, bt), b.bitcast(y, bt)])
        if self.pairs_exact(x, 15):
            one = Dot4Sum(self)
            one.add_dot4(x, y, top)
            v = one.value()
        else:
            wt = L.VectorType(I32, 4 * n)
            prod = b.mul(b.zext(b.bitcast(x, bt), wt), b.sext(b.bitcast(y, bt), wt))
            fours = [b.shuffle_vector(prod, prod, L.Constant(L.VectorType(I32, n), list(range(i, 4 * n, 4))))
                     for i in range(4)]
            v = b.add(b.add(fours[0], fours[1]), b.add(fours[2], fours[3]))
            v = v if n > 1 else b.extract_element(v, L.Constant(I32, 0))
        return v if acc is None else b.add(acc, v)

    def vnni(self, n):
        return has_vnni(n, self.isa)

    def _madd(self, n):
        """(pmaddubsw, pmaddwd) for vectors of n i32 where the CPU has them, else None"""
        madd = {16: ("avx512bw", "llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
                8: ("avx2", "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")}.get(n)
        return madd[1:] if madd and madd[0] in self.isa else None

    def pairs_exact(self, x, top):
        """Whether pmaddubsw gives the dot4s of x here: x's bytes at most top < 128 (no i16 pair sum saturates),
        the CPU has it for x's width, and no VNNI does a dot4 in one."""
        n = x.type.count if isinstance(x.type, L.VectorType) else 1
        return top < 128 and self._madd(n) is not None and not self.vnni(n)

    def dot4_pairs(self, x, y, top):
        """pmaddubsw of x's and y's bytes: each lane's two i16 sums of byte pairs, exact where `pairs_exact`; else
        None."""
        if not self.pairs_exact(x, top):
            return None
        n = x.type.count if isinstance(x.type, L.VectorType) else 1
        bt, ht = L.VectorType(I8, 4 * n), L.VectorType(I16, 2 * n)
        return self.b.call(self.declare(self._madd(n)[0], ht, [bt, bt]), [self.b.bitcast(x, bt), self.b.bitcast(y, bt)])

    def nibbles(self, x):
        """(x's bytes' low nibbles, their high ones): x's dot4 with y is the first's plus 16 times the second's,
        each within pmaddubsw's reach (a byte above 127 times -128 twice overflows its i16)."""
        b, mask = self.b, self.splat_like(x, I32, 0x0F0F0F0F)
        return b.and_(x, mask), b.and_(b.lshr(x, self.splat_like(x, I32, 4)), mask)

    def widen_pairs(self, pairs):
        """Each lane's two i16 sums added into one i32 (pmaddwd by ones)."""
        ht = pairs.type
        n = ht.count // 2
        fn = self.declare(self._madd(n)[1], L.VectorType(I32, n), [ht, ht])
        return self.b.call(fn, [pairs, L.Constant(ht, [1] * 2 * n)])

    def unop(self, op, x, dt):
        b = self.b
        if op == "neg":
            return b.fneg(x) if dt == "f32" else b.sub(self.splat_like(x, I32, 0), x)
        if op == "abs":
            if dt == "f32":
                return b.call(self.intrinsic("llvm.fabs", x.type), [x])
            return b.select(b.icmp_signed("<", x, self.splat_like(x, I32, 0)), b.sub(self.splat_like(x, I32, 0), x), x)
        if op == "not":
            return b.not_(x)
        if op in ("f16bits", "bf16bits", "f32bits"):
            ty = _shaped_like(x)
            if op == "f32bits":
                return b.bitcast(x, ty(F32))
            if op == "f16bits":
                return b.fpext(b.bitcast(b.trunc(x, ty(I16)), ty(F16)), ty(F32))
            return b.bitcast(b.shl(b.and_(x, self.splat_like(x, I32, 0xFFFF)), self.splat_like(x, I32, 16)), ty(F32))
        if op == "rsqrt":
            one = self.splat_like(x, F32, 1.0)
            return b.fdiv(one, b.call(self.intrinsic("llvm.sqrt", x.type), [x]))
        return b.call(self.intrinsic(f"llvm.{op}", x.type), [x])

    def cast(self, x, src, dst):
        b, ty = self.b, _shaped_like(x)
        if src == dst:
            return x
        if dst == "f32":
            return b.sitofp(x, ty(F32)) if src == "i32" else b.uitofp(x, ty(F32))
        if dst == "i32":
            if src == "bool":
                return b.zext(x, ty(I32))
            # NaN and values beyond i32 give 0, as on the other backends; a compare and a select, which stay
            # vector instructions (LLVM's fptosi.sat goes lane by lane on x86)
            fits = b.fcmp_ordered("<", b.call(self.intrinsic("llvm.fabs", x.type), [x]),
                                  self.splat_like(x, F32, 2.0 ** 31))
            return b.select(fits, b.fptosi(x, ty(I32)), self.splat_like(x, I32, 0))
        return self.binop("ne", x, self.splat_like(x, COMPUTE[src], 0), src)

    # ------------------------------------------------------------------ reductions
    def combine(self, op, acc, v, dt):
        return self.binop(op, acc, v, dt)

    def reduce(self, e):
        ext = self.expr(e.extent)
        dt = e.value.dtype
        if e.kind == "unroll" and isinstance(ext, L.Constant) and 0 < ext.constant <= UNROLL_MAX:
            acc = None
            for j in range(ext.constant):
                saved = dict(self.env)
                self.env[e.var] = L.Constant(I32, j)
                v = self.expr(e.value)
                self.env = saved
                acc = v if acc is None else self.combine(e.op, acc, v, dt)
            return acc
        inner = _vector_parts(e)
        if inner and all(self.vectorizable_expr(r.value) for r in inner):
            # reduce of (a sum of) vector reduces: vector accumulators across both loops (one horizontal sum per
            # row); consecutive outer iterations use different accumulators so the add latency does not bound them
            U = max(1, UNROLL_ACCS // len(inner))  # more parts already overlap; more copies would spill
            # as many copies as divide the extent (no remainder loop: short rows measured 7% faster)
            U = next(u for u in (U, 2, 1) if ext.constant % u == 0) if isinstance(ext, L.Constant) else 1
            accs = [self.vector_accumulators(e.op, dt) for _ in range(U)]
            into = lambda i, a: self.with_bind({e.var: i}, lambda: [self.vector_reduce_into(r, a) for r in inner])
            self.loop(L.Constant(I32, 0), ext,
                      lambda i: [into(self.b.add(i, L.Constant(I32, u)), a) for u, a in enumerate(accs)], step=U)
            for a in accs[1:]:
                for mine, theirs in zip(accs[0], a):
                    self.b.store(self.combine(e.op, self.b.load(mine), self.b.load(theirs), dt), mine)
            return self.finish_accumulators(e.op, dt, accs[0])
        if e.kind in ("vector", "reduce") and self.vectorizable_expr(e.value):
            # a "reduce" (any order, a tree on GPUs) runs on one CPU thread: SIMD lanes are its tree
            accs = self.vector_accumulators(e.op, dt)
            self.vector_reduce_into(e, accs)
            return self.finish_accumulators(e.op, dt, accs)
        acc = self.alloca(COMPUTE[dt])
        self.b.store(_const(dt, _identity(e.op, dt)), acc)

        def body(i):
            v = self.with_bind({e.var: i}, lambda: self.expr(e.value))
            self.b.store(self.combine(e.op, self.b.load(acc), v, dt), acc)
        self.loop(L.Constant(I32, 0), ext, body)
        return self.b.load(acc)

    def with_bind(self, bind, fn):
        saved = dict(self.env)
        self.env.update(bind)
        try:
            return fn()
        finally:
            self.env = saved

    # ------------------------------------------------------------------ vector code
    def vectorizable_expr(self, e):
        """Whether e (its structure alone) can be computed lane by lane, asked once per node: an expression shares
        its subexpressions, and asking it of every path through them took a third of a prefill gemm's lowering."""
        known = self.vectorizable.get(id(e))
        if known is None:
            ok = _unrolled(e) and self.vectorizable_expr(e.value) if isinstance(e, ir.Reduce) else \
                all(self.vectorizable_expr(c) for c in _children(e))
            known = self.vectorizable[id(e)] = (e, ok)  # (e kept: its id is not reused meanwhile)
        return known[1]

    def vectorizable_body(self, body, guarded=False):
        """Lets (of lane values, or of reduces over a uniform loop whose values are), stores, and ifs of stores."""
        for s in body:
            if isinstance(s, ir.Let) and not guarded and (self.vectorizable_expr(s.value) or self.lane_reduce(s.value)):
                continue
            if isinstance(s, ir.Store) and self.vectorizable_expr(s.index) and self.vectorizable_expr(s.value):
                continue
            if isinstance(s, ir.If) and not guarded and not s.orelse and self.vectorizable_expr(s.cond) \
                    and self.vectorizable_body(s.then, guarded=True):
                continue
            return False
        return True

    def lane_reduce(self, e):
        """A reduce inside a vector loop over a constant extent (every lane runs the same loop): vectorized across
        lanes."""
        return isinstance(e, ir.Reduce) and isinstance(e.extent, ir.Const) and self.vectorizable_expr(e.value)

    def vec_type(self, dt):
        return L.VectorType(COMPUTE[dt], self.W)

    def to_vec(self, v: VVal, dt):
        b, W = self.b, self.W
        if v.kind == "v":
            return v.val
        vt = self.vec_type(dt)
        splat = b.shuffle_vector(b.insert_element(L.Constant(vt, L.Undefined), v.val, L.Constant(I32, 0)),
                                 L.Constant(vt, L.Undefined), L.Constant(L.VectorType(I32, W), [0] * W))
        if v.kind == "u":
            return splat
        return b.add(splat, L.Constant(L.VectorType(I32, W), [v.stride * j for j in range(W)]))

    def vexpr(self, e, venv):
        """Evaluate e with lane-varying names in venv (name -> VVal); a node used twice is evaluated once."""
        if id(e) not in self.memo:
            self.memo[id(e)] = (e, self._vexpr(e, venv))  # e kept alive so that its id is not reused
        return self.memo[id(e)][1]

    def _vexpr(self, e, venv):
        b = self.b
        if isinstance(e, ir.Var) and e.name in venv:
            return venv[e.name]
        if isinstance(e, (ir.Const, ir.Var)):
            return VVal("u", self.expr(e))
        if isinstance(e, ir.Load):
            parts = [self.vexpr(t, venv) for t in _index_terms(e.index)]
            dt = self.k.buffers[e.buf].dtype
            if all(p.kind == "u" for p in parts):
                return VVal("u", self.load(e.buf, [p.val for p in parts]))
            if all(p.kind != "v" for p in parts) and sum(p.stride for p in parts) == 1:
                vt = L.VectorType(STORAGE[dt], self.W)
                ptr = self.element(e.buf, [p.val for p in parts])
                self.prefetch_ahead(e.buf, ptr, e.index, venv, sum(p.stride for p in parts))
                v = b.load(ptr, typ=vt, align=1)
                return VVal("v", self.from_storage(dt, v))
            vt, mt = L.VectorType(STORAGE[dt], self.W), L.VectorType(I1, self.W)
            fn = self.declare(f"llvm.masked.gather.{_mangle(vt)}.v{self.W}p0", vt,
                              [L.VectorType(PTR, self.W), I32, mt, vt])
            ptrs = self.lane_pointers(e.buf, self.vexpr(e.index, venv))
            all_lanes = L.Constant(mt, [1] * self.W)
            v = b.call(fn, [ptrs, L.Constant(I32, 1), all_lanes, L.Constant(vt, None)])
            return VVal("v", self.from_storage(dt, v))
        if isinstance(e, ir.Reduce):
            return self.unrolled_reduce(e, venv)
        if isinstance(e, ir.Bin):
            field = _byte_field(e, self.k)
            if field:
                v = self.field_load(field, venv)
                if v:
                    return v
            if _is_dot4_sum(e):
                return VVal("v", self.dot4_sum(_terms(e), venv))
            if (shift := _byte_shift(e)) is not None:  # nibbles, crumbs: (x >> s) & their mask
                x = self.vexpr(e.a.a, venv)
                if x.kind != "u":
                    return VVal("v", self.shift_bytes(self.to_vec(x, "i32"), shift))
            x, y = self.vexpr(e.a, venv), self.vexpr(e.b, venv)
            if x.kind == "u" and y.kind == "u":
                return VVal("u", self.binop(e.op, x.val, y.val, e.a.dtype))
            if e.op == "dot4":
                return VVal("v", self.dot4(self.to_vec(x, "i32"), self.to_vec(y, "i32"), top=_byte_max(e.a)))
            if e.a.dtype == "i32" and "v" not in (x.kind, y.kind):  # keep affine indices affine
                if e.op in ("add", "sub"):
                    f, sign = (b.add, 1) if e.op == "add" else (b.sub, -1)
                    return VVal("lin", f(x.val, y.val), x.stride + sign * y.stride)
                if e.op == "mul":
                    lin, u = (x, y) if x.kind == "lin" else (y, x)
                    if u.kind == "u" and isinstance(u.val, L.Constant):
                        return VVal("lin", b.mul(lin.val, u.val), lin.stride * u.val.constant)
            return VVal("v", self.binop(e.op, self.to_vec(x, e.a.dtype), self.to_vec(y, e.b.dtype), e.a.dtype))
        if isinstance(e, ir.Un):
            x = self.vexpr(e.a, venv)
            if x.kind == "u":
                return VVal("u", self.unop(e.op, x.val, e.a.dtype))
            return VVal("v", self.unop(e.op, self.to_vec(x, e.a.dtype), e.a.dtype))
        if isinstance(e, ir.Cast):
            table = _table(e.a, self.k) if (e.a.dtype, e.dtype, self.W) == ("i32", "f32", 16) else None
            if table and self.vexpr(table[0], venv).kind != "u":
                return VVal("v", self.lookup16(table[1], self.to_vec(self.vexpr(table[0], venv), "i32")))
            x = self.vexpr(e.a, venv)
            if x.kind == "u":
                return VVal("u", self.cast(x.val, e.a.dtype, e.dtype))
            return VVal("v", self.cast(self.to_vec(x, e.a.dtype), e.a.dtype, e.dtype))
        if isinstance(e, ir.Lut):
            x = self.vexpr(e.a, venv)
            shuffle = self._pshufb(self.W)
            if x.kind == "u" or shuffle is None:
                return self.vexpr(e.expanded(), venv)
            return VVal("v", self.lut16(e, shuffle, self.to_vec(x, "i32")))
        if isinstance(e, ir.Select):
            c, x, y = self.vexpr(e.cond, venv), self.vexpr(e.a, venv), self.vexpr(e.b, venv)
            if c.kind == x.kind == y.kind == "u":
                return VVal("u", b.select(c.val, x.val, y.val))
            return VVal("v", b.select(self.to_vec(c, "bool"), self.to_vec(x, e.dtype), self.to_vec(y, e.dtype)))
        raise NotVectorizable(repr(e))

    def dot4_sum(self, terms, venv):
        """A sum of i32 terms, dot4s among them (see Dot4Sum)."""
        acc = Dot4Sum(self)
        for t in terms:
            acc.add(t, venv)
        return acc.value()

    def unrolled_reduce(self, e, venv):
        """An unrolled reduce in a vector body (a sum of dot4s: see dot4_reduces; others: unrolled_reduces)."""
        if _dot4_reduce(e):
            return self.dot4_reduces([e], [venv], [self.memo])[0][0]
        return self.unrolled_reduces(e, [venv], [self.memo])[0]

    def unrolled_reduces(self, e, venvs, memos):
        """Unrolled reduce e for each vector of lanes (venvs, each with its memo), iteration by iteration, the
        vectors innermost, so that what an iteration loads for all lanes (an input element broadcast) feeds every
        vector at once: each vector's summands spread over UNROLL_ACCS chains of multiply-adds, so that the add
        latency does not bound it, joined at the end. Returns, per venv, the value."""
        dt, chains, n = e.value.dtype, [[] for _ in venvs], 0
        terms = _terms(e.value) if e.op == "add" else [e.value]
        for j, its in self.unrolled_iterations(e.extent.value, memos):
            for t in terms:
                for u, venv in enumerate(venvs):
                    self.memo = its[u]
                    v = self.to_vec(self.vexpr(t, {**venv, e.var: VVal("u", L.Constant(I32, j))}), dt)
                    if len(chains[u]) < UNROLL_ACCS:
                        chains[u].append(v)
                    else:
                        chains[u][n % UNROLL_ACCS] = self.combine(e.op, chains[u][n % UNROLL_ACCS], v, dt)
                n += 1
        out = []
        for c in chains:
            while len(c) > 1:
                c = [self.combine(e.op, a, b, dt) for a, b in zip(c[::2], c[1::2])] + c[len(c) // 2 * 2:]
            out.append(VVal("v", c[0]))
        return out

    def joint_unrolled_reduces(self, e, venvs, memos):
        """The unrolled reduces in e other than sums of dot4s (a block's dot of f32 products, say), each computed
        for every vector of lanes together (unrolled_reduces; memoized for e's evaluation)."""
        for r in _reduces_in(e, lambda r: _unrolled(r) and not _dot4_reduce(r)):
            if id(r) not in memos[0]:
                for m, v in zip(memos, self.unrolled_reduces(r, venvs, memos)):
                    m[id(r)] = (r, v)

    def dot4_reduces(self, reds, venvs, memos):
        """Unrolled sums of dot4s over the same extent, for each vector of lanes (venvs, each with its memo),
        computed together iteration by iteration, the vectors innermost, one chain each (a Dot4Sum: the kind comes
        many to a block, which overlap each other, and joining chains would cost more adds than the dot4s save
        waiting). Returns, per venv, the sums."""
        sums = [[Dot4Sum(self) for _ in reds] for _ in venvs]
        for j, its in self.unrolled_iterations(reds[0].extent.value, memos):
            for i, r in enumerate(reds):
                for u, venv in enumerate(venvs):
                    self.memo = its[u]
                    for t in _terms(r.value):
                        sums[u][i].add(t, {**venv, r.var: VVal("u", L.Constant(I32, j))})
        return [[VVal("v", acc.value()) for acc in row] for row in sums]

    def unrolled_iterations(self, n, memos):
        """Iterations 0 .. n - 1 of unrolled reduces in a vector body, each with a memo per vector of lanes (a copy
        of its memo: the enclosing body's values stay shared, the iteration's are its own); the body's memo is as
        before once they are done."""
        saved = self.memo
        for j in range(n):
            yield j, [dict(m) for m in memos]
        self.memo = saved

    def joint_dot4_reduces(self, e, venvs, memos):
        """The unrolled sums of dot4s in e that read the same words each iteration -- a sub-block's sums, one per
        digit of the input -- computed together for every vector of lanes (memoized for e's evaluation): a word
        loaded and split into nibbles feeds every digit's dot and is dropped, and an input word broadcast feeds
        every vector. One sum, or one vector, after another, the words would stay live across them all, more than
        AVX2's 16 registers hold (spilled)."""
        consts = _uniform_constants(venvs[0])
        groups = {}
        for r in _reduces_in(e, _dot4_reduce):
            if id(r) not in memos[0]:
                words = frozenset(_address_key(ld.index, {**consts, r.var: 0}) for t in _terms(r.value)
                                  for ld in _loads(t.a))
                groups.setdefault((r.var, r.extent.value, words), []).append(r)
        for reds in groups.values():
            for m, row in zip(memos, self.dot4_reduces(reds, venvs, memos)):
                m.update((id(r), (r, v)) for r, v in zip(reds, row))

    def joint_dot4_sums(self, e, venvs, memos):
        """The sums of dot4s written out in e (a sub-block's digit sums, each a sum of a few dot4s), each computed
        for every vector of lanes in turn (memoized for e's evaluation), inner sums first: an input word
        broadcast for one is used by every vector at once. Vector after vector, the whole of e's broadcasts would
        stay live until the last vector, more than AVX2's 16 registers hold (spilled)."""
        for s in _dot4_sums_in(e):
            self.each_vector(venvs, memos, lambda u, venv: self.vexpr(s, venv))

    def each_vector(self, venvs, memos, fn):
        """fn(u, venv) for each vector of lanes of a body in turn, with its memo (memos[u]) keeping what fn
        evaluated for it."""
        for u, venv in enumerate(venvs):
            self.memo = memos[u]
            fn(u, venv)
            memos[u] = self.memo
        self.memo = {}

    def lane_pointers(self, buf, idx):
        """The address of element idx of buf in each lane (for a gather or a scatter)."""
        b, W = self.b, self.W
        size = L.Constant(L.VectorType(I64, W), [ir.STORAGE_DTYPES[self.k.buffers[buf].dtype]] * W)
        base = self.to_vec(VVal("u", b.ptrtoint(self.ptrs[buf], I64)), "i64")
        offset = b.mul(b.sext(self.to_vec(idx, "i32"), L.VectorType(I64, W)), size)
        return b.inttoptr(b.add(base, offset), L.VectorType(PTR, W))

    def lookup16(self, table, v):
        """table[v & 15] for 16 lanes in one instruction (AVX-512 vpermps reads only each index's low 4 bits):
        a float of a function of 4 bits -- a quantized weight's nibble, with its offset -- costs one shuffle
        instead of masks, shifts, adds and a conversion, and runs on the port the multiply-adds leave free."""
        vt = L.VectorType(F32, 16)
        fn = self.declare("llvm.x86.avx512.permvar.sf.512", vt, [vt, v.type])
        return self.b.call(fn, [L.Constant(vt, [float(t) for t in table]), v])

    def _pshufb(self, n):
        """The byte shuffle for vectors of n i32 where the CPU has it, else None."""
        shuffle = {16: ("avx512bw", "llvm.x86.avx512.pshuf.b.512"), 8: ("avx2", "llvm.x86.avx2.pshuf.b"),
                   4: ("ssse3", "llvm.x86.ssse3.pshuf.b.128")}.get(n)
        return shuffle[1] if shuffle and shuffle[0] in self.isa else None

    def lut16(self, e, shuffle, v):
        """IR lut16 e of the lanes v: one pshufb of their bytes by the table (16 bytes, in each 16-byte lane of the
        vector); a byte above e.nbytes gets index 0x80, which pshufb turns into 0."""
        b, n = self.b, v.type.count
        bt = L.VectorType(I8, 4 * n)
        keep = (1 << 8 * e.nbytes) - 1
        index = b.or_(b.and_(v, self.splat_like(v, I32, _signed32(0x0F0F0F0F & keep))),
                      self.splat_like(v, I32, _signed32(0x80808080 & ~keep & 0xFFFFFFFF)))
        table = L.Constant(bt, [t - 256 if t > 127 else t for _ in range(n // 4) for t in e.table])
        out = b.call(self.declare(shuffle, bt, [bt, bt]), [table, b.bitcast(index, bt)])
        return b.bitcast(out, v.type)

    def prefetch_ahead(self, buf, ptr, index, venv, lane_bytes):
        """Prefetch the kernel's distances (PREFETCH_AHEAD) past ptr (element `index` of buf, lanes
        `lane_bytes` apart) when buf is the kernel's streamed weights (`streamed_weights`) of PREFETCH_MIN bytes or
        more, once per cache line in a body, whichever vector of lanes or unrolled iteration loads from it first: a
        quantized dot reads each word for every digit of the input, a line holds the words of several vectors or
        iterations, and prefetches take load slots."""
        w = self.streamed_weights()
        if buf != ir.WEIGHTS or not w or w.size < PREFETCH_MIN:
            return
        done = self.memo.setdefault(PREFETCHED, set())
        first = venv[LANE0].val.constant if LANE0 in venv else 0
        key = (buf, _line_key(index, _uniform_constants(venv), first * lane_bytes))
        if key not in done:
            done.add(key)
            self.b.call(self.declare(PREFETCH_AHEAD, VOID, [PTR]), [ptr])

    def field_load(self, field, venv):
        """A little-endian field of n bytes assembled from a byte buffer by shifts and ors, read by lanes n
        bytes apart: one vector load of n-byte integers (None when the lanes are not n bytes apart)."""
        buf, index, n = field
        parts = [self.vexpr(t, venv) for t in _index_terms(index)]
        if any(p.kind == "v" for p in parts) or sum(p.stride for p in parts) != n:
            return None
        ity = L.IntType(8 * n)
        ptr = self.element(buf, [p.val for p in parts])
        self.prefetch_ahead(buf, ptr, index, venv, n)
        v = self.b.load(ptr, typ=L.VectorType(ity, self.W), align=1)
        return VVal("v", v if n == 4 else self.b.zext(v, L.VectorType(I32, self.W)))

    def split_extent(self, ext):
        """(end of the W-wide part, end) for a loop of `ext` iterations from 0."""
        if isinstance(ext, L.Constant):
            return L.Constant(I32, ext.constant - ext.constant % self.W)
        return self.b.sub(ext, self.b.srem(ext, L.Constant(I32, self.W)))

    def vector_loop(self, s, start, ext):
        main = self.split_extent(ext)
        # a body with lane reduces runs JAM vectors of lanes per iteration, so that each value its loop loads
        # for all lanes (a broadcast weight, say) feeds JAM vectors
        jam = JAM if any(isinstance(st, ir.Let) and self.lane_reduce(st.value) for st in s.body) \
            and isinstance(ext, L.Constant) and ext.constant % (JAM * self.W) == 0 else 1

        memos = []  # per vector of lanes: what its statements have evaluated, shared by the later ones

        def each(venvs, fn):
            self.each_vector(venvs, memos, lambda u, venv: fn(venv))

        def vbody(i):
            venvs = [{s.var: VVal("lin", self.b.add(start, self.b.add(i, L.Constant(I32, u * self.W))), 1),
                      LANE0: VVal("u", L.Constant(I32, u * self.W))} for u in range(jam)]
            memos[:] = _body_memos(len(venvs))
            j = 0
            while j < len(s.body):
                st = s.body[j]
                if isinstance(st, ir.Let) and self.lane_reduce(st.value):
                    run = self.sibling_lane_reduces(s.body, j)
                    for venv, vals in zip(venvs, self.lane_reduces([let.value for let in run], venvs)):
                        venv.update((let.name, v) for let, v in zip(run, vals))
                    j += len(run)
                    continue
                j += 1
                if isinstance(st, ir.Let):
                    each(venvs, lambda venv: venv.__setitem__(st.name, self.vexpr(st.value, venv)))
                elif isinstance(st, ir.If):
                    def guarded(venv, st=st):
                        cond = self.vexpr(st.cond, venv)
                        if cond.kind == "u":  # the same for every lane: a branch around plain stores
                            saved = dict(self.memo)  # (masked stores are microcoded on AMD's cores)
                            self.if_then(cond.val, lambda: [self.vector_store(g, venv) for g in st.then])
                            self.memo = saved  # what the branch evaluated does not dominate what follows
                            for g in st.then:
                                self.forget(g.buf)
                            return
                        mask = self.to_vec(cond, "bool")
                        for g in st.then:
                            self.vector_store(g, venv, mask)
                    each(venvs, guarded)
                else:
                    each(venvs, lambda venv: self.vector_store(st, venv))
        self.loop(L.Constant(I32, 0), main, vbody, step=self.W * jam)
        if not (isinstance(ext, L.Constant) and ext.constant % self.W == 0):
            self.loop(self.b.add(start, main), self.b.add(start, ext), lambda i: self.block(s.body, {s.var: i}))

    def vector_store(self, st, venv, mask=None):
        """A store in a vector body; with a lane mask, only the lanes whose mask bit is set store. What the body
        evaluated from the stored buffer is forgotten after it (values before it are still right for it)."""
        parts, val = [self.vexpr(t, venv) for t in _index_terms(st.index)], self.vexpr(st.value, venv)
        dt = self.k.buffers[st.buf].dtype
        v = self.to_storage(dt, self.to_vec(val, st.value.dtype))
        if all(p.kind != "v" for p in parts) and sum(p.stride for p in parts) == 1:
            ptr = self.element(st.buf, [p.val for p in parts])
            if mask is None:
                self.b.store(v, ptr, align=1)
            else:
                fn = self.declare(f"llvm.masked.store.{_mangle(v.type)}.p0", VOID, [v.type, PTR, I32, mask.type])
                self.b.call(fn, [v, ptr, L.Constant(I32, 1), mask])
        else:  # any other index: one masked scatter (lanes in order, so a later lane's store wins, as in a loop)
            mask = mask if mask is not None else L.Constant(L.VectorType(I1, self.W), [1] * self.W)
            fn = self.declare(f"llvm.masked.scatter.{_mangle(v.type)}.v{self.W}p0", VOID,
                              [v.type, L.VectorType(PTR, self.W), I32, mask.type])
            self.b.call(fn, [v, self.lane_pointers(st.buf, self.vexpr(st.index, venv)), L.Constant(I32, 1), mask])
        self.forget(st.buf)

    def forget(self, buf):
        """Drop the body's evaluated values that read buf: a store to it may change what a later load reads
        (values from other buffers -- a block's scales, say -- stay shared)."""
        if buf in self.loaded:
            known = self.read_sets  # (reads(e) inlined where it is known: a tile matmul's stores made 400,000 calls)
            self.memo = {key: v for key, v in self.memo.items()
                         if key == PREFETCHED or buf not in (known[key][1] if key in known else self.reads(v[0]))}

    def reads(self, e):
        """The buffers expression e loads from (each node's set computed once: a block's hundreds of stores each
        ask about every value the body holds)."""
        if id(e) not in self.read_sets:
            out = {e.buf} if isinstance(e, ir.Load) else set()
            for c in (e.extent, e.value) if isinstance(e, ir.Reduce) else _children(e):
                out |= self.reads(c)
            self.read_sets[id(e)] = (e, frozenset(out))  # e kept alive so that its id is not reused
        return self.read_sets[id(e)][1]

    def sibling_lane_reduces(self, body, i):
        """body[i] (a Let of a lane reduce) and the Lets after it that reduce over the same loop, independently:
        one loop computes them all (rows of a register tile sharing each loaded vector)."""
        first, run, names = body[i].value, [body[i]], {body[i].name}
        for s in body[i + 1:]:
            e = s.value if isinstance(s, ir.Let) else None
            if not (self.lane_reduce(e) and (e.var, e.op, e.extent.value) == (first.var, first.op, first.extent.value)) \
                    or names & _var_names(e.value):
                break
            run.append(s)
            names.add(s.name)
        return run

    def lane_reduces(self, reds, venvs):
        """Reduces over one uniform loop, each lane accumulating its own value: a scalar loop with one vector
        accumulator per reduce and vector of lanes (outer-loop vectorization). Returns, per venv, the values.
        Sums run in blocks of LANE_BLOCK iterations added into totals (a long sum in one chain would lose
        accuracy), but for the "serial" kind, which each lane sums in order, as one thread would alone."""
        first = reds[0]
        dt, ext = first.value.dtype, first.extent.value
        blk = LANE_BLOCK if first.op == "add" and first.kind != "serial" and ext % LANE_BLOCK == 0 else ext
        accs = [[self.vector_accumulators(first.op, dt)[0] for _ in reds] for _ in venvs]
        totals = [[self.vector_accumulators(first.op, dt)[0] for _ in reds] for _ in venvs]

        def body(c):
            # reduce by reduce, each one's vectors of lanes together: a value shared by the vectors (a broadcast
            # weight) is used up before the next one is loaded, so only the accumulators stay live
            self.env[first.var] = c
            memos = _body_memos(len(venvs))
            for i, e in enumerate(reds):
                for t in _terms(e.value) if e.op == "add" else [e.value]:
                    self.joint_dot4_reduces(t, venvs, memos)
                    self.joint_dot4_sums(t, venvs, memos)
                    self.joint_unrolled_reduces(t, venvs, memos)

                    def accumulate(u, venv):  # called at once: t, e and i are this iteration's
                        acc, v = accs[u][i], self.to_vec(self.vexpr(t, venv), dt)
                        self.b.store(self.combine(e.op, self.b.load(acc), v, dt), acc)
                    self.each_vector(venvs, memos, accumulate)
            del self.env[first.var]

        def block(c0):
            ident = L.Constant(self.vec_type(dt), [_identity(first.op, dt)] * self.W)
            for row in accs:
                for acc in row:
                    self.b.store(ident, acc)
            self.loop(c0, self.b.add(c0, L.Constant(I32, blk)), body)
            for row, tot in zip(accs, totals):
                for acc, t in zip(row, tot):
                    self.b.store(self.combine(first.op, self.b.load(t), self.b.load(acc), dt), t)
        self.loop(L.Constant(I32, 0), L.Constant(I32, ext), block, step=blk)
        return [[VVal("v", self.b.load(t)) for t in row] for row in totals]

    def vector_accumulators(self, op, dt):
        vacc, sacc = self.alloca(self.vec_type(dt)), self.alloca(COMPUTE[dt])
        ident = _identity(op, dt)
        self.b.store(L.Constant(self.vec_type(dt), [ident] * self.W), vacc)
        self.b.store(_const(dt, ident), sacc)
        return vacc, sacc

    def vector_reduce_into(self, e, accs):
        vacc, sacc = accs
        dt = e.value.dtype
        ext = self.expr(e.extent)
        W = self.W

        def chunk(acc, i):
            # each term of a sum goes into the accumulator on its own (a multiply-add each)
            self.memo = {}
            venv = {e.var: VVal("lin", i, 1)}
            for t in _terms(e.value) if e.op == "add" else [e.value]:
                v = self.to_vec(self.vexpr(t, venv), dt)
                self.b.store(self.combine(e.op, self.b.load(acc), v, dt), acc)
            self.memo = {}
        done = L.Constant(I32, 0)
        if isinstance(ext, L.Constant) and ext.constant >= UNROLL_ACCS * W:
            # long reductions: several accumulators, so that the add latency does not bound the loop
            extra = [self.vector_accumulators(e.op, dt)[0] for _ in range(UNROLL_ACCS - 1)]
            accs4 = [vacc] + extra
            done = L.Constant(I32, ext.constant - ext.constant % (UNROLL_ACCS * W))
            self.loop(L.Constant(I32, 0), done,
                      lambda i: [chunk(a, self.b.add(i, L.Constant(I32, u * W))) for u, a in enumerate(accs4)],
                      step=UNROLL_ACCS * W)
            for a in extra:
                self.b.store(self.combine(e.op, self.b.load(vacc), self.b.load(a), dt), vacc)
        main = self.split_extent(ext)
        self.loop(done, main, lambda i: chunk(vacc, i), step=W)
        self.scalar_tail(e, sacc, main, ext)

    def scalar_tail(self, e, sacc, start, ext):
        """The iterations [start, ext) of reduce e that do not fill a vector, into the scalar accumulator."""
        if isinstance(ext, L.Constant) and ext.constant % self.W == 0:
            return
        dt = e.value.dtype

        def body(i):
            v = self.with_bind({e.var: i}, lambda: self.expr(e.value))
            self.b.store(self.combine(e.op, self.b.load(sacc), v, dt), sacc)
        self.loop(start, ext, body)

    def finish_accumulators(self, op, dt, accs):
        b = self.b
        v = b.load(accs[0])
        n = self.W
        while n > 1:  # pairwise tree: deterministic order
            n //= 2
            lo = b.shuffle_vector(v, v, L.Constant(L.VectorType(I32, n), list(range(n))))
            hi = b.shuffle_vector(v, v, L.Constant(L.VectorType(I32, n), list(range(n, 2 * n))))
            v = self.combine(op, lo, hi, dt)
        return self.combine(op, b.extract_element(v, L.Constant(I32, 0)), b.load(accs[1]), dt)


def _vector_parts(e):
    """The vector Reduces whose sum (or single one) is the value of Reduce e, when they share its op."""
    parts, todo = [], [e.value]
    while todo:
        v = todo.pop()
        if isinstance(v, ir.Bin) and v.op == "add" and e.op == "add":
            todo += [v.a, v.b]
        elif isinstance(v, ir.Reduce) and v.kind == "vector" and v.op == e.op:
            parts.append(v)
        else:
            return None
    return parts


def _mangle(t):
    """A type's part of an intrinsic's name (llvmlite mangles scalar types only)."""
    return f"v{t.count}{t.element.intrinsic_name}" if isinstance(t, L.VectorType) else t.intrinsic_name


def _byte_shift(e):
    """s where i32 e is (x >> s) & each byte's low 8 - s bits, s in 1..7: x's bytes shifted right; else None"""
    if e.op == "and" and isinstance(e.b, ir.Const) and isinstance(e.a, ir.Bin) and e.a.op == "shr" \
            and isinstance(e.a.b, ir.Const) and 0 < e.a.b.value < 8 and e.b.value == (0xFF >> e.a.b.value) * 0x01010101:
        return e.a.b.value
    return None


def _range(e, k):
    """(lo, hi) bounds of an i32 expression, where simple structure shows them; else None."""
    if isinstance(e, ir.Const) and e.dtype == "i32":
        return e.value, e.value
    if isinstance(e, ir.Load):
        return {"u8": (0, 255), "i8": (-128, 127)}.get(k.buffers[e.buf].dtype)
    if isinstance(e, ir.Bin) and isinstance(e.b, ir.Const) and e.b.value >= 0:
        if e.op == "and":
            return 0, e.b.value
        a = _range(e.a, k)
        if e.op == "shr" and a and a[0] >= 0:
            return a[0] >> e.b.value, a[1] >> e.b.value
    if isinstance(e, ir.Lut) and e.nbytes == 1:
        return min(e.table), max(e.table)
    return None


_CONST_OPS = {"add": lambda v, c: v + c, "sub": lambda v, c: v - c, "mul": lambda v, c: v * c,
              "shl": lambda v, c: v << c, "and": lambda v, c: v & c, "or": lambda v, c: v | c, "xor": lambda v, c: v ^ c}


def _table(e, k):
    """(x, [e for x & 15 = 0..15]) when i32 e is a function of x's low 4 bits alone -- constant operations
    on x & m (m < 16), or on a value known to lie in [0, 15] -- else None."""
    if isinstance(e, ir.Bin) and e.op == "and" and isinstance(e.b, ir.Const) and 0 <= e.b.value <= 15:
        return e.a, [i & e.b.value for i in range(16)]
    if isinstance(e, ir.Lut) and e.nbytes == 1:  # the table of the code's low 4 bits, or of a function of them
        inner = _table(e.a, k)
        return (inner[0], [e.table[v & 15] for v in inner[1]]) if inner else (e.a, list(e.table))
    r = _range(e, k)
    if r and 0 <= r[0] and r[1] <= 15:
        return e, list(range(16))
    if isinstance(e, ir.Bin) and e.op in _CONST_OPS and isinstance(e.b, ir.Const):
        inner = _table(e.a, k)
        if inner:
            return inner[0], [_CONST_OPS[e.op](v, e.b.value) for v in inner[1]]
    return None


def _loaded_buffers(body):
    """Names of the buffers that some expression of the statements reads."""
    out, seen = set(), set()

    def ex(e):
        if id(e) in seen:  # (a shared subexpression: its loads are counted; the body holds every node meanwhile)
            return
        seen.add(id(e))
        if isinstance(e, ir.Load):
            out.add(e.buf)
        if isinstance(e, ir.Reduce):
            ex(e.extent), ex(e.value)
        for c in _children(e):
            ex(c)

    def st(s):
        for name in ("index", "value", "init", "cond", "start", "extent"):
            if isinstance(getattr(s, name, None), ir.Expr):
                ex(getattr(s, name))
        for name in ("body", "then", "orelse"):
            for t in getattr(s, name, None) or []:
                st(t)
    for s in body:
        st(s)
    return out


def _index_terms(e):
    """The summands of an i32 index."""
    if isinstance(e, ir.Bin) and e.op == "add" and e.dtype == "i32":
        return _index_terms(e.a) + _index_terms(e.b)
    return [e]


def _unrolled(e):
    return e.kind == "unroll" and isinstance(e.extent, ir.Const) and 0 < e.extent.value <= UNROLL_MAX


def _byte_field(e, k):
    """(buffer, index of the first byte, n) when e assembles n = 2 or 4 consecutive bytes of a byte buffer
    little-endian (loads or-ed together, byte i shifted left by 8 i), else None."""
    parts = []

    def walk(x, shift):
        if isinstance(x, ir.Bin) and x.op == "or":
            return walk(x.a, shift) and walk(x.b, shift)
        if isinstance(x, ir.Bin) and x.op == "shl" and isinstance(x.b, ir.Const):
            return walk(x.a, shift + x.b.value)
        if isinstance(x, ir.Load) and k.buffers[x.buf].dtype == "u8":
            parts.append((shift, x))
            return True
        return False
    if not walk(e, 0) or len(parts) not in (2, 4):
        return None
    parts.sort(key=lambda p: p[0])
    first = parts[0][1]
    for i, (shift, load) in enumerate(parts):
        if shift != 8 * i or load.buf != first.buf or _offset(load.index, first.index) != i:
            return None
    return first.buf, first.index, len(parts)


def _offset(idx, base):
    """c when idx is base + c (a chain of constant additions), else None."""
    if _same(idx, base):
        return 0
    if isinstance(idx, ir.Bin) and idx.op == "add" and isinstance(idx.b, ir.Const):
        inner = _offset(idx.a, base)
        return None if inner is None else inner + idx.b.value
    return None


def _same(a, b):
    """Whether two expressions are the same tree (nodes are compared by identity otherwise)."""
    if a is b:
        return True
    if type(a) is not type(b) or a.dtype != b.dtype:
        return False
    if isinstance(a, ir.Const):
        return a.value == b.value
    if isinstance(a, ir.Var):
        return a.name == b.name
    if isinstance(a, (ir.Bin, ir.Un)) and a.op != b.op or isinstance(a, ir.Load) and a.buf != b.buf:
        return False
    if isinstance(a, ir.Lut) and (a.table, a.nbytes) != (b.table, b.nbytes):
        return False
    ca, cb = _children(a), _children(b)
    return bool(ca) and len(ca) == len(cb) and all(_same(x, y) for x, y in zip(ca, cb))


def _var_names(e):
    if isinstance(e, ir.Var):
        return {e.name}
    if isinstance(e, ir.Reduce):
        return _var_names(e.extent) | _var_names(e.value)
    return set().union(*(_var_names(c) for c in _children(e)))


def _terms(e):
    """The summands of a sum tree (f32, or i32: dot4s then add into their accumulators)."""
    if isinstance(e, ir.Bin) and e.op == "add" and e.dtype in ("f32", "i32"):
        return _terms(e.a) + _terms(e.b)
    return [e]


def _bits(e):
    """The bits an i32 expression can have set (all of them where its structure does not show fewer)."""
    if isinstance(e, ir.Const) and e.dtype == "i32":
        return e.value & 0xFFFFFFFF
    if isinstance(e, ir.Bin) and e.op in ("and", "or"):
        a, b = _bits(e.a), _bits(e.b)
        return a & b if e.op == "and" else a | b
    if isinstance(e, ir.Bin) and e.op in ("shl", "shr") and isinstance(e.b, ir.Const):
        a, c = _bits(e.a), e.b.value & 31
        if e.op == "shl":
            return (a << c) & 0xFFFFFFFF
        sign = (0xFFFFFFFF << (32 - c)) & 0xFFFFFFFF if a & 0x80000000 else 0  # copies of the sign bit
        return a >> c | sign
    if isinstance(e, ir.Lut):
        top = functools.reduce(operator.or_, e.table)
        return sum(top << 8 * j for j in range(e.nbytes))
    return 0xFFFFFFFF


def _is_dot4(e):
    return isinstance(e, ir.Bin) and e.op == "dot4"


def vector_registers(width):
    """x86's vector registers at a vector width of `width` f32: AVX-512's 32, AVX2's 16."""
    return 32 if width == 16 else 16


def _dot4_reduce(e):
    return isinstance(e, ir.Reduce) and e.op == "add" and _unrolled(e) and all(_is_dot4(t) for t in _terms(e.value))


def _reduces_in(e, pick, seen=None):
    """The reduces in e (not inside another reduce) that pick accepts, in order."""
    seen = set() if seen is None else seen
    if id(e) in seen:
        return []
    seen.add(id(e))
    if isinstance(e, ir.Reduce):
        return [e] if pick(e) else []
    return [r for c in _children(e) for r in _reduces_in(c, pick, seen)]


def _is_dot4_sum(e):
    """An i32 sum that lowers as one Dot4Sum (KernelLowering._vexpr): dot4s among its summands."""
    return isinstance(e, ir.Bin) and e.op == "add" and e.dtype == "i32" and any(_is_dot4(t) for t in _terms(e))


def _dot4_sums_in(e, seen=None):
    """The sums of dot4s in e (outside reduces) as the lowering evaluates them, a sum after the sums in its
    summands."""
    seen = set() if seen is None else seen
    if id(e) in seen or isinstance(e, ir.Reduce):
        return []
    seen.add(id(e))
    if _is_dot4_sum(e):
        return [s for t in _terms(e) for c in _children(t) for s in _dot4_sums_in(c, seen)] + [e]
    return [s for c in _children(e) for s in _dot4_sums_in(c, seen)]


def _loads(e):
    """The loads in e."""
    return ([e] if isinstance(e, ir.Load) else []) + [ld for c in _children(e) for ld in _loads(c)]


def _byte_max(e):
    """The largest value any byte of i32 e can have (from the bits it can have set)."""
    bits = _bits(e)
    return max((bits >> 8 * i) & 255 for i in range(4))


def _uniform_constants(venv):
    """The names a vector body's environment binds to one constant for every lane (an unrolled iteration's index)."""
    return {n: v.val.constant for n, v in venv.items() if v.kind == "u" and isinstance(v.val, L.Constant)}


def _address_key(e, consts):
    """A structural key of an i32 index expression, names in `consts` replaced by their values and constant
    subexpressions folded: equal for two evaluations of the same address."""
    if isinstance(e, ir.Var) and e.name in consts:
        return consts[e.name]
    if isinstance(e, ir.Const):
        return e.value
    if isinstance(e, ir.Bin):
        a, b = _address_key(e.a, consts), _address_key(e.b, consts)
        if isinstance(a, int) and isinstance(b, int) and e.op in _CONST_OPS:
            return _CONST_OPS[e.op](a, b)
        return e.op, a, b
    return e.name if isinstance(e, ir.Var) else id(e)


def _body_memos(n):
    """Fresh memos for the n vectors of lanes of a body: their own values, one set of prefetched lines."""
    prefetched = set()
    return [{PREFETCHED: prefetched} for _ in range(n)]


def _line_key(index, consts, offset):
    """The cache line of a byte index plus `offset`, as a key: its terms that vary (structural keys, as
    `_address_key`'s) and the 64-byte line of its constant part, on the assumption that what varies moves by
    whole lines (a block of an interleaved layout is a multiple of 64 bytes; where not, a prefetch per 64
    bytes of the constant part still streams every line, one early or late)."""
    varying, const = [], offset
    for t in _index_terms(index):
        key = _address_key(t, consts)
        if isinstance(key, int):
            const += key
        else:
            varying.append(repr(key))
    return tuple(sorted(varying)), const // LINE


def _shaped_like(v):
    """Element type -> that type, or a vector of it as wide as v."""
    return (lambda t: L.VectorType(t, v.type.count)) if isinstance(v.type, L.VectorType) else (lambda t: t)


def _children(e):
    if isinstance(e, ir.Load):
        return (e.index,)
    if isinstance(e, ir.Bin):
        return (e.a, e.b)
    if isinstance(e, (ir.Un, ir.Cast, ir.Lut)):
        return (e.a,)
    if isinstance(e, ir.Select):
        return (e.cond, e.a, e.b)
    return ()


def _signed32(v):
    """A 32-bit pattern as the i32 constant that holds it."""
    return v - (1 << 32) if v >= 1 << 31 else v


def claim_counters(kernel) -> int:
    """Claim counters a launch of kernel uses: one per top-level parallel loop."""
    return sum(isinstance(s, ir.Loop) and s.kind == "parallel" for s in kernel.body)


AMX_WORDS = 16  # 4-byte words of a row that one AMX tile multiply takes (a tile row is 64 bytes)


def _tile_dots(body):
    """The TileDots in a list of statements, nested ones too."""
    for s in body:
        if isinstance(s, ir.TileDot):
            yield s
        elif isinstance(s, ir.Loop):
            yield from _tile_dots(s.body)
        elif isinstance(s, ir.If):
            yield from _tile_dots(s.then + s.orelse)


def amx_shape(s):
    """(input rows, input tiles, weights tiles, outputs) of TileDot s: what its tile configuration says."""
    return s.m, len(s.a0s), len(s.b0s), len(s.outs)


def amx_fits(s, isa):
    """Whether TileDot s runs on AMX on a CPU of instructions isa: its weights 16 columns, a tile's; up to 16 input
    rows; whole tile rows; its input tiles, weights tiles and accumulators in AMX's 8 tile registers."""
    return {"amx-tile", "amx-int8"} <= isa and s.n == 16 and s.m <= 16 and s.words % AMX_WORDS == 0 \
        and len(s.a0s) + len(s.b0s) + len(s.outs) <= 8


def has_vnni(n, isa):
    """Whether a CPU of instructions isa has VNNI's byte dot for vectors of n i32."""
    return n == 16 and "avx512vnni" in isa or n == 8 and ("avxvnni" in isa or {"avx512vnni", "avx512vl"} <= isa)


# a kernel's entry (kernel_module), as jl_run calls it: bufs, scalars, slots, tid, nth, barrier, counters
ENTRY = L.FunctionType(VOID, [PTR, PTR, PTR, I32, I32, PTR, PTR])


def support_ir(options=None) -> str:
    """What a kernel's module is linked with as it is compiled: SUPPORT_IR, and PREFETCH_AHEAD for its tuned
    options' prefetch distances (CpuDevice.tune; PREFETCH where none are tuned), one prefetch of each."""
    prefetches = (options or {}).get("prefetch", PREFETCH)
    body = "".join(f"  %a{i} = getelementptr i8, ptr %p, i32 {distance}\n"
                   f"  call void @llvm.prefetch.p0(ptr %a{i}, i32 0, i32 {locality}, i32 1)\n"
                   for i, (distance, locality) in enumerate(prefetches))
    return (f"{SUPPORT_IR}declare void @llvm.prefetch.p0(ptr, i32, i32, i32)\n"
            f"define linkonce_odr void @{PREFETCH_AHEAD}(ptr %p) alwaysinline {{\n{body}  ret void\n}}\n")


def kernel_type(kernel) -> L.FunctionType:
    """A kernel's function: its buffers, its scalars, then tid, nth, the barrier and its claim counters."""
    return L.FunctionType(VOID, [PTR] * len(kernel.buffers) + [I32] * len(kernel.scalars) + [I32, I32, PTR, PTR])


def runner_module(triple) -> str:
    """The programs' runner, `jl_run` (RUNNER_IR), for this target: compiled once, whatever the programs."""
    return f'target triple = "{triple}"\n{RUNNER_IR}'


def kernel_module(kernel, name, width, triple, isa=frozenset()) -> L.Module:
    """Kernel `kernel` alone for `width` lanes and instructions `isa`, called by its entry `name` (ENTRY: a program's
    buffers and scalars, the launch's slots of them, tid, nth, the barrier and the launch's claim counters). Its
    tuned options are its support's (`support_ir`), linked in as it is compiled."""
    m = L.Module(name=name)
    m.triple = triple
    L.Function(m, L.FunctionType(VOID, [PTR, I32]), name="jl_barrier")  # SUPPORT_IR's
    fn = KernelLowering(m, kernel, width, isa, f"{name}_kernel").lower()
    entry = L.Function(m, ENTRY, name=name)
    bufs, scal, slots, tid, nth, bar, counters = entry.args
    b = L.IRBuilder(entry.append_basic_block("entry"))
    slot = lambda i: b.load(b.gep(slots, [L.Constant(I32, i)], source_etype=I32), typ=I32)
    nb = len(kernel.buffers)
    args = [b.load(b.gep(bufs, [slot(i)], source_etype=PTR), typ=PTR) for i in range(nb)]
    args += [b.load(b.gep(scal, [slot(nb + i)], source_etype=I32), typ=I32) for i in range(len(kernel.scalars))]
    b.call(fn, args + [tid, nth, bar, counters])
    b.ret_void()
    return m
