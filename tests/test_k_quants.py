"""A model with k-quant matrices (Q4_K and Q6_K, the 1B benchmark model's formats, Q5_K, Q3_K, Q2_K), 5-bit ones
(Q5_0, Q5_1: what llama.cpp's Q4_K_M falls back to for rows that are not whole 256-blocks) and IQ4's non-linear
levels (IQ4_XS, and IQ4_NL: IQ4_XS's fallback) through the engine
against HF transformers on the same file (the layouts' kernels alone: test_quant_formats, and as a VNNI machine runs them:
test_other_cpus)."""
import numpy as np
import pytest

import jitllm_core as jl
from jitllm_core import quantize
from jitllm_core.errors import BackendError
from jitllm_core.memory import Arena
from reference import step_and_prompt_errors
from test_model import PROMPTS

gguf = pytest.importorskip("gguf")


K_QUANTS = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS")
BLOCKS_OF_32 = ("Q5_0", "Q5_1", "IQ4_NL")


@pytest.fixture(scope="module")
def k_quant_model(default_model, tmp_path_factory):
    """The default model with its FFN down projections (the only matrices whose rows are whole 256-blocks)
    requantized from the file's values by jitllm's quantizer -- K_QUANTS in turn -- and its V projections
    BLOCKS_OF_32 in turn (the 5-bit ones by gguf's quantizer)."""
    out = tmp_path_factory.mktemp("k_quants") / "smollm2-k-quants.gguf"
    r = gguf.GGUFReader(default_model)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    for t in r.tensors:
        data, kind = t.data, t.tensor_type
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        if t.name.endswith("ffn_down.weight"):
            kind = gguf.GGMLQuantizationType[K_QUANTS[layer % len(K_QUANTS)]]
            data = quantize.quantize(gguf.quants.dequantize(t.data, t.tensor_type), kind.name)
        elif t.name.endswith("attn_v.weight"):
            kind = gguf.GGMLQuantizationType[BLOCKS_OF_32[layer % len(BLOCKS_OF_32)]]
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            data = quantize.quantize(values, kind.name) if kind.name.startswith("IQ") else \
                gguf.quants.quantize(values, kind)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out)


@pytest.fixture(scope="module")
def engine(cpu, k_quant_model):
    eng = jl.Engine(k_quant_model, devices=["cpu"], kv_dtype="f32")
    yield eng
    eng.close()


def weight_bytes(eng):
    (ds,) = eng.dev_state.values()
    return {n: b.host_view().copy() for n, (b, _) in ds.weights.items()}


def test_weights_repacked_by_the_device_or_on_the_host_are_the_same(cpu, k_quant_model, monkeypatch):
    """The CPU repacks the Q4_K and Q6_K matrices with the core's kernels (`Engine._repack`); where its memory has no
    room for a unit's file bytes beside its weights, NumPy repacks them on the host: the same bytes."""
    real_alloc, real_repack, by_kernel, no_room = Arena.alloc, jl.Engine._repack, [], []

    def repack(eng, ds, unit, interleave, weights):
        by_kernel.extend(name for name, *_ in weights)
        return real_repack(eng, ds, unit, interleave, weights)

    def alloc(arena, nbytes):
        if no_room:
            raise BackendError("no room (the test's)")
        return real_alloc(arena, nbytes)

    def repack_without_room(eng, *args):
        no_room.append(True)
        try:
            return real_repack(eng, *args)
        finally:
            no_room.pop()
    monkeypatch.setattr(jl.Engine, "_repack", repack)
    by_device = weight_bytes(jl.Engine(k_quant_model, devices=["cpu"]))
    assert {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"} <= set(by_kernel)  # Q4_K, Q6_K
    monkeypatch.setattr(Arena, "alloc", alloc)
    monkeypatch.setattr(jl.Engine, "_repack", repack_without_room)
    on_host = weight_bytes(jl.Engine(k_quant_model, devices=["cpu"]))
    assert by_device.keys() == on_host.keys()
    for n in by_device:
        np.testing.assert_array_equal(by_device[n], on_host[n], err_msg=n)


def test_model_has_the_formats_meant(k_quant_model):
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(k_quant_model).tensors if "ffn_down" in t.name}
    assert kinds == set(K_QUANTS)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(k_quant_model).tensors if "attn_v" in t.name}
    assert kinds == set(BLOCKS_OF_32)


def test_k_quants_match_transformers(engine, k_quant_model):
    """Token by token (decode steps: the dot4 matvecs of every packed layout, R2K to R6, R4NL, R4XS) and a whole
    prompt at once (the prefill gemms), within the f32 reference's bound."""
    steps, prompt = step_and_prompt_errors(engine, k_quant_model, (engine.tokenizer.encode(PROMPTS[0]) * 3)[:40])
    assert steps <= 1e-3
    assert prompt <= 1e-3


def test_k_quants_through_tile_dots_match_transformers(cpu, k_quant_model):
    """A prompt at once on a device whose prefill takes integer tile matmuls (Q4_K, Q5_K and Q6_K's down
    projections; the others' the f32 prefill matmul) within the f32 reference's bound: this CPU where it has AMX,
    else one that says it runs tile dots and runs them as loops of dot4 -- the same kernels."""
    from jitllm_core import registry
    from jitllm_cpu_llvm import runtime
    dev = cpu if cpu.caps.extra.get("tile_dots") else runtime.CpuDevice("cpu", 2, runtime.total_memory())
    dev.caps.extra["tile_dots"] = True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "device", lambda name: dev)
        eng = jl.Engine(k_quant_model, devices=["cpu"], kv_dtype="f32")
    try:
        steps, prompt = step_and_prompt_errors(eng, k_quant_model, (eng.tokenizer.encode(PROMPTS[0]) * 3)[:40])
        assert prompt <= 1e-3
        [name] = eng.devices  # the launches the engine binds for a prefill step on it
        tiles = {u: {ln.kernel.name.split("_")[1] for ln in eng._bind(u, name, prefill=True)
                     if ln.kernel.name.startswith("tilemm")} for u in range(3)}
        assert tiles == {0: {"R4K"}, 1: {"R6"}, 2: {"R5K"}}  # the layers' down projections (K_QUANTS in turn)
    finally:
        eng.close()
