"""Every kernel a GPU runs for a Llama-3.2-1B-shaped Q4_K_M model compiles to sm_90 and sm_75 cubins, and a
Gemma-3-1B-shaped one's to sm_90 (no GPU needed, no model file: the shape and tensor types are enough to build the
kernels)."""
import re

import pytest

from jitllm_core.llama import interleaves, model_kernels
from jitllm_core.architectures import Config
from jitllm_core.modelfile import SpecFile

jitllm_cuda = pytest.importorskip("jitllm_cuda", reason="the jitllm-cuda plugin is not installed")
from jitllm_cuda.backend import CudaBackend  # noqa: E402


def llama_3_2_1b_q4_k_m():
    c = Config(n_layer=16, dim=2048, n_head=32, n_kv=8, head_dim=64, ffn=8192, vocab=128256, eps=1e-5,
               rope_base=500000.0, context=131072)
    kv, q = c.n_kv * c.head_dim, c.n_head * c.head_dim
    more_bits = {0, 1, 4, 7, 10, 13, 14, 15}  # llama.cpp's Q4_K_M: Q6_K for attn_v / ffn_down of these layers
    types = {"token_embd.weight": ((c.vocab, c.dim), "Q6_K"), "output_norm.weight": ((c.dim,), "F32")}
    for i in range(c.n_layer):
        p, hi = f"blk.{i}.", "Q6_K" if i in more_bits else "Q4_K"
        types.update({p + "attn_norm.weight": ((c.dim,), "F32"), p + "ffn_norm.weight": ((c.dim,), "F32"),
                      p + "attn_q.weight": ((q, c.dim), "Q4_K"), p + "attn_k.weight": ((kv, c.dim), "Q4_K"),
                      p + "attn_v.weight": ((kv, c.dim), hi), p + "attn_output.weight": ((c.dim, q), "Q4_K"),
                      p + "ffn_gate.weight": ((c.ffn, c.dim), "Q4_K"), p + "ffn_up.weight": ((c.ffn, c.dim), "Q4_K"),
                      p + "ffn_down.weight": ((c.dim, c.ffn), hi)})
    return SpecFile(c, types, "llama-3.2-1b-shape-Q4_K_M")


def test_llama_1b_shape_kernels_compile():
    kernels = model_kernels(llama_3_2_1b_q4_k_m(), context=8192, interleave=interleaves(CudaBackend.threads))
    names = {k.name.split("_")[0] for k in kernels}
    assert names == {"embed", "rmsnorm", "matmul", "rope", "kvstore", "attn", "silu"}
    # a GPU reads Q6_K and Q4_K tensors in the file's layouts, prefill included (no dequantized copy, no gemm)
    assert any("_Q6_K_" in k.name for k in kernels) and any("_Q4_K_" in k.name for k in kernels)
    for arch in ("sm_90", "sm_75"):
        report = CudaBackend.compile_ahead(kernels, arch)
        assert len(report) == len(kernels) and all(r["bytes"] > 0 for r in report)


def gemma_3_1b_q4_k_m():
    """Gemma-3-1B's shape as llama.cpp's Q4_K_M writes it: its 1152-column matrices in Q5_0 (not whole 256-blocks),
    the FFN down projection in Q4_K; windows of 512 on five layers in six, per-head norms, a local rope table."""
    c = Config(n_layer=26, dim=1152, n_head=4, n_kv=1, head_dim=256, ffn=6912, vocab=262144, eps=1e-6,
               rope_base=1e6, context=32768, qk_norm="head", sliding_window=512,
               full_layers=frozenset(range(5, 26, 6)), embed_scale=1152 ** 0.5, act="gelu_tanh", sandwich=True,
               local_rope_base=1e4)
    kv, q = c.n_kv * c.head_dim, c.n_head * c.head_dim
    types = {"token_embd.weight": ((c.vocab, c.dim), "Q8_0"), "output_norm.weight": ((c.dim,), "F32")}
    for i in range(c.n_layer):
        p = f"blk.{i}."
        types.update({p + n: ((w,), "F32") for n, w in (
            ("attn_norm.weight", c.dim), ("ffn_norm.weight", c.dim), ("post_attention_norm.weight", c.dim),
            ("post_ffw_norm.weight", c.dim), ("attn_q_norm.weight", c.head_dim), ("attn_k_norm.weight", c.head_dim))})
        types.update({p + "attn_q.weight": ((q, c.dim), "Q5_0"), p + "attn_k.weight": ((kv, c.dim), "Q5_0"),
                      p + "attn_v.weight": ((kv, c.dim), "Q8_0"), p + "attn_output.weight": ((c.dim, q), "Q4_K"),
                      p + "ffn_gate.weight": ((c.ffn, c.dim), "Q5_0"), p + "ffn_up.weight": ((c.ffn, c.dim), "Q5_0"),
                      p + "ffn_down.weight": ((c.dim, c.ffn), "Q4_K")})
    return SpecFile(c, types, "gemma-3-1b-shape-Q4_K_M")


def test_gemma_3_1b_shape_kernels_compile():
    """Gemma's own kernels among them: GELU, the residual add after each sandwich norm, windowed attention with its
    heads of 256, per-head norms, scaled embedding rows."""
    kernels = model_kernels(gemma_3_1b_q4_k_m(), context=2048, interleave=interleaves(CudaBackend.threads))
    names = {k.name.split("_")[0] for k in kernels}
    assert {"gelu", "add", "head", "attn", "embed"} <= names and "silu" not in names
    windows = [re.search(r"_w(\d+)", k.name) for k in kernels if k.name.startswith("attn")]
    assert {w and w.group(1) for w in windows} == {"512", None}  # the windowed layers and the full ones
    report = CudaBackend.compile_ahead(kernels, "sm_90")
    assert len(report) == len(kernels) and all(r["bytes"] > 0 for r in report)
