"""Speculative decoding: drafts from a generation's own context (`PromptLookup`) checked in one step of several
tokens of one sequence, each at its own position -- each row bit for bit the logits of the steps one by one, so a
reply with drafts is the reply without, token for token, greedy or sampled."""
import threading

import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core import engine as engine_mod
from jitllm_core.lookup import DRAFT_FROM, Drafter, PromptLookup
from test_batched_decode import hf_models  # noqa: F401 -- the Gemma 3 and Qwen3-MoE folders, a fixture
from test_safetensors_model import PROMPTS

PASSAGE = ("The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed its ninety-two "
           "steps, trimmed the wick and wound the clockwork that turned the lens.")
COPY = [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + PASSAGE}]


def test_lookup_drafts_what_followed_the_latest_match():
    assert PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3]).draft(2) == [4, 6]  # the latest "2 3", not the first
    assert PromptLookup([5, 1, 2, 8, 9, 0, 7, 1, 2]).draft(3) == [8, 9, 0]
    assert PromptLookup([4, 1, 2, 3, 8, 6, 1, 2, 3]).draft(1) == [8]  # "1 2 3" before "2 3"
    assert PromptLookup([1, 2, 3, 1, 2]).draft(5) == [3, 1, 2, 3, 1]  # into the present: the period repeats
    assert PromptLookup([7, 7, 7]).draft(4) == [7] * 4
    assert PromptLookup([1, 2, 3, 4]).draft(3) == [] and PromptLookup([3, 1, 3]).draft(3) == []  # one token: no match
    p = PromptLookup([1, 2])
    for t in (3, 1, 2):
        p.push(t)
    assert p.draft(2) == [3, 1]


def test_drafter_drafts_while_its_guesses_pay():
    """Every draft's first token is scored, checked or not: misses stop the drafts, hits bring them back, one token
    at a time until most guesses are right; a whole draft taken makes the next one longer, a miss shorter."""
    d = Drafter([1, 2, 3, 4, 1, 2], most=3)
    assert d.draft(10) == [3]  # the share of guesses right starts at a half: one token
    misses = 0
    while d.right >= DRAFT_FROM:  # each time "1 2" is followed by a new token: the guess (the last one) misses
        d.push(100 + misses)
        d.push(1), d.push(2)
        d.draft(10)
        misses += 1
    assert misses >= 1 and d.draft(10) == [] and d.guess == 100 + misses - 1  # not drafted, still guessed
    for _ in range(12):  # right guesses: first one token, then the whole draft
        d.push(3)
        d.push(1), d.push(2)
        d.draft(10)
    assert d.draft(10) == [3, 1, 2] and d.draft(2) == [3, 1]
    d.checked(3, 1)
    assert d.ahead == 2 and d.draft(10) == [3, 1]
    d.checked(2, 2)
    assert d.ahead == 3


def steps_against_one_by_one(eng, prompt, draft):
    """Logits of one step of [draft...] at the end of prompt's sequence (a sequence named once per token), and of
    the same tokens fed one by one."""
    with eng.session() as s:
        s.feed(prompt)
        alone = [s.feed([t])[0] for t in draft]
    seq = eng.new_sequence()
    try:
        with eng._lock:
            eng._step(seq, prompt, len(prompt) - 1)
            eng._ensure_pages(seq, seq.n, seq.n + len(draft))
            together = eng._step_batch([seq] * len(draft), draft)
        assert seq.n == len(prompt) + len(draft)
    finally:
        eng.free_sequence(seq)
    return together, np.asarray(alone)


@pytest.mark.parametrize("device", ["cpu", "vulkan:0", "cuda:0"])
def test_a_draft_step_is_its_tokens_one_by_one(shallow_model, device):
    """Four tokens of one sequence in one step, across a page boundary (pages of 16), on the CPU and each
    accelerator (lavapipe; CUDA where a GPU is): bit for bit the logits of the four steps one by one (the default
    model's first 2 layers: every layer runs the same kernels)."""
    backend_device(device)
    with jl.Engine(shallow_model, devices=[device], max_context=256, prompt_cache=False) as eng:
        prompt = list(np.random.default_rng(1).integers(10, 1000, 14))
        together, alone = steps_against_one_by_one(eng, prompt, [31, 415, 92, 65])
    assert alone.std() > 1 and np.array_equal(together, alone)


@pytest.mark.parametrize("variant", ["gemma3-f32", "qwen3moe-f32"])
def test_a_draft_step_with_windows_and_experts(hf_models, variant):  # noqa: F811 -- the fixture imported above
    """A sliding window (Gemma 3's, 21 positions, passed within the draft) and a mixture of experts (each token
    its own): a draft step's rows are its tokens' steps one by one."""
    with jl.Engine(hf_models[variant][0], devices=["cpu"], kv_dtype="f32", max_context=256, prompt_cache=False) as eng:
        prompt = eng.tokenizer.encode(" ".join(PROMPTS))[:19]
        together, alone = steps_against_one_by_one(eng, prompt, [17, 94, 3])
    assert alone.std() > 0.05 and np.array_equal(together, alone)


def test_a_reply_with_drafts_is_the_reply_without(default_model):
    """A reply that quotes its prompt, greedy and sampled (seeded), with log probabilities: drafts checked, some
    taken and some not, and every token and log probability as without drafts. On the CPU: that an accelerator's
    draft steps are its steps one by one is test_a_draft_step_is_its_tokens_one_by_one's (lavapipe took over 7
    minutes for these 4 x 48 tokens of the whole model on a slow host)."""
    with jl.Engine(default_model, devices=["cpu"], max_context=512, prompt_cache=False, speculate=0) as eng:
        kws = [dict(max_tokens=48, logprobs=2), dict(max_tokens=48, logprobs=2, temperature=0.8, seed=3)]
        plain = [eng.chat(COPY, **kw) for kw in kws]
        eng.speculate = 3
        eng.wait_compiled()
        drafted = [eng.chat(COPY, **kw) for kw in kws]
    for p, d in zip(plain, drafted):
        assert (d.token_ids, d.logprobs, d.text, d.finish_reason) == (p.token_ids, p.logprobs, p.text, p.finish_reason)
        assert d.timings["decode_tokens"] == p.timings["decode_tokens"]
    greedy, sampled = (d.timings for d in drafted)
    assert greedy["accepted_tokens"] >= len(drafted[0].token_ids) // 2  # the copy is mostly drafts
    assert sampled["drafted_tokens"] > sampled["accepted_tokens"] > 0


def test_a_reply_ending_inside_a_draft_keeps_only_its_positions(default_model):
    """Replies cut by max_tokens or a stop string while a checked draft runs past them: the sequence parked for the
    prompt cache holds the reply's positions only, and the next turn's reply is a fresh engine's."""
    with jl.Engine(default_model, devices=["cpu"], max_context=512) as eng:
        eng.wait_compiled()  # drafts from the first step on (they start once the batched programs are compiled)
        ids = eng.encode(eng.apply_chat_template(COPY))
        ended_inside = 0
        for n in range(8, 14):
            eng.generate(ids, max_tokens=n)
            parked = eng.parked[-1]
            assert parked.seq.n == len(ids) + n - 1 == len(parked.tokens)
            ended_inside += eng.last.timings["drafted_tokens"] > eng.last.timings["accepted_tokens"]
        assert ended_inside  # at least one stopped with drafted rows left over
        r = eng.generate(ids, max_tokens=40, stop="keeper")
        assert r.finish_reason == "stop" and eng.parked[-1].seq.n == len(eng.parked[-1].tokens)
        turn = ids + r.token_ids + eng.encode(" and then")
        cached = eng.generate(turn, max_tokens=24)
    with jl.Engine(default_model, devices=["cpu"], max_context=512, prompt_cache=False, speculate=0) as fresh:
        assert cached.token_ids == fresh.generate(turn, max_tokens=24).token_ids


def test_generations_at_once_draft_in_the_rows_left(default_model, monkeypatch):
    """Two generations decoding together in steps of up to four tokens: each one's drafts take the rows the other
    leaves, and each reply is the one it gives alone."""
    monkeypatch.setattr(engine_mod, "BATCH_WAIT", 1.0)  # a busy machine's threads still meet (test_batched_decode)
    chats = [COPY, [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the dog sat on the log."}]]
    with jl.Engine(default_model, devices=["cpu"], max_sequences=2, prompt_cache=False) as eng:
        assert eng.model.batch == 4  # a token of each, and drafts
        eng.wait_compiled()
        alone = [eng.chat(c, max_tokens=32).token_ids for c in chats]
        eng.reset_stats()
        out = [None, None]

        def run(i):
            out[i] = eng.chat(chats[i], max_tokens=32)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.token_ids for r in out] == alone
    assert eng.stats["batched_steps"] > 0 and sum(r.timings["accepted_tokens"] for r in out) > 0


def test_layers_move_while_a_draft_is_checked(default_model):
    """Layers move between two CPU devices while a reply streams, some moves while a checked draft's rows wait to
    be sampled (the draft's positions move with the KV): the reply is the one without moves."""
    backend_device("cpu:1")
    with jl.Engine(default_model, devices=["cpu:0", "cpu:1"], placement={"cpu:0": range(30)},
                   prompt_cache=False) as eng:
        eng.wait_compiled()
        base = eng.chat(COPY, max_tokens=40).token_ids
        out, reports = [], []
        for i, ev in enumerate(eng.chat(COPY, max_tokens=40, stream=True)):
            out.append(ev.token_id)
            if i in (4, 9, 22):
                reports.append(eng.migrate("3-7" if i == 9 else "0-29", "cpu:0" if i == 22 else "cpu:1"))
        assert out == base and eng.last.timings["accepted_tokens"] > 20
    assert len(reports) == 3 and all(r.ok and r.recomputed_tokens == 0 for r in reports)


def test_a_reply_does_not_wait_for_the_batched_programs(default_model):
    """While the batched programs that drafts run in are still being compiled, a reply goes on without drafts
    (the reply without them) instead of waiting; once they are ready, replies draft."""
    with jl.Engine(default_model, devices=["cpu"], max_context=512, prompt_cache=False) as eng:
        built, compile_batch = threading.Event(), eng._batch_program
        eng._batch_program = lambda seg: built.wait(120) and compile_batch(seg)  # a compile that takes its time
        out = []
        reply = threading.Thread(target=lambda: out.append(eng.chat(COPY, max_tokens=24)))
        reply.start()
        reply.join(60)
        built.set()
        assert out and out[0].timings["drafted_tokens"] == 0
        eng.wait_compiled()
        again = eng.chat(COPY, max_tokens=24)
    assert again.token_ids == out[0].token_ids and again.timings["drafted_tokens"] > 0


def test_speculate_is_a_whole_number(default_model):
    for bad in (-1, 1.5, True):
        with pytest.raises(jl.JitllmError, match="speculate must be a whole number >= 0"):
            jl.Engine(default_model, devices=["cpu"], speculate=bad)
