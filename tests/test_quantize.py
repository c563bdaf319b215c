"""Round trips of jitllm_core.quantize through the gguf package's own dequantizers (an independent decoder)."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from jitllm_core import quantize as Q  # noqa: E402

# RMS error relative to data RMS on standard normal data; llama.cpp's reference quantizers land just below
BOUNDS = {"F32": 0.0, "F16": 5e-4, "BF16": 4e-3, "Q8_0": 0.006, "Q4_0": 0.095, "Q4_1": 0.085,
          "Q2_K": 0.35, "Q3_K": 0.17, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02, "IQ4_NL": 0.085, "IQ4_XS": 0.085}


def _data(rows, cols, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)


def _dequantize(q, type_name):
    return gguf.quants.dequantize(q, T[type_name])


@pytest.mark.parametrize("type_name", list(BOUNDS))
@pytest.mark.parametrize("rows", [3, 7])
def test_round_trip_error(type_name, rows):
    x = _data(rows, 4096, seed=rows)
    q = Q.quantize(x, type_name)
    assert q.dtype == np.uint8
    assert q.shape == gguf.quant_shape_to_byte_shape(x.shape, T[type_name])
    y = _dequantize(q, type_name)
    assert y.shape == x.shape
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel <= BOUNDS[type_name], f"{type_name}: relative RMS error {rel:.4f}"


@pytest.mark.parametrize("type_name", ["BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_same_bytes_as_gguf_reference(type_name):
    # gguf's quantizers for these types are bit-exact ports of llama.cpp's reference ones
    x = _data(7, 512)
    x[1] = 0.0
    np.testing.assert_array_equal(Q.quantize(x, type_name), gguf.quants.quantize(x, T[type_name]))


def _implied(type_name, parts):
    """The values the scales and quants stand for, in the same float32 order as gguf computes them."""
    f = lambda a: a.astype(np.float32)  # noqa: E731
    if type_name in ("Q8_0", "IQ4_NL"):  # IQ4's q: the levels its codes stand for
        d, q = parts
        return f(q) * f(d)[:, None]
    if type_name == "Q4_0":
        d, q = parts
        return f(d)[:, None] * (f(q) - 8)
    if type_name == "Q4_1":
        d, m, q = parts
        return f(d)[:, None] * f(q) + f(m)[:, None]
    if type_name in ("Q2_K", "Q4_K", "Q5_K"):
        d, dmin, sc, mn, q = parts
        return ((f(d)[:, None] * f(sc))[..., None] * f(q) - (f(dmin)[:, None] * f(mn))[..., None]).reshape(len(q), -1)
    d, sc, q = parts  # Q3_K, Q6_K, IQ4_XS
    return ((f(d)[:, None] * f(sc))[..., None] * f(q)).reshape(len(q), -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                       "IQ4_XS"])
def test_bytes_decode_to_exactly_the_parts(type_name):
    bs, _ = Q.BLOCK[type_name]
    x = _data(7, 1024, seed=3) * np.float32(0.02)
    x[2] = 0.0  # all-zero blocks
    x[4] = -0.5  # constant blocks
    x[5, :bs // 2] *= 100  # one sub-block dominates its super-block's scales
    parts = getattr(Q, f"_parts_{type_name.lower()}")(x.reshape(-1, bs))
    expected = _implied(type_name, parts).reshape(x.shape)
    np.testing.assert_array_equal(_dequantize(Q.quantize(x, type_name), type_name), expected)
    # and the quants are in range and not wasted: the zero and constant rows come back (nearly) exactly
    np.testing.assert_array_equal(expected[2], 0.0)
    np.testing.assert_allclose(expected[4], -0.5, rtol=2e-3)


def test_threaded_chunks_match_single_pass():
    x = _data(3, 3 * Q._CHUNK // 2)  # more than one work item
    for type_name in ["Q4_K", "Q5_K", "Q6_K"]:
        whole = Q.quantize(x, type_name)
        per_row = np.concatenate([Q._QUANTIZERS[type_name](r.reshape(-1, Q.QK_K)).reshape(1, -1) for r in x])
        np.testing.assert_array_equal(whole, per_row)


def test_k_quants_beat_legacy_4_bit():
    x = _data(3, 4096)
    err = {t: np.sqrt(np.mean((_dequantize(Q.quantize(x, t), t) - x) ** 2)) for t in ["Q4_0", "Q4_1", "Q4_K"]}
    assert err["Q4_K"] < err["Q4_1"] < err["Q4_0"]


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        Q.quantize(np.zeros((2, 100), np.float32), "Q4_K")
    with pytest.raises(ValueError):
        Q.quantize(np.zeros(256, np.float32), "Q4_K")
    with pytest.raises(ValueError):
        Q.quantize(np.zeros((2, 256), np.float32), "IQ2_XXS")
