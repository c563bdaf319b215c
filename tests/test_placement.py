"""Residencies and the planner on real devices: same tokens as all-resident, counters equal the arithmetic."""
import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core import costmodel as cm
from jitllm_core import planner

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(default_model):
    backend_device("cpu:1")
    eng = jl.Engine(default_model, devices=["cpu:0"], kv_dtype="f32")
    ids = eng.tokenizer.encode(PROMPT)
    out = eng.generate(ids, max_tokens=12, ignore_eos=True).token_ids
    eng.close()
    return ids, out


def run(eng, ids):
    eng.reset_stats()
    return eng.generate(ids, max_tokens=12, ignore_eos=True).token_ids


def test_streamed_and_host_compute_match_all_resident(default_model, reference):
    ids, want = reference
    eng = jl.Engine(default_model, devices=["cpu:0", "cpu:1"], kv_dtype="f32",
                    placement={"cpu:1": {"resident": range(0, 8), "streamed": range(8, 20)}, "cpu:0": range(20, 30)})
    assert eng.placement[8] == ("cpu:1", "streamed") and eng.placement[25] == ("cpu:0", "host-compute")
    assert run(eng, ids) == want
    # counters against the arithmetic: each streamed layer's weights cross once per step, the activation
    # crosses at the embed->layer 0... boundary only where devices change
    steps = eng.stats["steps"]
    layer_bytes = eng.model.unit_bytes(8)
    assert eng.stats["bytes_crossed"]["host->cpu:1"] == 12 * layer_bytes * steps
    act = [eng.config.dim * 4 * n for n in [len(ids)] + [1] * (steps - 1)]
    assert eng.stats["bytes_crossed"]["cpu:1->cpu:0"] == sum(act)
    assert eng.stats["crossings"] == steps * (12 + 1)
    # streamed weights are held in their packed layout as memory-mapped cache files, not as copies in memory
    held = eng.model.host_data("blk.8.ffn_up.weight", 8, keep=True)
    assert isinstance(held, np.memmap) and held.size == eng.model.tensor_bytes("blk.8.ffn_up.weight", 8)
    eng.close()


def test_auto_splits_under_caps_and_counters_match_plan(default_model, reference):
    ids, want = reference
    probe = jl.Engine(default_model, devices=["cpu:0"], kv_dtype="f32", max_context=512)
    shp = planner.shape(probe.model)
    total = sum(shp.unit_bytes) + sum(shp.kv_bytes)
    act = probe.model.activation_bytes(probe.devices["cpu:0"].caps.tile_dots)  # what each device holds besides
    probe.close()
    caps = {"cpu:0": act + int(total * 0.6), "cpu:1": act + int(total * 0.6)}  # neither holds the model alone
    eng = jl.Engine(default_model, devices=["cpu:0", "cpu:1"], kv_dtype="f32", max_context=512, mem=caps)
    assert eng.plan is not None and eng.plan.fits
    assert {d for d, _ in eng.placement.values()} == {"cpu:0", "cpu:1"}
    assert all(eng.arenas[d].used <= caps[d] for d in caps)
    assert run(eng, ids) == want
    steps = eng.stats["steps"]
    assert eng.stats["crossings"] == steps * eng.plan.crossings
    for link, per_token in eng.plan.bytes_crossed.items():  # decode steps carry one token's activation
        assert eng.stats["bytes_crossed"][link] == per_token * (len(ids) + steps - 1)
    eng.close()


def test_auto_never_exceeds_capacity():
    hw = cm.Hardware([cm.Device("gpu", 5e9, 900e9), cm.Device("host", 64e9, 50e9, host=True)],
                     [cm.Link("gpu", "host", 25e9, 5e-6)])
    shp = cm.ModelShape.uniform(20, 12e9, 1e9, 8192)
    best = cm.choose([cm.predict(lay, hw, shp) for lay in planner.candidates(hw, shp)])
    assert best.fits and best.memory_bytes["gpu"] <= 5e9
    assert all(best.tokens_per_s >= p.tokens_per_s for p in
               (cm.predict(lay, hw, shp) for lay in planner.candidates(hw, shp)) if p.fits)


def test_failed_move_of_streamed_units_leaks_nothing(default_model):
    from jitllm_core import faults
    backend_device("cpu:1")
    eng = jl.Engine(default_model, devices=["cpu:0", "cpu:1"], kv_dtype="f32", max_context=256,
                    placement={"cpu:1": {"resident": range(0, 4), "streamed": range(4, 30)}, "cpu:0": ["head"]})
    with eng.session() as s:
        s.feed(eng.tokenizer.encode(PROMPT))
        before = {d: a.used for d, a in eng.arenas.items()}
        faults.inject("transfer", "cpu:0", after_bytes=0)
        try:
            report = eng.migrate("4-29", "cpu:0")
        finally:
            faults.clear()
        assert not report.ok and "injected transfer" in report.reason
        assert {d: a.used for d, a in eng.arenas.items()} == before
        assert eng.placement[4] == ("cpu:1", "streamed")
    eng.close()
