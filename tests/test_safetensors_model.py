"""HF safetensors folders (config.json + *.safetensors + tokenizer files) through the engine on the CPU,
against HF transformers running the very same folder.

The models are small and random (built here with transformers, seeded), with SmolLM2's tokenizer saved
beside them: a Llama (GQA, separate LM head) in float32 and again in bfloat16 / float16 (the engine then
reads BF16 / F16 tensors; the reference runs that same model upcast to float32), a Qwen2-style model
(q/k/v biases) and a Qwen3-style one (per-head query and key norms, heads wider than hidden / heads).
"""
import os

import numpy as np
import pytest

import jitllm_core as jl
from reference import agreeing_prefix, f32_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The history of the printing press begins in China, where woodblock printing was used for centuries before "
    "movable type appeared in Europe.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n# Usage:\n",
]
TOKENIZER_STRINGS = PROMPTS + [
    "Ünïcödé, emoji 🚀 and numbers 12345!",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "<|im_start|>user\nHi<|im_end|>",
    "",
]
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=512, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False)
# rope theta not the loader's default (1e4), so that a theta not found in config.json shows
ROPE = {"rope_theta": 500000.0}
# Qwen3's heads: 128 wide (its default), 4 of them in a hidden size of 256
QWEN3_HEADS = dict(num_attention_heads=4, head_dim=128)
# Gemma's: heads of 256 (what transformers assumes of a GGUF file), a sliding window these prompts pass
GEMMA = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=21)
# Gemma 3's rope: the full layers' (here linearly scaled) and the sliding-window layers' own base
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# LongRoPE's per-pair factors (12 pairs turned), the long ones larger (slower turns) as in Phi-3's
SHORT_FACTORS = [1.0 + 0.1 * i for i in range(12)]
LONG_FACTORS = [2.0 + 1.5 * i for i in range(12)]
VARIANTS = {  # name -> (config class name, dtype saved, rope parameters[, shape changes])
    "llama-f32": ("LlamaConfig", "float32", ROPE),
    "llama-bf16": ("LlamaConfig", "bfloat16", ROPE),
    "llama-f16": ("LlamaConfig", "float16", ROPE),
    "qwen2-f32": ("Qwen2Config", "float32", ROPE),  # attention biases on q, k, v
    "qwen3-f32": ("Qwen3Config", "float32", ROPE, QWEN3_HEADS),
    "smollm3-f32": ("SmolLM3Config", "float32", ROPE, {"pad_token_id": None}),  # its last layer without rope (1 in 4)
    # multipliers of the embedding, of each block's output, of the scores and (divided by) of the logits
    "granite-f32": ("GraniteConfig", "float32", ROPE, {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                                       "attention_multiplier": 0.1, "logits_scaling": 2.0}),
    # transformers' defaults: the scores times 1.0 (not 1 / sqrt(head_dim), what a GGUF file without the key means)
    "granite-defaults": ("GraniteConfig", "float32", ROPE),
    # fused q/k/v and gate/up matrices, a sliding window on every layer
    "phi3-f32": ("Phi3Config", "float32", ROPE, {"sliding_window": 21}),
    # GELU, scaled embeddings, norms of 1 + w around both blocks, every other layer windowed; caps on scores and
    # logits low enough to bite
    "gemma2-f32": ("Gemma2Config", "float32", ROPE, {**GEMMA, "attn_logit_softcapping": 3.0,
                                                     "final_logit_softcapping": 15.0}),
    # per-head norms, a full layer among windowed ones with a rope of its own
    "gemma3-f32": ("Gemma3TextConfig", "float32", GEMMA3_ROPE, {**GEMMA, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}),
    "mistral-f32": ("MistralConfig", "float32", ROPE),  # a sliding window (4096) past these prompts
    # sliding windows these prompts pass: every layer's, and Qwen2's from its max_window_layers on
    "mistral-window": ("MistralConfig", "float32", ROPE, {"sliding_window": 21}),
    "qwen2-window": ("Qwen2Config", "float32", ROPE, {"sliding_window": 21, "use_sliding_window": True,
                                                     "max_window_layers": 2}),
    # no norm before attention or the MLP, their outputs normed; the whole query and key normed
    "olmo2-f32": ("Olmo2Config", "float32", ROPE),
    # OLMo 3: windows on three layers in four, the full layers' rope scaled (YaRN), the windowed ones' not
    "olmo3-f32": ("Olmo3Config", "float32", {"full_attention": {**ROPE, "rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64},
                                             "sliding_attention": {**ROPE, "rope_type": "default"}},
                  {"sliding_window": 21}),
    # mixtures of experts: 2 of 8 experts (of 64-wide MLPs) per token, their weights normalized (Mixtral,
    # Qwen3-MoE with norm_topk_prob) or not (OLMoE, whose whole query and key are normed)
    "mixtral-f32": ("MixtralConfig", "float32", ROPE, {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                       "intermediate_size": 64}),
    "qwen3moe-f32": ("Qwen3MoeConfig", "float32", ROPE, {"num_experts": 8, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "olmoe-f32": ("OlmoeConfig", "float32", ROPE, {"num_experts": 8, "num_experts_per_tok": 2,
                                                   "intermediate_size": 64}),
    # Qwen2-MoE: a shared expert (wider than the others) gated by sigmoid(x . w), q/k/v biases, weights not
    # normalized (4 of 8 experts: with 2, prompt 0's 71st token's choice is a near-tie, which llama.cpp flips)
    "qwen2moe-f32": ("Qwen2MoeConfig", "float32", ROPE, {"num_experts": 8, "num_experts_per_tok": 4,
                                                         "moe_intermediate_size": 64,
                                                         "shared_expert_intermediate_size": 96}),
    # Granite's multipliers and a mixture whose experts' gate and up projections are stacked in one tensor
    "granitemoe-f32": ("GraniteMoeConfig", "float32", ROPE, {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                             "intermediate_size": 64, "embedding_multiplier": 4.0,
                                                             "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                                                             "logits_scaling": 2.0}),
    # scaled rope: an original context of 64 positions scales most of the frequencies these prompts turn through
    "llama-rope-linear": ("LlamaConfig", "float32", {**ROPE, "rope_type": "linear", "factor": 4.0}),
    "llama-rope-llama3": ("LlamaConfig", "float32", {**ROPE, "rope_type": "llama3", "factor": 4.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    "llama-rope-yarn": ("LlamaConfig", "float32", {**ROPE, "rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
    # Phi-4-mini's rope: over 3 in 4 of each head's dimensions (24 of 32), LongRoPE's factors per pair; the engine
    # (512 positions, past the original 64) takes the long ones, as transformers does for these 80-token prompts
    "phi3-longrope": ("Phi3Config", "float32", {**ROPE, "rope_type": "longrope", "short_factor": SHORT_FACTORS,
                                                "long_factor": LONG_FACTORS},
                      {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 64}),
}
# transformers takes LongRoPE's long factors only for sequences past the original context (`test_longrope_within_
# the_original_context`), which these prompts and 12 tokens are not
GREEDY_SKIPS = {"phi3-longrope"}


def variants(skip=()):
    return sorted(set(VARIANTS) - set(skip))


@pytest.fixture(scope="module")
def hf_tokenizer(default_model):
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                      gguf_file=os.path.basename(default_model))


def _build(folder, variant, tokenizer, spec=None):
    """Writes a random model of `variant` (or of `spec`, a VARIANTS entry) into `folder`; returns that folder's
    model loaded as float32.

    The reference is loaded back from the folder rather than upcast in memory: `.to(float16)` would also
    round the rotary inverse frequencies (a buffer that is not saved), which moves later positions by 1e-2.
    """
    cls_name, dtype, rope, *shape = spec or VARIANTS[variant]
    config = getattr(transformers, cls_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id, rope_parameters=rope,
                                             **{**SHAPE, **(shape[0] if shape else {})})
    assert config.vocab_size == 49152
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init (0.02), so that logits and top-2 margins are not tiny
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name == "lm_head.weight":
                p.normal_(0.0, 0.15)
            elif p.dim() == 2:
                p.normal_(0.0, 0.06)
            else:  # norms around 1 but not 1, so that a norm weight left out shows
                p.uniform_(0.5, 1.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory, hf_tokenizer):
    torch.set_num_threads(os.cpu_count() or 1)
    root = tmp_path_factory.mktemp("hf_models")
    built = {}
    for variant in VARIANTS:
        folder = root / variant
        built[variant] = (str(folder), _build(folder, variant, hf_tokenizer))
    return built


@pytest.fixture(scope="module")
def engines(cpu, models):
    made = {}
    yield lambda variant: made.get(variant) or made.setdefault(
        variant, jl.Engine(models[variant][0], devices=["cpu"], kv_dtype="f32"))
    for e in made.values():
        e.close()


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_folder_is_what_the_test_means(models):
    folder, _ = models["llama-f32"]
    names = set(os.listdir(folder))
    assert {"config.json", "tokenizer.json"} <= names and any(n.endswith(".safetensors") for n in names)
    from jitllm_core.safetensors import SafetensorsFolder
    for variant, want in (("llama-f32", "F32"), ("llama-bf16", "BF16"), ("llama-f16", "F16")):
        st = SafetensorsFolder(models[variant][0])
        assert "lm_head.weight" in st.tensors  # not tied
        assert st.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (64, 256)  # GQA: 2 KV heads of 32
        assert {t.type_name for t in st.tensors.values()} == {want}
    assert "model.layers.0.self_attn.q_proj.bias" in SafetensorsFolder(models["qwen2-f32"][0]).tensors
    qwen3 = SafetensorsFolder(models["qwen3-f32"][0]).tensors
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (512, 256)


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_score_matches_transformers(engines, models, variant, prompt):
    eng = engines(variant)
    ids = (eng.tokenizer.encode(PROMPTS[prompt]) * 3)[:80]  # ≥ 32 positions, more than one step of 64
    assert len(ids) >= 32
    got, want = eng.score(ids), _reference(models[variant][1], ids)
    assert got.shape == want.shape == (len(ids), 49152) and got.dtype == np.float32
    assert want.std() > 0.05  # the logits are not trivially small: a wrong model cannot pass by accident
    assert (np.abs(got - want).max(axis=1) <= f32_bound(models[variant][1], ids, want)).all()


@pytest.mark.parametrize("variant", variants(skip=GREEDY_SKIPS))
def test_greedy_matches_transformers(engines, models, variant):
    eng = engines(variant)
    checked = 0
    for prompt in PROMPTS:
        ids = eng.tokenizer.encode(prompt)
        out = eng.generate(ids, max_tokens=12, ignore_eos=True).token_ids
        assert len(out) == 12
        ref = _reference(models[variant][1], ids + out)
        n = agreeing_prefix(ref, out, len(ids) - 1, margin=0.01)  # 10x the logits' agreement (f32 KV cache)
        assert out[:n] == list(ref[len(ids) - 1:len(ids) - 1 + n].argmax(-1))
        checked += n
    assert checked >= 10  # the margins of these random models are wide enough for most tokens to be checked


def test_longrope_within_the_original_context(cpu, models):
    """An engine that holds no more positions than LongRoPE's original context takes its short factors, as
    transformers does for any sequence that short: a prompt's scores and a greedy reply."""
    folder, model = models["phi3-longrope"]
    checked = 0
    with jl.Engine(folder, devices=["cpu"], kv_dtype="f32", max_context=64) as eng:
        for prompt in PROMPTS:
            ids = eng.tokenizer.encode(prompt)[:40]
            got, want = eng.score(ids), _reference(model, ids)
            assert want.std() > 0.05 and np.abs(got - want).max() <= 1e-3
            out = eng.generate(ids, max_tokens=12, ignore_eos=True).token_ids
            ref = _reference(model, ids + out)
            n = agreeing_prefix(ref, out, len(ids) - 1, margin=0.01)
            assert out[:n] == list(ref[len(ids) - 1:len(ids) - 1 + n].argmax(-1))
            checked += n
    assert checked >= 6


def test_tokenizer_matches_hf(engines, hf_tokenizer, models):
    eng = engines("llama-f32")
    saved = transformers.AutoTokenizer.from_pretrained(models["llama-f32"][0])
    for text in TOKENIZER_STRINGS:
        want = hf_tokenizer.encode(text)
        assert saved.encode(text) == want
        assert eng.tokenizer.encode(text) == want, text
        assert eng.tokenizer.decode(want) == hf_tokenizer.decode(want)
    assert eng.tokenizer.eos_token == hf_tokenizer.eos_token
