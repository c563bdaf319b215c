#!/usr/bin/env python3
"""The engine on a GPU with a real model file where the default model and transformers are out of reach (an offline
device machine, given the default model cut by cut_model.py): greedy tokens on the CPU, on the device, and split
between them must agree; prints each device's tuned lowering options. Exit status 1 when they disagree.

    python tests/device/engine_check.py MODEL [--device cuda:0]
"""
import argparse
import sys

import jitllm_core as jl
from jitllm_core.modelfile import ModelFile

PROMPT = "The capital of France is"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cpu", default="cpu")
    args = ap.parse_args()
    n = ModelFile(args.model).config.n_layer
    runs = {}
    for label, devices, placement in [
            (args.cpu, [args.cpu], args.cpu), (args.device, [args.device], args.device),
            ("split", [args.cpu, args.device], {args.cpu: range(0, n // 2), args.device: range(n // 2, n)})]:
        e = jl.Engine(args.model, devices=devices, placement=placement, kv_dtype="f32")
        try:
            runs[label] = e.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
            print(f"{label}: {runs[label]}; tuned: " +
                  "; ".join(f"{d.name} {dict(d.tuned)}" for d in e.devices.values()))
        finally:
            e.close()
    same = all(r == runs[args.cpu] for r in runs.values())
    print("greedy tokens agree" if same else "greedy tokens DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
