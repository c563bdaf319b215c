"""The prompt cache: a finished generation's sequence is kept, and a later prompt that starts with its tokens (a
chat's next turn, the same prompt again) resumes it. Replies are the tokens a fresh run gives, bit for bit (the
steps resumed are those a fresh run takes); fewer positions are computed; a full pool takes parked pages back."""
import pytest

import jitllm_core as jl

SYSTEM = ("You are a patient teacher of computer science. Explain each idea in plain words, with one short example, "
          "and say when a simpler answer would do. Prefer concrete numbers to vague words, name the trade-offs, "
          "and keep every answer under a hundred words. If the question is unclear, ask one question back before "
          "answering. Students range from beginners to working engineers; adapt to what the question shows of "
          "them. Never invent references. When code helps, write it in Python with comments on the why. Compare "
          "with what the student already knows, such as a recipe for an algorithm or a library for a module, and "
          "end with one question that checks the idea landed. Mention the history of an idea only when it helps: "
          "who found it, when, and what problem it solved at the time.")


@pytest.fixture(scope="module")
def engines(default_model, cpu):
    with jl.Engine(default_model, devices=["cpu"]) as cached, \
            jl.Engine(default_model, devices=["cpu"], prompt_cache=False) as fresh:
        yield cached, fresh


def computed(eng, call):
    """(the call's result, positions the engine computed for it)."""
    before = eng.stats["tokens"]
    r = call()
    return r, eng.stats["tokens"] - before


def test_chat_turns_resume_the_conversation(engines):
    cached, fresh = engines
    messages = [{"role": "system", "content": SYSTEM}]
    for i, question in enumerate(["What is a compiler?", "And an interpreter?", "Which one runs faster?"]):
        messages.append({"role": "user", "content": question})
        got, n = computed(cached, lambda: cached.chat(messages, max_tokens=40))
        want = fresh.chat(messages, max_tokens=40)
        assert got.token_ids == want.token_ids and got.text == want.text
        t = got.timings
        # computed: the prompt's uncached tokens, the reply's decode steps and the drafted tokens it did not keep
        assert n == t["prompt_tokens"] - t["cached_tokens"] + t["decode_tokens"] + t["drafted_tokens"] \
            - t["accepted_tokens"]
        if i == 0:
            assert t["cached_tokens"] == 0 and t["prompt_tokens"] > 128
        else:  # the history up to the last whole step of the previous prompt
            assert t["cached_tokens"] > 0 and t["cached_tokens"] % cached.model.T == 0
        messages.append({"role": "assistant", "content": got.text})


def test_the_same_prompt_again(engines):
    cached, fresh = engines
    prompt = SYSTEM + " Now list three sorting algorithms."
    first, again = cached.generate(prompt, max_tokens=12), cached.generate(prompt, max_tokens=12)
    assert first.token_ids == again.token_ids == fresh.generate(prompt, max_tokens=12).token_ids
    assert again.timings["cached_tokens"] == (again.timings["prompt_tokens"] - 1) // cached.model.T * cached.model.T
    # an early end (a closed stream) parks what it holds too, and is resumed
    stream = cached.generate(prompt + " Briefly.", max_tokens=30, stream=True)
    next(stream)
    stream.close()
    ids = cached.encode(prompt + " Briefly.")
    assert cached.parked[-1].tokens[:len(ids)] == ids
    assert cached.generate(ids, max_tokens=5).timings["cached_tokens"] == (len(ids) - 1) // 128 * 128


def test_a_full_pool_takes_parked_pages_back(default_model, cpu):
    with jl.Engine(default_model, devices=["cpu"], max_context=256) as eng:  # 16 pages of 16 positions
        ids = eng.tokenizer.encode(SYSTEM)
        first, other = ids[:150], (ids * 2)[:200][::-1]
        eng.generate(first, max_tokens=4)  # 153 positions parked: 10 pages
        assert [p.tokens[:150] for p in eng.parked] == [first] and eng.units[0].pool.used == 10
        r = eng.generate(other, max_tokens=4)  # 13 pages: the parked sequence's are taken back
        assert r.timings["cached_tokens"] == 0 and r.finish_reason == "length"
        assert [p.tokens[:200] for p in eng.parked] == [other] and eng.units[0].pool.used == 13
        with eng.session() as s:  # a session too takes what parked sequences hold
            s.feed(first + other[:60])
            assert not eng.parked
