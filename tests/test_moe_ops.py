"""A mixture of experts' ops on every installed backend, against NumPy: the router's top-k choice and weights
(`ops.moe_route`), a matmul whose rows each token takes from the expert chosen for it (`ops.matmul(experts=)`), in
a plain format and a repacked one, and an expert's weighted output joining the residual (`ops.add(used=)`)."""
import numpy as np
import pytest

from backend_check import assert_matches_interpreter, run_on_device
from jitllm_core import ops, quant, registry
from test_quant_formats import quantized_input, random_tensor

E, K, T = 8, 3, 5


def installed_devices():
    return list(registry.all_devices().values())


@pytest.mark.parametrize("device", installed_devices(), ids=lambda d: d.name)
@pytest.mark.parametrize("normalize", [True, False])
def test_route(device, normalize):
    rng = np.random.default_rng(1)
    r = rng.standard_normal((T, E)).astype(np.float32) * 2
    k = ops.moe_route(E, K, T, normalize)
    bufs = {"r": r.reshape(-1).copy(), "sel": np.zeros(T * K, np.int32), "wt": np.zeros(T * K, np.float32)}
    out = run_on_device(device, k, bufs, {"n_tokens": T, "t0": 1})
    sel, wt = out["sel"].reshape(T, K), out["wt"].reshape(T, K)
    p = np.exp(r - r.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_sel = np.argsort(-r, axis=1, kind="stable")[:, :K]
    want_wt = np.take_along_axis(p, want_sel, 1)
    if normalize:
        want_wt /= want_wt.sum(1, keepdims=True)
    assert (sel[1:] == want_sel[1:]).all() and not sel[0].any()  # tokens from t0 only
    np.testing.assert_allclose(wt[1:], want_wt[1:], rtol=1e-5, atol=1e-6)
    assert_matches_interpreter(device, k, bufs, {"n_tokens": T, "t0": 1})


@pytest.mark.parametrize("device", installed_devices(), ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_K"])
def test_expert_matmul(device, name):
    """Each token's rows from its own expert (slot 1 of 3), token by token, from t0; Q8_0 and Q4_K repacked into
    their interleaved layouts on a CPU (read through their quantized input there)."""
    rows, cols = 32, 256
    rng = np.random.default_rng(2)
    w, ref = random_tensor(name, E * rows, cols, rng)
    fmt = quant.get_format(name, cols)
    wide = not device.name.startswith("cpu")
    if device.name.startswith("cpu"):
        fmt, w = quant.packed_format(fmt, rows), quant.repack(fmt, w, E * rows)
    sel = rng.integers(0, E, (T, K)).astype(np.int32)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    bufs = {"w": w, "x": x.reshape(-1), "sel": sel.reshape(-1), "y": np.zeros(T * rows, np.float32)}
    if fmt.digits:
        bufs.update(quantized_input(device, x))
    k = ops.matmul(fmt, rows, cols, T, wide=wide, experts=E, used=K)
    y = run_on_device(device, k, bufs, {"n_tokens": T, "t0": 1, "slot": 1})["y"].reshape(T, rows)
    experts = ref.reshape(E, rows, cols).astype(np.float64)
    want = np.stack([experts[sel[t, 1]] @ x[t] for t in range(T)])
    np.testing.assert_allclose(y[1:], want[1:], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not y[0].any()


@pytest.mark.parametrize("scale", [1.0, 0.25], ids=["weighted", "weighted-and-scaled"])  # Granite's residual scale
@pytest.mark.parametrize("device", installed_devices(), ids=lambda d: d.name)
def test_add_weighted_by_the_router(device, scale):
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((T, 40)).astype(np.float32), rng.standard_normal((T, 40)).astype(np.float32)
    wt = rng.random((T, K)).astype(np.float32)
    out = run_on_device(device, ops.add(40, T, scale, used=K), {"y": y.reshape(-1), "wt": wt.reshape(-1),
                                                                   "x": x.reshape(-1).copy()},
                        {"n_tokens": T, "t0": 2, "slot": 2})
    got = out["x"].reshape(T, 40)
    np.testing.assert_array_equal(got[:2], x[:2])
    np.testing.assert_allclose(got[2:], x[2:] + wt[2:, 2:3] * scale * y[2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", installed_devices(), ids=lambda d: d.name)
def test_add_gated_by_the_input(device):
    """A shared expert's output joining the residual times sigmoid(its input . w) (Qwen2-MoE's shared_expert_gate),
    for the tokens from t0."""
    rng = np.random.default_rng(4)
    x, y, xin = (rng.standard_normal((T, 40)).astype(np.float32) for _ in range(3))
    w = (rng.standard_normal(40) * 0.3).astype(np.float32)
    out = run_on_device(device, ops.add_gated(40, T), {"y": y.reshape(-1), "xin": xin.reshape(-1), "w": w,
                                                         "x": x.reshape(-1).copy()}, {"n_tokens": T, "t0": 1})
    got = out["x"].reshape(T, 40)
    gate = 1 / (1 + np.exp(-(xin.astype(np.float64) @ w)))
    np.testing.assert_array_equal(got[:1], x[:1])
    assert 0.05 < gate.min() and gate.max() < 0.95  # gates away from 0 and 1: a wrong one shows
    np.testing.assert_allclose(got[1:], x[1:] + gate[1:, None] * y[1:], rtol=1e-5, atol=1e-5)
