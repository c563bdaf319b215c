"""A brand-new op, defined only here in IR, runs on every installed backend with no plugin change."""
import numpy as np
import pytest

from backend_check import assert_matches_interpreter
from jitllm_core import ir, registry


def softcap_layernorm(rows, cols, cap):
    """y = cap * tanh(layernorm(x) / cap): mean/variance reductions, a transcendental, a vector loop."""
    k = ir.Kernel(f"softcap_layernorm_{rows}x{cols}")
    k.buffer("x", "f32", rows * cols), k.buffer("y", "f32", rows * cols, True)
    with k.parallel("r", rows) as r:
        mean = k.let("mean", ir.reduce("add", "c", cols, lambda c: k.load("x", r * cols + c), "reduce") / float(cols))
        var = k.let("var", ir.reduce("add", "c", cols, lambda c: (k.load("x", r * cols + c) - mean) *
                                                                  (k.load("x", r * cols + c) - mean), "reduce") / float(cols))
        inv = k.let("inv", ir.rsqrt(var + 1e-5))
        with k.loop("c", cols, "vector") as c:
            k.store("y", r * cols + c, ir.Un("tanh", (k.load("x", r * cols + c) - mean) * inv / cap) * cap)
    return k.finish()


def installed_devices():
    return [d for d in registry.all_devices().values()] or [None]


@pytest.mark.parametrize("device", installed_devices(), ids=lambda d: getattr(d, "name", "none"))
def test_new_op_runs_on_every_backend(device):
    if device is None:
        pytest.skip("no backend installed")
    k = softcap_layernorm(5, 70, 2.0)
    x = np.random.default_rng(0).standard_normal(5 * 70).astype(np.float32) * 3
    assert_matches_interpreter(device, k, {"x": x, "y": np.zeros(5 * 70, np.float32)}, {}, rtol=1e-4, atol=1e-4)
    # and against plain NumPy, so the op itself is right, not just consistent
    xr = x.reshape(5, 70)
    want = 2.0 * np.tanh((xr - xr.mean(1, keepdims=True)) / np.sqrt(xr.var(1, keepdims=True) + 1e-5) / 2.0)
    from backend_check import run_on_device
    got = run_on_device(device, k, {"x": x, "y": np.zeros(5 * 70, np.float32)}, {})["y"].reshape(5, 70)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
