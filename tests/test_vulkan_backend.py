"""The Vulkan backend (plugins/vulkan) against the reference interpreter, on vulkan:0 (lavapipe here).

The fallbacks are forced by env vars that the device reads when it is set up, and lavapipe reads
LP_NATIVE_VECTOR_WIDTH (its subgroup size) when the instance is created, so those configurations re-run this
file in a subprocess. Everything skips with the probe's reason when there is no Vulkan device.
"""
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest

from backend_check import assert_matches_interpreter, assert_timed_program_times_each_launch, run_on_device
from conftest import missing
from ir_cases import CASES, inputs_for
from jitllm_core import interp, ir, quant
from jitllm_core.errors import BackendError
from jitllm_core.plugin import BackendUnavailable, Buffer, Caps, Device, Launch

try:
    import jitllm_vulkan as jv
except ImportError:
    missing("vulkan", "the jitllm-vulkan plugin is not installed", module=True)
from jitllm_vulkan.glsl import LoweringError, Target, lower  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = os.environ.get("JITLLM_VULKAN_TEST_CHILD") == "1"
big_buffers = pytest.mark.skipif("JITLLM_VULKAN_MAX_RANGE" in os.environ,
                                 reason="megabyte buffers need too many descriptors at the forced range")


@pytest.fixture(scope="module")
def dev():
    try:
        return jv.VulkanBackend().probe()[0]
    except BackendUnavailable as e:
        missing("vulkan", f"no Vulkan device: {e}")


def _kernel(name, build):
    k = ir.Kernel(name)
    build(k)
    return k.finish()


# ----------------------------------------------------------------------------------------------- IR on device
@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_interpreter(dev, case):
    build, scalars = CASES[case]
    k = build()
    assert_matches_interpreter(dev, k, inputs_for(k), scalars)


def _op_examples():
    from test_ir import op_examples, op_inputs  # the lead's list of every model op at small shapes
    return op_examples(), op_inputs


@pytest.mark.parametrize("op", sorted(_op_examples()[0]))
def test_op_matches_interpreter(dev, op):
    examples, op_inputs = _op_examples()
    k, scalars = examples[op]
    assert_matches_interpreter(dev, k, op_inputs(k), scalars, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("JITLLM_VULKAN_MAX_RANGE" in os.environ,
                    reason="at the forced 256-byte range every byte load picks among a dozen buffers: a k-quant's dots "
                           "take a minute on lavapipe (the split itself is checked by the other cases)")
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("name", sorted(n for n, f in quant.FORMATS.items() if f.storage == "u8"))
def test_format_row_dots_match_gguf(dev, name, wide):
    """Every quantized format's dots, in both forms, on the GPU backend: a format added to the core needs no
    plugin change."""
    from test_quant_formats import row_dot_case
    k, bufs, ref = row_dot_case(name, wide, 5)
    want = ref.astype(np.float64) @ bufs["x"]
    y = run_on_device(dev, k, bufs, {})["y"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif("JITLLM_VULKAN_MAX_RANGE" in os.environ,
                    reason="the raw bytes at a 256-byte range need more descriptors than a shader may have (the engine "
                           "then repacks on the host, `Engine._repack`)")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_repack_kernel_writes_what_numpy_writes(dev, name):
    """A device repacks its weights with the core's kernels (`quant.repack_kernel`): lavapipe interleaves, as a CPU
    of few threads; Q6_K's rows of 630 bytes start mid-word every other row."""
    from test_quant_formats import repack_kernel_case
    k, bufs, want = repack_kernel_case(name, 32, 768)
    np.testing.assert_array_equal(run_on_device(dev, k, bufs, {})["out"].view(np.uint8), want)


@big_buffers
def test_half_conversions_round_to_nearest_even(dev):
    """f32 -> f16/bf16 stores (ties, subnormals, overflow, inf/nan) and every f16 bit pattern loaded back."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    fin = np.sort(halves[np.isfinite(halves)].astype(np.float32))
    mids = ((fin[1:].astype(np.float64) + fin[:-1]) / 2).astype(np.float32)  # exact ties
    rnd = np.random.default_rng(0).integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([65504, 65519.996, 65520, 1e6, np.inf, -np.inf, 2.0**-25, 2.0**-24 * 1.5, 2.0**-26, 0.0, -0.0],
                     np.float32)
    x = np.concatenate([fin, mids, np.nextafter(mids, np.inf), edges, rnd[np.isfinite(rnd)]]).astype(np.float32)
    n, nh = x.size, halves.size

    def build(k):
        k.buffer("x", "f32", n), k.buffer("hin", "f16", nh)
        k.buffer("h", "f16", n, True), k.buffer("b", "bf16", n, True), k.buffer("back", "f32", nh, True)
        with k.parallel("i", n) as i:
            k.store("h", i, k.load("x", i))
            k.store("b", i, k.load("x", i))
        with k.parallel("i", nh) as i:
            k.store("back", i, k.load("hin", i))

    bufs = {"x": x, "hin": halves, "h": np.zeros(n, np.float16), "b": np.zeros(n, np.uint16),
            "back": np.zeros(nh, np.float32)}
    got = run_on_device(dev, _kernel("halves", build), bufs, {})
    with np.errstate(over="ignore"):  # numpy rounds to inf too, and says so
        want_h = x.astype(np.float16)
    np.testing.assert_array_equal(got["h"].view(np.uint16), want_h.view(np.uint16))
    np.testing.assert_array_equal(got["b"], interp.f32_to_bf16(x))
    want = halves.astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got["back"][~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got["back"][nan]).all()


def test_spill_and_once_semantics(dev):
    """Top-level values cross global barriers; top-level stores run once, in order (a read-modify-write)."""
    def build(k):
        k.buffer("x", "f32", 16), k.buffer("o", "f32", 16, True), k.buffer("c", "i32", 2, True)
        n = k.scalar("n")
        half = k.let("half", n // 2)
        acc = k.local("acc", ir.reduce("add", "j", 4, lambda j: k.load("x", j)))
        with k.parallel("i", half) as i:
            k.store("o", i, k.load("x", i) + acc)
        k.barrier()
        k.assign(acc, acc * 2.0)
        k.store("c", 0, k.load("c", 0) + 5)     # once, even with parallel loops in the same segment
        k.atomic_add("c", 1, 3)
        with k.parallel("i", n - half) as i:
            k.store("o", half + i, k.load("o", i) - acc + ir.f32(k.load("c", 0)))
        k.barrier()
        k.store("o", 15, acc + ir.f32(half))

    k = _kernel("spills", build)
    assert len(lower(k, dev.target).dispatches) == 5
    bufs = inputs_for(k)
    bufs["c"] = np.array([7, 1], np.int32)
    assert_matches_interpreter(dev, k, bufs, {"n": 12})


def test_program_reruns_with_new_scalars(dev):
    """One recorded command buffer, two launches (the second reads the first), scalars renamed per launch;
    new values each run change dispatch sizes without re-recording."""
    def build(k):
        k.buffer("src", "f32", 64), k.buffer("dst", "f32", 64, True)
        m, off = k.scalar("m"), k.scalar("off")
        with k.parallel("i", m) as i:
            k.store("dst", i, k.load("src", i + off) * 2.0 + ir.f32(m))

    k = _kernel("shift", build)
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    a, b, c = (dev.alloc(256) for _ in range(3))
    try:
        dev.upload(a, x)
        prog = dev.program([Launch(k, {"src": a, "dst": b}, {"m": "n1", "off": "o1"}),
                            Launch(k, {"src": b, "dst": c}, {"m": "n2"})])
        cmd = prog.cmd
        for n1, o1, n2 in [(10, 3, 5), (40, 0, 33), (1, 63, 1), (0, 0, 0), (60, 4, 60)]:
            for buf in (b, c):
                dev.upload(buf, np.zeros(64, np.float32))
            prog.run({"n1": n1, "o1": o1, "n2": n2, "off": 2})
            want_b = interp.run(k, {"src": x.copy(), "dst": np.zeros(64, np.float32)}, {"m": n1, "off": o1})["dst"]
            want_c = interp.run(k, {"src": want_b.copy(), "dst": np.zeros(64, np.float32)}, {"m": n2, "off": 2})["dst"]
            np.testing.assert_allclose(dev.download(c).view(np.float32), want_c, rtol=1e-6)
        assert prog.cmd is cmd
        with pytest.raises(BackendError, match="n2"):
            prog.run({"n1": 1, "o1": 0, "off": 0})
    finally:
        for buf in (a, b, c):
            dev.free(buf)


@big_buffers
def test_timed_program_times_each_launch_in_order(dev):
    """A timed program (the profile's: timestamp queries after each launch's barrier)."""
    if not dev.timestamp_ns:
        pytest.skip(f"{dev.name}: its compute queue has no timestamps")
    assert_timed_program_times_each_launch(dev, 1 << 20)


@big_buffers
def test_grid_stride_beyond_max_groups(dev):
    """More iterations than one dispatch can have workgroups: the shaders stride over the rest."""
    nw = dev.max_groups + 37               # one workgroup per iteration
    nt = dev.max_groups * 64 + 5           # one invocation per iteration (64-lane workgroups)

    def build(k):
        k.buffer("x", "f32", 2 * nw), k.buffer("o", "f32", nw, True)
        k.buffer("y", "f32", nt), k.buffer("p", "f32", nt, True)
        with k.parallel("r", nw) as r:
            k.store("o", r, ir.reduce("add", "j", 2, lambda j: k.load("x", 2 * r + j), "reduce"))
        with k.parallel("i", nt) as i:
            k.store("p", i, k.load("y", i) * 2.0)

    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(2 * nw).astype(np.float32), rng.standard_normal(nt).astype(np.float32)
    got = run_on_device(dev, _kernel("big_grid", build), {"x": x, "o": np.zeros(nw, np.float32), "y": y,
                                                           "p": np.zeros(nt, np.float32)}, {})
    np.testing.assert_allclose(got["o"], x.reshape(-1, 2).sum(1), rtol=1e-6)
    np.testing.assert_array_equal(got["p"], y * 2)


@pytest.mark.skipif(CHILD, reason="one real-size run is enough")
def test_buffer_beyond_max_storage_buffer_range(dev):
    """A buffer larger than one descriptor may cover, at the device's real limit (128 MiB on lavapipe)."""
    limit = dev.caps.extra["max_storage_buffer_range"]
    if limit > 1 << 30:
        pytest.skip(f"maxStorageBufferRange is {limit} bytes; a buffer beyond it would be too large for a test")
    n = limit // 4 + (1 << 20)
    idx = np.array([0, limit // 4 - 1, limit // 4, limit // 4 + 1, n - 1], np.int32)

    def build(k):
        k.buffer("big", "f32", n, True), k.buffer("idx", "i32", idx.size), k.buffer("o", "f32", idx.size, True)
        with k.parallel("i", idx.size) as i:
            k.store("o", i, k.load("big", k.load("idx", i)))
            k.store("big", k.load("idx", i), ir.f32(i) + 0.5)

    k = _kernel("big_buffer", build)
    assert [b.chunks for b in lower(k, dev.target).bindings][0] == 2
    big, bi, bo = dev.alloc(4 * n), dev.alloc(idx.nbytes), dev.alloc(4 * idx.size)
    try:
        vals = np.arange(idx.size, dtype=np.float32) + 100
        for i, v in zip(idx, vals):
            dev.upload(big, np.array([v], np.float32), 4 * int(i))
        dev.upload(bi, idx)
        dev.program([Launch(k, {"big": big, "idx": bi, "o": bo})]).run({})
        np.testing.assert_array_equal(dev.download(bo).view(np.float32), vals)
        got = [dev.download(big, 4, 4 * int(i)).view(np.float32)[0] for i in idx]
        np.testing.assert_array_equal(got, np.arange(idx.size) + 0.5)
    finally:
        for b in (big, bi, bo):
            dev.free(b)


# ----------------------------------------------------------------------------------------------- buffers, transfers
def test_buffer_round_trips(dev):
    rng = np.random.default_rng(3)
    for n in (1, 3, 17, 4096, (16 << 20) + 5):  # the last spans more than one staging chunk
        data = rng.integers(0, 256, n, dtype=np.uint8)
        b = dev.alloc(n)
        try:
            dev.upload(b, data)
            np.testing.assert_array_equal(dev.download(b), data)
            if n > 8:
                dev.upload(b, np.array([1, 2, 3], np.uint8), 5)
                np.testing.assert_array_equal(dev.download(b, 4, 4), [data[4], 1, 2, 3])
            with pytest.raises(BackendError):
                dev.upload(b, data, 1)
        finally:
            dev.free(b)
    b = dev.alloc(64)
    try:
        view = b.host_view()
        assert (view is not None) == dev.caps.host_visible
        if view is not None:  # the mapping is the buffer
            view[:4] = [9, 8, 7, 6]
            np.testing.assert_array_equal(dev.download(b, 4), [9, 8, 7, 6])
        dev.upload(b, np.arange(16, dtype=np.float32))
        np.testing.assert_array_equal(dev.download(b, 8, 56).view(np.float32), [14, 15])
    finally:
        dev.free(b)


class HostDevice(Device):
    """A minimal CPU device (numpy memory with host_view), like the cpu plugin's."""
    name, backend = "cpu:test", "cpu"
    caps = Caps(memory_bytes=1 << 30, host_visible=True)

    def alloc(self, nbytes):
        b = Buffer(self, nbytes)
        b.mem = np.zeros(nbytes, np.uint8)
        b.host_view = lambda: b.mem
        return b

    def free(self, buf):
        pass

    def upload(self, buf, data, offset=0):
        d = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf.mem[offset:offset + d.size] = d

    def download(self, buf, nbytes=None, offset=0):
        return buf.mem[offset:offset + (buf.nbytes - offset if nbytes is None else nbytes)].copy()


def _cheapest(paths, src, dst):
    return min((p for p in paths if p.supports(src, dst)), key=lambda p: p.priority)


def test_transfer_paths(dev):
    paths = jv.jitllm_transfer_paths()
    host = HostDevice()
    other = jv.VulkanDevice(1, dev.pd)  # a second logical device on the same GPU: a real vulkan:i -> vulkan:j
    want = "mapped" if dev.caps.host_visible else "host-staged"
    assert _cheapest(paths, dev, host).mechanism == want and _cheapest(paths, host, dev).mechanism == want
    assert _cheapest(paths, dev, other).mechanism == "host-staged"
    assert not any(p.supports(host, HostDevice()) for p in paths)  # cpu <-> cpu is not this plugin's business
    data = np.random.default_rng(4).integers(0, 256, 3000, dtype=np.uint8)
    h1, h2 = host.alloc(3000), host.alloc(3000)
    v1, v2 = dev.alloc(3000), other.alloc(3000)
    try:
        host.upload(h1, data)
        _cheapest(paths, host, dev).copy(h1, 100, v1, 7, 2000)       # cpu -> vulkan
        _cheapest(paths, dev, other).copy(v1, 7, v2, 1, 2000)        # vulkan:0 -> vulkan:1
        _cheapest(paths, other, host).copy(v2, 1, h2, 50, 2000)      # vulkan:1 -> cpu
        np.testing.assert_array_equal(h2.mem[50:2050], data[100:2100])
        np.testing.assert_array_equal(dev.download(v1, 2000, 7), data[100:2100])
        assert all(p.cost_s(1 << 20) > 0 for p in paths)
    finally:
        dev.free(v1)
        other.free(v2)


def test_transfer_with_cpu_backend(dev):
    """The same paths against the real cpu plugin, when it is installed."""
    from jitllm_core import registry
    cpu = registry.all_devices().get("cpu") or registry.all_devices().get("cpu:0")
    if cpu is None:
        pytest.skip("the cpu plugin is not installed")
    paths = jv.jitllm_transfer_paths()
    data = np.arange(1000, dtype=np.float32)
    c1, c2, v = cpu.alloc(4000), cpu.alloc(4000), dev.alloc(4000)
    try:
        cpu.upload(c1, data)
        _cheapest(paths, cpu, dev).copy(c1, 0, v, 0, 4000)
        _cheapest(paths, dev, cpu).copy(v, 400, c2, 0, 3600)
        np.testing.assert_array_equal(cpu.download(c2, 3600).view(np.float32), data[100:])
    finally:
        cpu.free(c1), cpu.free(c2), dev.free(v)


# ----------------------------------------------------------------------------------------------- errors
def test_bad_bindings_are_refused(dev):
    k = CASES["scalar_params"][0]()
    small, ok = dev.alloc(8), dev.alloc(4 * 30)
    try:
        with pytest.raises(BackendError, match="'o'"):
            dev.program([Launch(k, {"x": ok})])
        with pytest.raises(BackendError, match="needs 120 bytes"):
            dev.program([Launch(k, {"x": ok, "o": small})])
    finally:
        dev.free(small), dev.free(ok)


def test_too_many_descriptors_is_refused():
    k = CASES["elementwise_f32"][0]()
    with pytest.raises(LoweringError, match="descriptors"):
        lower(k, Target(max_range=64, max_descriptors=16))


# ----------------------------------------------------------------------------------------------- configurations
CONFIGS = {  # name -> env; each re-runs the device tests in a fresh process
    "subgroup4": {"LP_NATIVE_VECTOR_WIDTH": "128"},
    "subgroup16": {"LP_NATIVE_VECTOR_WIDTH": "512"},
    "no_small_storage": {"JITLLM_VULKAN_NO_SMALL_STORAGE": "1"},
    "no_subgroup_ops": {"JITLLM_VULKAN_NO_SUBGROUP": "1"},
    "split_buffers": {"JITLLM_VULKAN_MAX_RANGE": "256"},
    "staged_memory": {"JITLLM_VULKAN_NO_HOST_VISIBLE": "1"},
}


def test_config_applied(dev):
    """In a configuration's subprocess: the forced setting is what the device and the lowering use."""
    e = os.environ
    storage = lower(CASES["storage_types"][0](), dev.target).dispatches[0].source
    reduce = lower(CASES["reductions"][0](), dev.target).dispatches[0].source
    if "llvmpipe" in dev.caps.extra["device_name"] and "LP_NATIVE_VECTOR_WIDTH" in e:
        assert dev.caps.subgroup_size == int(e["LP_NATIVE_VECTOR_WIDTH"]) // 32
    if e.get("JITLLM_VULKAN_NO_SMALL_STORAGE") == "1":
        assert not (dev.caps.fp16 or dev.caps.int8) and "uint16_t" not in storage and "uint8_t" not in storage
    elif dev.caps.fp16 and dev.caps.int8:
        assert "uint16_t" in storage and "uint8_t" in storage
    assert ("subgroupAdd" in reduce) == (e.get("JITLLM_VULKAN_NO_SUBGROUP") != "1" and dev.target.subgroup_ops)
    if "JITLLM_VULKAN_MAX_RANGE" in e:
        assert max(b.chunks for b in lower(CASES["elementwise_f32"][0](), dev.target).bindings) > 1
    if e.get("JITLLM_VULKAN_NO_HOST_VISIBLE") == "1":
        b = dev.alloc(16)
        assert not dev.caps.host_visible and b.host_view() is None
        dev.free(b)


def _child(env, *args):
    path = [str(ROOT), str(ROOT / "plugins" / "vulkan"), os.environ.get("PYTHONPATH", "")]
    full = {**os.environ, **env, "JITLLM_VULKAN_TEST_CHILD": "1", "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(CHILD, reason="already in a configuration's subprocess")
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_configuration(dev, config):
    env = CONFIGS[config]
    if "LP_NATIVE_VECTOR_WIDTH" in env and "llvmpipe" not in dev.caps.extra["device_name"]:
        pytest.skip("LP_NATIVE_VECTOR_WIDTH only changes lavapipe")
    r = _child(env, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


PROBE = """
from jitllm_core.plugin import BackendUnavailable
import jitllm_vulkan  # must not import the `vulkan` module itself
try:
    jitllm_vulkan.VulkanBackend().probe()
    print("DEVICES")
except BackendUnavailable as e:
    print("UNAVAILABLE:", e)
"""


def _probe_in_child(env, prelude=""):
    r = _child(env, "-c", textwrap.dedent(prelude) + PROBE)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(CHILD, reason="probe failures are tested once")
def test_probe_without_a_driver_says_why():
    out = _probe_in_child({"VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"})
    assert out.startswith("UNAVAILABLE:") and "ICD" in out, out


@pytest.mark.skipif(CHILD, reason="probe failures are tested once")
def test_probe_without_the_loader_says_why():
    """Importing the `vulkan` module raises OSError when libvulkan is missing: simulate exactly that."""
    out = _probe_in_child({}, """
        import sys
        class NoLoader:
            def find_spec(self, name, path=None, target=None):
                if name == "vulkan":
                    raise OSError("cannot load library 'libvulkan.so.1'")
        sys.meta_path.insert(0, NoLoader())
    """)
    assert out.startswith("UNAVAILABLE:") and "libvulkan" in out, out


@pytest.mark.skipif(CHILD, reason="probe failures are tested once")
def test_probe_without_glslc_says_why():
    out = _probe_in_child({"PATH": os.path.dirname(sys.executable)})
    assert out.startswith("UNAVAILABLE:") and "glslc" in out, out


# ----------------------------------------------------------------------------------------------- packaging, caches
def test_plugin_hooks_and_entry_point():
    from jitllm_core.plugin import HostStaged, plugin_manager
    pm = plugin_manager()
    pm.register(jv)
    backends = [b for bs in pm.hook.jitllm_backends() for b in bs]
    assert [b.name for b in backends] == ["vulkan"]
    mechs = {p.mechanism for ps in pm.hook.jitllm_transfer_paths() for p in ps}
    assert mechs == {"mapped", "host-staged"}
    assert all(p.priority < HostStaged.priority for ps in pm.hook.jitllm_transfer_paths() for p in ps)
    meta = tomllib.loads((ROOT / "plugins" / "vulkan" / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "jitllm-vulkan"
    assert meta["project"]["entry-points"]["jitllm.backends"] == {"vulkan": "jitllm_vulkan"}


def test_lowering_is_deterministic_and_spirv_is_cached(tmp_path, monkeypatch):
    from jitllm_vulkan import compile as comp
    t = Target(subgroup_size=8)
    srcs = [[d.source for d in lower(CASES[c][0](), t).dispatches] for c in ("reductions", "barriers")]
    assert srcs == [[d.source for d in lower(CASES[c][0](), t).dispatches] for c in ("reductions", "barriers")]
    try:
        comp.glslc_version()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(tmp_path))
    code = comp.spirv(srcs[0][0])
    assert code[:4] == b"\x03\x02\x23\x07"  # SPIR-V magic
    files = list((tmp_path / "vulkan").glob("*.spv"))
    assert len(files) == 1 and files[0].read_bytes() == code
    files[0].write_bytes(b"cached")  # a second compile of the same source comes from the file
    assert comp.spirv(srcs[0][0]) == b"cached"


def test_pipeline_cache_is_persisted(dev):
    k = CASES["atomics"][0]()
    run_on_device(dev, k, inputs_for(k), {})
    assert dev.cache_path.exists() and dev.cache_path.stat().st_size > 0
