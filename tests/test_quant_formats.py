"""Every weight format described in the core, dequantized and dotted on cpu_llvm, against the gguf package's own
NumPy dequantizers (an independent reference), on random blocks and odd row counts."""
import numpy as np
import pytest

from backend_check import run_on_device
from jitllm_core import interp, ir, ops, quant
from jitllm_core.interp import NP_STORAGE as NP

gguf = pytest.importorskip("gguf")


def random_tensor(name, rows, cols, rng):
    """(storage array, reference f32 values): random blocks with finite f16 scales, dequantized by gguf."""
    fmt = quant.get_format(name, cols)
    if fmt.storage == "u8":
        nb = rows * cols // fmt.block
        raw = rng.integers(0, 256, (nb, fmt.unit)).astype(np.uint8)
        for o in fmt.halves:
            raw[:, o:o + 2] = (rng.standard_normal(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(rows, -1)
        ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(rows, cols)
        return raw.reshape(-1), ref.astype(np.float32)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if name == "F16":
        w = x.astype(np.float16).reshape(-1)
        return w, w.astype(np.float32).reshape(rows, cols)
    if name == "BF16":
        w = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16).reshape(-1)
        return w, interp.bf16_to_f32(w).reshape(rows, cols)
    return x.reshape(-1), x


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_dequantize_matches_gguf(cpu, name, rows):
    cols = 512
    w, ref = random_tensor(name, rows, cols, np.random.default_rng(rows))
    k = quant.dequant_kernel(quant.get_format(name, cols), rows, cols)
    got = run_on_device(cpu, k, {"w": w, "out": np.zeros(rows * cols, np.float32)}, {})["out"]
    np.testing.assert_array_equal(got.reshape(rows, cols), ref)


def row_dot_case(name, wide, seed, rows=5, cols=768):
    """A kernel of a format's row dots (Format.row_dot, in the CPU's form or the GPUs' wide one) on random blocks:
    (kernel, buffers, the weights as gguf dequantizes them)."""
    rng = np.random.default_rng(seed)
    w, ref = random_tensor(name, rows, cols, rng)
    fmt = quant.get_format(name, cols)
    k = ir.Kernel(f"dot_{name}{'_wide' if wide else ''}")
    k.buffer("w", fmt.storage, w.size), k.buffer("x", "f32", cols), k.buffer("y", "f32", rows, True)
    with k.parallel("r", rows) as r:
        k.store("y", r, fmt.row_dot(k, "w", r, cols, lambda c: k.load("x", c), wide))
    bufs = {"w": w, "x": rng.standard_normal(cols).astype(np.float32), "y": np.zeros(rows, np.float32)}
    return k.finish(), bufs, ref


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_row_dot_matches_gguf(cpu, name, wide):
    k, bufs, ref = row_dot_case(name, wide, 7)
    y = run_on_device(cpu, k, bufs, {})["y"]
    want = ref.astype(np.float64) @ bufs["x"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", sorted(quant.REPACK))
def test_repacked_layout_holds_the_same_values(cpu, name, monkeypatch):
    monkeypatch.setattr(quant, "REPACK_PART_BYTES", 1)  # a row group a part: the parts join up
    assert_packed_layout_holds_the_values(cpu, name)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_repack_writes_into_the_bytes_it_is_given(name):
    """A device buffer's host view takes the repacked tensor as it is (the engine's load: no copy to upload)."""
    rows, cols = 48, 768
    w, _ = random_tensor(name, rows, cols, np.random.default_rng(3))
    fmt = quant.get_format(name, cols)
    out = np.full(quant.packed_format(fmt, rows).nbytes(rows, cols), 0xAB, np.uint8)
    assert quant.repack(fmt, w, rows, out) is out
    np.testing.assert_array_equal(out, quant.repack(fmt, w, rows))


def repack_kernel_case(name, rows, cols, seed=5):
    """(kernel, buffers, NumPy's repacking) of a BLOCK_WORDS format's repack kernel on random blocks: the file's bytes
    as words, one more word past them (a block may end mid-word) filled with junk."""
    w, _ = random_tensor(name, rows, cols, np.random.default_rng(seed))
    fmt = quant.get_format(name, cols)
    k = quant.repack_kernel(fmt, rows, cols)
    raw = np.full(k.buffers["raw"].size * 4, 0xA5, np.uint8)
    raw[:w.size] = w
    out = np.zeros(k.buffers["out"].size, np.int32)
    return k, {"raw": raw.view(np.int32), "out": out}, quant.repack(fmt, w, rows)


# 3 blocks of 256 a row: a Q6_K row of 630 bytes, so every other row starts mid-word
@pytest.mark.parametrize("rows, cols", [(32, 768), (16, 256)])
@pytest.mark.parametrize("name", sorted(quant.BLOCK_WORDS))
def test_repack_kernel_writes_what_numpy_writes(cpu, name, rows, cols):
    """The layouts written once for NumPy and the IR (`quant.BLOCK_WORDS`): the IR kernel a device repacks with,
    on the reference interpreter and on the CPU, writes NumPy's bytes."""
    k, bufs, want = repack_kernel_case(name, rows, cols)
    got = interp.run(k, {n: a.copy() for n, a in bufs.items()})["out"]
    np.testing.assert_array_equal(got.view(np.uint8), want)
    np.testing.assert_array_equal(run_on_device(cpu, k, bufs, {})["out"].view(np.uint8), want)


def assert_packed_layout_holds_the_values(cpu, name):
    """The load-time repacking changes no value: dequantized on the device, the packed tensor equals gguf's
    reference exactly; its matmul (a dot4 layout's reads the input as quantize_input writes it) equals the
    reference dot to rounding, for several tokens, with the input in exact digits and in int8, token by token
    and in a tile of 2 (the step's third token then on its own; from t0 = 1, the tile is the step)."""
    rows, cols, T = 48, 768, 3
    rng = np.random.default_rng(11)
    w, ref = random_tensor(name, rows, cols, rng)
    fmt = quant.packed_format(quant.get_format(name, cols), rows)
    assert fmt.name != name
    packed = quant.repack(quant.get_format(name, cols), w, rows)
    assert packed.size == fmt.nbytes(rows, cols)
    k = quant.dequant_kernel(fmt, rows, cols)
    got = run_on_device(cpu, k, {"w": packed, "out": np.zeros(rows * cols, np.float32)}, {})["out"]
    if isinstance(fmt, quant.Interleaved):
        got = got.reshape(rows // quant.ROWS, cols, quant.ROWS).transpose(0, 2, 1)
    np.testing.assert_array_equal(got.reshape(rows, cols), ref)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    bufs = {"w": packed, "x": x.reshape(-1), "y": np.zeros(T * rows, np.float32)}
    if fmt.digits:
        bufs.update(quantized_input(cpu, x))
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    for tokens, t0 in ((1, 0), (2, 0), (2, 1)):
        y = run_on_device(cpu, ops.matmul(fmt, rows, cols, T, tokens=tokens), bufs,
                          {"n_tokens": T, "t0": t0})["y"].reshape(T, rows)
        np.testing.assert_allclose(y[t0:], want[t0:], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert not y[:t0].any()
    if fmt.digits:  # int8 inputs: the same dot of the weights with the input as its int8 values spell it
        q = quantized_input(cpu, x, quant.INT8)
        xq = q["xq"].view(np.int8).reshape(T, cols) * q["xd"].reshape(T, -1).repeat(32, 1).astype(np.float64)
        bufs.update(q)
        want = xq @ ref.T.astype(np.float64)
        for tokens in (1, 2):
            y = run_on_device(cpu, ops.matmul(fmt, rows, cols, T, digits=quant.INT8, tokens=tokens), bufs,
                              {"n_tokens": T, "t0": 0})["y"].reshape(T, rows)
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def quantized_input(device, x, digits=quant.DIGITS):
    """x [T, cols] as quantize_input writes it on the device: {xq, xd, xs}"""
    T, cols = x.shape
    bufs = {"x": x.reshape(-1), "xq": np.zeros(T * digits * cols, np.uint8),
            "xd": np.zeros(T * cols // 32, np.float32), "xs": np.zeros(T * cols // 16, np.float32)}
    out = run_on_device(device, ops.quantize_input(cols, T, digits), bufs, {"n_tokens": T})
    return {n: out[n] for n in ("xq", "xd", "xs")}


@pytest.mark.parametrize("digits", [quant.DIGITS, quant.INT8])
def test_quantized_input_holds_the_input(cpu, digits):
    """Each element is its span's scale times the integer its digits spell, rounded to the nearest (half a step
    away, and f32 rounding of x / scale: with 4 digits, f32's precision of each element); the sums are of the
    16 quantized values."""
    rng = np.random.default_rng(5)
    T, cols = 3, 512
    x = (rng.standard_normal((T, cols)) * np.exp(rng.uniform(-8, 8, (T, cols // 32, 1))).repeat(32, 2).reshape(
        T, cols)).astype(np.float32)
    x[1, 32:64] = 0.0   # a span of zeros
    got = quantized_input(cpu, x, digits)
    d = got["xq"].reshape(T, digits, cols).transpose(0, 2, 1).reshape(-1, digits)
    n = (d.view(np.int8).astype(np.int64) << 8 * np.arange(digits)).sum(1)
    scale = got["xd"].repeat(32).astype(np.float64)
    top = np.abs(x.reshape(-1, 32)).max(1)
    np.testing.assert_allclose(got["xd"], top / ops.digit_max(digits), rtol=1e-6)
    assert np.abs(n).max() <= ops.digit_max(digits) and (n[x.reshape(-1) == 0] == 0).all()
    err = np.abs(n * scale - x.reshape(-1))
    assert (err <= 0.5 * scale + np.abs(x.reshape(-1)) * 2.0 ** -21).all()
    np.testing.assert_allclose(got["xs"], (n * scale).reshape(-1, 16).sum(1), rtol=1e-5, atol=1e-6 * np.abs(x).max())


def test_prefill_tile_fits_the_registers_a_device_says():
    """2 groups x 8 tokens where they fit with a weight vector each (AVX-512's 32 x 16), else as many groups of 6 as
    fit (AVX2's 16 x 8: 1 x 6), at least one; a device that does not say gets the IR's default."""
    assert ops.gemm_tile(32 * 16) == ops.GEMM_WIDE == (2, 8)
    assert ops.gemm_tile(16 * 8) == (1, 6) and ops.gemm_tile(64)[0] == 1
    assert ops.gemm_tile(2 * 16 * 7)[0] == 2 and ops.gemm_tile(0)[0] == ops.GEMM_GROUPS
    assert ops.gemm_tile(0)[1] == ops.GEMM_TOKENS


def test_interleaved_layouts_keep_odd_row_counts_in_the_file_format():
    fmt = quant.get_format("Q4_K", 256)
    assert quant.packed_format(fmt, 40) is fmt and quant.packed_format(fmt, 48).name == "R4K"


def test_unsupported_format_is_named():
    from jitllm_core.errors import ModelFileError
    with pytest.raises(ModelFileError, match="IQ2_XXS is not supported"):
        quant.get_format("IQ2_XXS", 256, "model.gguf: tensor 'blk.0.attn_q.weight'")
    with pytest.raises(ModelFileError, match="not a multiple"):
        quant.get_format("Q4_K", 200, "model.gguf: tensor 'x'")


def tile_devices(cpu):
    """This CPU, and one that runs TileDot as loops of dot4 where this one has AMX (the other path of the lowering)."""
    from jitllm_cpu_llvm import runtime
    if not runtime.AMX <= cpu.instructions:
        return [cpu]
    return [cpu, runtime.CpuDevice("cpu", 1, 1 << 30, cpu.width, cpu.instructions - runtime.AMX)]


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_cpu_tile_matmul_matches_gguf(cpu, name):
    """The integer tile matmul (each block's integers by the input's digits in tile dots, scaled per block and
    token) against gguf's dequantized weights times the input: several row groups to a slice, more than one block,
    bias, accumulate, a partial step (from t0, and n_tokens inside a tile of tokens) and a chunk of columns; as
    AMX runs it where this CPU has it, and as loops of dot4. Within the f32 product's rounding: an input of an
    outlier 50x its neighbours, whose span's digits keep 2^-24 of it."""
    rows, cols, T = 640, 1024, 23
    rng = np.random.default_rng(17)
    w, ref = random_tensor(name, rows, cols, rng)
    fmt = quant.packed_format(quant.get_format(name, cols), rows)
    w = quant.repack(quant.get_format(name, cols), w, rows)
    Tp = ops.tile_tokens(T)
    x = rng.standard_normal((Tp, cols)).astype(np.float32)
    x[:, 7] *= 50.0
    b, y0 = rng.standard_normal(rows).astype(np.float32), rng.standard_normal((T, rows)).astype(np.float32)
    for dev in tile_devices(cpu):
        q = ops.quantize_input(cols, T, quant.DIGITS, ops.TILE_SPAN, 32)
        xq = {"xq": np.zeros(Tp * quant.DIGITS * cols, np.uint8),
              "xd": np.zeros(Tp * cols // ops.TILE_SPAN, np.float32), "xs": np.zeros(Tp * cols // 32, np.float32)}
        xq = run_on_device(dev, q, {"x": x[:T].reshape(-1), **xq}, {"n_tokens": T})
        for chunk_cols, col0, n, t0 in ((0, 0, 21, 3), (512, 512, T, 0)):
            k = ops.tile_matmul(fmt, rows, cols, T, accumulate=True, bias=True, chunk_cols=chunk_cols)
            scratch = {n: np.zeros(k.buffers[n].size, NP[k.buffers[n].dtype]) for n in ("wt", "wts")}
            y = run_on_device(dev, k, {"w": w, **{n: xq[n] for n in ("xq", "xd", "xs")}, "b": b,
                                       "y": y0.reshape(-1).copy(), **scratch},
                              {"n_tokens": n, "t0": t0, "col0": col0})["y"].reshape(T, rows)
            cs = slice(col0, col0 + (chunk_cols or cols))
            want = y0.astype(np.float64)
            want[t0:n] += x[t0:n, cs].astype(np.float64) @ ref[:, cs].T.astype(np.float64) + b
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{dev.describe()}: columns {cs}, tokens {t0}-{n}")


def test_tile_matmul_refuses_what_its_tiles_do_not_fit():
    with pytest.raises(ir.IRError, match="blocks of 256"):
        ops.tile_matmul(quant.packed_format(quant.get_format("Q4_1", 256), 32), 32, 256, 8)


@pytest.mark.parametrize("tile", [(2, 8), (4, 6)], ids=["2x8", "4x6"])
def test_cpu_prefill_matmul_tiles_every_step_length(cpu, tile):
    """Every count of tokens a step may hold, from the first or the last only: the step's tiles of N and N - 1
    tokens and its tail cover [t0, n_tokens) -- every wanted row of y right, no other row written."""
    rows, cols, T = 32, 256, 48
    rng = np.random.default_rng(5)
    w, ref = random_tensor("Q4_K", rows, cols, rng)
    fmt = quant.packed_format(quant.get_format("Q4_K", cols), rows)
    w = quant.repack(quant.get_format("Q4_K", cols), w, rows)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    k = ops.prefill_matmul(fmt, rows, cols, T, tile=tile)
    for n in range(1, T + 1):
        for t0 in sorted({0, n - 1}):
            y = run_on_device(cpu, k, {"w": w, "x": x.reshape(-1), "y": np.full(T * rows, 7.0, np.float32),
                                       "wdq": np.zeros(k.buffers["wdq"].size, np.float32)},
                              {"n_tokens": n, "t0": t0})["y"].reshape(T, rows)
            want = np.full((T, rows), 7.0, np.float32)
            want[t0:n] = x[t0:n] @ ref.reshape(rows, cols).T
            np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3, err_msg=f"n_tokens {n}, t0 {t0}")


@pytest.mark.parametrize("packed", [True, False], ids=["interleaved", "file"])
@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_1", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_cpu_prefill_matmul_matches_gguf(cpu, name, packed):
    """The prefill matmul (blocks of columns dequantized into scratch, multiplied by every token) against gguf's
    dequantized weights times the input in numpy: each layout a CPU holds, three slices of rows (a tile of 64
    each), more than one block of columns, bias, accumulate, a partial step and a whole one (tiles of 6 and 5
    tokens), a short step (its last tokens in a tile of T % 6), and a chunk of columns; with the IR's default tile
    and with the one this CPU gets (`ops.gemm_tile` of its registers)."""
    rows, cols, T = 192, 1024, 64
    rng = np.random.default_rng(13)
    w, ref = random_tensor(name, rows, cols, rng)
    fmt = quant.packed_format(quant.get_format(name, cols), rows) if packed else quant.get_format(name, cols)
    if packed and fmt.name == name:
        pytest.skip(f"{name} has no interleaved layout")
    w = quant.repack(quant.get_format(name, cols), w, rows) if packed else w
    x = rng.standard_normal((T, cols)).astype(np.float32)
    b, y0 = rng.standard_normal(rows).astype(np.float32), rng.standard_normal((T, rows)).astype(np.float32)
    tiles = sorted({ops.GEMM_TILE, ops.gemm_tile(cpu.caps.registers)})
    for tile, (chunk_cols, col0, n, t0) in [(g, c) for g in tiles for c in ((0, 0, 45, 3), (512, 512, 45, 3),
                                                                            (0, 0, T, 0), (0, 0, 15, 2))]:
        k = ops.prefill_matmul(fmt, rows, cols, T, accumulate=True, bias=True, chunk_cols=chunk_cols, tile=tile)
        y = run_on_device(cpu, k, {"w": w, "x": x.reshape(-1), "b": b, "y": y0.reshape(-1).copy(),
                                   "wdq": np.zeros(k.buffers["wdq"].size, np.float32)},
                          {"n_tokens": n, "t0": t0, "col0": col0})["y"].reshape(T, rows)
        cs = slice(col0, col0 + (chunk_cols or cols))
        want = y0.astype(np.float64)
        want[t0:n] += x[t0:n, cs].astype(np.float64) @ ref[:, cs].T.astype(np.float64) + b
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
