"""`jitllm bench speculate`: decode tokens/s of replies that quote their prompt, with and without speculative
decoding (`Engine(speculate=N)`: drafts from the context, `PromptLookup`), beside llama.cpp's own prompt lookup
(llama-cpp-python's `LlamaPromptLookupDecoding`, 2 tokens a draft: its advice for CPUs).

Method, per thread count: one Engine (no prompt cache) and one llama.cpp context (logits of every token in a step,
which its drafts need) on the same file; for each task, its chat prompt's greedy reply (up to --decode-tokens,
ending at EOS) from each engine with speculation off and on, interleaved, one warm-up round, medians of `repeats`
rounds. Decode tok/s = the reply's tokens after the first / the wall time from its first token to its last,
sampling and detokenizing included, for both engines. jitllm's reply with speculation is checked to be the one
without, token for token."""
from __future__ import annotations

import statistics
import sys
import time

from .bench import open_llama_cpp
from .cli import print_table
from .engine import Engine
from .errors import JitllmError

PASSAGE = ("The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed its ninety-two "
           "steps, trimmed the wick and wound the clockwork that turned the lens. Ships passing in the night saw "
           "its beam sweep the water every ten seconds, and knew where the reef lay.")
TASKS = {  # name -> the user's message: replies that quote the prompt (copy, json), repeat themselves (code), or not
    "copy": "Repeat this text exactly, word for word:\n\n" + PASSAGE,
    "json": 'Turn this into JSON with keys name, age, city: "Alice is 30 and lives in Paris. Bob is 25 and lives in '
            'Rome. Carol is 41 and lives in Oslo."',
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "free": "Write a short story about a lighthouse keeper.",
}


def timed_reply(tokens) -> tuple[list, float]:
    """(the tokens a reply's iterator gives, decode tok/s: those after the first / the time from the first on)."""
    out, start = [], None
    for tok in tokens:
        out.append(tok)
        start = start or time.perf_counter()
    return out, (len(out) - 1) / (time.perf_counter() - start) if len(out) > 1 else 0.0


def jitllm_reply(eng, ids, max_tokens, speculate):
    eng.speculate = speculate
    reply = timed_reply(e.token_id for e in eng.generate(ids, max_tokens=max_tokens, stream=True))
    return (*reply, eng.last.timings)


def llama_cpp_reply(llm, ids, max_tokens, draft, eos):
    llm.draft_model = draft
    llm.reset()

    def tokens():
        for n, tok in enumerate(llm.generate(ids, temp=0.0), 1):
            if tok in eos:
                return
            yield tok
            if n >= max_tokens:
                return
    return timed_reply(tokens())


def run(model=None, devices=None, kv_dtype="f16", threads=(1, 2), speculate=3, decode_tokens=128, repeats=3,
        llama_cpp=True, activations="f32", out=None) -> list[dict]:
    if speculate < 1 or decode_tokens < 2 or repeats < 1:
        raise JitllmError("bench speculate: --speculate must be at least 1, --decode-tokens 2, --repeats 1")
    out, rows, results = out or sys.stdout, [], []
    for n_threads in threads:
        print(f"bench speculate: {n_threads} thread(s): loading, warming up ...", file=sys.stderr)
        eng = Engine(model=model, devices=devices or ["cpu"], threads=n_threads, kv_dtype=kv_dtype,
                     activations=activations, prompt_cache=False, speculate=speculate)
        eng.wait_compiled()  # every measured reply drafts from its first step
        peer = draft = None
        try:
            prompts = {name: eng.encode(eng.apply_chat_template([{"role": "user", "content": text}])
                                        if eng.tokenizer.chat_template else text) for name, text in TASKS.items()}
            n_ctx = max(map(len, prompts.values())) + decode_tokens + 16
            peer = open_llama_cpp(eng.model_path, n_threads, n_ctx, logits_all=True) if llama_cpp else None
            llama_cpp = peer is not None  # say why only once
            if peer:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
                draft = LlamaPromptLookupDecoding(num_pred_tokens=2)
                eos = {peer.llm.token_eos(), *eng.tokenizer.eos_ids}
            for name, ids in prompts.items():
                runs = {k: [] for k in ("off", "on", "peer off", "peer on")}
                for r in range(repeats + 1):  # round 0 warms up
                    plain, tok_s, _ = jitllm_reply(eng, ids, decode_tokens, 0)
                    reply, spec_tok_s, timings = jitllm_reply(eng, ids, decode_tokens, speculate)
                    if reply != plain:
                        raise JitllmError(f"bench speculate: task {name!r}: the reply with speculation differs from "
                                          "the one without")
                    measured = {"off": tok_s, "on": spec_tok_s}
                    if peer:
                        measured.update({"peer off": llama_cpp_reply(peer.llm, ids, decode_tokens, None, eos)[1],
                                         "peer on": llama_cpp_reply(peer.llm, ids, decode_tokens, draft, eos)[1]})
                    if r:
                        for k, v in measured.items():
                            runs[k].append(v)
                m = {k: statistics.median(v) for k, v in runs.items() if v}
                accepted = timings["accepted_tokens"] / max(1, timings["drafted_tokens"])
                results.append({"threads": n_threads, "task": name, "tokens": len(reply), "accepted": accepted,
                                **{f"{k.replace(' ', '_')}_tok_s": v for k, v in m.items()}})
                peer_cells = ([f"{m['peer off']:.1f}", f"{m['peer on']:.1f}", f"{m['on'] / m['peer on']:.2f}x"]
                              if peer else ["-", "-", "-"])
                rows.append([n_threads, name, len(reply), f"{m['off']:.1f}", f"{m['on']:.1f}",
                             f"{m['on'] / m['off']:.2f}x", f"{accepted:.0%}", *peer_cells])
        finally:
            eng.close()
            if peer:
                peer.close()
    print(f"model: {eng.model_path}\ngreedy replies of up to {decode_tokens} tokens; drafts of up to {speculate} "
          f"tokens (llama.cpp's: 2); medians of {repeats} runs after a warm-up", file=out)
    print_table(["threads", "task", "tokens", "jitllm", "speculating", "x", "drafts taken", "llama.cpp",
                 "llama.cpp lookup", "ratio"], rows, file=out, right=[0, *range(2, 10)])
    print("decode tok/s of the reply (from its first token to its last, sampling included); x: speculating / not; "
          "drafts taken: drafted tokens the reply kept; ratio = jitllm speculating / llama.cpp with its prompt "
          "lookup", file=out)
    return results
