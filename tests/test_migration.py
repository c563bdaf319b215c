"""Live migration: output unchanged, no token recomputed, faults rolled back without leaks."""
import threading

import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core import faults

PROMPT = "The history of the printing press begins in China, where woodblock printing was used for centuries."


@pytest.fixture(scope="module")
def eng(default_model):
    backend_device("cpu:1")
    e = jl.Engine(default_model, devices=["cpu:0", "cpu:1"], placement={"cpu:0": range(30)}, kv_dtype="f32")
    e.wait_compiled()  # every reply drafts from its first step: the same steps with and without moves
    yield e
    e.close()


@pytest.fixture(autouse=True)
def home(eng):
    """Every test starts with all units on cpu:0 and no faults."""
    faults.clear()
    eng.migrate("embed,0-29,head", "cpu:0")
    yield
    faults.clear()


def feed_in_parts(eng, ids, cuts, moves):
    """Feed ids in parts, running moves[i] (units, device) after part i; returns logits and reports."""
    reports, out = [], []
    with eng.session() as s:
        for i, (a, b) in enumerate(zip([0] + cuts, cuts + [len(ids)])):
            out.append(s.feed(ids[a:b]))
            if i < len(moves) and moves[i]:
                reports.append(eng.migrate(*moves[i]))
    return np.concatenate(out), reports


def test_same_kind_moves_are_bit_identical(eng):
    ids = (eng.tokenizer.encode(PROMPT) * 6)[:100]
    cuts = [1, 17, 33, 64, 90]  # before the first token, page boundaries, a step boundary, mid-sequence
    base, _ = feed_in_parts(eng, ids, cuts, [])
    moves = [("0-9", "cpu:1"), ("10-29", "cpu:1"), ("head", "cpu:1"), ("0-29,embed,head", "cpu:0"), ("5", "cpu:1")]
    got, reports = feed_in_parts(eng, ids, cuts, moves)
    assert np.array_equal(got, base)
    assert all(r.ok and r.recomputed_tokens == 0 for r in reports), [str(r) for r in reports]
    assert any(r.paths.get("kv cpu:0->cpu:1") == "peer" for r in reports)


def test_streamed_generation_with_moves_matches(eng):
    before = eng.stats["steps"]
    base = eng.generate(PROMPT, max_tokens=40, ignore_eos=True).token_ids
    steps = eng.stats["steps"]
    out, reports = [], []
    for i, ev in enumerate(eng.generate(PROMPT, max_tokens=40, ignore_eos=True, stream=True)):
        out.append(ev.token_id)
        if i in (0, 15, 16, 38):  # first token, around a page boundary, the last position
            reports.append(eng.migrate("0-29" if i % 2 else "3-7", "cpu:1" if i < 16 else "cpu:0"))
    assert out == base
    assert eng.stats["steps"] - steps == steps - before  # the reply's steps without moves: nothing ran twice
    assert all(r.ok and r.recomputed_tokens == 0 for r in reports)


def test_migrate_from_another_thread_while_streaming(eng):
    base = eng.generate(PROMPT, max_tokens=30, ignore_eos=True).token_ids
    out, handles = [], []
    started = threading.Event()

    def mover():
        started.wait()
        handles.append(eng.migrate("0-29", "cpu:1", wait=False))

    t = threading.Thread(target=mover)
    t.start()
    for i, ev in enumerate(eng.generate(PROMPT, max_tokens=30, ignore_eos=True, stream=True)):
        out.append(ev.token_id)
        if i == 3:
            started.set()
    t.join()
    report = handles[0].result(timeout=60)
    assert report.ok and out == base
    assert eng.placement[0][0] == "cpu:1"


def test_two_sessions_keep_their_kv(eng):
    a_ids, b_ids = eng.tokenizer.encode(PROMPT), eng.tokenizer.encode("Rivers flow to the sea because")
    with eng.session() as a, eng.session() as b:
        ref_a, ref_b = a.feed(a_ids + a_ids[:5]), b.feed(b_ids + b_ids[:5])
    with eng.session() as a, eng.session() as b:
        a.feed(a_ids), b.feed(b_ids)
        r = eng.migrate("0-29", "cpu:1")
        got_a, got_b = a.feed(a_ids[:5]), b.feed(b_ids[:5])
    assert r.ok and r.bytes_precopied + r.bytes_in_pause > 0
    assert np.array_equal(got_a, ref_a[-5:]) and np.array_equal(got_b, ref_b[-5:])


def test_a_parked_sequence_moves_along(eng):
    """The prompt cache's sequences are the engine's: they move with their layers and are resumed after."""
    prompt = " ".join([PROMPT] * 8)  # more than a step of 128 tokens
    first = eng.generate(prompt, max_tokens=8)
    assert eng.migrate("0-29", "cpu:1").ok
    again = eng.generate(prompt, max_tokens=8)
    assert again.timings["cached_tokens"] > 0 and again.token_ids == first.token_ids


def test_noop_and_queued_migrations(eng):
    assert eng.migrate("0-29", "cpu:0").noop
    h1, h2 = eng.migrate("0-14", "cpu:1", wait=False), eng.migrate("0-29", "cpu:1", wait=False)
    assert h1.result(60).ok and h2.result(60).ok
    assert {eng.placement[u][0] for u in range(30)} == {"cpu:1"}


def _accounts(eng):
    return ({d: a.used for d, a in eng.arenas.items()},
            {u: st.pool.used for u, st in eng.units.items() if st.pool is not None})


@pytest.mark.parametrize("fault", ["transfer", "compile", "memory"])
def test_faults_roll_back(eng, default_model, fault):
    base = eng.generate(PROMPT, max_tokens=30, ignore_eos=True).token_ids
    out, reports = [], []
    for i, ev in enumerate(eng.generate(PROMPT, max_tokens=30, ignore_eos=True, stream=True)):
        out.append(ev.token_id)
        if i == 10:
            before = _accounts(eng)
            if fault == "memory":
                eng.arenas["cpu:1"].cap = eng.arenas["cpu:1"].used + 10_000_000  # far below 30 layers
            else:
                faults.inject(fault, "cpu:1", after_bytes=50_000 if fault == "transfer" else 0)
            reports.append(eng.migrate("0-29", "cpu:1"))
            faults.clear()
            eng.arenas["cpu:1"].cap = eng.arenas["cpu:1"].dev.caps.memory_bytes
            assert _accounts(eng) == before  # nothing leaked: buffers and pages
    r = reports[0]
    assert not r.ok and {"transfer": "injected transfer", "compile": "injected compile",
                         "memory": "out of memory"}[fault] in r.reason
    assert out == base and eng.placement[0][0] == "cpu:0"


def test_bad_migration_requests(eng):
    with pytest.raises(jl.JitllmError, match="unknown unit"):
        eng.migrate("0-40", "cpu:1")
    with pytest.raises(jl.JitllmError, match="no device|not in this engine"):
        eng.migrate("0-3", "cuda:7")


def test_moves_do_not_measure_tunings(eng, monkeypatch):
    """A move compiles the target's programs while the reply goes on: tunings it has no record of keep their
    defaults rather than being measured against the running steps (tuning.tune's measure)."""
    from jitllm_core import tuning
    calls, real = [], tuning.tune

    def spy(dev, kernels, progress=None, measure=True):
        calls.append(measure)
        return real(dev, kernels, progress, measure)
    monkeypatch.setattr(tuning, "tune", spy)
    assert eng.migrate("0-29", "cpu:1").ok
    assert calls == [False] * len(calls) and calls
