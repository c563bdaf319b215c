"""The programs of another kind of CPU -- an AVX-512 VNNI machine's, the kind the CPU targets are measured on --
made here and run with what this CPU lacks emulated (jitllm_cpu_llvm.assembly.device): every packed layout's
matmul against gguf's values, and the default model's decode steps and prompt against transformers. Where this
CPU has AVX-512 VNNI they run natively."""
import pytest

import jitllm_core as jl
from jitllm_core import quant, registry
from jitllm_core.errors import BackendError
from reference import step_and_prompt_errors
from test_model import PROMPTS
from test_quant_formats import assert_packed_layout_holds_the_values

VNNI = "icelake-server"


@pytest.fixture(scope="module")
def vnni(cpu):
    from jitllm_cpu_llvm import assembly, runtime
    if not runtime.host()[0].startswith("x86_64"):
        pytest.skip(f"an {VNNI}'s programs run on x86-64 hosts only")
    return assembly.device(VNNI, threads=2)


def test_device_makes_that_cpus_programs(vnni):
    assert vnni.caps.subgroup_size == 16 and "avx512vnni" in vnni.instructions


def test_an_instruction_without_emulation_is_named():
    """Not an abort inside LLVM (what compiling it for this CPU would be)."""
    from jitllm_cpu_llvm import emulation
    text = 'declare <16 x float> @"llvm.x86.avx512.rcp14.ps.512"(<16 x float> %".1", <16 x float> %".2", i16 %".3")'
    with pytest.raises(BackendError, match="llvm.x86.avx512.rcp14.ps.512"):
        emulation.emulated(text, ["avx2"])


@pytest.mark.parametrize("name", sorted(quant.REPACK))
def test_packed_layouts_hold_the_values(vnni, name):
    assert_packed_layout_holds_the_values(vnni, name)


@pytest.mark.parametrize("name", sorted(quant.REPACK))
def test_packed_layouts_hold_the_values_on_avx2(cpu, name):
    """An AVX2 machine's programs (8 lanes, dot4 in pmaddubsw: 5-bit quants too are bytes below 128)."""
    from jitllm_cpu_llvm import runtime
    if not runtime.host()[0].startswith("x86_64"):
        pytest.skip("AVX2 programs run on x86-64 hosts only")
    assert_packed_layout_holds_the_values(runtime.CpuDevice("cpu", 1, 1 << 30, 8, {"avx2"}), name)


def test_default_model_matches_transformers(vnni, default_model):
    """Token by token (the decode step's dot4 matvecs in vpdpbusd) and a prompt at once (the prefill step), within
    the f32 reference's bound."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "device", lambda name: vnni)
        eng = jl.Engine(default_model, devices=["cpu"], kv_dtype="f32")
    try:
        assert list(eng.devices.values()) == [vnni]
        steps, prompt = step_and_prompt_errors(eng, default_model, (eng.tokenizer.encode(PROMPTS[0]) * 3)[:40])
        assert steps <= 1e-3
        assert prompt <= 1e-3
    finally:
        eng.close()


def test_byte_shuffle_emulation_is_the_instruction():
    """lut16's AVX-512BW byte shuffle as emulated for a CPU without it: the same bytes as the instruction where this
    CPU has it, and as its definition (each 16-byte lane's own bytes; an index with its top bit set gives 0)."""
    import ctypes

    import llvmlite.binding as llvm
    import numpy as np
    from jitllm_cpu_llvm import emulation, runtime
    if "avx512bw" not in runtime.isa():
        pytest.skip("this CPU has no AVX-512BW to compare the emulation with")
    v = "<64 x i8>"
    text = (f'declare {v} @"llvm.x86.avx512.pshuf.b.512"({v} %".1", {v} %".2")\n'  # as llvmlite declares it
            f"define void @f(ptr %o, ptr %t, ptr %i) {{\n%a = load {v}, ptr %t, align 1\n%b = load {v}, ptr %i, align 1\n"
            f'%r = call {v} @"llvm.x86.avx512.pshuf.b.512"({v} %a, {v} %b)\nstore {v} %r, ptr %o, align 1\nret void\n}}\n')
    rng = np.random.default_rng(0)
    table, index = rng.integers(0, 256, 64).astype(np.uint8), rng.integers(0, 256, 64).astype(np.uint8)
    want = np.where(index >= 128, 0, table[(np.arange(64) & ~15) + (index & 15)]).astype(np.uint8)
    for source in (text, emulation.emulated(text, ["avx2"])):
        mod = llvm.parse_assembly(source)
        engine = llvm.create_mcjit_compiler(mod, runtime.target_machine())
        engine.finalize_object()
        out = np.zeros(64, np.uint8)
        ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(engine.get_function_address("f"))(
            out.ctypes.data, table.ctypes.data, index.ctypes.data)
        np.testing.assert_array_equal(out, want)
