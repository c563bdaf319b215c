"""How far each mode's logits are from transformers' (the same GGUF, dequantized to f32): the largest absolute
difference over a prompt's positions, for decode steps (token by token) and for one prefill, and how often the
greedy token agrees. The figures docs/benchmarks.md and docs/engine-api.md quote.

    python benchmarks/accuracy.py [-m MODEL] [--device D]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference import reference_logits  # noqa: E402  (transformers loading the GGUF)

import jitllm_core as jl  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Germany is"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for act in ("f32", "int8"):
        eng = jl.Engine(args.model, devices=[args.device], kv_dtype="f32", activations=act, max_context=512)
        ids = (eng.tokenizer.encode(PROMPT) * 3)[:48]
        ref = reference_logits(eng.model_path, ids)
        with eng.session() as s:
            steps = np.concatenate([s.feed([t]) for t in ids])
        prefill = eng.score(ids)
        print(f"activations {act}: {len(ids)} positions, max |logit - transformers'| decode steps "
              f"{np.abs(steps - ref).max():.2e}, prefill {np.abs(prefill - ref).max():.2e}; greedy token agrees at "
              f"{(steps.argmax(1) == ref.argmax(1)).mean():.0%} of positions")
        eng.close()


if __name__ == "__main__":
    main()
