"""CUDA devices through the driver API (cuda.bindings.driver): primary contexts, plain cuMemAlloc memory, and copies
staged through pinned host chunks. Imported only once the backend probes, so a missing libcuda is a reason, not a
crash."""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

import numpy as np
from cuda.bindings import driver as cu

from jitllm_core.errors import BackendError
from jitllm_core.plugin import Buffer, Caps, Device

from . import compiler
from .lower import lower

ALIGN = 16          # allocation granularity we promise the kernels (narrow atomics touch whole 32-bit words)
CHUNK = 8 << 20     # bytes per pinned staging chunk


def call(fn, *args):
    """Call a driver function; cuda-bindings returns (CUresult, *values). Raise BackendError on failure."""
    err, *vals = fn(*args)
    check(err, fn.__name__)
    return vals[0] if len(vals) == 1 else (vals or None)


def check(err, what):
    if err != cu.CUresult.CUDA_SUCCESS:
        _, text = cu.cuGetErrorString(err)
        raise BackendError(f"cuda: {what} failed: {err.name} ({text.decode() if text else '?'})")


def pinned(nbytes):
    """Page-locked host memory usable from every context: (address, uint8 view)."""
    addr = int(call(cu.cuMemHostAlloc, nbytes, cu.CU_MEMHOSTALLOC_PORTABLE))
    return addr, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class CudaBuffer(Buffer):
    def __init__(self, device, nbytes, ptr):
        super().__init__(device, nbytes)
        self.ptr = ptr


class _Chunks:
    """Two pinned chunks, an event for each and a copy stream: the host side of one chunk overlaps the DMA of the
    other."""

    def __init__(self):
        self.stream = call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.events = [call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) for _ in range(2)]
        self.host = [pinned(CHUNK) for _ in range(2)]


class CudaDevice(Device):
    backend = "cuda"

    def __init__(self, ordinal: int):
        self.name = f"cuda:{ordinal}"
        self.dev = call(cu.cuDeviceGet, ordinal)
        self.gpu = call(cu.cuDeviceGetName, 256, self.dev).split(b"\0")[0].decode()
        major, minor = self.attr("COMPUTE_CAPABILITY_MAJOR"), self.attr("COMPUTE_CAPABILITY_MINOR")
        self.arch = compiler.device_arch(major, minor)
        self.ctx = call(cu.cuDevicePrimaryCtxRetain, self.dev)
        self.use()
        self.stream = call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)  # programs and peer copies
        # nominal bandwidth: DDR memory clock (kHz) x bus width (bits)
        bw = 2 * self.attr("MEMORY_CLOCK_RATE") * 1e3 * self.attr("GLOBAL_MEMORY_BUS_WIDTH") / 8
        self.caps = Caps(memory_bytes=int(call(cu.cuDeviceTotalMem, self.dev)), bandwidth_Bps=bw,
                         subgroup_size=self.attr("WARP_SIZE"), fp16=True, int8=True,
                         threads=self.attr("MULTIPROCESSOR_COUNT") * self.attr("MAX_THREADS_PER_MULTIPROCESSOR"),
                         extra={"name": self.gpu, "sm": major * 10 + minor, "arch": self.arch,
                                "multiprocessors": self.attr("MULTIPROCESSOR_COUNT")})
        self._chunks, self._lock = [], threading.Lock()
        self._functions, self._can_peer, self._peer_enabled = {}, {}, set()

    def attr(self, name):
        return call(cu.cuDeviceGetAttribute, getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}"), self.dev)

    def use(self):
        """Make this device's context current on the calling thread (the engine calls from several threads)."""
        call(cu.cuCtxSetCurrent, self.ctx)

    def describe(self):
        return f"{self.name} ({self.gpu}, {self.arch}, {self.caps.memory_bytes / 2**30:.0f} GiB)"

    # -- memory
    def alloc(self, nbytes):
        self.use()
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        try:
            ptr = int(call(cu.cuMemAlloc, size))
        except BackendError as e:
            raise BackendError(f"{self.name}: cannot allocate {nbytes} bytes: {e}") from None
        return CudaBuffer(self, nbytes, ptr)

    def free(self, buf):
        if buf.ptr:
            self.use()
            call(cu.cuMemFree, buf.ptr)
            buf.ptr = 0

    def upload(self, buf, data, offset=0):
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._bounds(buf, offset, src.nbytes)
        self.to_device(buf.ptr + offset, src.nbytes, lambda o, chunk: np.copyto(chunk, src[o:o + chunk.size]))

    def download(self, buf, nbytes=None, offset=0):
        n = buf.nbytes - offset if nbytes is None else nbytes
        self._bounds(buf, offset, n)
        out = np.empty(n, np.uint8)
        self.from_device(buf.ptr + offset, n, lambda o, chunk: np.copyto(out[o:o + chunk.size], chunk))
        return out

    def synchronize(self):
        self.use()
        call(cu.cuCtxSynchronize)

    def _bounds(self, buf, offset, n):
        if offset < 0 or offset + n > buf.nbytes:
            raise BackendError(f"{self.name}: copy of {n} bytes at {offset} outside a {buf.nbytes}-byte buffer")

    # -- staged copies: `fill(offset, chunk)` writes, `drain(offset, chunk)` reads a pinned chunk's bytes
    @contextmanager
    def chunks(self):
        """A free pair of pinned chunks (one pair per concurrent copy, so copies never wait on each other's locks)."""
        with self._lock:
            c = self._chunks.pop() if self._chunks else None
        if c is None:
            self.use()
            c = _Chunks()
        try:
            yield c
        finally:
            with self._lock:
                self._chunks.append(c)

    def to_device(self, ptr, n, fill):
        with self.chunks() as c:
            for k, off in enumerate(range(0, n, CHUNK)):
                i, m = k % 2, min(CHUNK, n - off)
                if k >= 2:
                    call(cu.cuEventSynchronize, c.events[i])   # its previous DMA is done: reuse the chunk
                addr, view = c.host[i]
                fill(off, view[:m])
                self.use()
                call(cu.cuMemcpyHtoDAsync, ptr + off, addr, m, c.stream)
                call(cu.cuEventRecord, c.events[i], c.stream)
            call(cu.cuStreamSynchronize, c.stream)

    def from_device(self, ptr, n, drain):
        with self.chunks() as c:
            pending = None
            for k, off in enumerate(range(0, n, CHUNK)):
                i, m = k % 2, min(CHUNK, n - off)
                self.use()
                call(cu.cuMemcpyDtoHAsync, c.host[i][0], ptr + off, m, c.stream)
                call(cu.cuEventRecord, c.events[i], c.stream)
                if pending:   # drain the previous chunk while this one is in flight
                    self._drain(c, *pending, drain)
                pending = (i, off, m)
            if pending:
                self._drain(c, *pending, drain)

    @staticmethod
    def _drain(c, i, off, m, drain):
        call(cu.cuEventSynchronize, c.events[i])
        drain(off, c.host[i][1][:m])

    # -- peers
    def can_access_peer(self, other) -> bool:
        if other not in self._can_peer:
            self._can_peer[other] = bool(call(cu.cuDeviceCanAccessPeer, self.dev, other.dev))
        return self._can_peer[other]

    def enable_peer(self, other):
        """Let this context reach other's memory directly (once)."""
        if other not in self._peer_enabled:
            self.use()
            (err,) = cu.cuCtxEnablePeerAccess(other.ctx, 0)
            if err != cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                check(err, "cuCtxEnablePeerAccess")
            self._peer_enabled.add(other)

    # -- programs
    def program(self, launches):
        from .program import CudaProgram
        return CudaProgram(self, launches)

    def timed_program(self, launches):
        from .program import CudaProgram
        return CudaProgram(self, launches, timed=True)

    def functions(self, kernel):
        """Lowered kernel and its loaded __global__ functions by name (compiled once per IR, loaded once per device)."""
        key = kernel.key()
        if key not in self._functions:
            low = lower(kernel)
            cubin, _ = compiler.compile_cubin(low.source, self.arch, kernel.name)
            self.use()
            module = call(cu.cuModuleLoadData, cubin)
            self._functions[key] = (low, {d.name: call(cu.cuModuleGetFunction, module, d.name.encode())
                                          for d in low.dispatches})
        return self._functions[key]
