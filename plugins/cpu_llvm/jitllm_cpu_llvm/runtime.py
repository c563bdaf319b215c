"""CPU devices: memory arenas, JIT compilation (cached on disk) and threads that run whole-step programs.

A program is a table of its launches that one native function, `jl_run(table, bufs, scalars, tid, nth, barrier,
counters)`, walks: every thread of the device calls it with its own tid, each launch's kernel entry in turn, a
native barrier between launches where one depends on another, and the program's counters are where its parallel
loops claim work. The calling thread is thread 0, so one step costs one ctypes call plus one wake-up of the workers.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import mmap
import os
import platform
import sys
import threading
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numpy as np

from jitllm_core import background
from jitllm_core.cache import cache_dir, digest, write_atomic
from jitllm_core.errors import BackendError
from jitllm_core.plugin import BackendUnavailable, Buffer, Caps, Device, Program

from . import compiler, emulation, lower
from .compiler import host, machine_scheduler, optimize, target_machine  # noqa: F401 (the device's LLVM)

RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                       ctypes.c_void_p, ctypes.c_void_p)  # lower.RUNNER_IR's jl_run
LOWERING = digest(*(Path(m.__file__).read_bytes() for m in (lower, compiler)), Path(__file__).read_bytes())
# (code is as new as its compiler)


def on_llvm_thread(generate, schedule=True):
    """generate() (code generation of one module) run on LLVM's thread, with its machine scheduler or without."""
    def run():
        machine_scheduler(schedule)
        return generate()
    return _LLVM.submit(run).result()


def machine_scheduled(device, k) -> bool:
    """Whether kernel k's module is compiled with LLVM's machine scheduler: not where it was tuned for streaming (a
    decode step's matvec; a prefill gemm is tagged and never tuned). There the scheduler's order spills: on a CPU
    without VNNI it interleaves the byte products' i16 sums (a Zen 3's decode matvecs 10 % slower in the step with
    it; its prefill gemm at half the pace without it), on an AMX Xeon a whole block's values (R4K's loop stored 11
    vectors to the stack, R6's 30; without it none, the 1B shape's decode +3.9 % on one thread, +2.8 % on two)."""
    return k.tune_tag not in device.tuned


def simd_width(feats=None):
    """f32 lanes per vector register of this CPU (or of a CPU with features feats: {name: True})."""
    feats = host()[3] if feats is None else feats
    return 16 if feats.get("avx512f") else 8 if feats.get("avx2") else 4


# what the lowering picks instructions by: IR dot4's byte dots, lut16's byte shuffles, TileDot's tile multiplies
ISA = ("avx512vnni", "avxvnni", "avx512vl", "avx512bw", "avx2", "ssse3", "amx-tile", "amx-int8")
AMX = {"amx-tile", "amx-int8"}


@functools.cache
def largest_cache(caches=Path("/sys/devices/system/cpu/cpu0/cache")):
    """Bytes of this CPU's largest cache, as Linux says in `caches` (0 where it does not): read once a process."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for f in caches.glob("index*/size"):
        text = f.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=0)


def isa(feats=None):
    """The x86 features of this CPU (or of feats) that the lowering chooses instructions by (VNNI's byte dots and
    the like); this CPU's AMX only where Linux lets the process use its tiles (`amx_permitted`)."""
    own = feats is None
    feats = host()[3] if own else feats
    have = frozenset(f for f in ISA if feats.get(f))
    return have if not own or not AMX <= have or amx_permitted() else have - AMX


@functools.cache
def amx_permitted() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), which a process must have
    before its first tile instruction; the answer holds for the process's threads."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA


def compile_failed(device_name, e):
    """llvmlite reports parse, verify and codegen failures as RuntimeError: as the backend's error."""
    return BackendError(f"{device_name}: LLVM compile failed: {e}")


# LLVM works in the caller's process on one thread of its own (llvmlite holds one lock around each of its calls):
# it loads compiled code there; compile processes (compiler.Compilers) make the code, as many modules at once as
# there are cores, up to 4 (a cold start compiles a tuning's variants, then the kernels of prefill and decode)
_LLVM = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jitllm-llvm")
_COMPILERS = compiler.Compilers(max(1, min(4, os.cpu_count() or 1)), write_atomic)
# and for background work's modules (jitllm_core.background: the programs drafts run in), processes of its own: started
# by that work's thread, they share its low priority, where a reply's compiles must not wait behind them
_BACKGROUND_COMPILERS = compiler.Compilers(1, write_atomic)
# every Compiled by its key, made once a process and kept for its life whatever becomes of its device: compiled code is
# never unloaded (Workers), and a device let go of (tests make some for other CPUs) took the process down as its
# engines and their LLVM contexts were collected
_COMPILED = {}
_COMPILED_LOCK = threading.Lock()
# the last kernel module's text lowered, by its entry's name: a tuning makes one kernel with each variant of its
# options in turn, a text for all (they are its support's: lower.support_ir)
_LAST_TEXT = (None, None)


class Compiled:
    """A JIT-compiled module -- a kernel's, or the programs' runner -- its object code cached on disk under `key` (what
    the module is made of: the kernel, this lowering's source, the CPU), so that a warm start neither
    lowers nor compiles. Not cached: lowered to LLVM IR text on the caller's thread, compiled by a compile process
    into the cache, and loaded from there as a warm start loads it; `wait` waits for it. symbol: the function it
    is called by; support: the IR it is linked with (lower.support_ir)."""

    def __init__(self, key: str, text_fn, device_name, schedule, symbol, support):
        self.path, self.device_name, self.schedule = cache_dir("cpu") / f"{key}.o", device_name, schedule
        self.symbol, self.support = symbol, support
        self._lock, self._text_fn = threading.Lock(), text_fn
        self._address = self._compiling = None
        if self.path.exists():
            self._address = self._load()  # (None: unreadable, compiled anew)
        if not self._address and not self.path.exists():
            self._submit()

    def wait(self) -> int:
        """The address of the compiled function, once LLVM is done (its error raised as a BackendError)."""
        with self._lock:
            if not self._address:
                self._join()
                self._address = self._load()
                if not self._address:  # a cached object that would not load: compiled anew
                    self._submit()
                    self._join()
                    self._address = self._load()
                if not self._address:
                    raise compile_failed(self.device_name, f"{self.path.name} holds no function {self.symbol}")
                self._text_fn = None
        return self._address

    def _submit(self):
        pool = _BACKGROUND_COMPILERS if background.in_background() else _COMPILERS
        self._compiling = pool.submit(self._text_fn(), self.support, self.schedule, self.path)

    def _join(self):
        if self._compiling is not None:
            try:
                self._compiling.result()
            except (RuntimeError, compiler.Crashed) as e:
                raise compile_failed(self.device_name, e) from None

    def _load(self):
        """The function's address in the object code in the cache, loaded on LLVM's thread (None: none to be had)."""
        try:
            obj = self.path.read_bytes()
        except OSError:
            return None
        return _LLVM.submit(self._engine, obj).result()

    def _engine(self, obj):
        self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), target_machine())
        self.engine.set_object_cache(getbuffer_func=lambda _mod: obj)
        self.engine.finalize_object()
        return self.engine.get_function_address(self.symbol) or None


# How long a thread at a barrier spins before it sleeps (lower.SUPPORT_IR), in timestamp ticks: while no other task
# wants the CPUs, up to a millisecond or so, so that a step's waits (a few us; the workers' wake-up, tens) end
# spinning as they always did (sleeping after 1-2 us cost SmolLM2's two-thread decode 10-20 %); where more tasks want
# to run than there are CPUs, 1-2 us, after which a waiting thread lends its CPU and is woken ahead of the others when
# the barrier opens. SmolLM2's two-thread decode beside a busy process on one of two cores: 43-50 tok/s spinning,
# 70-71 so; beside one on each core: 4-14 (spinning, then yielding), 42-46 so (alternated, the processes pinned).
SPIN_TICKS, SPIN_TICKS_SHARED = 1_000_000, 4_000


@functools.cache
def _loadavg():
    """A descriptor of Linux's /proc/loadavg (its 4th field counts the runnable tasks), one for the process; None
    where there is none."""
    try:
        return os.open("/proc/loadavg", os.O_RDONLY)
    except OSError:
        return None


class Workers:
    """nth-1 persistent threads that each call the step function with their own tid.

    Workers may still be returning from the step's final barrier after thread 0 has moved on, so the barrier
    word belongs to the Workers (not to a program) and compiled code is never unloaded (see _COMPILED).
    """

    def __init__(self, nth: int):
        self.nth, self.job, self.lock = nth, None, threading.Lock()
        # arrival count at [0]; generation, sleepers and spin budget at [16:19]: another cache line
        self.bar = (ctypes.c_int32 * 32)()
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.go = [threading.Semaphore(0) for _ in range(nth - 1)]
        for t in range(1, nth):
            threading.Thread(target=self._loop, args=(t,), daemon=True, name=f"jitllm-cpu-{t}").start()

    def _loop(self, tid):
        while True:
            self.go[tid - 1].acquire()
            fn, table, bufs, scal, counters = self.job
            fn(table, bufs, scal, tid, self.nth, ctypes.addressof(self.bar), counters)

    def shared(self) -> bool:
        """Whether other tasks want the CPUs now: the runnable tasks but this thread (the workers sleep between
        steps), with this step's threads, outnumber them."""
        if _loadavg() is None or self.nth == 1:
            return False
        running = os.pread(_loadavg(), 128, 0).split()[3].split(b"/")[0]
        return int(running) - 1 + self.nth > self.cpus

    def run(self, fn, table, bufs, scal, counters):
        with self.lock:
            self.bar[18] = SPIN_TICKS_SHARED if self.shared() else SPIN_TICKS
            self.job = (fn, table, bufs, scal, counters)
            for s in self.go:
                s.release()
            fn(table, bufs, scal, 0, self.nth, ctypes.addressof(self.bar), counters)  # returns after the final barrier


HUGE_PAGE = 2 << 20
# a buffer of a huge page or more is its own private mapping, its pages asked to be huge from a huge page's boundary
# on (the rest of the last stays small pages: rounding it up would cost up to 2 MB a tensor). Weights on 4 KB pages
# can cost a decode a TLB miss per page read. NumPy's arrays are advised too, but from wherever they start: each
# tensor's first and last partial 2 MB stayed small, and what the weights got varied with the load's pattern
# (repacked straight into the buffer: 356 MB of the 1B shape's; copied in: 664). From a boundary, 660 MB either
# way, and the 1B shape's decode (bench --no-llama-cpp, 2 pairs alternated): 19.6 -> 20.4 tok/s on one thread,
# 36.3-37.0 -> 37.9 on two


class CpuBuffer(Buffer):
    def __init__(self, device, nbytes):
        super().__init__(device, nbytes)
        self.map = None
        if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux's
            self.map = mmap.mmap(-1, nbytes + HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed
            raw = np.frombuffer(self.map, np.uint8)
            off = (-raw.ctypes.data) % HUGE_PAGE
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE, off, nbytes + HUGE_PAGE - off)
            except OSError:  # a kernel without transparent huge pages: small pages, as NumPy's would be
                pass
        else:
            raw = np.zeros(nbytes + 128, np.uint8)
            off = (-raw.ctypes.data) % 64
        self.arr = raw[off:off + nbytes]
        self.addr = raw.ctypes.data + off

    def host_view(self):
        return self.arr


class CpuProgram(Program):
    """timed: a barrier after every launch, and thread 0 notes the time after each (run returns the launches'
    seconds), so that a profile sees each launch as it runs in the step, weights coming from memory. Making one
    compiles no code of its own: its table (lower.RUNNER_IR) names the entries of its kernels' code."""

    def __init__(self, device, launches, timed=False):
        self.device = device
        bslot, sslot, slots, starts = {}, {}, [], []  # slots: every launch's, one after another
        for ln in launches:
            starts.append(len(slots))
            bufs = [ln.buffer(p, device) for p in ln.kernel.buffers]
            slots += [bslot.setdefault(id(b), (len(bslot), b))[0] for b in bufs]
            slots += [sslot.setdefault(ln.scalar_name(s), len(sslot)) for s in ln.kernel.scalars]
        self.slots = (ctypes.c_int32 * max(1, len(slots)))(*slots)
        barriers = set(barriers_needed(launches)) | {len(launches) - 1}
        self.stamps = CpuBuffer(device, 8 * (len(launches) + 1)) if timed else None
        self.code = []
        for ln in launches:
            background.pause()  # a kernel's code is lowered on this thread: background work's waits for replies
            self.code.append(device.kernel_code(ln.kernel))
        self.kernel_code = {ln.kernel.key(): code for ln, code in zip(launches, self.code)}
        self.runner = device.compile(_runner_key(), lambda: lower.runner_module(host()[0]), "jl_run")
        claims = [lower.claim_counters(ln.kernel) * lower.CLAIM_STRIDE for ln in launches]
        self.table = (ctypes.c_int64 * (3 + 4 * len(launches)))(
            len(launches), self.stamps.addr if timed else 0, 4 * max(1, sum(claims)))
        at = ctypes.addressof(self.slots)
        for i, (start, offset) in enumerate(zip(starts, np.cumsum([0] + claims[:-1]))):
            self.table[4 + 4 * i:7 + 4 * i] = [at + 4 * start, int(offset), int(timed or i in barriers)]
        self.run_fn = None
        self.scalar_slots = sslot
        self.keep = [b for _, b in bslot.values()]
        self.bufs = (ctypes.c_void_p * max(1, len(bslot)))(*[b.addr for _, b in sorted(bslot.values(), key=lambda t: t[0])])
        self.scal = (ctypes.c_int32 * max(1, len(sslot)))()
        self.counters = CpuBuffer(device, self.table[2])

    def ready(self):
        self._run_fn()

    def _run_fn(self):
        """jl_run, once every launch's entry is in the table (the kernels' code compiled or loaded)."""
        for i, code in enumerate(self.code):
            self.table[3 + 4 * i] = code.wait()
        self.run_fn = RUN(self.runner.wait())
        return self.run_fn

    def run(self, values):
        for name, i in self.scalar_slots.items():
            self.scal[i] = int(values[name])
        self.device.workers.run(self.run_fn or self._run_fn(), ctypes.addressof(self.table),
                                ctypes.addressof(self.bufs), ctypes.addressof(self.scal), self.counters.addr)
        if self.stamps is not None:
            return list(np.diff(self.stamps.arr.view(np.int64)) * 1e-9)


@functools.cache
def _runner_key():
    """The key of the programs' runner's code (lower.runner_module): this lowering's, for this CPU."""
    return digest(LOWERING, "jl_run", host()[:3], llvmlite.__version__)


def barriers_needed(launches):
    """Indices of launches that must be followed by a barrier: those whose writes a later launch touches, or
    whose reads a later launch overwrites, before some other barrier intervenes. Independent launches (the q, k
    and v projections, say) then run back to back."""
    need, written, read = [], set(), set()
    for i, ln in enumerate(launches):
        w = {id(b) for p, b in ln.buffers.items() if ln.kernel.buffers[p].write}
        r = {id(b) for p, b in ln.buffers.items() if not ln.kernel.buffers[p].write}
        if (r | w) & written or w & read:
            need.append(i - 1)
            written, read = set(), set()
        written |= w
        read |= r
    return need


class CpuDevice(Device):
    backend = "cpu"
    # how far ahead streamed weights are prefetched and how (lower.PREFETCH_DEEP, PREFETCH, PREFETCH_L2,
    # PREFETCH_FAR), or not at all: Intel's Ice Lake and Emerald Rapids stream every layout faster with a prefetch, a
    # Zen 3 its 4-bit ones but not its 6-bit one on two threads, a Zen 5 fastest with the far prefetch non-temporal,
    # or on a busy host with a third one further ahead, an AMX Xeon with two both further ahead. The first is the
    # tuner's default, kept unless another beats it (tuning.MARGIN): its probe, one matvec over rotated copies, saw
    # the first three within 2-8 % of one another on a Sapphire Rapids host whose whole decode steps differed by
    # 1.6x (SmolLM2 on two threads: 121.4 tok/s deep, 77.8 non-temporal; a busy Zen 5's 1B: 37.0 and 22.7), so a
    # tie keeps the deep one, never far behind in a step
    tunables = {"prefetch": [lower.PREFETCH_DEEP, lower.PREFETCH, lower.PREFETCH_L2, lower.PREFETCH_FAR, ()]}
    lowering = LOWERING

    def __init__(self, name, threads, memory_bytes, width=None, instructions=None):
        """width, instructions: the vector width and instructions (of ISA) of the CPU whose programs the device makes,
        by default this one's; where this CPU lacks some, they run emulated (emulation.py: the programs of another
        kind of machine checked here, not timed: such a device tunes nothing)."""
        self.name = name
        self.width = W = width or simd_width()
        self.instructions = isa() if instructions is None else frozenset(instructions)
        self.foreign = (W, self.instructions) != (simd_width(), isa())
        # the emulation's code, in its programs' keys
        self.emulation = digest(Path(emulation.__file__).read_bytes()) if self.foreign else None
        if self.foreign:
            self.tunables = {}
        self.caps = Caps(memory_bytes=memory_bytes, bandwidth_Bps=0.0, subgroup_size=W, fp16=True, int8=True,
                         host_visible=True, registers=W * lower.vector_registers(W), extra={"cpu": host()[1]})
        if AMX <= self.instructions:  # TileDot as AMX tile multiplies (lower.amx_fits)
            self.caps.extra["tile_dots"] = True
        self.used = 0
        self.cache_bytes = largest_cache()
        self.tuned = {}  # kernel tag -> lowering options (Device.tune)
        self._lock = threading.Lock()
        self.configure(threads=threads)

    def configure(self, threads=None, memory_bytes=None):
        if threads:
            self.tuned = {}  # measured with another thread count
            self.threads = int(threads)
            self.caps.threads = self.threads
            self.workers = Workers(self.threads)
        if memory_bytes:
            self.caps.memory_bytes = int(memory_bytes)

    def describe(self):
        own = f"{self.name}: {self.caps.extra['cpu']}, {self.threads} threads, SIMD {self.caps.subgroup_size} x f32"
        if not self.foreign:
            return own
        return f"{own} and {', '.join(sorted(self.instructions)) or 'no x86 extension'}, what this CPU lacks emulated"

    def made_runnable(self, text):
        """A program's module text, with what this CPU lacks of the device's instructions emulated."""
        return emulation.emulated(text, [f for f, on in host()[3].items() if on]) if self.foreign else text

    def alloc(self, nbytes):
        with self._lock:
            if self.used + nbytes > self.caps.memory_bytes:
                raise BackendError(f"{self.name}: out of memory ({self.used + nbytes} > {self.caps.memory_bytes} bytes)")
            self.used += nbytes
        return CpuBuffer(self, nbytes)

    def free(self, buf):
        with self._lock:
            self.used -= buf.nbytes
        buf.arr = buf.map = None  # unmapped once no view of it is left

    def upload(self, buf, data, offset=0):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf.arr[offset:offset + data.size] = data

    def download(self, buf, nbytes=None, offset=0):
        n = buf.nbytes - offset if nbytes is None else nbytes
        return buf.arr[offset:offset + n].copy()

    def tune(self, tag, options):
        self.tuned[tag] = dict(options)

    def program(self, launches):
        return CpuProgram(self, launches)

    def timed_program(self, launches):
        return CpuProgram(self, launches, timed=True)

    def kernel_code(self, k):
        """Kernel k's code for this device (its tuned options, its instructions), shared by every program that
        launches it -- and by other devices of the same kind, as its function's name is the key of its text."""
        options = self.tuned.get(k.tune_tag) if k.tune_tag else None
        schedule = machine_scheduled(self, k)
        triple, cpu, features, _ = host()
        text_key = digest(LOWERING, k.key(), self.width, sorted(self.instructions), self.emulation, triple, cpu,
                          features, llvmlite.__version__)
        name = f"k_{k.name}_{text_key}"
        return self.compile(digest(text_key, sorted((options or {}).items()), schedule),
                            lambda: self.kernel_text(k, name, triple), name, schedule, lower.support_ir(options))

    def kernel_text(self, k, name, triple):
        """Kernel k's module text, called by `name` (the key of its text), lowered unless it was the last one."""
        global _LAST_TEXT
        last = _LAST_TEXT
        if last[0] != name:
            last = _LAST_TEXT = name, self.made_runnable(str(lower.kernel_module(
                k, name, self.width, triple, self.instructions)))
        return last[1]

    def compile(self, key, text_fn, symbol, schedule=True, support=lower.SUPPORT_IR):
        """The Compiled of module text_fn() (its key: what it is made of), made once a process; symbol: the
        function it is called by; support: the IR it is linked with."""
        with _COMPILED_LOCK:
            if key not in _COMPILED:
                try:
                    _COMPILED[key] = Compiled(key, text_fn, self.name, schedule, symbol, support)
                except RuntimeError as e:  # loading the cached code
                    raise compile_failed(self.name, e) from None
            return _COMPILED[key]


def total_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def env_count(name, least):
    """The whole number in environment variable `name` (None when unset or empty), refused below `least`."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < least:
        raise BackendUnavailable(f"{name}={v!r}: must be a whole number >= {least}")
    return int(v)


def make_devices(threads=None):
    """`cpu`, or with JITLLM_CPU_DEVICES=N, N partitions cpu:0..cpu:N-1 with their own arenas and threads."""
    threads = int(threads or env_count("JITLLM_THREADS", 1) or os.cpu_count() or 1)
    n = env_count("JITLLM_CPU_DEVICES", 0) or 0
    if n <= 0:
        return [CpuDevice("cpu", threads, total_memory())]
    return [CpuDevice(f"cpu:{i}", max(1, threads // n), total_memory() // n) for i in range(n)]
