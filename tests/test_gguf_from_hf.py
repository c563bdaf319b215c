"""GGUF files of each architecture the engine reads, written from transformers models as llama.cpp's converter
writes them (`hf_to_gguf`): llama (query and key rows in rope pairs), qwen2 (biases; rows left in HF's halves),
qwen3 (per-head query and key norms, 128-wide heads given by attention.key_length; halves), phi3 (fused q/k/v and
gate/up matrices) and gemma2 / gemma3 (norms of 1 + w, sliding windows, caps) -- through the engine against
transformers loading the same file, token by token and whole prompts; smollm3 and granite, which transformers does
not read, against the models they were written from."""
import os

import numpy as np
import pytest

import jitllm_core as jl
import hf_to_gguf
from reference import f32_bound, reference_logits, step_and_prompt_errors
from test_safetensors_model import GEMMA, PROMPTS, VARIANTS, _build

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Gemmas as transformers reads them from a GGUF file, which names neither their caps (Gemma 2's defaults, 50 and
# 30) nor which layers see every key (one in 2, one in 6: six layers, so that Gemma 3 has one) nor Gemma 3's ropes;
# their LM head is the embedding
GEMMA_TIED = {**GEMMA, "tie_word_embeddings": True}
GGUF_VARIANTS = {"phi3-gguf": ("Phi3Config", "float32", {"rope_theta": 1e4}, {}),  # no window: transformers reads none
                 "gemma2-gguf": ("Gemma2Config", "float32", {"rope_theta": 1e4}, GEMMA_TIED),
                 "gemma3-gguf": ("Gemma3TextConfig", "float32", {
                     "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                     {**GEMMA_TIED, "num_hidden_layers": 6})}

# transformers reads no local rope base from a GGUF file: this one against its source
GGUF_VARIANTS["gemma3-swa-base"] = ("Gemma3TextConfig", "float32", {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}, {**GEMMA_TIED, "num_hidden_layers": 6})

ARCHS = {"llama": "llama-f32", "qwen2": "qwen2-f32", "qwen3": "qwen3-f32",  # arch -> HF variant
         "phi3": "phi3-gguf", "gemma2": "gemma2-gguf", "gemma3": "gemma3-gguf"}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, default_model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    root = tmp_path_factory.mktemp("gguf_from_hf")
    out = {}
    for arch, variant in ARCHS.items():
        model = _build(root / variant, variant, tokenizer, {**VARIANTS, **GGUF_VARIANTS}[variant])
        out[arch] = (hf_to_gguf.write(model, arch, root / f"{arch}.gguf", default_model), model)
    return out


@pytest.mark.parametrize("arch, variant, max_context, n", [
    ("smollm3", "smollm3-f32", None, 40), ("granite", "granite-f32", None, 40),
    ("llama", "llama-rope-yarn", None, 80),
    # LongRoPE's long factors (the engine's 512 positions are past the original 64, and so are transformers' 80),
    # and its short ones (an engine of 64 positions, 40 of them)
    ("phi3", "phi3-longrope", None, 80), ("phi3", "phi3-longrope", 64, 40),
    ("gemma3", "gemma3-swa-base", None, 40), ("olmo2", "olmo2-f32", None, 40),
    # mixtures of experts: Mixtral's as a llama file with experts, Qwen3-MoE's, OLMoE's
    ("llama", "mixtral-f32", None, 40), ("qwen3moe", "qwen3moe-f32", None, 40), ("olmoe", "olmoe-f32", None, 40),
    ("granitemoe", "granitemoe-f32", None, 40), ("qwen2moe", "qwen2moe-f32", None, 40)])
def test_gguf_transformers_cannot_read_matches_its_source(cpu, tmp_path, default_model, arch, variant, max_context,
                                                          n):
    """GGUF files transformers does not read (SmolLM3's last layer in 4 without rope, Granite's multipliers,
    YaRN's and LongRoPE's keys and Phi-3's rope over part of each head, Gemma 3's local rope base, OLMo 2, the
    mixtures of experts): with F32 matrices, against the transformers model each was written from (within
    `f32_bound`)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    model = _build(tmp_path / variant, variant, tokenizer, {**VARIANTS, **GGUF_VARIANTS}[variant])
    path = hf_to_gguf.write(model, arch, tmp_path / f"{arch}.gguf", default_model, matrix_type="F32")
    with jl.Engine(path, devices=["cpu"], kv_dtype="f32", max_context=max_context) as eng:
        ids = (eng.tokenizer.encode(PROMPTS[0]) * 3)[:n]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        with eng.session() as s:
            steps = np.concatenate([s.feed([t]) for t in ids])
        prompt = eng.score(ids)
    assert want.std() > 0.05
    bound = f32_bound(model, ids, want)
    assert (np.abs(steps - want).max(axis=1) <= bound).all()
    assert (np.abs(prompt - want).max(axis=1) <= bound).all()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gguf_matches_transformers(cpu, gguf_models, arch):
    path, hf_model = gguf_models[arch]
    with jl.Engine(path, devices=["cpu"], kv_dtype="f32") as eng:
        ids = (eng.tokenizer.encode(PROMPTS[0]) * 2)[:40]
        # the file is what it means: transformers reads it as the model it came from, but for its Q8_0 matrices
        # (mean difference 1.6-5.4 % of the logits' spread; a qwen2 file with its rows in pairs, 30 %)
        with torch.no_grad():
            source = hf_model(torch.tensor([ids])).logits[0].numpy()
        want = reference_logits(path, ids)
        assert want.std() > 0.05 and np.abs(want - source).mean() < 0.1 * want.std()
        steps, prompt = step_and_prompt_errors(eng, path, ids)
    assert steps <= 1e-3
    assert prompt <= 1e-3


@pytest.mark.parametrize("device", ["vulkan:0", "cuda:0"])
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_gguf_on_an_accelerator_matches_transformers(gguf_models, device, arch):
    """The same on each accelerator (vulkan:0 is lavapipe on the test machines): Gemma 3's heads of 256, windows and
    local rope table, Phi-3's split matrices."""
    from conftest import backend_device
    backend_device(device)
    path, _ = gguf_models[arch]
    with jl.Engine(path, devices=[device], kv_dtype="f32") as eng:
        steps, prompt = step_and_prompt_errors(eng, path, (eng.tokenizer.encode(PROMPTS[0]) * 2)[:40])
    assert steps <= 1e-3
    assert prompt <= 1e-3


@pytest.mark.parametrize("device", ["vulkan:0", "cuda:0"])
def test_moe_on_an_accelerator(tmp_path, default_model, device):
    """A mixture of experts (Qwen3-MoE's) on each accelerator: the router's choice and each token's expert rows in
    the wide matmul form, against the transformers model the file was written from."""
    from conftest import backend_device
    backend_device(device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    model = _build(tmp_path / "moe", "qwen3moe-f32", tokenizer)
    path = hf_to_gguf.write(model, "qwen3moe", tmp_path / "moe.gguf", default_model, matrix_type="F32")
    with jl.Engine(path, devices=[device], kv_dtype="f32") as eng:
        ids = (eng.tokenizer.encode(PROMPTS[0]) * 2)[:40]
        with eng.session() as s:
            steps = np.concatenate([s.feed([t]) for t in ids[:8]])
        prompt = eng.score(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(steps - want[:8]).max() <= 1e-3
    assert np.abs(prompt - want).max() <= 1e-3


@pytest.mark.parametrize("arch, variant", [("qwen3moe", "qwen3moe-f32"), ("qwen2moe", "qwen2moe-f32")])
@pytest.mark.parametrize("kind, layout", [("Q8_0", "R8"), ("Q4_0", "R40")])
def test_quantized_moe_matches_its_dequantized_source(cpu, tmp_path, default_model, kind, layout, arch, variant):
    """Quantized experts (their CPU layout interleaved: each token's expert rows read in row groups; R40 a dot4
    layout, its inputs quantized -- the MLP's once, each down projection's apart, a shared expert's too) against
    the source model with every matrix replaced by what the file's blocks hold: decode steps and a prompt."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    model = _build(tmp_path / "moe", variant, tokenizer)
    path = hf_to_gguf.write(model, arch, tmp_path / "moe.gguf", default_model, matrix_type=kind)
    q = hf_to_gguf.gguf.GGMLQuantizationType[kind]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("shared_expert_gate.weight"):  # a vector in the file, F32
                a = p.detach().numpy()
                p.copy_(torch.from_numpy(hf_to_gguf.gguf.quants.dequantize(hf_to_gguf.gguf.quants.quantize(a, q), q)
                                         .reshape(a.shape)))
    with jl.Engine(path, devices=["cpu"], kv_dtype="f32") as eng:
        experts = "blk.0.ffn_gate_exps.weight"
        assert eng.model.fmt(experts, eng.model.weight_shapes(0)[experts][0]).name == layout  # interleaved
        ids = (eng.tokenizer.encode(PROMPTS[0]) * 2)[:40]
        got = eng.score(ids)
        with eng.session() as s:
            steps = np.concatenate([s.feed([t]) for t in ids[:8]])
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    bound = f32_bound(model, ids, want)  # 1e-3 beyond the source's own f32 spread at each position: see there
    assert (np.abs(got - want).max(axis=1) <= bound).all()
    assert (np.abs(steps - want[:8]).max(axis=1) <= bound[:8]).all()
