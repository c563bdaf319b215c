"""SmolLM2 through the engine on the CPU against HF transformers on the same GGUF."""
import io

import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core import llama
from jitllm_core.engine import Result
from jitllm_core.llama import WIDE_THREADS
from jitllm_core.profile import profile_decode
from reference import agreeing_prefix, reference_logits, step_and_prompt_errors

PROMPTS = [
    "The history of the printing press begins in China, where woodblock printing was used for centuries before "
    "movable type appeared in Europe.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n# Usage:\n",
    "Ünïcödé, emoji 🚀 and numbers 12345: a model should handle all of them gracefully when it writes a story.",
]


@pytest.fixture(scope="module")
def engines(cpu, default_model):
    return {kv: jl.Engine(default_model, devices=["cpu"], kv_dtype=kv) for kv in ("f32", "f16")}


@pytest.mark.parametrize("kv,tol", [("f32", 1e-3), ("f16", 5e-2)])
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_score_matches_transformers(engines, default_model, kv, tol, prompt):
    eng = engines[kv]
    ids = eng.tokenizer.encode(PROMPTS[prompt])
    ids = (ids * 3)[:80]  # ≥ 32 positions, more than one step of 64
    assert len(ids) >= 32
    got, want = eng.score(ids), reference_logits(default_model, ids)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= tol


def test_decode_steps_match_transformers(engines, default_model):
    """Token by token (decode steps: the matmuls read the input quantized to integer digits, not the prefill's
    f32 gemm), within the same bound as the f32 reference."""
    eng = engines["f32"]
    steps, _ = step_and_prompt_errors(eng, default_model, (eng.tokenizer.encode(PROMPTS[0]) * 3)[:40])
    assert steps <= 1e-3


def test_prefill_in_column_chunks_matches_transformers(cpu, default_model, monkeypatch):
    """Prefill as it runs a matrix wider than PREFILL_CHUNK_COLS (a larger model's FFN down projection): column
    chunks dequantized and multiplied one after another into the same outputs."""
    monkeypatch.setattr(llama, "PREFILL_CHUNK_COLS", 512)  # SmolLM2's down projection: 3 chunks of its 1,536
    eng = jl.Engine(default_model, devices=["cpu"], kv_dtype="f32")
    try:
        names = {name for _, name, *_ in profile_decode(eng, prompt_tokens=1, repeats=1, step_tokens=2)[0]}
        assert any(n.startswith("gemm_R4_576x1536_") and "_k512_" in n for n in names), names
        ids = (eng.tokenizer.encode(PROMPTS[0]) * 3)[:40]
        assert np.abs(eng.score(ids) - reference_logits(default_model, ids)).max() <= 1e-3
    finally:
        eng.close()


def sampled_logits(eng, ids, n):
    """The logits a greedy generation of n tokens after ids samples from, one row a token, and the tokens."""
    rows = []

    def greedy(logits):
        rows.append(logits.copy())
        return int(np.argmax(logits))
    result = Result([], "", "length")
    for _ in eng._generate(ids, n, greedy, [], True, result):
        pass
    return rows, result.token_ids


def test_generation_logits_from_the_wanted_tokens_match_transformers(engines, default_model):
    """A generation's prompt computes the last layer's queries, and what follows its attention, only for the
    tokens whose logits are wanted (none of a first chunk's, the last token of the last chunk's): the logits it
    samples from, and the decode steps after it (whose last layer attends to every prompt position's keys and
    values), are transformers'."""
    eng = engines["f32"]
    ids = (eng.tokenizer.encode(PROMPTS[0]) * 8)[:eng.model.T + 12]  # two chunks
    rows, out = sampled_logits(eng, ids, 3)
    want = reference_logits(default_model, ids + out)[len(ids) - 1:]
    assert len(rows) == 3 and np.abs(np.stack(rows) - want[:3]).max() <= 1e-3
    # which launches start at the step's t0: the last layer's queries and from its attention on, no other layer's
    m = eng.model
    from_t0 = lambda unit: [lt.kernel.name.split("_")[0] for lt in m.unit_launches(unit, prefill=True)
                            if "t0" in lt.kernel.scalars and "t0" not in lt.scalars]
    assert from_t0(0) == []
    assert from_t0(m.cfg.n_layer - 1) == ["gemm", "rope", "attn", "gemm", "rmsnorm", "gemm", "gemm",
                                                  "silu", "gemm"]


def test_int8_activations_trade_accuracy_for_speed(cpu, default_model):
    """The optional int8 inputs (as llama.cpp's): logits about 1 off transformers' (the exact mode: 1e-4), the
    next token mostly the same; prefill (through the same integer matmuls) and decode steps agree."""
    eng = jl.Engine(default_model, devices=["cpu"], kv_dtype="f32", activations="int8")
    ids = (eng.tokenizer.encode(PROMPTS[0]) * 3)[:40]
    got, ref = eng.score(ids), reference_logits(default_model, ids)
    assert 0.05 < np.abs(got - ref).max() <= 3.0
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
    with eng.session() as s:
        steps = np.concatenate([s.feed([t]) for t in ids[:8]])
    assert np.abs(steps - got[:8]).max() <= 1e-3
    # a two-chunk generation (its last layer from t0: the integer matmuls' token tiles start there) samples from
    # the logits scoring gives
    long_ids = (ids * 4)[:eng.model.T + 12]
    rows, out = sampled_logits(eng, long_ids, 2)
    scored = eng.score(long_ids + out)[len(long_ids) - 1:len(long_ids) + 1]
    assert np.abs(np.stack(rows) - scored).max() <= 1e-4
    with pytest.raises(jl.JitllmError, match="activations must be"):
        jl.Engine(default_model, devices=["cpu"], activations="int4")


@pytest.fixture(params=["cpu:1", "vulkan:0"])
def wide(request):
    """A device as the engine sees a GPU: many threads at once, so it gets the wide schedule (llama.interleaves)
    -- on cpu:1 and on lavapipe, what a GPU runs is checked where there is none."""
    dev = backend_device(request.param)
    threads, dev.caps.threads = dev.caps.threads, WIDE_THREADS
    yield request.param
    dev.caps.threads = threads


def test_wide_schedule_matches_transformers(wide, default_model, engines):
    """What GPUs run -- the file's layouts, a row per iteration, prefill through the same matmul -- scores like
    transformers; a split between it and the interleaved cpu:0 gives the all-cpu:0 tokens, and layers moved
    from one to the other mid-sequence give its logits."""
    eng = jl.Engine(default_model, devices=[wide], kv_dtype="f32")
    try:
        for step in (1, 2):   # a decode step, a prefill step
            names = {name for _, name, *_ in profile_decode(eng, prompt_tokens=1, repeats=1, step_tokens=step)[0]}
            assert any(n.startswith("matmul_Q4_1_") for n in names), names
            assert not any(n.startswith(("matmul_R", "gemm", "dequant", "quantize_input")) for n in names), names
        ids = eng.tokenizer.encode(PROMPTS[0])[:12]   # on a CPU, the GPU's form of the dot runs ~20x slower
        assert np.abs(eng.score(ids) - reference_logits(default_model, ids)).max() <= 1e-3
    finally:
        eng.close()
    ids = engines["f32"].tokenizer.encode(PROMPTS[1])[:12]
    want = engines["f32"].generate(ids, max_tokens=4, ignore_eos=True).token_ids
    split = jl.Engine(default_model, devices=["cpu:0", wide], kv_dtype="f32",
                      placement={"cpu:0": range(0, 15), wide: range(15, 30)})
    try:
        assert split.generate(ids, max_tokens=4, ignore_eos=True).token_ids == want
        with split.session() as s:   # layers 0-14 move from the interleaved layout to the file's mid-sequence
            s.feed(ids)
            assert split.migrate("0-14", wide).ok
            moved = s.feed(want[:2])
        with engines["f32"].session() as s:
            s.feed(ids)
            still = s.feed(want[:2])
        assert np.abs(moved - still).max() <= 1e-3
    finally:
        split.close()


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_greedy_matches_transformers(engines, default_model, kv):
    eng, checked = engines[kv], 0
    for prompt in PROMPTS[:2]:
        ids = eng.tokenizer.encode(prompt)
        out = eng.generate(ids, max_tokens=24, ignore_eos=True).token_ids
        ref = reference_logits(default_model, ids + out)
        n = agreeing_prefix(ref, out, len(ids) - 1)
        assert out[:n] == list(ref[len(ids) - 1:len(ids) - 1 + n].argmax(-1))
        checked += n
    assert checked >= 10  # a near-tie at the first token (prompt 0's is 0.024) must not leave nothing checked


def test_greedy_is_deterministic(engines):
    eng = engines["f16"]
    runs = [eng.generate("Tell me about the moon.", max_tokens=16).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_stream_matches_non_stream(engines):
    eng = engines["f16"]
    events = list(eng.generate("List three colors:", max_tokens=12, stream=True))
    whole = eng.generate("List three colors:", max_tokens=12)
    assert [e.token_id for e in events] == whole.token_ids
    assert "".join(e.text for e in events) == whole.text


def test_stop_strings_and_sampling(engines):
    eng = engines["f16"]
    full = eng.generate("Count: 1, 2, 3,", max_tokens=12, ignore_eos=True)
    cut = full.text[3:6]
    r = eng.generate("Count: 1, 2, 3,", max_tokens=12, ignore_eos=True, stop=[cut])
    assert r.finish_reason == "stop" and r.text == full.text[:full.text.find(cut)]
    a = eng.generate("Once upon a time", max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=7).token_ids
    b = eng.generate("Once upon a time", max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=7).token_ids
    assert a == b


def test_meaningless_options_are_refused_by_name(engines, default_model):
    eng = engines["f16"]
    for kw, problem in [(dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
                        (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"),
                        (dict(top_k=-1), "top_k"), (dict(seed=-2), "seed")]:
        with pytest.raises(jl.JitllmError, match=f"^{problem} must be"):
            eng.generate("Hi", stream=True, **kw)  # refused at the call, not when the stream is read
    assert eng.generate("Hi", max_tokens=0).token_ids == []
    for kw, problem in [(dict(stop=""), "stop is"), (dict(stop=[5]), "stop is"), (dict(stop=5), "stop is"),
                        (dict(prompt=None), "a prompt is"), (dict(prompt=[1.5, 2]), "a prompt is"),
                        (dict(prompt=b"hi"), "a prompt is"), (dict(prompt=[True]), "a prompt is")]:
        with pytest.raises(jl.JitllmError, match=f"^{problem}"):
            eng.generate(kw.pop("prompt", "Hi"), stream=True, **kw)
    assert eng.generate(np.array(eng.tokenizer.encode("Hi")), max_tokens=2, stop=("x",)).token_ids
    for kw in (dict(threads=0), dict(threads=1.5), dict(max_context=0)):
        with pytest.raises(jl.JitllmError, match=f"^{next(iter(kw))} must be a whole number >= 1"):
            jl.Engine(default_model, devices=["cpu"], **kw)
    with pytest.raises(jl.JitllmError, match="^devices is empty"):
        jl.Engine(default_model, devices=[])
    with jl.Engine(default_model, devices="cpu") as one:  # a name alone is one device
        assert len(one.devices) == 1


def test_a_closed_engine_says_so(default_model, cpu):
    with jl.Engine(default_model, devices=["cpu"]) as eng:
        assert eng.generate("Hi", max_tokens=2).token_ids
        events = eng.generate("Hi", max_tokens=5, stream=True)
        next(events)
    events.close()  # a stream outliving its engine ends quietly (it raised KeyError freeing its pages)
    for call in (lambda: eng.generate("Hi", max_tokens=2), lambda: eng.score([1, 2]),
                 lambda: eng.migrate("0", "cpu")):
        with pytest.raises(jl.JitllmError, match="the engine is closed"):
            call()


def test_context_limit_is_reported(default_model, cpu):
    eng = jl.Engine(default_model, devices=["cpu"], max_context=40)
    r = eng.generate("Write a long essay about rivers.", max_tokens=100, ignore_eos=True)
    assert r.finish_reason == "context" and len(r.token_ids) > 0
    with pytest.raises(jl.ContextLimitError):
        eng.generate("word " * 60, max_tokens=5)


def test_chat_template(engines):
    eng = engines["f16"]
    text = eng.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    r = eng.chat([{"role": "user", "content": "What is 2+2?"}], max_tokens=20)
    assert "4" in r.text


def test_token_ids_outside_the_vocabulary_are_refused(engines):
    eng = engines["f16"]
    for call in (lambda: eng.generate([1, 10 ** 8], max_tokens=2), lambda: eng.score([5, -1])):
        with pytest.raises(jl.JitllmError, match="outside the vocabulary"):
            call()
    assert eng.generate("Hi", max_tokens=2).token_ids  # and the engine carries on


def test_profile_times_every_launch_and_counts_weight_bytes(engines):
    """`jitllm bench --profile`'s numbers: one row per launch of the step, each timed (in sequence, on a CPU), the
    bytes of the matmuls' weights equal to the packed tensors the engine holds, the embedding's one row."""
    from jitllm_core.profile import IN_SEQUENCE, print_profile, profile_decode
    eng = engines["f16"]
    rows, whole, how = profile_decode(eng, prompt_tokens=4, repeats=1)
    launches = sum(len(eng._bind(u, seg.device)) for seg in eng.segments for u in seg.units)
    assert len(rows) == launches and whole > 0 and all(r[2] > 0 for r in rows) and how == IN_SEQUENCE
    mm_bytes = sum(b for _, name, _, b, _ in rows if name.startswith("matmul"))
    want = sum(eng.model.tensor_bytes(t, u) for u in eng.model.units for t, (_, as_f32) in
               eng.model.weight_shapes(u).items() if not as_f32 and u != "embed")
    assert mm_bytes == want
    embed_bytes, = [b for _, name, _, b, _ in rows if name.startswith("embed")]  # one row of the table per token
    assert embed_bytes * eng.model.cfg.vocab == eng.model.tensor_bytes("token_embd.weight", "embed")
    # a prefill step's matmuls count 2 flops per weight per token they compute: every token of the step, but the
    # last layer's queries and those after its attention, the last token's (the LM head, for it, is a matvec)
    rows, _, _ = profile_decode(eng, prompt_tokens=4, repeats=1, step_tokens=8)
    last = eng.model.cfg.n_layer - 1
    wanted = ("attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    tokens = lambda u, name: 1 if u == last and name.split(".")[2] in wanted else 8
    flops = sum(2 * tokens(u, name) * np.prod(shape) for u in eng.model.units if u not in ("embed", "head")
                for name, (shape, as_f32) in eng.model.weight_shapes(u).items() if not as_f32)
    assert sum(f for _, name, _, _, f in rows if name.startswith("gemm")) == flops
    head, = [f for _, name, _, _, f in rows if name.startswith("matmul")]  # the LM head, for the last token
    assert head == 2 * eng.model.cfg.vocab * eng.model.cfg.dim
    # and their share of a multiply-add peak, where one is given: the kernels that count flops, each its GFLOP/s
    out = io.StringIO()
    print_profile(rows, 1.0, how, file=out, peak=1e11)  # 100 GFLOP/s: a kernel's share, its GFLOP/s as a percentage
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("% of peak") and "peak: 100.0 GFLOP/s" in lines[-1]
    shares = [line.split()[-2:] for line in lines[1:-2] if line.split()[-1] != "0.0"]  # those with flops
    assert len(shares) > 1 and all(abs(int(pct[:-1]) - float(gflops)) <= 1 for gflops, pct in shares)
