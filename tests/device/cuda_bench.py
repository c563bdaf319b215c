"""Short measurements of the CUDA backend on a GPU (run by run_cuda_check.sh): staged copy bandwidth, the memory
bandwidth of generated kernels (elementwise, a warp-per-row reduction) and the per-step cost of a program of many
launches (one CUDA graph). The model's own kernels are timed by `jitllm bench --profile`."""
import time

import numpy as np

from jitllm_core import ir
from jitllm_core.plugin import Launch
from jitllm_cuda import CudaBackend


def timed(fn, reps):
    fn()   # warm-up (compilation, first graph launch)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


dev = CudaBackend().probe()[0]
print(f"{dev.describe()}: nominal {dev.caps.bandwidth_Bps / 1e9:.0f} GB/s, {dev.caps.extra}")
n = 64 << 20                                     # f32 elements: 256 MiB per buffer
a, b = dev.alloc(4 * n), dev.alloc(4 * n)
host = np.ones(n, np.float32)
s = timed(lambda: dev.upload(a, host), 3)
print(f"upload (pinned chunks)          {4 * n / s / 1e9:7.1f} GB/s")
s = timed(lambda: dev.download(a), 3)
print(f"download (pinned chunks)        {4 * n / s / 1e9:7.1f} GB/s")

k = ir.Kernel("bench_scale")
k.buffer("x", "f32", n), k.buffer("y", "f32", n, True)
with k.parallel("i", n) as i:
    k.store("y", i, k.load("x", i) * 2.0)
p = dev.program([Launch(k.finish(), {"x": a, "y": b})])
s = timed(lambda: p.run({}), 20)
print(f"elementwise kernel              {8 * n / s / 1e9:7.1f} GB/s (read + write)")

rows, cols = 16384, 4096
k = ir.Kernel("bench_rowsum")
k.buffer("x", "f32", rows * cols), k.buffer("y", "f32", rows, True)
with k.parallel("r", rows) as r:
    k.store("y", r, ir.reduce("add", "c", cols, lambda c: k.load("x", r * cols + c), "reduce"))
p = dev.program([Launch(k.finish(), {"x": a, "y": b})])
s = timed(lambda: p.run({}), 20)
print(f"row sums (a warp per row)       {4 * rows * cols / s / 1e9:7.1f} GB/s")

k = ir.Kernel("bench_tiny")
k.buffer("y", "f32", 1024, True)
m = k.scalar("m")
with k.parallel("i", 1024) as i:
    k.store("y", i, ir.f32(i + m))
p = dev.program([Launch(k.finish(), {"y": b})] * 300)
s = timed(lambda: p.run({"m": 1}), 20)
print(f"300-launch program: {s * 1e3:.2f} ms per run ({s / 300 * 1e6:.1f} us per launch)")
