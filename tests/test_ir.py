"""The IR interpreter against plain NumPy, and every IR construct and op on cpu_llvm against the interpreter."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_check import assert_matches_interpreter, run_on_device
from ir_cases import CASES, inputs_for
from jitllm_core import interp, ir, ops, planner, quant


def matvec_kernel(rows, cols, kind):
    k = ir.Kernel(f"mv_{rows}x{cols}_{kind}")
    k.buffer("w", "f32", rows * cols), k.buffer("x", "f32", cols), k.buffer("y", "f32", rows, True)
    with k.parallel("r", rows) as r:
        k.store("y", r, ir.reduce("add", "c", cols, lambda c: k.load("w", r * cols + c) * k.load("x", c), kind))
    return k.finish()


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 40), kind=st.sampled_from(ir.REDUCE_KINDS))
def test_interpreter_matches_numpy(rows, cols, kind):
    rng = np.random.default_rng(rows * 100 + cols)
    w, x = rng.standard_normal(rows * cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    y = interp.run(matvec_kernel(rows, cols, kind), {"w": w, "x": x, "y": np.zeros(rows, np.float32)})["y"]
    np.testing.assert_allclose(y, w.reshape(rows, cols) @ x, rtol=1e-5, atol=1e-5)


def test_interpreter_storage_rounding():
    k = ir.Kernel("round")
    k.buffer("x", "f32", 4), k.buffer("h", "f16", 4, True), k.buffer("b", "bf16", 4, True)
    with k.parallel("i", 4) as i:
        k.store("h", i, k.load("x", i))
        k.store("b", i, k.load("x", i))
    x = np.array([1 / 3, -2.5e-3, 65519.0, 1e-8], np.float32)
    out = interp.run(k.finish(), {"x": x, "h": np.zeros(4, np.float16), "b": np.zeros(4, np.uint16)})
    np.testing.assert_array_equal(out["h"], x.astype(np.float16))
    torch = pytest.importorskip("torch")  # an independent round-to-nearest-even bf16 conversion
    np.testing.assert_array_equal(interp.bf16_to_f32(out["b"]), torch.tensor(x).to(torch.bfloat16).float().numpy())


def test_ir_rejects_malformed_kernels():
    k = ir.Kernel("bad")
    k.buffer("x", "f32", 4)
    with k.parallel("i", 4) as i:
        k.store("x", i, 1.0)
    with pytest.raises(ir.IRError, match="read-only"):
        k.finish()
    k = ir.Kernel("bad2")
    k.buffer("x", "f32", 4, True)
    with k.parallel("i", 4) as i:
        with k.parallel("j", 2):
            k.store("x", i, 1.0)
    with pytest.raises(ir.IRError, match="top level"):
        k.finish()
    k = ir.Kernel("bad3")
    k.buffer("x", "f32", 4, True)
    n = k.scalar("n")
    with k.parallel("i", n):
        k.let("n", n + 1)
    with pytest.raises(ir.IRError, match="shadows the scalar"):
        k.finish()


def test_a_shared_subexpression_is_checked_in_each_scope_it_is_used_in():
    """The check visits a node shared by several statements once a scope: used again outside the loop whose
    variable it reads, or after a name it reads is bound again to another type, it is an error still."""
    k = ir.Kernel("shared")
    k.buffer("x", "f32", 8, True)
    with k.parallel("i", 4) as i:
        with k.loop("j", 2) as j:
            e = (i * 2 + j) * 1
            k.store("x", e, 1.0)
        k.store("x", e, 2.0)  # j is out of scope here
    with pytest.raises(ir.IRError, match="unknown name 'j'"):
        k.finish()
    k = ir.Kernel("rebound")
    k.buffer("x", "f32", 8, True)
    with k.parallel("i", 4) as i:
        a = k.let("a", i + 1)
        e = (a * 2) + 1
        k.store("x", e, 1.0)
        k.let("a", ir.f32(i) + 0.5)  # a is an f32 from here on: the same index no longer type-checks
        k.store("x", e, 2.0)
    with pytest.raises(ir.IRError, match="mul of f32 and i32"):
        k.finish()


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_matches_interpreter(cpu, case):
    build, scalars = CASES[case]
    k = build()
    assert_matches_interpreter(cpu, k, inputs_for(k), scalars)


@pytest.mark.parametrize("width,isa", [(16, {"avx512bw"}), (16, set()), (8, {"avx512vnni", "avx512vl"}),
                                       (8, {"avx2"}), (8, set())],
                         ids=["16-maddubs", "16-plain", "8-vnni", "8-maddubs", "8-plain"])
def test_cpu_dot4_on_other_cpus(cpu, width, isa):
    """The lowerings of dot4 for CPUs without AVX-512 VNNI (pmaddubsw where the unsigned bytes are below 128, their
    pair sums added as i16 as far as their bound allows; widened bytes elsewhere) and with 8-lane vectors (AVX2,
    AVX-VNNI), on a device that makes such a CPU's programs (what this one lacks emulated): random bytes, and the
    extremes (nibbles of 15 times -128, where one more pair sum in an i16 would wrap)."""
    from jitllm_cpu_llvm import runtime
    dev = runtime.CpuDevice("cpu", 1, 1 << 30, width, isa)
    k = CASES["byte_dots"][0]()
    assert_matches_interpreter(dev, k, inputs_for(k), {})
    extremes = inputs_for(k)
    extremes["w"][:] = 0xFF
    extremes["x"][:] = np.int32(-0x7F7F7F80)  # bytes 0x80: -128 each
    assert_matches_interpreter(dev, k, extremes, {})


def test_interpreter_dot4_matches_numpy():
    rng = np.random.default_rng(4)
    a, b = (rng.integers(-2**31, 2**31, 64).astype(np.int32) for _ in range(2))
    k = ir.Kernel("dot4")
    k.buffer("a", "i32", 64), k.buffer("b", "i32", 64), k.buffer("o", "i32", 64, True)
    with k.parallel("i", 64) as i:
        k.store("o", i, ir.dot4(k.load("a", i), k.load("b", i)))
    got = interp.run(k.finish(), {"a": a, "b": b, "o": np.zeros(64, np.int32)})["o"]
    want = (a.view(np.uint8).reshape(64, 4).astype(np.int64) * b.view(np.int8).reshape(64, 4)).sum(1)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 13), cols=st.integers(1, 70), kind=st.sampled_from(ir.REDUCE_KINDS))
def test_cpu_matvec_random_shapes(cpu, rows, cols, kind):
    k = matvec_kernel(rows, cols, kind)
    assert_matches_interpreter(cpu, k, inputs_for(k, seed=rows + cols), {})


def op_examples():
    """Small instances of every model op, with scalars."""
    T, page, n_pages = 3, 4, 6
    return {
        "embed": (ops.embed(quant.FORMATS["Q8_0"], 5, 64, T), {"n_tokens": 2}),
        "rmsnorm": (ops.rmsnorm(64, T, 1e-5), {"n_tokens": 3, "t0": 1}),
        # a group of NORM_LANES tokens a lane each, then 3 one by one
        "rmsnorm_lanes": (ops.rmsnorm(16, 20, 1e-5), {"n_tokens": 20, "t0": 1}),
        "rmsnorm_wide": (ops.rmsnorm(64, T, 1e-5, wide=True), {"n_tokens": 3, "t0": 1}),
        "head_rmsnorm": (ops.head_rmsnorm(3, 8, T, 1e-6), {"n_tokens": 3, "t0": 1}),
        "matmul_q4_1": (ops.matmul(quant.FORMATS["Q4_1"], 5, 64, T, accumulate=True, bias=True), {"n_tokens": 3, "t0": 1}),
        "matmul_q4_k": (ops.matmul(quant.FORMATS["Q4_K"], 3, 256, T), {"n_tokens": 2, "t0": 0}),
        "matmul_q6_k": (ops.matmul(quant.FORMATS["Q6_K"], 3, 256, T), {"n_tokens": 2, "t0": 0}),
        # prefill matmuls, dequantizing blocks of columns into scratch: partial token tiles at both ends, the step's
        # last T % 6 tokens a tile of their own (small enough for every backend configuration;
        # test_cpu_prefill_matmul_matches_gguf covers long rows, several slices and the interleaved layouts)
        "prefill_matmul": (ops.prefill_matmul(quant.FORMATS["Q4_1"], 16, 32, 16, accumulate=True, bias=True),
                           {"n_tokens": 13, "t0": 1}),
        # a step long enough for tiles of 6 and 5 tokens (22 from t0's tile: 2 x 6 + 2 x 5), in a kernel whose
        # T % 6 tail tile is also of 5 tokens
        "prefill_matmul_long_step": (ops.prefill_matmul(quant.FORMATS["Q4_1"], 16, 32, 23), {"n_tokens": 22, "t0": 1}),
        # a tile of two row groups, a step of 3 tokens in one tile
        "prefill_matmul_small_step": (ops.prefill_matmul(quant.FORMATS["Q8_0"], 32, 32, T), {"n_tokens": 3, "t0": 0}),
        # a chunk of columns [col0, col0 + chunk_cols): its sum added into y
        "prefill_matmul_chunk_cols": (ops.prefill_matmul(quant.FORMATS["Q4_1"], 16, 96, 8, accumulate=True,
                                                         chunk_cols=32), {"n_tokens": 7, "t0": 1, "col0": 64}),
        "dequant": (quant.dequant_kernel(quant.FORMATS["Q4_1"], 8, 64), {}),
        "rope": (ops.rope(3, 8, T, 10), {"pos": 5, "n_tokens": 3, "t0": 1}),
        "kv_store_f16": (ops.kv_store(2, 8, T, page, n_pages, n_pages, "f16"), {"pos": 5, "n_tokens": 3}),
        # positions 3-5: the end of one page and the start of the next
        "kv_store_f32_two_pages": (ops.kv_store(2, 8, T, page, n_pages, n_pages, "f32"), {"pos": 3, "n_tokens": 3}),
        "attention_f32": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f32"), {"pos": 5, "n_tokens": 3, "t0": 1}),
        "attention_f16": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f16"), {"pos": 2, "n_tokens": 2, "t0": 0}),
        "attention_wide": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f16", wide=True),
                           {"pos": 5, "n_tokens": 3, "t0": 2}),
        # a sliding window of 6: positions 13-15 see from 8-10 on (their third page, part of it scored out)
        "attention_window": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f16", window=6),
                             {"pos": 13, "n_tokens": 3, "t0": 0}),
        "attention_wide_window": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f32", wide=True, window=6),
                                  {"pos": 13, "n_tokens": 3, "t0": 1}),
        "silu_mul": (ops.silu_mul(16, T), {"n_tokens": 2, "t0": 1}),
        # Gemma's: GELU (tanh form), a normed output joining the residual, capped logits and scores, scaled rows
        "gelu_mul": (ops.gelu_mul(16, T), {"n_tokens": 3, "t0": 1}),
        "add": (ops.add(16, T), {"n_tokens": 3, "t0": 1}),
        "add_scaled": (ops.add(16, T, 0.25), {"n_tokens": 3, "t0": 1}),  # Granite's residual multiplier
        "softcap": (ops.softcap(16, T, 3.0), {"n_tokens": 2, "t0": 1}),
        "attention_softcap": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f32", scale=0.25, softcap=2.0),
                              {"pos": 5, "n_tokens": 3, "t0": 1}),
        "attention_wide_softcap": (ops.attention(4, 2, 8, T, page, n_pages, n_pages, "f32", wide=True, scale=0.25,
                                                 softcap=2.0), {"pos": 5, "n_tokens": 3, "t0": 0}),
        "embed_scaled": (ops.embed(quant.FORMATS["Q8_0"], 5, 64, T, scale=8.0), {"n_tokens": 2}),
        # not a model's op: the kernel `jitllm bench --profile` measures a device's multiply-add peak with
        "multiply_add_peak": (planner.multiply_add_kernel(3, chains=4, columns=40), {}),
    }


def op_inputs(k):
    """Random inputs made valid: token ids in range, a shuffled page table, finite f16 scales in blocks."""
    bufs = inputs_for(k)
    rng = np.random.default_rng(1)
    if "tok" in bufs:
        bufs["tok"] = np.array([1, 4, 2], np.int32)
    if "ptab" in bufs:
        bufs["ptab"] = rng.permutation(bufs["ptab"].size).astype(np.int32)
    if k.buffers.get("w") is not None and k.buffers["w"].dtype == "u8":
        fmt = next(f for f in quant.FORMATS.values() if f"_{f.name}_" in k.name)
        blocks = bufs["w"].reshape(-1, fmt.unit)
        for o in fmt.halves:
            blocks[:, o:o + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    for name in ("kc", "vc"):
        if name in bufs and not k.buffers[name].write:
            bufs[name] = rng.standard_normal(bufs[name].size).astype(bufs[name].dtype)
    return bufs


def test_gemma_elementwise_ops(cpu):
    """GELU in its tanh form times the up projection (torch's gelu(approximate="tanh")), the capped logits and the
    residual join, for the tokens from t0 only."""
    torch = pytest.importorskip("torch")
    T, dim, cap = 4, 24, 3.0
    rng = np.random.default_rng(5)
    g, u, x = (rng.standard_normal((T, dim)).astype(np.float32) * 3 for _ in range(3))
    h = run_on_device(cpu, ops.gelu_mul(dim, T), {"g": g.ravel(), "u": u.ravel(), "h": np.zeros(T * dim, np.float32)},
                      {"n_tokens": T, "t0": 1})["h"].reshape(T, dim)
    want = torch.nn.functional.gelu(torch.from_numpy(g), approximate="tanh").numpy() * u
    np.testing.assert_allclose(h[1:], want[1:], rtol=1e-5, atol=1e-5)
    assert not h[0].any()
    capped = run_on_device(cpu, ops.softcap(dim, T, cap), {"x": x.ravel().copy()}, {"n_tokens": 3, "t0": 1})["x"]
    want = x.copy()
    want[1:3] = np.tanh(x[1:3] / cap) * cap
    np.testing.assert_allclose(capped.reshape(T, dim), want, rtol=1e-5, atol=1e-6)
    summed = run_on_device(cpu, ops.add(dim, T), {"y": g.ravel(), "x": x.ravel().copy()}, {"n_tokens": T, "t0": 2})["x"]
    np.testing.assert_array_equal(summed.reshape(T, dim), np.concatenate([x[:2], x[2:] + g[2:]]))


def test_head_rmsnorm_normalizes_each_head(cpu):
    """Qwen3's query and key norms: every head of the tokens from t0 over its own rms, times the weight, in place;
    the tokens before t0 left as they were."""
    heads, hd, T, eps = 4, 16, 5, 1e-6
    rng = np.random.default_rng(3)
    q, w = rng.standard_normal((T, heads, hd)).astype(np.float32), rng.uniform(0.5, 1.5, hd).astype(np.float32)
    got = run_on_device(cpu, ops.head_rmsnorm(heads, hd, T, eps), {"q": q.ravel().copy(), "w": w},
                        {"n_tokens": 4, "t0": 1})["q"].reshape(T, heads, hd)
    want = q.copy()
    want[1:4] = q[1:4] / np.sqrt((q[1:4] ** 2).mean(-1, keepdims=True) + eps) * w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_prefill_matmul_refuses_rows_that_are_not_whole_groups():
    """Its lanes are rows in groups of 16 (llama._prefill_matmul sends other matrices to the decode matmul)."""
    with pytest.raises(ir.IRError, match="not whole groups of 16"):
        ops.prefill_matmul(quant.FORMATS["F16"], 40, 32, 8)


def test_wide_attention_is_the_same_op():
    """The form for devices of many threads (every position at once, a head an iteration) computes what the paged
    form (the 3 heads that share a KV head an iteration) does."""
    page, n_pages, scalars = 4, 6, {"pos": 9, "n_tokens": 3, "t0": 0}
    paged, wide = (ops.attention(6, 2, 8, 3, page, n_pages, n_pages, "f32", wide=w) for w in (False, True))
    bufs = op_inputs(paged)
    want = interp.run(paged, {b: v.copy() for b, v in bufs.items()}, scalars)["out"]
    got = interp.run(wide, {b: v.copy() for b, v in bufs.items()}, scalars)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wide", [False, True], ids=["paged", "wide"])
@pytest.mark.parametrize("window", [5, 9, 64])
def test_cpu_sliding_window_attention(cpu, wide, window):
    """A token at position q attends to the keys of (q - window, q] (transformers' sliding window), computed in
    NumPy from the pool in the sequence's order; the pages wholly before a window hold NaN and are not read."""
    n_head, n_kv, hd, page, n_pages, T = 4, 2, 8, 4, 6, 3
    pos, n, t0 = 17, 3, 1  # queries at positions 18, 19 (their windows start on the third page or later, or at 0)
    k = ops.attention(n_head, n_kv, hd, T, page, n_pages, n_pages, "f32", wide=wide, window=window)
    bufs = op_inputs(k)
    where = np.argsort(bufs["ptab"])  # pool page -> the sequence's page it holds
    kc = bufs["kc"].reshape(n_pages, n_kv, hd, page).transpose(0, 3, 1, 2)[bufs["ptab"]].reshape(-1, n_kv, hd)
    vc = bufs["vc"].reshape(n_pages, page, n_kv, hd)[bufs["ptab"]].reshape(-1, n_kv, hd)
    q = bufs["q"].reshape(T, n_head, hd)
    want = np.zeros((T, n_head, hd))
    for t in range(t0, n):
        first = max(0, pos + t + 1 - window)
        for h in range(n_head):
            sc = kc[first:pos + t + 1, h // 2] @ q[t, h].astype(np.float64) / np.sqrt(hd)
            w = np.exp(sc - sc.max())
            want[t, h] = w @ vc[first:pos + t + 1, h // 2] / w.sum()
    first_page = max(0, pos + t0 + 1 - window) // page
    unread = where < first_page  # pool pages holding sequence pages before every query's window
    bufs["kc"].reshape(n_pages, -1)[unread] = np.nan
    bufs["vc"].reshape(n_pages, -1)[unread] = np.nan
    got = run_on_device(cpu, k, bufs, {"pos": pos, "n_tokens": n, "t0": t0})["out"].reshape(T, n_head, hd)
    np.testing.assert_allclose(got[t0:n], want[t0:n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wide", [False, True], ids=["paged", "wide"])
def test_cpu_attention_ignores_pool_positions_past_the_keys(cpu, wide):
    """What the pool holds past the last key (a page's unwritten slots: anything, NaN included) changes nothing."""
    n_head, n_kv, hd, page, n_pages = 4, 2, 8, 4, 6
    pos, n = 4, 2   # keys 0..5: the second page's last two slots are past them
    k = ops.attention(n_head, n_kv, hd, 3, page, n_pages, n_pages, "f32", wide=wide)
    bufs = op_inputs(k)
    where = np.argsort(bufs["ptab"])  # pool page -> the sequence's page it holds
    idx = np.arange(bufs["kc"].size)
    k_pos = where[idx // (n_kv * hd * page)] * page + idx % page                 # K pages [n_kv, hd, page]
    v_pos = where[idx // (page * n_kv * hd)] * page + idx // (n_kv * hd) % page  # V pages [page, n_kv, hd]
    scalars = {"pos": pos, "n_tokens": n, "t0": 0}
    want = interp.run(k, {b: v.copy() for b, v in bufs.items()}, scalars)["out"]
    bufs["kc"][k_pos >= pos + n] = np.nan
    bufs["vc"][v_pos >= pos + n] = np.nan
    got = run_on_device(cpu, k, bufs, scalars)["out"]
    np.testing.assert_allclose(got[:n * n_head * hd], want[:n * n_head * hd], rtol=1e-5, atol=1e-6)


def test_cpu_prefill_rmsnorm_sums_each_token_in_order(cpu):
    """A prefill step's rmsnorm (its tokens' sums of squares a lane each) gives, bit for bit, what the decode
    step's (one token's sum alone, in order) gives for each token: the lanes sum in the same order."""
    dim, T, n, t0 = 2048, 20, 19, 1
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((T, dim)) * rng.uniform(0.01, 100, (T, 1))).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    out = np.zeros(T * dim, np.float32)
    got = run_on_device(cpu, ops.rmsnorm(dim, T, 1e-5), {"x": x.ravel(), "w": w, "out": out},
                        {"n_tokens": n, "t0": t0})["out"].reshape(T, dim)
    for t in range(t0, n):
        one = run_on_device(cpu, ops.rmsnorm(dim, 1, 1e-5), {"x": x[t], "w": w, "out": out[:dim]},
                            {"n_tokens": 1, "t0": 0})["out"]
        assert np.array_equal(got[t], one), t


@pytest.mark.parametrize("op", sorted(op_examples()))
def test_cpu_ops_match_interpreter(cpu, op):
    k, scalars = op_examples()[op]
    assert_matches_interpreter(cpu, k, op_inputs(k), scalars, rtol=1e-4, atol=1e-4)


def test_cpu_programs_compile_no_code_of_their_own(cpu):
    """A CPU program is a table its kernels' entries are walked by (lower.RUNNER_IR): programs of the same kernels in
    other orders, on other buffers, timed or not, add no compiled module once the kernels' code exists -- and run
    each launch on its own buffers and scalars, in order, a barrier after those a later one reads."""
    from jitllm_core.plugin import Launch
    from jitllm_cpu_llvm import runtime

    def scaled(c):  # y[i] = x[i] * c + b
        k = ir.Kernel(f"scaled_{c}")
        k.buffer("x", "f32", 64), k.buffer("y", "f32", 64, True)
        b = k.scalar("b")
        with k.parallel("i", 64) as i:
            k.store("y", i, k.load("x", i) * c + ir.f32(b))
        return k.finish()

    two, three = scaled(2.0), scaled(3.0)
    x = np.arange(64, dtype=np.float32)
    bufs = {n: cpu.alloc(256) for n in "xyz"}
    cpu.upload(bufs["x"], x)
    cpu.program([Launch(two, {"x": bufs["x"], "y": bufs["y"]})]).ready()
    cpu.program([Launch(three, {"x": bufs["x"], "y": bufs["y"]})]).ready()
    before = set(runtime._COMPILED)
    chain = [Launch(three, {"x": bufs["x"], "y": bufs["z"]}, {"b": "b1"}),
             Launch(two, {"x": bufs["z"], "y": bufs["y"]}, {"b": "b2"})]
    cpu.program(chain).run({"b1": 1, "b2": 5})
    np.testing.assert_array_equal(cpu.download(bufs["y"]).view(np.float32), (x * 3 + 1) * 2 + 5)
    seconds = cpu.timed_program(chain[::-1]).run({"b1": 0, "b2": 0})  # y from the z above, then z anew
    assert len(seconds) == 2 and min(seconds) >= 0
    np.testing.assert_array_equal(cpu.download(bufs["y"]).view(np.float32), (x * 3 + 1) * 2)
    np.testing.assert_array_equal(cpu.download(bufs["z"]).view(np.float32), x * 3)
    assert set(runtime._COMPILED) == before, "a program compiled code of its own"
    for b in bufs.values():
        cpu.free(b)


def test_cpu_llvm_compile_error_names_the_device(cpu, tmp_path, monkeypatch):
    """A module LLVM refuses (compiled by a compile process, while the caller goes on): a clear error when it is
    waited for (a program's ready(), as the engine calls it before running programs), and again at each wait."""
    from jitllm_core.errors import BackendError
    from jitllm_cpu_llvm import runtime
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(tmp_path))
    compiled = cpu.compile("not-a-module", lambda: "define void @jl_step( {", "jl_step")
    try:
        with pytest.raises(BackendError, match=rf"{cpu.name}: LLVM compile failed"):
            compiled.wait()
        with pytest.raises(BackendError, match="LLVM compile failed"):
            compiled.wait()
    finally:
        del runtime._COMPILED["not-a-module"]


def test_cpu_llvm_compile_process_that_dies_is_an_error_naming_the_device(cpu, tmp_path, monkeypatch):
    """A compile process that ends without an answer (LLVM aborting on a module, or the process killed): the wait
    raises an error naming the device and what happened, and the next module gets a process of its own; where no
    process can be started (no Python executable), modules compile in the engine's process."""
    from jitllm_core.errors import BackendError
    from jitllm_core.cache import write_atomic
    from jitllm_cpu_llvm import compiler, lower, runtime
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_COMPILERS", compiler.Compilers(1, write_atomic))
    step = "define void @jl_step(ptr, ptr, i32, i32, ptr, ptr) { ret void }"
    for name, python in (("dies", "/bin/false"), ("here", tmp_path / "none"), ("lives", compiler.sys.executable)):
        monkeypatch.setattr(compiler.sys, "executable", str(python))  # /bin/false: a "compiler" that exits at once
        compiled = cpu.compile(name, lambda: step, "jl_step")
        try:
            if name == "dies":
                with pytest.raises(BackendError, match=rf"{cpu.name}: LLVM compile failed: the compile process ended"):
                    compiled.wait()
            else:
                assert compiled.wait()
        finally:
            del runtime._COMPILED[name]
    # the object code not written (a full disk, a cache gone): the error says so, and the process goes on -- the
    # same where modules compile in the engine's process
    for python in (compiler.sys.executable, tmp_path / "none"):
        monkeypatch.setattr(compiler.sys, "executable", str(python))
        # a thread of its own: no process yet
        monkeypatch.setattr(runtime, "_COMPILERS", compiler.Compilers(1, write_atomic))
        with pytest.raises(RuntimeError, match="FileNotFoundError"):
            runtime._COMPILERS.submit(step, lower.SUPPORT_IR, True, tmp_path / "gone" / "x.o").result()
        assert runtime._COMPILERS.submit(step, lower.SUPPORT_IR, True, tmp_path / "x.o").result() is None


def test_prefetch_is_a_hint_of_a_buffer_the_kernel_has():
    """A prefetch names one of the kernel's buffers and an i32 index; it shows in the kernel's text (so in its key)
    and changes nothing the kernel computes (the interpreter skips it)."""
    k = ir.Kernel("prefetching")
    k.buffer("x", "f32", 8), k.buffer("y", "f32", 8, True)
    with k.parallel("i", 8) as i:
        k.prefetch("x", ir.vmin(i + 4, 7), 4, near=False)
        k.store("y", i, k.load("x", i) * 2.0)
    k.finish()
    assert "prefetch.far x[" in ir.dump(k)
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(interp.run(k, {"x": x, "y": np.zeros(8, np.float32)}, {})["y"], 2 * x)
    bad = ir.Kernel("prefetching_nothing")
    bad.buffer("y", "f32", 8, True)
    with bad.parallel("i", 8) as i:
        bad.prefetch("x", i, 1)
    with pytest.raises(ir.IRError, match="unknown buffer 'x'"):
        bad.finish()


def test_shared_subexpressions_print_and_type_as_their_trees():
    """A kernel's text (its cache key's input) spells a shared subexpression out wherever it is used, as the same
    tree built twice would be; an unknown operator is `check`'s error, not one of building the expression."""
    def kernel(shared):
        k = ir.Kernel("shared")
        k.buffer("x", "f32", 8), k.buffer("y", "f32", 8, True)
        with k.parallel("i", 8) as i:
            term = lambda: k.load("x", i) * 2.0 + 1.0
            t = term()
            k.store("y", i, t * t if shared else term() * term())
        return k.finish()

    assert ir.dump(kernel(True)) == ir.dump(kernel(False))
    assert kernel(True).key() == kernel(False).key()
    assert ir.Bin("lt", ir.Const(1.0, "f32"), ir.Const(2.0, "f32")).dtype == "bool"
    for op in (ir.Un("cube", ir.Const(1.0, "f32")), ir.Bin("pow", ir.Const(1.0, "f32"), ir.Const(2.0, "f32"))):
        k = ir.Kernel("bad_op")
        k.buffer("y", "f32", 1, True)
        with k.parallel("i", 1):
            k.store("y", 0, op)
        with pytest.raises(ir.IRError, match="unknown"):
            k.finish()


def test_multiply_add_meter_sums_its_chains_and_counts_their_flops(cpu):
    """planner.multiply_add_peak's kernel computes what its docstring says (on the interpreter; the backends against
    it among the op examples), its flops are its products and sums, and the peak it measures is as many FLOP/s."""
    k = planner.multiply_add_kernel(3, chains=4, columns=40)
    x = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    bufs = {"x": x, "y": np.zeros(3 * 16, np.float32)}
    want = sum((np.arange(16) + i) * np.float32(1e-3) for i in range(4)) * x.sum(dtype=np.float64)
    np.testing.assert_allclose(interp.run(k, {n: a.copy() for n, a in bufs.items()}, {})["y"], np.tile(want, 3),
                               rtol=1e-4, atol=1e-5)
    assert k.flops(1) == 2 * 3 * 16 * 4 * 40
    assert planner.multiply_add_peak(cpu, runs=1, slices=2) > 1e8
