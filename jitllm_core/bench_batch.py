"""`jitllm bench batch`: decode tokens/s of several generations at once, which the engine decodes together (each
weight read once a step for all of them: `Engine._decode`), against one generation alone and llama.cpp's one.

Method, per thread count: one Engine (no prompt cache) whose batched step takes the most sequences asked for; for
each count of sequences, that many generations of the same prompt start together, each in a thread of its own
(a server's requests), and wait for one another after their first token; the clock runs from then until the last
ends. Decode tok/s = every generation's decode steps / that time; medians of `repeats` runs after a warm-up (the
first batched step compiles its programs). llama.cpp's figure is its one sequence's decode (`bench.LlamaCpp`, the
same file, prompt and threads).
"""
from __future__ import annotations

import statistics
import sys
import threading
import time

from .bench import open_llama_cpp, prompt_ids
from .cli import print_table
from .engine import Engine
from .errors import JitllmError


def decode_at_once(eng, ids, n, steps) -> float:
    """Decode tok/s of n generations of ids at once, from the moment all of them have their first token."""
    streams = [eng.generate(ids, max_tokens=steps + 1, ignore_eos=True, stream=True) for _ in range(n)]
    started, ends = threading.Barrier(n + 1), []

    def run(stream):
        next(stream)
        started.wait()
        for _ in stream:
            pass
        ends.append(time.perf_counter())
    threads = [threading.Thread(target=run, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return n * steps / (max(ends) - t0)


def run(model=None, devices=None, kv_dtype="f16", threads=(1, 2), sequences=(1, 2, 4), prompt_tokens=37,
        decode_tokens=64, repeats=3, llama_cpp=True, activations="f32", out=None) -> list[dict]:
    if min(sequences) < 1 or prompt_tokens < 1 or decode_tokens < 1 or repeats < 1:
        raise JitllmError("bench batch: --sequences, --prompt-tokens, --decode-tokens and --repeats must be at "
                          "least 1")
    out, rows, results = out or sys.stdout, [], []
    for n_threads in threads:
        print(f"bench batch: {n_threads} thread(s): loading, warming up ...", file=sys.stderr)
        eng = Engine(model=model, devices=devices or ["cpu"], threads=n_threads, kv_dtype=kv_dtype,
                     activations=activations, max_sequences=max(sequences), prompt_cache=False, speculate=0)
        peer = None
        try:
            ids = prompt_ids(eng.tokenizer, prompt_tokens)
            peer = open_llama_cpp(eng.model_path, n_threads, prompt_tokens + decode_tokens + 16) if llama_cpp else None
            llama_cpp = peer is not None  # say why only once
            runs, batched = {n: [] for n in sequences}, dict.fromkeys(sequences, 0)
            for r in range(repeats + 1):  # round 0 warms up
                for n in sequences:
                    eng.reset_stats()
                    tok_s = decode_at_once(eng, ids, n, decode_tokens)
                    if r:
                        runs[n].append(tok_s)
                        batched[n] += eng.stats["batched_steps"]
            peer_tok_s = statistics.median(peer.once(ids, decode_tokens)[1] for _ in range(repeats)) if peer else None
        finally:
            eng.close()
            if peer:
                peer.close()
        one = statistics.median(runs[min(sequences)]) / min(sequences)
        for n in sequences:
            tok_s = statistics.median(runs[n])
            results.append({"threads": n_threads, "sequences": n, "decode_tok_s": tok_s, "llama_cpp_tok_s": peer_tok_s,
                            "batched_steps": batched[n]})
            peer_cells = [f"{peer_tok_s:.1f}", f"{tok_s / peer_tok_s:.2f}x"] if peer_tok_s else ["-", "-"]
            rows.append([n_threads, n, f"{tok_s:.1f}", f"{tok_s / n:.1f}", f"{tok_s / one:.2f}x", *peer_cells])
    print(f"model: {eng.model_path}\n{prompt_tokens}-token prompt, {decode_tokens} decode steps per generation; "
          f"medians of {repeats} runs after a warm-up", file=out)
    print_table(["threads", "sequences", "decode tok/s", "per sequence", "x one", "llama.cpp one", "ratio"], rows,
                file=out, right=range(7))
    print("decode tok/s: every generation's steps / the time from all having their first token to the last's end; "
          f"x one: against {min(sequences)} sequence(s) alone, per sequence; llama.cpp one: its decode of one "
          "sequence, on the same file and threads; ratio = jitllm's tok/s (all sequences) / llama.cpp's", file=out)
    return results
