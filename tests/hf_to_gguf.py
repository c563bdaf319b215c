"""A transformers model written to GGUF as llama.cpp's converter (convert_hf_to_gguf.py) writes it: GGUF tensor
names, the architecture's keys, the default model's tokenizer, 2-D weights in a chosen ggml type. For `llama`,
`smollm3` and `granite` the converter reorders each head's query and key rows to adjacent rope pairs; for Qwen,
Phi-3 and Gemma it keeps HF's order (llama.cpp rotates their halves, "neox" rope) -- what the engine must undo as
it loads them. Gemma's norms are written as 1 + w (what they scale by), its sliding window and caps, and Granite's
multipliers, as keys of their own; YaRN's and LongRoPE's scalings as llama.cpp's keys (and LongRoPE's factors as
tensors), a rope over part of each head as its rope.dimension_count."""
import math
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones, as llama.cpp keeps them
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


# Gemma's: post_attention_layernorm norms the attention's output there
GEMMA_NAMES = {**NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


# a mixture of experts' (transformers 5 holds them fused: [experts, gate's rows then up's, cols] and [experts,
# rows, cols] of the down projections): as llama.cpp's converter stacks them
EXPERTS = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.gate|block_sparse_moe\.router)\.weight")


def _gguf_name(hf, names=NAMES):
    if hf.startswith("model.layers."):
        i, rest = hf[len("model.layers."):].split(".", 1)
        part, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{names[part]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def _pairs(w, n_heads):
    """HF's rotate-half rows of each head -> adjacent pairs (the converter's permute for llama)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(model, arch, path, tokenizer_gguf, matrix_type="Q8_0"):
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3's: per layer type
    w.add_rope_freq_base(rope["rope_theta"])
    gemma = arch.startswith("gemma")
    post_norms = gemma or arch == "olmo2"  # post_attention_layernorm norms the attention's output
    if gemma:
        w.add_sliding_window(c.sliding_window)
    if "sliding_attention" in c.rope_parameters:  # Gemma 3's local rope base, as newer converters write it
        w.add_float32(f"{arch}.rope.freq_base_swa", c.rope_parameters["sliding_attention"]["rope_theta"])
    if arch in ("granite", "granitemoe"):
        w.add_float32(f"{arch}.embedding_scale", c.embedding_multiplier)
        w.add_float32(f"{arch}.residual_scale", c.residual_multiplier)
        w.add_float32(f"{arch}.attention.scale", c.attention_multiplier)
        w.add_float32(f"{arch}.logit_scale", c.logits_scaling)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", c.final_logit_softcapping)
    pairs = arch in ("llama", "smollm3", "granite", "granitemoe")  # the converter's permute: their rope rotates pairs
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if pairs or rot != head_dim:
        w.add_rope_dimension_count(rot)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":  # Phi-3's: per-pair factors as tensors, the cosines' factor as a key
        orig = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(orig)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], np.float32))
    if head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None) and arch in ("qwen3moe", "qwen2moe"):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)

    tok = gguf.GGUFReader(tokenizer_gguf)
    for name, f in tok.fields.items():
        if name.startswith("tokenizer."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    for hf, t in model.state_dict().items():
        if gemma and hf == "lm_head.weight":  # tied: the embedding
            continue
        a = t.detach().float().numpy()
        experts, router = EXPERTS.fullmatch(hf), ROUTER.fullmatch(hf)
        if experts:
            i, part = experts.groups()
            if part == "down_proj":
                _add(w, f"blk.{i}.ffn_down_exps.weight", a, matrix_type)
            else:
                ffn = a.shape[1] // 2
                _add(w, f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :ffn]), matrix_type)
                _add(w, f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(a[:, ffn:]), matrix_type)
            continue
        name = f"blk.{router.group(1)}.ffn_gate_inp.weight" if router else \
            _gguf_name(hf, GEMMA_NAMES if post_norms else NAMES)
        if gemma and name.endswith("norm.weight"):
            a = a + 1
        if name.endswith("gate_inp_shexp.weight"):  # [1, dim]: llama.cpp's converter writes a vector
            a = a.reshape(-1)
        if pairs and (".attn_q." in name or ".attn_k." in name):
            a = _pairs(a, c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads)
        _add(w, name, a, matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _add(w, name, a, matrix_type):
    """A matrix (or a stack of them) in matrix_type; a vector in F32."""
    if a.ndim >= 2:
        kind = gguf.GGMLQuantizationType[matrix_type]
        data = a if matrix_type == "F32" else gguf.quants.quantize(a, kind)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    else:
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
