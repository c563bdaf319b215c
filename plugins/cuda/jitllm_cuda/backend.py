"""The CUDA backend: probing for GPUs, and ahead-of-time compilation that needs none."""
from __future__ import annotations

import time

from jitllm_core.errors import BackendError
from jitllm_core.plugin import Backend, BackendUnavailable


class CudaBackend(Backend):
    name = "cuda"
    threads = 1 << 14   # every CUDA GPU runs thousands of threads at once (an H200: 132 x 2048)

    def __init__(self):
        self._devices = None

    def probe(self):
        """Devices cuda:0..N-1, or BackendUnavailable with the reason (no libcuda, no GPU, driver too old...)."""
        if self._devices is None:
            try:  # the driver bindings load libcuda lazily: any failure here means "no usable driver"
                from cuda.bindings import driver as cu

                from .device import call
                call(cu.cuInit, 0)
                n = call(cu.cuDeviceGetCount)
            except Exception as e:
                raise BackendUnavailable(f"CUDA driver not available: {e}") from None
            if not n:
                raise BackendUnavailable("CUDA driver not available: no CUDA device found")
            from .device import CudaDevice
            try:
                self._devices = [CudaDevice(i) for i in range(n)]
            except BackendError as e:
                raise BackendUnavailable(str(e)) from None
        return self._devices

    @staticmethod
    def compile_ahead(kernels, arch: str) -> list[dict]:
        """Lower and compile kernels to cubins for `arch` (e.g. "sm_90") into the disk cache; no GPU needed.
        Returns one {name, seconds, bytes, cached} per kernel."""
        from . import compiler  # (here: the plugin's import, at every engine's start, loads neither)
        from .lower import lower
        compiler.check_arch(arch)
        report = []
        for k in kernels:
            t = time.perf_counter()
            cubin, cached = compiler.compile_cubin(lower(k).source, arch, k.name)
            report.append(dict(name=k.name, seconds=time.perf_counter() - t, bytes=len(cubin), cached=cached))
        return report
