"""A whole-step program: all launches of one device segment, captured once into a CUDA graph.

Per-step scalars never change the graph: kernels read them from a small device array (`jl_s`) and the graph's
first node copies that array from a pinned host array that run() fills in. Grids do not depend on scalars either
(see lower.py), so one capture serves every step and run() is one graph launch plus one synchronize.
A timed program (the profile's) also records an event before the first launch and after each one, as nodes of the
graph: the GPU notes the time each launch ends, with no host in between.
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
    def __init__(self, dev, launches, timed=False):
        self.dev, self.graph, self.events = dev, None, []
        slots, calls = [], []     # slots: the per-step value name behind each entry of the scalar array
        for launch in launches:
            low, fns = dev.functions(launch.kernel)
            ptrs = [launch.buffer(p, self.dev).ptr for p in launch.kernel.buffers]
            calls += [(fns[d.name], d.blocks, ptrs, len(slots)) for d in low.dispatches]
            slots += [launch.scalar_name(s) for s in low.scalars]
            if timed:
                calls.append(None)   # an event after the launch's last dispatch
        if timed:
            dev.use()
            self.events = [call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DEFAULT) for _ in range(len(launches) + 1)]
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
            events = iter(self.events)
            self._record(next(events, None))
            for c in calls:
                if c is None:
                    self._record(next(events))
                    continue
                fn, blocks, ptrs, base = c
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

    def _record(self, event):
        """An event as a node of the graph being captured (EXTERNAL: a node, not a dependency between streams)."""
        if event is not None:
            call(cu.cuEventRecordWithFlags, event, self.dev.stream, cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)

    def run(self, values):
        if self.graph is None:
            return [] if self.events else None
        try:
            v = np.array([values[n] for n in self.names], np.int64)
        except KeyError as e:
            raise BackendError(f"{self.dev.name}: program needs the per-step value {e.args[0]!r}") from None
        self.scalars_host[:self.gather.size] = v[self.gather]
        self.dev.use()
        call(cu.cuGraphLaunch, self.graph, self.dev.stream)
        call(cu.cuStreamSynchronize, self.dev.stream)
        if self.events:   # a timed program: each launch's seconds
            return [call(cu.cuEventElapsedTime, a, b) / 1e3 for a, b in zip(self.events, self.events[1:])]

    def __del__(self):   # best effort: the driver may already be gone at interpreter exit
        try:
            if self.graph is not None:
                cu.cuGraphExecDestroy(self.graph)
            for e in self.events:
                cu.cuEventDestroy(e)
            self.dev.free(self.scalars_dev)
            cu.cuMemFreeHost(self.scalars_addr)
        except Exception:
            pass
