#!/usr/bin/env python3
"""Write a Gemma-3-1B-shaped benchmark model: random weights (std 0.02, norms near 1) in Gemma 3's GGUF layout,
quantized to Q4_K_M by llama.cpp's own quantizer (through llama-cpp-python: the benchmark set-up installs it), so
its tensor types are the ones llama.cpp picks -- Q5_0 / Q8_0 for the 1152-column matrices, which are not whole
256-blocks. The tokenizer is the default model's, padded with control tokens to Gemma's 262,144 entries.

    python benchmarks/make_gemma_bench_model.py [--out PATH]
    jitllm bench -m PATH --prompt-tokens 32 --decode-tokens 16 --repeats 3
"""
import argparse
import ctypes
import os
from pathlib import Path

import gguf
import numpy as np

from jitllm_core.models import default_model_path

DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, WINDOW = 1152, 26, 4, 1, 256, 6912, 262144, 512
DEFAULT_OUT = Path("~/.cache/jitllm/bench/gemma-3-1b-shape-Q4_K_M.gguf")
PADDED = {"tokenizer.ggml.tokens": lambda i: f"<pad_{i}>", "tokenizer.ggml.token_type": lambda i: 3,
          "tokenizer.ggml.scores": lambda i: 0.0}


def write_f16(path):
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(32768)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_sliding_window(WINDOW)
    for name, f in gguf.GGUFReader(default_model_path()).fields.items():
        if name.startswith("tokenizer."):
            v = f.contents()
            if name in PADDED:
                v = v + [PADDED[name](i) for i in range(len(v), VOCAB)]
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(name, v, f.types[0], sub_type=f.types[-1] if array else None)
    rng = np.random.default_rng(20250312)
    mat = lambda rows, cols: (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
    norm = lambda n: 1 + rng.standard_normal(n, dtype=np.float32) * 0.02  # GGUF holds Gemma's norms as 1 + w
    w.add_tensor("token_embd.weight", mat(VOCAB, DIM))
    w.add_tensor("output_norm.weight", norm(DIM))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        for name, a in (("attn_norm", norm(DIM)), ("attn_q", mat(q, DIM)), ("attn_k", mat(kv, DIM)),
                        ("attn_v", mat(kv, DIM)), ("attn_q_norm", norm(HEAD_DIM)), ("attn_k_norm", norm(HEAD_DIM)),
                        ("attn_output", mat(DIM, q)), ("post_attention_norm", norm(DIM)), ("ffn_norm", norm(DIM)),
                        ("ffn_gate", mat(FFN, DIM)), ("ffn_up", mat(FFN, DIM)), ("ffn_down", mat(DIM, FFN)),
                        ("post_ffw_norm", norm(DIM))):
            w.add_tensor(f"blk.{i}.{name}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = ap.parse_args().out.expanduser()
    import llama_cpp
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_suffix(".f16.tmp")
    write_f16(f16)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, os.cpu_count() or 1
    try:
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)):
            raise SystemExit("llama.cpp's quantizer failed")
    finally:
        f16.unlink()
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
