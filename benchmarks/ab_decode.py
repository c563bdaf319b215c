"""Decode (and prompt) tok/s of variants of the IR's builders alternated in one process (A B A B ...), so that the
machine's drift between runs (~30 % here) falls on all variants alike. A variant sets one class or module attribute of
jitllm_core before its engine is built (the op builders' caches are cleared, so its kernels are built anew;
the CPU compiles them under keys of their own, as the IR differs):

    python benchmarks/ab_decode.py -m MODEL --threads 2 --set quant.R6.pieces 2 4 [--rounds 7]
    python benchmarks/ab_decode.py -m MODEL --activations int8 --prompt-tokens 256 --set ops.INT8_TOKENS 1 4
    python benchmarks/ab_decode.py -m MODEL --prompt-tokens 256 --set engine.STEP_TOKENS 64 128  # an engine's steps
    python benchmarks/ab_decode.py -m MODEL --prompt-tokens 3000 --set ops.KV_AHEAD 2 4  # decode at a long context

A device's tuned lowering options too: `--set tuning.FORCED '{"prefetch": 0}' '{"prefetch": 1}'` gives every
kernel tag candidate 0, then 1, of the CPU's `prefetch` (CpuDevice.tunables). And the CPU backend's lowering
constants (a module of jitllm_cpu_llvm: `--set lower.PREFETCH_MIN 262144 32768`), whose value then joins the
keys of the programs compiled with it.
"""
import argparse
import ast
import functools
import importlib
import importlib.util

import numpy as np

import jitllm_core as jl
from jitllm_core import bench, ops
from jitllm_core.cache import digest


def setter(name):
    """A function that sets attribute `name` (module.attr or module.Class.attr, a module of jitllm_core or of
    jitllm_cpu_llvm) to a value, so that kernels built and compiled after it are the variant's."""
    path = name.split(".")
    backend = importlib.util.find_spec(f"jitllm_core.{path[0]}") is None  # a module of the CPU backend
    owner = functools.reduce(getattr, path[1:-1], importlib.import_module(
        f"{'jitllm_cpu_llvm' if backend else 'jitllm_core'}.{path[0]}"))
    if backend:
        from jitllm_cpu_llvm import runtime
        lowering = runtime.LOWERING

    def apply(v):
        setattr(owner, path[-1], v)
        if backend:  # the program keys digest the lowering's source, not the constants set here
            runtime.LOWERING = digest(lowering, name, repr(v))
        for f in vars(ops).values():
            if hasattr(f, "cache_clear"):
                f.cache_clear()
    return apply


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", nargs="+", required=True, metavar=("MODULE.ATTR", "VALUE"),
                    help="an attribute under jitllm_core or jitllm_cpu_llvm (module.name or module.Class.name) and its values")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--activations", default="f32", help="the engine's matmul inputs: f32 (exact) or int8")
    args = ap.parse_args()
    apply, values = setter(args.set[0]), [ast.literal_eval(v) for v in args.set[1:]]
    engines = []  # (value, engine): a value may be unhashable (a dict)
    for v in values:
        apply(v)
        context = max(512, args.prompt_tokens + args.decode_tokens + 1)  # a long prompt's decode measured too
        eng = jl.Engine(args.model, devices=["cpu"], threads=args.threads, max_context=context,
                        activations=args.activations, speculate=0)
        ids = bench.prompt_ids(eng.tokenizer, args.prompt_tokens)
        bench.jitllm_once(eng, ids, 2)  # warm-up
        engines.append((v, eng))
    runs = [[] for _ in values]
    for _ in range(args.rounds):
        for (v, eng), r in zip(engines, runs):
            r.append(bench.jitllm_once(eng, ids, args.decode_tokens))
    for v, r in zip(values, runs):
        prompt, decode = zip(*r)
        print(f"{args.set[0]} = {v!r}: {args.threads} thread(s), decode tok/s median {np.median(decode):.2f} "
              f"(runs {', '.join(f'{x:.2f}' for x in decode)}); {args.prompt_tokens}-token prompt tok/s median "
              f"{np.median(prompt):.1f} (runs {', '.join(f'{x:.1f}' for x in prompt)})")


if __name__ == "__main__":
    main()
