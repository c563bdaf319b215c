#!/usr/bin/env python3
"""Write the Llama-3.2-1B-shaped benchmark model: random weights in llama.cpp's Q4_K_M mix, no download.

Shapes and metadata are those of Llama-3.2-1B as llama.cpp's convert_hf_to_gguf.py and `llama-quantize
Q4_K_M` write them (tied embedding, Llama-3 rope scaling as a `rope_freqs.weight` tensor of per-frequency
factors). The tokenizer is the default model's (SmolLM2, 49152 tokens), padded with control tokens to the
128256-entry vocabulary. Tensors are generated (a seed each) and quantized in parallel, a process per core,
and written in order; memory stays at about one f32 matrix per core.

    python scripts/make_bench_model.py [--out PATH] [--force]
"""

import argparse
import math
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jitllm_core.models import default_model_path  # noqa: E402
from jitllm_core.quantize import BLOCK, quantize  # noqa: E402

N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB = 2048, 16, 32, 8, 8192, 128256
HEAD_DIM = N_EMBD // N_HEAD
CONTEXT, ROPE_BASE, RMS_EPS = 131072, 500000.0, 1e-5
ROPE_FACTOR, LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, ORIGINAL_CONTEXT = 32.0, 1.0, 4.0, 8192
SEED, STD = 20240925, 0.02
NAME = "jitllm-bench-llama-3.2-1b-shape"
DEFAULT_OUT = Path("~/.cache/jitllm/bench/llama-3.2-1b-shape-Q4_K_M.gguf")


def rope_factors():
    """Llama-3 rope scaling as convert_hf_to_gguf.py bakes it: a divisor per rotary frequency."""
    factors = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * ROPE_BASE ** (i / HEAD_DIM)
        if wavelen < ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR:
            factors.append(1.0)
        elif wavelen > ORIGINAL_CONTEXT / LOW_FREQ_FACTOR:
            factors.append(ROPE_FACTOR)
        else:
            smooth = (ORIGINAL_CONTEXT / wavelen - LOW_FREQ_FACTOR) / (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR)
            factors.append(1 / ((1 - smooth) / ROPE_FACTOR + smooth))
    return np.array(factors, np.float32)


def tensor_plan():
    """(name, numpy shape, ggml type) in file order, with llama_tensor_get_type's Q4_K_M choices: Q4_K by
    default; Q6_K for the tied embedding (it is also the output head) and for attn_v and ffn_down in the
    layers where use_more_bits holds (first and last eighth, every third in between)."""
    kv = N_HEAD_KV * HEAD_DIM
    matrices = {"attn_q": (N_EMBD, N_EMBD), "attn_k": (kv, N_EMBD), "attn_v": (kv, N_EMBD),
                "attn_output": (N_EMBD, N_EMBD), "ffn_gate": (N_FF, N_EMBD), "ffn_up": (N_FF, N_EMBD),
                "ffn_down": (N_EMBD, N_FF)}
    plan = [("rope_freqs.weight", (HEAD_DIM // 2,), "F32"), ("token_embd.weight", (N_VOCAB, N_EMBD), "Q6_K")]
    for i in range(N_LAYER):
        more_bits = i < N_LAYER // 8 or i >= 7 * N_LAYER // 8 or (i - N_LAYER // 8) % 3 == 2
        plan.append((f"blk.{i}.attn_norm.weight", (N_EMBD,), "F32"))
        for m, shape in matrices.items():
            plan.append((f"blk.{i}.{m}.weight", shape, "Q6_K" if more_bits and m in ("attn_v", "ffn_down") else "Q4_K"))
        plan.append((f"blk.{i}.ffn_norm.weight", (N_EMBD,), "F32"))
    plan.append(("output_norm.weight", (N_EMBD,), "F32"))
    return plan


def add_metadata(writer):
    writer.add_type("model")
    writer.add_name(NAME)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(N_VOCAB)
    # tokenizer (and chat template) of the default model; the token list must be as long as the vocab
    src = gguf.GGUFReader(default_model_path())
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        val = field.contents()
        if key == "tokenizer.ggml.tokens":
            val += [f"<|reserved_{i}|>" for i in range(N_VOCAB - len(val))]
        elif key == "tokenizer.ggml.token_type":
            val += [int(gguf.TokenType.CONTROL)] * (N_VOCAB - len(val))
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, val, field.types[0], sub_type=field.types[-1] if array else None)


def nbytes(shape, type_name):
    bs, ts = BLOCK[type_name]
    return math.prod(shape) // bs * ts


def tensor_data(item):
    """Tensor i of the plan: random normal weights (a seed per tensor), quantized."""
    i, (name, shape, type_name) = item
    if name == "rope_freqs.weight":
        return rope_factors()
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    w = np.random.default_rng([SEED, i]).standard_normal(shape, dtype=np.float32)
    w *= STD
    return quantize(w, type_name)


def write(path):
    plan = tensor_plan()
    tmp = path.with_name(path.name + ".part")  # a crash never leaves a file that looks finished
    writer = gguf.GGUFWriter(tmp, "llama")
    add_metadata(writer)
    for name, shape, type_name in plan:
        writer.add_tensor_info(name, shape, np.float32, nbytes(shape, type_name), gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:   # tensors quantized in parallel
        for (name, _, _), data in zip(plan, pool.imap(tensor_data, enumerate(plan))):
            writer.write_tensor_data(data)
            if name.endswith("ffn_norm.weight") or name == "token_embd.weight":
                print(f"  {name.rsplit('.', 2)[0]:<12} written, {time.time() - t0:6.1f} s", flush=True)
    writer.close()
    os.replace(tmp, path)


def verify(path):
    reader = gguf.GGUFReader(path)
    plan = tensor_plan()
    assert [t.name for t in reader.tensors] == [p[0] for p in plan]
    for t, (name, shape, type_name) in zip(reader.tensors, plan):
        assert t.tensor_type.name == type_name and tuple(int(n) for n in reversed(t.shape)) == shape, name
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == N_VOCAB
    types = Counter(t.tensor_type.name for t in reader.tensors)
    print(f"gguf.GGUFReader: {len(reader.tensors)} tensors ({dict(types)}), {N_VOCAB} tokens: ok")
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp not importable: llama.cpp load check skipped")
        return
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=os.cpu_count(), logits_all=True, verbose=False)
    assert llm.n_vocab() == N_VOCAB and llm.n_embd() == N_EMBD
    llm.eval([1, 2, 3])
    assert np.isfinite(np.asarray(llm.scores[:3])).all()
    print("llama.cpp: loads and evaluates 3 tokens: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output path (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rewrite the file even if it exists")
    args = ap.parse_args()
    path = args.out.expanduser()
    if path.exists() and not args.force:
        print(f"{path} exists ({path.stat().st_size / 1e6:.0f} MB); --force rewrites it")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        print(f"writing {path}")
        write(path)
        print(f"wrote {path}: {path.stat().st_size / 1e6:.0f} MB in {time.time() - t0:.0f} s")
    verify(path)


if __name__ == "__main__":
    main()
