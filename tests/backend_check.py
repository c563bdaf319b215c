"""Run a kernel on a device and on the reference interpreter, and compare (shared by every backend's tests)."""
import time

import numpy as np

from jitllm_core import interp, ir
from jitllm_core.plugin import Launch


def run_on_device(device, kernel, bufs, scalars):
    """Upload copies of bufs, run the kernel as a one-launch program, return downloaded arrays."""
    dev_bufs = {}
    for name, arr in bufs.items():
        b = device.alloc(arr.nbytes)
        device.upload(b, arr.view(np.uint8))
        dev_bufs[name] = b
    try:
        device.program([Launch(kernel, dev_bufs)]).run(dict(scalars))
        return {n: device.download(b, bufs[n].nbytes).view(bufs[n].dtype) for n, b in dev_bufs.items()}
    finally:
        for b in dev_bufs.values():
            device.free(b)


def assert_matches_interpreter(device, kernel, bufs, scalars, rtol=2e-5, atol=2e-5):
    want = interp.run(kernel, {n: a.copy() for n, a in bufs.items()}, scalars)
    got = run_on_device(device, kernel, bufs, scalars)
    for name, p in kernel.buffers.items():
        if not p.write:
            continue
        w, g = want[name], got[name]
        if p.dtype == "bf16":
            w, g = interp.bf16_to_f32(w), interp.bf16_to_f32(g)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=rtol, atol=atol,
                                       err_msg=f"{kernel.name}: buffer {name}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{kernel.name}: buffer {name}")


def assert_timed_program_times_each_launch(device, n):
    """device.timed_program on two launches of one kernel (y = 2 x over 64 and over n elements): a time per launch,
    all inside the run's own time, the n-element launch the longer (the least of 9 runs of each: preemption only
    adds time; with 5, one CI run of the CUDA stand-in saw the 64-element launch's least the longer), and the results
    right. One warm-up run first (lavapipe compiles a shader at its first dispatch)."""
    k = ir.Kernel("scale_by_two")
    k.buffer("x", "f32", n), k.buffer("y", "f32", n, True)
    with k.parallel("i", k.scalar("n")) as i:
        k.store("y", i, k.load("x", i) * 2.0)
    k = k.finish()
    x, y = device.alloc(4 * n), device.alloc(4 * n)
    try:
        device.upload(x, np.arange(n, dtype=np.float32))
        prog = device.timed_program([Launch(k, {"x": x, "y": y}, {"n": "small"}),
                                     Launch(k, {"x": x, "y": y}, {"n": "big"})])
        prog.run({"small": 64, "big": n})
        times = []
        for _ in range(9):
            t = time.perf_counter()
            times.append(prog.run({"small": 64, "big": n}))
            assert 0 < min(times[-1]) and sum(times[-1]) <= time.perf_counter() - t
        assert min(s for s, _ in times) < min(b for _, b in times)
        assert np.array_equal(device.download(y).view(np.float32), np.arange(n, dtype=np.float32) * 2)
    finally:
        device.free(x), device.free(y)
