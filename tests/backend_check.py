"""Run a kernel on a device and on the reference interpreter, and compare (shared by every backend's tests)."""
import numpy as np

from jitllm_core import interp
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
