"""Independent reference: HF transformers loading the same GGUF (dequantized to fp32)."""
import functools
import os

import numpy as np
import pytest


@functools.lru_cache(maxsize=2)
def transformers_model(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    torch.set_num_threads(os.cpu_count() or 1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32).eval()


def reference_logits(path, ids):
    import torch
    with torch.no_grad():
        return transformers_model(path)(torch.tensor([ids])).logits[0].numpy()


def step_and_prompt_logits(eng, path, ids):
    """transformers' logits of ids, and eng's, fed them token by token (decode steps) and all at once (a prompt)."""
    want = reference_logits(path, ids)
    with eng.session() as s:
        steps = np.concatenate([s.feed([t]) for t in ids])
    return want, steps, eng.score(ids)


def step_and_prompt_errors(eng, path, ids):
    """Largest differences from transformers' logits of eng's, fed ids token by token (decode steps) and all at
    once (a prompt)."""
    want, steps, prompt = step_and_prompt_logits(eng, path, ids)
    return np.abs(steps - want).max(), np.abs(prompt - want).max()


def f32_bound(model, ids, want, tol=1e-3, spreads=4):
    """Per position of ids, the bound of a check against transformers model's logits `want`: tol beyond `spreads`
    times what f32 rounding alone moves them by there -- transformers' own logits fed one token at a time through
    its KV cache against its whole prompt's. ~1e-5 at most positions of the test models; but a random mixture of
    experts has positions whose logits are ill-conditioned (terms that cancel): one of the random Qwen2-MoE's moves
    5e-4 between transformers' two paths, 2e-4 from its f64 logits, while this engine's CPU prompt came within
    2.5e-3 of the f64 logits there on a Sapphire Rapids host (its token-by-token 9e-4) and within 1e-5 at the
    rest. Compare `np.abs(got - want).max(axis=1) <= bound`."""
    import torch
    import transformers
    cache, rows = transformers.DynamicCache(config=model.config), []
    with torch.no_grad():
        for t in ids:
            out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].numpy())
    return tol + spreads * np.abs(np.stack(rows) - want).max(axis=1)


def agreeing_prefix(ref_logits, got_tokens, start, margin=0.05):
    """Number of greedy tokens that must match: up to the first position whose reference top-2 margin is small."""
    for i, tok in enumerate(got_tokens):
        row = ref_logits[start + i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= margin:
            return i
    return len(got_tokens)
