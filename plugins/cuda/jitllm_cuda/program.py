"""A whole-step program: all launches of one device segment, captured once into a CUDA graph.

Per-step scalars never change the graph: kernels read them from a small device array (`jl_s`) and the graph's
first node copies that array from a pinned host array that run() fills in. Grids do not depend on scalars either
(see lower.py), so one capture serves every step and run() is one graph launch plus one synchronize.
"""
from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver as cu

from jitllm_core.errors import BackendError
from jitllm_core.plugin import Program

from .device import call, pinned
from .lower import BLOCK


class CudaProgram(Program):
    def __init__(self, dev, launches):
        self.dev, self.graph = dev, None
        slots, calls = [], []     # slots: the per-step value name behind each entry of the scalar array
        for launch in launches:
            low, fns = dev.functions(launch.kernel)
            ptrs = [launch.buffer(p, self.dev).ptr for p in launch.kernel.buffers]
            calls += [(fns[d.name], d.blocks, ptrs, len(slots)) for d in low.dispatches]
            slots += [launch.scalar_name(s) for s in low.scalars]
        self.names = sorted(set(slots))
        self.gather = np.array([self.names.index(s) for s in slots], np.intp)
        self.scalars_dev = dev.alloc(4 * max(1, len(slots)))
        self.scalars_addr, host = pinned(4 * max(1, len(slots)))
        self.scalars_host = host.view(np.int32)
        if calls:
            self.graph = self._capture(calls, 4 * len(slots))

    def _capture(self, calls, scalar_bytes):
        dev = self.dev
        dev.use()
        call(cu.cuStreamBeginCapture, dev.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            if scalar_bytes:
                call(cu.cuMemcpyHtoDAsync, self.scalars_dev.ptr, self.scalars_addr, scalar_bytes, dev.stream)
            for fn, blocks, ptrs, base in calls:
                # kernelParams: an array of pointers to the argument values (all arguments are device pointers)
                vals = (ctypes.c_uint64 * (len(ptrs) + 1))(*ptrs, self.scalars_dev.ptr + 4 * base)
                args = (ctypes.c_void_p * len(vals))(*(ctypes.addressof(vals) + 8 * i for i in range(len(vals))))
                call(cu.cuLaunchKernel, fn, blocks, 1, 1, BLOCK, 1, 1, 0, dev.stream, ctypes.addressof(args), 0)
        except BaseException:
            cu.cuStreamEndCapture(dev.stream)
            raise
        graph = call(cu.cuStreamEndCapture, dev.stream)
        try:
            return call(cu.cuGraphInstantiate, graph, 0)
        finally:
            call(cu.cuGraphDestroy, graph)

    def run(self, values):
        if self.graph is None:
            return
        try:
            v = np.array([values[n] for n in self.names], np.int64)
        except KeyError as e:
            raise BackendError(f"{self.dev.name}: program needs the per-step value {e.args[0]!r}") from None
        self.scalars_host[:self.gather.size] = v[self.gather]
        self.dev.use()
        call(cu.cuGraphLaunch, self.graph, self.dev.stream)
        call(cu.cuStreamSynchronize, self.dev.stream)

    def __del__(self):   # best effort: the driver may already be gone at interpreter exit
        try:
            if self.graph is not None:
                cu.cuGraphExecDestroy(self.graph)
            self.dev.free(self.scalars_dev)
            cu.cuMemFreeHost(self.scalars_addr)
        except Exception:
            pass
