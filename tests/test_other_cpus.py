"""The programs of another kind of CPU -- an AVX-512 VNNI machine's, the kind the CPU targets are measured on --
made here and run with what this CPU lacks emulated (jitllm_cpu_llvm.assembly.device): every packed layout's
matmul against gguf's values, and the default model's decode steps and prompt against transformers. Where this
CPU has AVX-512 VNNI they run natively."""
import numpy as np
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


def _emulation_case(name, rng):
    """(IR types of the result and operands, operands, the result by the instruction's definition)"""
    if name == "pshuf.b.512":  # a byte shuffle within each 16-byte lane; an index with its top bit set gives 0
        table, index = rng.integers(0, 256, 64).astype(np.uint8), rng.integers(0, 256, 64).astype(np.uint8)
        return ["<64 x i8>"] * 3, [table, index], np.where(index >= 128, 0, table[(np.arange(64) & ~15) + (index & 15)])
    if name == "permvar.sf.512":  # a lane permutation by each index's low 4 bits
        table, index = rng.standard_normal(16).astype(np.float32), rng.integers(-2**31, 2**31, 16).astype(np.int32)
        return ["<16 x float>", "<16 x float>", "<16 x i32>"], [table, index], table[index & 15]
    n = int(name.rsplit(".", 1)[1]) // 32  # vpdpbusd: acc + per lane 4 products of a's unsigned and b's signed bytes
    acc = rng.integers(-2**30, 2**30, n).astype(np.int32)
    a, b = rng.integers(0, 256, 4 * n).astype(np.uint8), rng.integers(-128, 128, 4 * n).astype(np.int8)
    a[:8], b[:8] = 255, -128  # the extremes (a pmaddubsw pair sum would saturate)
    want = acc + (a.astype(np.int32) * b).reshape(n, 4).sum(1).astype(np.int32)
    return [f"<{n} x i32>"] * 4, [acc, a.view(np.int32), b.view(np.int32)], want


@pytest.mark.parametrize("name", ["pshuf.b.512", "permvar.sf.512", "vpdpbusd.512", "vpdpbusd.256"])
def test_emulations_are_the_instruction(name):
    """AVX-512's byte shuffle (lut16), lane permutation (lookup16) and dot4 (vpdpbusd) as emulated for a CPU
    without them, in plain IR and (where it has AVX2) by its instructions: the same as the instruction's
    definition, and as the instruction where this CPU has it."""
    import ctypes

    import llvmlite.binding as llvm
    from jitllm_cpu_llvm import emulation, runtime
    (ret, *types), inputs, want = _emulation_case(name, np.random.default_rng(0))
    fn = f'@"llvm.x86.avx512.{name}"'
    params = ", ".join(f'{t} %".{i + 1}"' for i, t in enumerate(types))  # as llvmlite declares it
    ptrs = ", ".join(f"ptr %p{i}" for i in range(len(types)))
    loads = "".join(f"%v{i} = load {t}, ptr %p{i}, align 1\n" for i, t in enumerate(types))
    args = ", ".join(f"{t} %v{i}" for i, t in enumerate(types))
    text = (f"declare {ret} {fn}({params})\ndefine void @f(ptr %o, {ptrs}) {{\n{loads}"
            f"%r = call {ret} {fn}({args})\nstore {ret} %r, ptr %o, align 1\nret void\n}}\n")
    sources = [emulation.emulated(text, [])]  # plain IR
    if "avx2" in runtime.isa():
        sources.append(emulation.emulated(text, ["avx2"]))
        assert "@llvm.x86.avx2." in sources[-1] and sources[-1] != sources[0]
    if any(need <= runtime.isa() for need in emulation.NEEDS[f"llvm.x86.avx512.{name}"]):
        sources.append(text)
    for source in sources:
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(source), runtime.target_machine())
        engine.finalize_object()
        out = np.zeros_like(want)
        ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (len(inputs) + 1))(engine.get_function_address("f"))(
            out.ctypes.data, *[x.ctypes.data for x in inputs])
        np.testing.assert_array_equal(out, want)
