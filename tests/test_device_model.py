"""SmolLM2 through the engine on each accelerator device (vulkan:0, cuda:0) against HF transformers on the same
GGUF, a cpu + device split, and live moves between the CPU and the device while a reply streams.

vulkan:0 is lavapipe on the test machines (Vulkan emulated on the CPU): a decode step is slow, so token counts
stay small. Each device's tests skip with its backend's reason when there is no such device.
"""
import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core.modelfile import ModelFile
from reference import agreeing_prefix, reference_logits

PROMPT = ("The history of the printing press begins in China, where woodblock printing was used for centuries "
          "before movable type appeared in Europe.")
GEN_PROMPT = "The capital of France is"  # short (prefill is slow here too) and every greedy step decided by > 0.2


@pytest.fixture(scope="module", params=["vulkan:0", "cuda:0"])
def accel(request):
    backend_device(request.param)
    return request.param


@pytest.fixture(scope="module")
def layers(default_model):
    """The model's layers: the default model's 30, or fewer in one cut to be carried to an offline GPU machine
    (tests/device/cut_model.py)."""
    return ModelFile(default_model).config.n_layer


@pytest.fixture(scope="module")
def on_device(accel, default_model):
    e = jl.Engine(default_model, devices=[accel], kv_dtype="f32")
    yield e
    e.close()


@pytest.fixture(scope="module")
def cpu_tokens(cpu, default_model):
    """Greedy tokens of the all-CPU engine for the prompts the tests below use (max_tokens -> ids)."""
    e = jl.Engine(default_model, devices=["cpu:0"], kv_dtype="f32")
    ids = e.tokenizer.encode(GEN_PROMPT)
    yield ids, {n: e.generate(ids, max_tokens=n, ignore_eos=True).token_ids for n in (6, 8)}
    e.close()


def test_everything_is_on_the_device(on_device, accel):
    assert {dev for dev, _ in on_device.placement.values()} == {accel}


def test_score_matches_transformers(on_device, default_model):
    ids = (on_device.tokenizer.encode(PROMPT) * 2)[:32]  # lavapipe: about 1 s per scored position on 2 cores
    assert len(ids) >= 32
    got, want = on_device.score(ids), reference_logits(default_model, ids)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-3


def test_greedy_matches_transformers(on_device, default_model, cpu_tokens):
    ids, cpu_runs = cpu_tokens
    out = on_device.generate(ids, max_tokens=6, ignore_eos=True).token_ids
    assert len(out) == 6
    ref = reference_logits(default_model, ids + out)
    n = agreeing_prefix(ref, out, len(ids) - 1)
    assert n >= 3  # all 6 on this prompt with the CPU build; fewer only if the margins moved
    assert out[:n] == list(ref[len(ids) - 1:len(ids) - 1 + n].argmax(-1))
    assert out == cpu_runs[6]


def test_cpu_device_split_matches_cpu(accel, default_model, cpu_tokens, layers):
    ids, cpu_runs = cpu_tokens
    half = layers // 2
    split = {"cpu:0": range(0, half), accel: range(half, layers)}
    e = jl.Engine(default_model, devices=["cpu:0", accel], placement=split, kv_dtype="f32")
    try:
        assert e.placement[0][0] == "cpu:0" and e.placement[half - 1][0] == "cpu:0"
        assert e.placement[half][0] == accel and e.placement[layers - 1][0] == accel
        out = e.generate(ids, max_tokens=6, ignore_eos=True).token_ids
        assert out == cpu_runs[6]
        assert e.stats["crossings"] > 0  # the activation really went cpu:0 -> the device
        backend = accel.split(":")[0]
        assert any(backend in path for path, n in e.stats["bytes_crossed"].items() if n > 0), e.stats
    finally:
        e.close()


def test_live_move_cpu_to_device(accel, default_model, cpu_tokens, layers):
    ids, cpu_runs = cpu_tokens
    e = jl.Engine(default_model, devices=["cpu:0", accel], placement={"cpu:0": range(layers)}, kv_dtype="f32")
    try:
        assert {e.placement[i][0] for i in range(layers)} == {"cpu:0"}
        out, reports = [], []
        for i, ev in enumerate(e.generate(ids, max_tokens=8, ignore_eos=True, stream=True)):
            out.append(ev.token_id)
            if i == 2:  # between two streamed tokens: the KV of the prompt and three tokens moves along
                reports.append(e.migrate(f"0-{layers - 1}", accel))
        assert out == cpu_runs[8]
        assert e.stats["steps"] == 8  # one prefill step + 7 decode steps: nothing ran twice
        assert len(reports) == 1 and reports[0].ok, str(reports[0])
        assert reports[0].recomputed_tokens == 0
        assert {e.placement[i][0] for i in range(layers)} == {accel}
    finally:
        e.close()


def test_chain_of_moves_across_backends(accel, default_model, cpu_tokens, layers):
    """cpu:0 -> cpu:1 -> the device -> cpu:0 while streaming: same greedy tokens, logits of the final state within
    1e-3 of a run that never moved."""
    backend_device("cpu:1")
    ids, want = cpu_tokens
    eng = jl.Engine(default_model, devices=["cpu:0", "cpu:1", accel], placement="cpu:0", kv_dtype="f32")
    try:
        out, reports = [], []
        chain = {1: "cpu:1", 3: accel, 5: "cpu:0"}
        for i, ev in enumerate(eng.generate(ids, max_tokens=8, ignore_eos=True, stream=True)):
            out.append(ev.token_id)
            if i in chain:
                reports.append(eng.migrate(f"embed,0-{layers - 1},head", chain[i]))
        assert out == want[8]
        assert [r.ok for r in reports] == [True] * 3 and all(r.recomputed_tokens == 0 for r in reports)
        with eng.session() as s:  # a move mid-sequence to the device and back, logits against the unmoved run
            s.feed(ids)
            eng.migrate(f"0-{layers - 1}", accel)
            moved = s.feed(out[:3])
            eng.migrate(f"0-{layers - 1}", "cpu:0")
        with eng.session() as s:
            s.feed(ids)
            still = s.feed(out[:3])
        assert np.abs(moved - still).max() <= 1e-3
    finally:
        eng.close()
