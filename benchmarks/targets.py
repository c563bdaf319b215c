"""The CPU targets of docs/benchmarks.md checked in one run: `jitllm bench` beside llama.cpp as its Reproduce list
runs it (SmolLM2 at 37 and 256 prompt tokens, the 1B shape at 32 and 256; 1 and 2 threads), the cold and warm
start (startup.py) and the logits against transformers' (accuracy.py). Prints each run's table as bench does,
then every target with what this run measured and whether it holds. Needs llama-cpp-python and the 1B-shaped
model (both set up as docs/benchmarks.md's Reproduce says); 2-3 minutes on 2 cores.

    python benchmarks/targets.py [--one-b PATH] [--repeats-times N]
"""
import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "scripts")]
from accuracy import logit_errors  # noqa: E402
from make_bench_model import DEFAULT_OUT  # noqa: E402
from startup import start_seconds  # noqa: E402

from jitllm_core.bench import run_bench  # noqa: E402

# (model name, prompt tokens, decode steps, repeats): the Reproduce list's bench commands
RUNS = [("SmolLM2", 37, 64, 5), ("SmolLM2", 256, 32, 3), ("1B shape", 32, 16, 3), ("1B shape", 256, 8, 3)]
DECODE_RATIO = {"SmolLM2": 1.5, "1B shape": 1.2}  # decode tok/s against llama.cpp's, at least
BANDWIDTH = 0.80  # the 1B shape's decode: bytes per token x tok/s against the read bandwidth beside the run
PROMPT_RATIO, PROMPT_TOKENS = 1.0, 256  # prompt tok/s against llama.cpp's, for prompts of this length
COLD_S, FIRST_TOKEN_S = 10.0, 0.5  # Engine() and the first token with an empty kernel cache; the first token, warm
LOGITS = {"f32": 1e-3, "f16": 5e-2}  # |logit - transformers'| in the exact mode, by KV cache dtype


def ratio_check(row, what, least, target):
    """(target, measured, holds) of jitllm's median `what` against llama.cpp's in one bench row."""
    x = row["jitllm"][what] / row["llama.cpp"][what]
    return target, "{:.2f}x (pairs {:.2f}-{:.2f}x)".format(x, *row["pair_ratios"][what]), x >= least


def bench_targets(name, prompt_tokens, rows):
    """(target, measured, holds) of one bench run's rows (one per thread count)."""
    out = []
    for r in rows:
        if "llama.cpp" not in r:
            raise SystemExit("targets: llama.cpp was not measured (see the note above); the ratios need it")
        where = f"{name}, {prompt_tokens}-token prompt, {r['threads']} thread(s)"
        least = DECODE_RATIO[name]
        out.append(ratio_check(r, "decode_tok_s", least, f"decode >= {least}x llama.cpp, {where}"))
        if name == "1B shape":
            f = r["jitllm"]["bw_fraction"]
            out.append((f"decode >= {BANDWIDTH:.0%} of the read bandwidth, {where}",
                        f"{f:.0%} of {r['bandwidth_Bps'] / 1e9:.1f} GB/s", f >= BANDWIDTH))
        if prompt_tokens == PROMPT_TOKENS:
            out.append(ratio_check(r, "prompt_tok_s", PROMPT_RATIO, f"prompt >= {PROMPT_RATIO}x llama.cpp, {where}"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-b", default=str(DEFAULT_OUT.expanduser()), help="the 1B-shaped GGUF")
    ap.add_argument("--repeats-times", type=int, default=1, help="every run's repeats multiplied by N")
    args = ap.parse_args()
    if not os.path.isfile(args.one_b):
        raise SystemExit(f"targets: {args.one_b} does not exist (python scripts/make_bench_model.py makes it)")
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("targets: llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    checks = []
    for name, prompt, decode, repeats in RUNS:
        print(f"\n== {name}, {prompt}-token prompt", flush=True)
        rows = run_bench(model=args.one_b if name == "1B shape" else None, prompt_tokens=prompt, decode_tokens=decode,
                         repeats=repeats * args.repeats_times)
        checks += bench_targets(name, prompt, rows)
    starts = start_seconds()
    checks.append((f"cold start <= {COLD_S:.0f} s (empty kernel cache, default model: Engine() and the first token)",
                   "{:.2f} s + {:.3f} s".format(*starts["cold"]), sum(starts["cold"]) <= COLD_S))
    checks.append((f"first token <= {FIRST_TOKEN_S} s after Engine() returns, warm kernel cache",
                   f"{starts['warm'][1]:.3f} s", starts["warm"][1] <= FIRST_TOKEN_S))
    for kv, bound in LOGITS.items():
        _, steps, prefill, _ = logit_errors(kv_dtype=kv)
        checks.append((f"logits within {bound:g} of transformers', KV cache {kv} (SmolLM2, decode steps and prefill)",
                       f"{max(steps, prefill):.2e}", max(steps, prefill) <= bound))
    print("\n== targets")
    width = max(len(t) for t, _, _ in checks)
    for target, measured, holds in checks:
        print(f"{target:{width}}  {measured:>28}  {'holds' if holds else 'MISSED'}")
    held = sum(h for _, _, h in checks)
    print(f"{held} of {len(checks)} targets hold in this run")


if __name__ == "__main__":
    main()
