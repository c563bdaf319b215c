"""`jitllm bench`: prompt and decode tokens/s of the engine, beside llama.cpp on the same GGUF when llama-cpp-python
is installed, and decode's fraction of the machine's measured memory read bandwidth.

Method, per thread count: one jitllm Engine and one llama.cpp context with that many threads, on the same file
and the same prompt token ids; one warm-up run of each, then `repeats` runs interleaved A B A B; medians, their
ratio, and the lowest and highest ratio of a pair of runs taken back to back (how far the machine's drift moves it).
Prompt tok/s = prompt tokens / prefill time; decode tok/s = decode steps / their time (greedy, EOS ignored).
Read bandwidth: the engine's device summing a 256 MB f32 matrix with a kernel of its own, on the same threads
(planner.bandwidth_meter), the best of 5 before the runs and of 2 after each, in the same run. Decode's fraction
of it = bytes read per token x decode tok/s / bandwidth, where jitllm's bytes are what its engine counts
(weights in their packed layout) and llama.cpp's are the GGUF file's tensors. Two figures: each run against the
bandwidth measured just before and just after it (a shared machine's speed drifts by tens of percent within a
run; the median over runs is reported), and the median run against the best bandwidth of the whole run.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np

from .architectures import experts_tensor
from .cli import print_table
from .engine import Engine
from .errors import JitllmError
from .gguf import GGUFFile
from .planner import bandwidth_meter

PROMPT_TEXT = ("The history of compilers begins with the first high-level languages, when programmers wrote "
               "machine code by hand and dreamed of letting the machine translate their formulas. ")


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of the model's tensors, each read once per token; an untied embedding table counts only as the
    one row a token reads (nothing), a mixture's experts as the share a token uses (expert_used_count of
    expert_count)."""
    g = GGUFFile(path)
    arch = g.get("general.architecture", "")
    experts = g.get(f"{arch}.expert_count", 0)
    share = g.get(f"{arch}.expert_used_count", 0) / experts if experts else 1
    skip = {"token_embd.weight"} if "output.weight" in g.tensors else set()
    return round(sum(t.nbytes * (share if experts_tensor(name) else 1)
                     for name, t in g.tensors.items() if name not in skip))


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def jitllm_once(eng, ids, steps) -> tuple[float, float]:
    t = eng.generate(ids, max_tokens=steps + 1, temperature=0.0, ignore_eos=True).timings
    return t["prompt_tokens"] / t["prefill_s"], t["decode_tokens"] / t["decode_s"]


class LlamaCpp:
    """llama.cpp through llama-cpp-python, timed the same way: prefill, then greedy single-token steps."""

    def __init__(self, path, threads, n_ctx, logits_all=False):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         logits_all=logits_all, verbose=False)

    def next_token(self):
        """Greedy: the argmax of the last evaluated token's logits, read from the context (llama-cpp-python keeps
        its `scores` rows only with logits_all, and only n_batch of them otherwise)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def once(self, ids, steps) -> tuple[float, float]:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        token = self.next_token()
        prefilled = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
            token = self.next_token()
        end = time.perf_counter()
        return len(ids) / (prefilled - start), steps / (end - prefilled)

    def close(self):
        self.llm.close()


def open_llama_cpp(path, threads, n_ctx, logits_all=False):
    """A LlamaCpp, or None (with a note why) when llama-cpp-python is missing or cannot load the file."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: not measured (llama-cpp-python is not installed; `pip install llama-cpp-python` "
              "builds it, about 4 minutes on 2 cores)", file=sys.stderr)
        return None
    if not os.path.isfile(path):
        print(f"llama.cpp: not measured ({path} is not a GGUF file)", file=sys.stderr)
        return None
    crash = peer_crash(path, threads)
    if crash:
        print(f"llama.cpp: not measured ({crash})", file=sys.stderr)
        return None
    try:
        return LlamaCpp(path, threads, n_ctx, logits_all)
    except Exception as e:  # llama-cpp-python raises ValueError, RuntimeError, ... for files it cannot load
        print(f"llama.cpp: not measured (it could not load {path}: {e})", file=sys.stderr)
        return None


# A prompt's batch through llama.cpp in a process of its own: its default build on a CPU with AMX (Sapphire Rapids
# and later) repacks Q4/Q8 weights for an AMX matmul that can crash at its first tile instruction (llama.cpp issue
# 20824, seen here with llama-cpp-python 0.3.36), which would take the whole bench down with it
PROBE = ("import sys, llama_cpp; l = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), "
         "n_threads_batch=int(sys.argv[2]), n_ctx=64, verbose=False); l.eval(list(range(1, 17)))")


def peer_crash(path, threads) -> str | None:
    """Why llama.cpp cannot be measured on `path` in this process (it died on a 16-token batch in a probe
    process), or None."""
    done = subprocess.run([sys.executable, "-c", PROBE, path, str(threads)], capture_output=True, text=True)
    if done.returncode >= 0:
        return None
    amx = "AMX_INT8 = 1" in _system_info()
    return (f"llama.cpp died of signal {-done.returncode} evaluating a 16-token batch of {path} in a probe process"
            + ("; its build uses AMX on this CPU, whose matmul crashes on some machines (llama.cpp issue 20824): "
               "rebuild llama-cpp-python without AMX as docs/benchmarks.md says" if amx else ""))


def _system_info() -> str:
    import llama_cpp
    return llama_cpp.llama_print_system_info().decode()


def interleaved_runs(eng, peer, ids, decode_tokens, repeats, measure):
    """{engine: [(prompt tok/s, decode tok/s, read bandwidth beside the run) per run]} after a warm-up run of each,
    jitllm and the peer (or None) in turn, and the best read bandwidth of the whole run. `measure` (a best of
    several) runs before the runs and after each; a run's bandwidth is the better of those just before and just
    after it, so that decode and the bandwidth it is divided by see the machine in the same moment."""
    runs, marks = {"jitllm": [], "llama.cpp": []}, [measure(5)]
    for r in range(repeats + 1):  # run 0 is the warm-up
        measured = {"jitllm": jitllm_once(eng, ids, decode_tokens)}
        if peer:
            measured["llama.cpp"] = peer.once(ids, decode_tokens)
        marks.append(measure(2))
        if r:
            for name, m in measured.items():
                runs[name].append((*m, max(marks[-2:])))
    return runs, max(marks)


def pair_ratios(runs) -> dict:
    """{"prompt_tok_s" / "decode_tok_s": (lowest, highest)} of jitllm's run i / llama.cpp's run i: each pair ran
    back to back, so its ratio shows how far the machine's drift moves the ratio of medians; {} without a peer."""
    pairs = list(zip(runs["jitllm"], runs["llama.cpp"]))
    if not pairs:
        return {}
    ratios = {what: [j[i] / p[i] for j, p in pairs] for i, what in enumerate(("prompt_tok_s", "decode_tok_s"))}
    return {what: (min(r), max(r)) for what, r in ratios.items()}


def run_bench(model=None, devices=None, kv_dtype="f16", threads=(1, 2), prompt_tokens=37, decode_tokens=64,
              repeats=5, llama_cpp=True, out=None, activations="f32") -> list[dict]:
    """Measure, print the table on `out` (stdout) and return one dict per thread count (tok/s are medians)."""
    if prompt_tokens < 1 or decode_tokens < 1 or repeats < 1:
        raise JitllmError("bench: --prompt-tokens, --decode-tokens and --repeats must be at least 1")
    out = out or sys.stdout
    results, model_path = [], None
    for n in threads:
        print(f"bench: {n} thread(s): loading, measuring read bandwidth, warming up ...", file=sys.stderr)
        # no prompt cache: each run computes its whole prompt, as llama.cpp's (reset before each) does; no drafts:
        # decode steps of one token, as llama.cpp's (`bench speculate` measures them)
        eng = Engine(model=model, devices=devices or ["cpu"], threads=n, kv_dtype=kv_dtype, activations=activations,
                     prompt_cache=False, speculate=0)
        peer = None
        try:
            model_path = eng.model_path
            ids = prompt_ids(eng.tokenizer, prompt_tokens)
            if llama_cpp:
                peer = open_llama_cpp(model_path, n, prompt_tokens + decode_tokens + 16)
                llama_cpp = peer is not None  # say why only once
            with bandwidth_meter(next(iter(eng.devices.values())), rows=16384) as measure:
                runs, bandwidth = interleaved_runs(eng, peer, ids, decode_tokens, repeats, measure)
            file_bytes = gguf_bytes_per_token(model_path) if os.path.isfile(model_path) else None
            bytes_per_token = {"jitllm": eng.stats.get("bytes_per_token") or file_bytes, "llama.cpp": file_bytes}
        finally:
            eng.close()
            if peer:
                peer.close()
        row = {"threads": n, "bandwidth_Bps": bandwidth, "bytes_per_token": bytes_per_token,
               "tuned": {d.name: dict(d.tuned) for d in eng.devices.values()}, "pair_ratios": pair_ratios(runs)}
        for name, ms in runs.items():
            if ms:
                b = bytes_per_token[name]
                row[name] = {"prompt_tok_s": statistics.median(m[0] for m in ms),
                             "decode_tok_s": statistics.median(m[1] for m in ms),
                             "bw_fraction": statistics.median(b * m[1] / m[2] for m in ms) if b else None}
        results.append(row)
    print_report(results, model_path, prompt_tokens, decode_tokens, repeats, out, activations)
    return results


def print_report(results, model_path, prompt_tokens, decode_tokens, repeats, out, activations="f32"):
    peer = any("llama.cpp" in r for r in results)
    engines = ["jitllm", "llama.cpp"] if peer else ["jitllm"]
    bpt = results[0]["bytes_per_token"]
    print(f"model: {model_path}" + ("; jitllm's matmul inputs int8 (--activations int8: not the default, exact mode)"
                                     if activations == "int8" else ""), file=out)
    print(f"{prompt_tokens}-token prompt, {decode_tokens} decode steps; medians of {repeats} runs after a warm-up"
          + (", jitllm and llama.cpp interleaved" if peer else ""), file=out)
    source = {"jitllm": "counted by its engine: weights in their packed layout", "llama.cpp": "the GGUF file's tensors"}
    print("bytes read per token: " + "; ".join(f"{e} {bpt[e] / 1e6:.1f} MB ({source[e]})" if bpt.get(e) else
                                               f"{e} unknown" for e in engines), file=out)
    header = ["threads"]
    for what in ("prompt", "decode"):
        header += [f"{what} {e}" for e in engines] + (["ratio"] if peer else [])
    header += ["read GB/s"] + [f"{e} % of bw" for e in engines] + [f"{e} % of best" for e in engines]
    rows = []
    for r in results:
        row = [r["threads"]]
        for what in ("prompt_tok_s", "decode_tok_s"):
            row += [f"{r[e][what]:.1f}" if e in r else "-" for e in engines]
            if peer:
                row.append(f"{r['jitllm'][what] / r['llama.cpp'][what]:.2f}x" if "llama.cpp" in r else "-")
        row.append(f"{r['bandwidth_Bps'] / 1e9:.1f}")
        b = r["bytes_per_token"]
        row += [f"{100 * r[e]['bw_fraction']:.0f}%" if e in r and r[e]["bw_fraction"] else "-" for e in engines]
        row += [f"{100 * b[e] * r[e]['decode_tok_s'] / r['bandwidth_Bps']:.0f}%" if b.get(e) and e in r else "-"
                for e in engines]
        rows.append(row)
    print_table(header, rows, file=out, right=range(len(header)))
    spans = [f"{r['threads']} thread(s) " + ", ".join(f"{what.split('_')[0]} {lo:.2f}-{hi:.2f}x"
                                                    for what, (lo, hi) in r["pair_ratios"].items())
             for r in results if r.get("pair_ratios")]
    if spans:
        print("ratio of each pair of runs (jitllm's run i / llama.cpp's run i, back to back), lowest-highest: "
              + "; ".join(spans), file=out)
    for r in results:
        for dev, tuned in r.get("tuned", {}).items():
            if tuned:
                print(f"lowering options tuned on this machine, {dev} at {r['threads']} thread(s): " +
                      "; ".join(f"{tag} {opts}" for tag, opts in sorted(tuned.items())), file=out)
    print("tok/s" + ("; ratio = jitllm / llama.cpp" if peer else "") + "; % of bw = bytes per token x decode "
          "tok/s / read bandwidth at that thread count: each run against the bandwidth measured just before and "
          "after it (median over runs); % of best: the median run against the best bandwidth (read GB/s)",
          file=out)
