"""Generations at once decode together: the decode steps they wait for at the same moment run as one batched step
(`Engine._decode`), each token at its own position with its own sequence's pages -- and each reply is the one
the generation gives alone, token for token."""
import os
import threading

import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core import engine as engine_mod
from test_safetensors_model import PROMPTS, _build

PROMPT_LENS = [5, 16, 31, 47]  # one token short of, at, and past page boundaries (pages of 16)


@pytest.fixture(autouse=True)
def patient_batches(monkeypatch):
    """A batched step waits up to a second (not BATCH_WAIT) for every generation in its decode loop: on a busy
    machine a thread may take longer than BATCH_WAIT to ask for its next step, and a test that means to batch must
    not depend on that (the wait ends as soon as every one has asked)."""
    monkeypatch.setattr(engine_mod, "BATCH_WAIT", 1.0)


def batched_against_alone(eng, prompts, steps=3):
    """Logits of `steps` decode steps of every prompt's sequence: (batched, each sequence alone)."""
    alone = []
    for p in prompts:
        with eng.session() as s:
            s.feed(p)
            alone.append([s.feed([7 + i])[0] for i in range(steps)])
    seqs = [eng.new_sequence() for _ in prompts]
    try:
        with eng._lock:
            for s, p in zip(seqs, prompts):
                eng._step(s, p, len(p) - 1)
            batched = []
            for i in range(steps):
                for s in seqs:
                    eng._ensure_pages(s, s.n, s.n + 1)
                batched.append(eng._step_batch(seqs, [7 + i] * len(seqs)))
    finally:
        for s in seqs:
            eng.free_sequence(s)
    return np.stack(batched, 1), np.asarray(alone)


@pytest.mark.parametrize("device", ["cpu", "vulkan:0", "cuda:0"])
def test_a_batched_step_is_each_sequence_alone(shallow_model, device):
    """Four sequences of different lengths, a token each, on the CPU (interleaved weights, matmuls in tiles of
    tokens) and each accelerator (lavapipe; CUDA where a GPU is: their wide schedule): bit for bit the logits of
    each sequence's steps alone (the default model's first 2 layers: every layer runs the same kernels)."""
    backend_device(device)
    with jl.Engine(shallow_model, devices=[device], max_context=256, prompt_cache=False) as eng:
        rng = np.random.default_rng(0)
        batched, alone = batched_against_alone(eng, [list(rng.integers(10, 1000, n)) for n in PROMPT_LENS])
        assert eng.stats["batched_steps"] == 3
    assert alone.std() > 1 and np.array_equal(batched, alone)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, default_model):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    root = tmp_path_factory.mktemp("batched")
    return {v: (str(root / v), _build(root / v, v, tokenizer)) for v in ("gemma3-f32", "qwen3moe-f32")}


@pytest.mark.parametrize("variant", ["gemma3-f32", "qwen3moe-f32"])
def test_batched_steps_against_transformers(hf_models, variant):
    """Sliding windows (Gemma 3's, 21 positions: each sequence's window at its own place, the pages it passed
    freed) and a mixture of experts (each token its own experts): the batched steps' logits against
    transformers' for each sequence, and against its steps alone."""
    import torch
    folder, model = hf_models[variant]
    with jl.Engine(folder, devices=["cpu"], kv_dtype="f32", max_context=256, prompt_cache=False) as eng:
        text = eng.tokenizer.encode(" ".join(PROMPTS))
        prompts = [text[i:i + n] for i, n in zip((0, 3, 9, 1), PROMPT_LENS)]
        batched, alone = batched_against_alone(eng, prompts)
        # the bytes counted: a mixture's batch of 4 tokens, 2 of 8 experts each, may read every expert
        layer = eng.model.step_bytes(0, tokens=4)
        assert layer == eng.model.unit_bytes(0) and (layer > eng.model.step_bytes(0)) == bool(eng.config.experts)
    assert np.abs(batched - alone).max() <= 1e-5 * np.abs(alone).max()
    for p, got in zip(prompts, batched):
        with torch.no_grad():
            want = model(torch.tensor([p + [7, 8, 9]])).logits[0, len(p):].numpy()
        assert want.std() > 0.05 and np.abs(got - want).max() <= 1e-3


def at_once(work, n):
    """work(i) for i < n, each in a thread of its own, all at once."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


GENERATIONS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
               "The three laws of robotics", "A recipe for bread:"]


def test_generations_at_once_are_the_generations_alone(default_model):
    """Five generations at once (more than the four a batched step takes), greedy and sampled, stopping at
    different lengths: each the generation alone, token for token, and most of their decode steps batched."""
    with jl.Engine(default_model, devices=["cpu"], max_sequences=4, prompt_cache=False, speculate=0) as eng:
        kws = [dict(max_tokens=24 + 4 * i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(5)]
        alone = [eng.generate(p, **kw).token_ids for p, kw in zip(GENERATIONS, kws)]
        eng.reset_stats()
        out = [None] * 5

        def run(i):
            out[i] = eng.generate(GENERATIONS[i], **kws[i]).token_ids
        at_once(run, 5)
        assert out == alone
        decode_steps = sum(len(a) - 1 for a in alone)
        assert eng.stats["tokens"] == sum(len(eng.encode(p)) for p in GENERATIONS) + decode_steps
        assert eng.stats["batched_steps"] >= decode_steps // 4 // 2  # at least half the steps four at a time


def test_batched_generations_through_streamed_layers_and_migration(default_model):
    """Layers whose weights stream in every step and host-compute layers, then layers moving between devices while
    three generations decode together: each reply the generation's alone."""
    backend_device("cpu:1")
    placement = {"cpu:1": {"resident": range(0, 8), "streamed": range(8, 20)}, "cpu:0": range(20, 30)}
    with jl.Engine(default_model, devices=["cpu:0", "cpu:1"], placement=placement, prompt_cache=False) as eng:
        kw = dict(max_tokens=30, ignore_eos=True)
        alone = [eng.generate(p, **kw).token_ids for p in GENERATIONS[:3]]
        eng.reset_stats()
        streams = [eng.generate(p, stream=True, **kw) for p in GENERATIONS[:3]]
        out, reports = [[] for _ in streams], []

        def run(i):
            for ev in streams[i]:
                out[i].append(ev.token_id)
                if i == 0 and len(out[0]) in (5, 17):  # moves while the others decode
                    reports.append(eng.migrate("8-19" if len(out[0]) == 5 else "0-29,head", "cpu:0"))
        at_once(run, 3)
        assert out == alone
        assert all(r.ok for r in reports) and len(reports) == 2 and eng.stats["batched_steps"] > 0


def test_a_step_that_cannot_run_leaves_the_others(default_model):
    """A waiting step that cannot run (here a token outside the vocabulary) gets its error; the others in its
    batch run, their logits those of their steps alone."""
    with jl.Engine(default_model, devices=["cpu"], prompt_cache=False) as eng:
        prompts = [eng.encode(p) for p in GENERATIONS[:3]]
        alone = []
        for p in prompts:
            with eng.session() as s:
                s.feed(p)
                alone.append(s.feed([11])[0])
        seqs = [eng.new_sequence() for _ in prompts]
        with eng._lock:
            for s, p in zip(seqs, prompts):
                eng._step(s, p, len(p) - 1)
            waiting = [engine_mod._Waiting(s, [t]) for s, t in zip(seqs, [11, eng.config.vocab + 5, 11])]
            eng._waiting.extend(waiting)
            eng._run_waiting()
        assert "outside the vocabulary" in str(waiting[1].error) and waiting[1].logits is None
        assert [w.error for w in (waiting[0], waiting[2])] == [None, None] and eng.stats["batched_steps"] == 1
        assert np.array_equal(waiting[0].logits[0], alone[0]) and np.array_equal(waiting[2].logits[0], alone[2])
        assert seqs[1].n == len(prompts[1])  # nothing of the failed step was kept
