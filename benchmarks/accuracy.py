"""How far each mode's logits are from transformers' (the same GGUF, dequantized to f32): the largest absolute
difference over a prompt's positions, for decode steps (token by token) and for one prefill, and how often the
greedy token agrees; in the exact mode with an f32 KV cache and with the default f16 one, and in the int8 mode.
The figures docs/benchmarks.md and docs/engine-api.md quote.

    python benchmarks/accuracy.py [-m MODEL] [--device D]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference import step_and_prompt_logits  # noqa: E402  (transformers loading the GGUF)

import jitllm_core as jl  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Germany is"


# (matmul inputs, KV cache): the exact mode as the 1e-3 bound is checked (f32 cache), the default (f16
# cache, bound 5e-2), and the optional int8 inputs
MODES = [("f32", "f32"), ("f32", "f16"), ("int8", "f32")]


def logit_errors(model=None, device="cpu", activations="f32", kv_dtype="f32"):
    """(positions, largest |logit - transformers'| over decode steps, over one prefill, fraction of positions whose
    greedy token agrees) for one mode."""
    eng = jl.Engine(model, devices=[device], kv_dtype=kv_dtype, activations=activations, max_context=512)
    try:
        ids = (eng.tokenizer.encode(PROMPT) * 3)[:48]
        ref, steps, prefill = step_and_prompt_logits(eng, eng.model_path, ids)
        agree = (steps.argmax(1) == ref.argmax(1)).mean()
        return len(ids), np.abs(steps - ref).max(), np.abs(prefill - ref).max(), agree
    finally:
        eng.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for act, kv in MODES:
        n, steps, prefill, agree = logit_errors(args.model, args.device, act, kv)
        print(f"activations {act}, KV {kv}: {n} positions, max |logit - transformers'| decode steps {steps:.2e}, "
              f"prefill {prefill:.2e}; greedy token agrees at {agree:.0%} of positions")


if __name__ == "__main__":
    main()
