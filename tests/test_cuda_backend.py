"""The CUDA backend (plugins/cuda).

Without a GPU: every IR case lowers to CUDA C and NVRTC compiles it to sm_90 and sm_75 cubins; the source is
deterministic; the probe names its reason; compile_ahead reports; the generated source, run on the host by
tests/cuda_host_emu.py, computes what the interpreter computes; and the GPU tests run through the real
cuda-bindings against a stand-in driver (tests/cuda_fake). With a GPU (else skipped with the probe's reason) the
test_gpu_* tests run on cuda:0: every case against the interpreter, programs re-run with new scalars, transfers.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend_check import assert_matches_interpreter, assert_timed_program_times_each_launch
from ir_cases import CASES, inputs_for, reductions
from jitllm_core import interp, ir, quant
from jitllm_core.errors import BackendError
from jitllm_core.plugin import BackendUnavailable, Buffer, Launch

jitllm_cuda = pytest.importorskip("jitllm_cuda", reason="the jitllm-cuda plugin is not installed")
import cuda_host_emu as emu  # noqa: E402
from jitllm_cuda import compiler  # noqa: E402
from jitllm_cuda.backend import CudaBackend  # noqa: E402
from jitllm_cuda.lower import lower  # noqa: E402

F = ir.f32


# ----------------------------------------------------------------------------------------------- extra kernels
# Shapes the shared cases do not reach: warp-per-iteration loops, run-time extents, 8/16-bit atomics, top-level
# definitions across barriers, repeated names, i32 wrap-around and empty reductions.
def coop_dynamic(rows=9, cols=70):
    k = ir.Kernel("coop_dynamic")
    k.buffer("x", "f32", rows * cols), k.buffer("xi", "i32", rows * cols), k.buffer("s", "f32", rows * cols, True)
    k.buffer("o", "f32", rows * 2, True), k.buffer("oi", "i32", rows * 3, True), k.buffer("u", "f32", rows * cols, True)
    n = k.scalar("n")
    with k.parallel("r", n) as r:
        with k.loop("c", cols, "vector") as c:
            k.store("s", r * cols + c, k.load("x", r * cols + c) * 2.0)
        k.barrier()
        tot = k.let("tot", ir.reduce("add", "c", cols, lambda c: k.load("s", r * cols + (cols - 1 - c)), "reduce"))
        k.store("o", r * 2, tot)
        k.atomic_add("o", r * 2 + 1, tot)
        k.store("u", r * cols, tot)                       # one store for the iteration...
        with k.loop("c", cols - 1, "vector") as c:        # ...that every lane then reads back
            k.store("u", r * cols + 1 + c, k.load("u", r * cols) + F(c))
        for j, op in enumerate(("add", "max", "min")):
            k.store("oi", r * 3 + j, ir.Reduce(op, "c", ir.as_expr(cols), k.load("xi", r * cols + ir.Var("c")),
                                               "reduce"))
    return k.finish()


def narrow_atomics(n=200, bins=8):
    k = ir.Kernel("narrow_atomics")
    k.buffer("x", "i32", n)
    for d in ("f16", "bf16", "u8", "i8"):
        k.buffer(d, d, bins, True)
    with k.parallel("i", n) as i:
        b = k.load("x", i) & (bins - 1)
        k.atomic_add("f16", b, 0.25)
        k.atomic_add("bf16", b, 0.5)
        k.atomic_add("u8", b, 3)
        k.atomic_add("i8", b, -5)
    with k.parallel("g", 3) as g:   # cooperative: the atomic must happen once per iteration, not once per lane
        with k.loop("j", 4, "vector") as j:
            k.atomic_add("f16", j, 1.0)
        k.atomic_add("u8", g, 1)
    return k.finish()


def top_level(n=16):
    k = ir.Kernel("top_level")
    k.buffer("x", "f32", n), k.buffer("t", "f32", n, True), k.buffer("o", "f32", n + 8, True)
    m = k.let("m", n)
    base = k.local("base", 2)
    k.assign(base, base + 1)
    with k.parallel("i", m) as i:
        k.store("t", i, k.load("x", i) + F(base))
    with k.parallel("z", m - n) as z:   # empty
        k.store("o", z, 99.0)
    k.barrier()
    first = k.let("first", k.load("t", 0))
    with k.parallel("i", m) as i:
        k.store("o", i, k.load("t", (i + 1) % n) * first)
    with k.loop("j", 4, "serial") as j:
        k.store("o", n + j, F(j) + first)
    k.barrier()
    k.store("o", n + 4, ir.reduce("add", "c", n, lambda c: k.load("o", c), "reduce"))
    return k.finish()


def names_and_edges(n=8):
    k = ir.Kernel("names_and_edges")
    k.buffer("x", "f32", n), k.buffer("a", "i32", n), k.buffer("o", "f32", n * 3, True)
    k.buffer("oi", "i32", n * 6, True), k.buffer("v", "f32", n)
    with k.parallel("i", n) as i:
        v = k.let("v", k.load("x", i))
        v = k.let("v", v * 2.0)                      # the same name again
        k.store("o", i * 3, v + k.load("v", i))      # and a buffer of that name
        k.store("o", i * 3 + 2, ir.reduce("max", "c", 0, lambda c: k.load("x", c)))   # empty: -inf
        k.store("oi", i * 6 + 5, ir.i32(ir.Const(float("inf"), "f32")))              # non-finite -> 0
        a = k.load("a", i)
        k.store("oi", i * 6, a * 65537 + 2147483647)                                  # wraps
        k.store("oi", i * 6 + 1, ir.Un("neg", ir.as_expr(-2**31)) + a)
        k.store("oi", i * 6 + 2, a << 30)
        k.store("oi", i * 6 + 3, ir.Reduce("min", "c", ir.as_expr(0), ir.Var("c")))  # empty: INT_MAX
        k.store("oi", i * 6 + 4, ir.i32(F(a) / 7.0))
        with k.loop("j", 2, "serial", start=i) as j:     # a start naming an outer variable of the same name
            with k.loop("j", 1, "serial", start=j + 1) as j2:
                k.store("o", i * 3 + 1, F(j2))
    return k.finish()


def flat_vector(rows=5, cols=37):
    """Elementwise vector loops under a parallel loop (a thread per element): a start that names the iteration, and
    a run-time iteration count."""
    k = ir.Kernel("flat_vector")
    k.buffer("x", "f32", rows * cols), k.buffer("o", "f32", rows * cols, True), k.buffer("p", "f32", rows * cols, True)
    with k.parallel("r", rows) as r:
        with k.loop("c", cols - 2, "vector", start=r % 3) as c:
            k.store("o", r * cols + c, k.load("x", r * cols + c) * 2.0 + F(r))
    with k.parallel("r", k.scalar("n")) as r:
        with k.loop("c", cols, "vector") as c:
            k.store("p", r * cols + c, k.load("x", r * cols + c) - F(c))
    return k.finish()


def vector_loads(rows=6, n=32):
    """Reductions a thread runs alone over contiguous elements of every storage type (uint4 loads), mixed widths
    in one sum, an offset that is not a multiple of 16 bytes (plain loads), and a run-time extent."""
    k = ir.Kernel("vector_loads")
    types = ("f32", "f16", "bf16", "u8", "i8", "i32")
    for d in types:
        k.buffer(d, d, rows * n + 8)
    k.buffer("o", "f32", rows * 4, True), k.buffer("oi", "i32", rows, True)
    m = k.scalar("m")
    with k.parallel("r", rows) as r:
        k.store("o", r * 4, ir.reduce("add", "j", n, lambda j: k.load("f32", r * n + j) * k.load("f16", r * n + j)
                                      + k.load("bf16", r * n + j) - F(k.load("u8", r * n + j)), "serial"))
        k.store("o", r * 4 + 1, ir.reduce("max", "j", n, lambda j: F(k.load("i8", r * n + j)), "unroll"))
        k.store("o", r * 4 + 2, ir.reduce("add", "j", n, lambda j: k.load("f32", r * n + 1 + j)))
        k.store("o", r * 4 + 3, ir.reduce("add", "j", m, lambda j: k.load("f16", r * n + j)))
        k.store("oi", r, ir.Reduce("add", "j", ir.as_expr(n), k.load("i32", r * n + ir.Var("j")), "serial"))
    return k.finish()


def staged_serial(rows=6, cols=203):
    """Serial reductions of constant extent in loops whose lanes cooperate (a block per row; a warp per row for 300
    rows), f32 and i32, two in one iteration (the staging memory reused), one reading what the lanes just stored;
    a multiple of 4 columns is read back 16 bytes at a time."""
    k = ir.Kernel("staged_serial")
    k.buffer("x", "f32", rows * cols), k.buffer("a", "i32", rows * cols), k.buffer("o", "f32", rows * cols, True)
    k.buffer("s", "f32", rows * 2, True), k.buffer("si", "i32", rows, True)
    with k.parallel("r", rows) as r:
        x = lambda c: k.load("x", r * cols + c)
        ss = k.let("ss", ir.reduce("add", "c", cols, lambda c: x(c) * x(c), "serial"))
        with k.loop("c", cols, "vector") as c:
            k.store("o", r * cols + c, x(c) / (ss + 1.0))
        k.store("s", r * 2, ss)
        k.store("s", r * 2 + 1, ir.reduce("add", "c", cols, lambda c: k.load("o", r * cols + c) * 3.0, "serial"))
        k.store("si", r, ir.Reduce("add", "c", ir.as_expr(cols), k.load("a", r * cols + ir.Var("c")), "serial"))
    return k.finish()


def wide_dot(name):
    """A quantized format's row dots in the form GPUs get (Format.row_dot(wide=True)): (kernel, buffers)."""
    from test_quant_formats import row_dot_case
    return row_dot_case(name, True, 3)[:2]


WIDE = sorted(n for n, f in quant.FORMATS.items() if f.storage == "u8")  # every quantized format


EXTRA = {
    "staged_serial": (staged_serial, {}),
    "staged_serial_warps": (lambda: staged_serial(rows=300, cols=204), {}),
    "warp_reductions": (lambda: reductions(rows=300), {"n": 13}),
    "coop_dynamic": (coop_dynamic, {"n": 7}),
    "narrow_atomics": (narrow_atomics, {}),
    "top_level": (top_level, {}),
    "names_and_edges": (names_and_edges, {}),
    "flat_vector": (flat_vector, {"n": 4}),
    "vector_loads": (vector_loads, {"m": 20}),
}
ALL = {**CASES, **EXTRA}


# ----------------------------------------------------------------------------------------------- no GPU needed
@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
@pytest.mark.parametrize("name", list(ALL))
def test_lowers_and_compiles(name, arch):
    cubin, _ = compiler.compile_cubin(lower(ALL[name][0]()).source, arch, name)
    assert cubin[:4] == b"\x7fELF"


def test_mapping_choices():
    """Few or run-time iterations: a block each; many: a warp each; an elementwise vector loop: a thread per
    element; a global barrier splits the kernel."""
    from jitllm_core import ops
    assert "block task" in lower(reductions(rows=5)).source
    assert "warp task" in lower(reductions(rows=300)).source
    assert "block task" in lower(coop_dynamic()).source
    assert "flat task" in lower(ops.silu_mul(64, 4)).source
    assert lower(flat_vector()).source.count("flat task") == 2
    # 16-byte loads, per 16 steps of the first sum: f32 x4, f16 x2, bf16 x2, u8 x1; one per iteration of the i8
    # and i32 sums; none in the unaligned and run-time sums
    assert lower(vector_loads()).source.count("*(const uint4*)") == 4 + 2 + 2 + 1 + 1 + 1
    assert "thread task" in lower(CASES["elementwise_f32"][0]()).source
    # serial sums of constant extent in a cooperative iteration: the terms staged in shared memory by the lanes
    assert lower(staged_serial()).source.count("__shared__ __align__(16) float jl_stage") == 2
    assert "__shared__ __align__(16) float jl_stage[4][204]" in lower(staged_serial(rows=300, cols=204)).source
    assert "float4" not in lower(staged_serial()).source   # 16-byte reads only where the rows stay aligned
    assert "__shared__ __align__(16) float jl_stage[1][2048]" in lower(ops.rmsnorm(2048, 1, 1e-5)).source
    # a GPU's Q4_K row dot: a lane's step reads its block's header (16 bytes), 4 words of nibbles and 8 x 4 inputs
    # with one load each; Q6_K's blocks (210 bytes) are not word-aligned: only its inputs are merged
    from jitllm_core import quant
    q4k = lower(ops.matmul(quant.get_format("Q4_K", 2048), 64, 2048, 1, wide=True)).source
    assert q4k.count("const uint4 jl_m") == 1 + 8 and q4k.count("const unsigned jl_m") == 4
    q6k = lower(ops.matmul(quant.get_format("Q6_K", 2048), 64, 2048, 1, wide=True)).source
    assert q6k.count("const uint4 jl_m") == 8 and "const unsigned jl_m" not in q6k
    assert len(lower(CASES["barriers"][0]()).dispatches) == 2
    assert len(lower(top_level()).dispatches) == 3


@pytest.mark.parametrize("name", list(ALL))
def test_source_is_deterministic(name):
    build = ALL[name][0]
    a, b = lower(build()), lower(build())
    assert a == b
    assert compiler.cache_key(a.source, "sm_90") == compiler.cache_key(b.source, "sm_90")
    assert compiler.cache_key(a.source, "sm_90") != compiler.cache_key(a.source, "sm_75")


@pytest.mark.skipif(not emu.available(), reason="no g++ for the host emulation")
@pytest.mark.parametrize("name", list(ALL))
def test_generated_source_matches_interpreter(name):
    build, scalars = ALL[name]
    k = build()
    assert_matches_interpreter(emu.EmuDevice(), k, inputs_for(k), scalars)


@pytest.mark.skipif(not emu.available(), reason="no g++ for the host emulation")
@pytest.mark.parametrize("name", ["staged_serial", "staged_serial_warps"])
def test_staged_serial_sums_keep_the_order(name):
    """A staged serial sum adds the same terms in the same order as the interpreter: equal bit for bit."""
    build, scalars = ALL[name]
    k = build()
    assert_matches_interpreter(emu.EmuDevice(), k, inputs_for(k), scalars, rtol=0, atol=0)


@pytest.mark.parametrize("name", WIDE)
def test_wide_row_dots_compile_with_nvrtc(name):
    cubin, _ = compiler.compile_cubin(lower(wide_dot(name)[0]).source, "sm_90", f"dot_{name}")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not emu.available(), reason="no g++ for the host emulation")
@pytest.mark.parametrize("name", WIDE)
def test_wide_row_dots_match_interpreter(name):
    """The quantized dots as a GPU runs them (formats may split their blocks over lanes their own way)."""
    k, bufs = wide_dot(name)
    assert_matches_interpreter(emu.EmuDevice(), k, bufs, {})


@pytest.mark.skipif(not emu.available(), reason="no g++ for the host emulation")
@pytest.mark.parametrize("name", ["attention_f16", "attention_wide", "attention_window", "attention_wide_window",
                                  "attention_softcap", "attention_wide_softcap", "gelu_mul", "softcap",
                                  "head_rmsnorm", "multiply_add_peak"])
def test_attention_matches_interpreter(name):
    """Attention in both forms (the paged one, and the one GPUs get: a lane per position, then per dimension),
    windowed and capped, Qwen3's per-head norms of its queries and keys, Gemma's GELU and capped logits, and the
    bench's multiply-add meter."""
    from test_ir import op_examples, op_inputs
    k, scalars = op_examples()[name]
    assert_matches_interpreter(emu.EmuDevice(), k, op_inputs(k), scalars, rtol=1e-4, atol=1e-4)


def test_top_level_assign_in_control_flow_is_refused():
    k = ir.Kernel("bad_top")
    k.buffer("o", "f32", 1, True)
    acc = k.local("acc", 0.0)
    with k.loop("j", 3, "serial"):
        k.assign(acc, acc + 1.0)
    with k.parallel("i", 1):
        k.store("o", 0, acc)
    with pytest.raises(BackendError, match="top-level local"):
        lower(k.finish())


def test_compile_ahead_report(tmp_path, monkeypatch):
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(tmp_path))
    kernels = [CASES["reductions"][0](), CASES["atomics"][0]()]
    first = CudaBackend.compile_ahead(kernels, "sm_90")
    assert [r["name"] for r in first] == ["reductions", "atomics"]
    assert all(r["bytes"] > 0 and r["seconds"] >= 0 and not r["cached"] for r in first)
    again = CudaBackend().compile_ahead(kernels, "sm_90")
    assert all(r["cached"] for r in again) and [r["bytes"] for r in again] == [r["bytes"] for r in first]
    assert len(list((tmp_path / "cuda").glob("*.cubin"))) == 2


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(BackendError, match=r"unknown GPU architecture 'sm_12'.*sm_90"):
        CudaBackend.compile_ahead([CASES["atomics"][0]()], "sm_12")
    with pytest.raises(BackendError, match="unknown GPU architecture"):
        CudaBackend.compile_ahead([], "gfx90a")


def test_model_kernels_compile():
    """Every kernel of the default model (the core's op builders) compiles for sm_90 and sm_75."""
    from jitllm_core.llama import interleaves, model_kernels
    from jitllm_core.models import default_model_path
    try:
        path = default_model_path()
    except Exception as e:
        pytest.skip(f"default model not available: {e}")
    kernels = model_kernels(path, interleave=interleaves(CudaBackend.threads))
    for arch in ("sm_90", "sm_75"):
        report = CudaBackend.compile_ahead(kernels, arch)
        assert len(report) == len(kernels) and all(r["bytes"] > 0 for r in report)


def test_hooks_and_lazy_driver_import():
    (backend,) = jitllm_cuda.jitllm_backends()
    assert backend.name == "cuda"
    assert {p.mechanism for p in jitllm_cuda.jitllm_transfer_paths()} == {"peer", "host-staged"}
    code = "import sys, jitllm_cuda; jitllm_cuda.jitllm_transfer_paths(); print('cuda.bindings.driver' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


_BACKEND = CudaBackend()   # one probe per test process: device objects are shared by the tests


def _probe():
    try:
        return _BACKEND.probe(), None
    except BackendUnavailable as e:
        return [], str(e)


def test_probe_reports_reason_or_devices():
    devices, reason = _probe()
    if devices:
        d = devices[0]
        assert d.name == "cuda:0" and d.caps.subgroup_size == 32 and d.caps.memory_bytes > 0
    else:
        assert reason.startswith("CUDA driver not available") or "compute capability" in reason


def test_stand_in_driver_runs_the_gpu_tests(tmp_path):
    """The runtime (contexts, staged copies, graph capture, scalars, transfer paths) through the real cuda-bindings,
    on tests/cuda_fake's libcuda, with kernels run by the host emulation."""
    if _probe()[0]:
        pytest.skip("a GPU is present: the test_gpu_* tests run on it")
    if not (emu.available() and shutil.which("gcc")):
        pytest.skip("no gcc/g++ to build the stand-in driver and the emulation")
    import cuda_fake
    here = Path(__file__).parent
    env = {**os.environ, "LD_LIBRARY_PATH": f"{cuda_fake.build(tmp_path)}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    code = (f"import sys, pytest, cuda_fake; cuda_fake.install(); "
            f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-k', 'test_gpu_', {str(here / Path(__file__).name)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert r.returncode == 0 and "skipped" not in summary, r.stdout[-5000:] + r.stderr[-2000:]


# ----------------------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def gpu():
    devices, reason = _probe()
    if not devices:
        pytest.skip(reason)
    return devices[0]


@pytest.mark.parametrize("name", list(ALL))
def test_gpu_case(gpu, name):
    build, scalars = ALL[name]
    k = build()
    assert_matches_interpreter(gpu, k, inputs_for(k), scalars)


@pytest.mark.parametrize("name", ["staged_serial", "staged_serial_warps"])
def test_gpu_staged_serial_sums_keep_the_order(gpu, name):
    build, scalars = ALL[name]
    k = build()
    assert_matches_interpreter(gpu, k, inputs_for(k), scalars, rtol=0, atol=0)


@pytest.mark.parametrize("name", WIDE)
def test_gpu_wide_row_dots(gpu, name):
    k, bufs = wide_dot(name)
    assert_matches_interpreter(gpu, k, bufs, {})


def test_gpu_program_reuses_its_graph_with_new_scalars(gpu):
    """One program, several steps: scalars change, the captured graph does not; launches run in order."""
    k = CASES["scalar_params"][0]()
    bump = ir.Kernel("bump")
    bump.buffer("o", "f32", 30, True)
    with bump.parallel("i", bump.scalar("m")) as i:
        bump.store("o", i, bump.load("o", i) * 2.0)
    bump.finish()
    x = inputs_for(k)["x"]
    bx, bo = gpu.alloc(x.nbytes), gpu.alloc(30 * 4)
    try:
        gpu.upload(bx, x)
        prog = gpu.program([Launch(k, {"x": bx, "o": bo}), Launch(bump, {"o": bo}, {"m": "m2"})])
        for m, off, m2 in [(20, 6, 20), (5, 0, 30), (24, 3, 1)]:
            gpu.upload(bo, np.zeros(30, np.float32))
            prog.run({"m": m, "off": off, "m2": m2})
            want = interp.run(k, {"x": x, "o": np.zeros(30, np.float32)}, {"m": m, "off": off})["o"]
            want = interp.run(bump, {"o": want}, {"m": m2})["o"]
            np.testing.assert_allclose(gpu.download(bo).view(np.float32), want, rtol=1e-6)
        with pytest.raises(BackendError, match="m2"):
            prog.run({"m": 1, "off": 0})
    finally:
        gpu.free(bx)
        gpu.free(bo)


def test_gpu_timed_program_times_each_launch(gpu):
    """A timed program (the profile's): events recorded inside the graph, before the first launch and after each.
    16M elements: on the stand-in driver each launch's 512 blocks of 128 threads cost ~240 ms however small its
    extent, and 4M elements of work stood only ~20 ms above that, within the runs' spread (a CI run saw the
    small launch's least the longer); 16M stand ~120 ms above."""
    assert_timed_program_times_each_launch(gpu, 1 << 24)


@pytest.mark.parametrize("nbytes", [1, 4096, 8 << 20, (16 << 20) + 12345])
def test_gpu_upload_download_round_trip(gpu, nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes).astype(np.uint8)
    b = gpu.alloc(nbytes + 100)
    try:
        gpu.upload(b, data, 100)
        assert np.array_equal(gpu.download(b, nbytes, 100), data)
    finally:
        gpu.free(b)


class _HostDevice:
    """Another API's device (as vulkan is to cuda): bytes move only through its own upload/download."""
    backend, name = "host-test", "host-test"

    def alloc(self, nbytes):
        buf = Buffer(self, nbytes)
        buf.mem = np.zeros(nbytes, np.uint8)
        return buf

    def upload(self, buf, data, offset=0):
        buf.mem[offset:offset + data.nbytes] = data.reshape(-1).view(np.uint8)

    def download(self, buf, nbytes=None, offset=0):
        return buf.mem[offset:offset + (buf.nbytes - offset if nbytes is None else nbytes)].copy()


def _other_devices(gpu):
    from jitllm_core import registry
    others = [_HostDevice()] + [d for d in registry.all_devices().values() if d.backend in ("cpu", "vulkan")]
    devices, _ = _probe()
    return others + [d for d in devices if d is not gpu]


def test_gpu_transfer_paths(gpu):
    from jitllm_cuda.transfer import CudaPeer, CudaStaged
    n = (16 << 20) + 777   # three pinned chunks
    data = np.random.default_rng(1).integers(0, 256, n).astype(np.uint8)
    src = gpu.alloc(n)
    gpu.upload(src, data)
    for other in _other_devices(gpu):
        paths = [p for p in (CudaPeer(), CudaStaged()) if p.supports(gpu, other)]
        assert paths and all(p.supports(other, gpu) for p in paths), other.name
        for path in paths:
            mid, back = other.alloc(n + 8), gpu.alloc(n + 8)
            path.copy(src, 0, mid, 8, n)
            assert np.array_equal(other.download(mid, n, 8), data), (path.mechanism, other.name)
            path.copy(mid, 8, back, 3, n - 5)
            assert np.array_equal(gpu.download(back, n - 5, 3), data[:n - 5]), (path.mechanism, other.name)
            gpu.free(back)
            if hasattr(other, "free"):
                other.free(mid)
    gpu.free(src)

