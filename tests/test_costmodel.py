"""The placement cost model and planner (jitllm_core.costmodel) and `jitllm plan --what-if` (plan_cli)."""
import argparse
import json

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from jitllm_core.costmodel import (GB, Device, Hardware, Layout, Link, ModelShape, auto, candidates, choose,
                                   load_hardware_toml, n_device_layers, predict, sweep, unified)
from jitllm_core.errors import JitllmError
from jitllm_core.plan_cli import add_plan_arguments, run_plan

EXAMPLE = (Path(__file__).parent / "classic_gpu.toml").read_text()  # the example, as written


@pytest.fixture
def example(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(EXAMPLE)
    return path


def plan(capsys, *argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    rc = run_plan(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("n, rest, expected", [(40, "host", 109.3), (24, "host-compute", 12.8),
                                               (24, "streamed", 10.3)])
def test_classic_discrete_gpu_example(example, n, rest, expected):
    hw, shape = load_hardware_toml(example)
    p = predict(n_device_layers(n, hw, shape, "gpu", rest), hw, shape)
    assert p.tokens_per_s == pytest.approx(expected, rel=0.03)
    assert p.fits


def test_example_bytes_and_crossings(example):
    hw, shape = load_hardware_toml(example)
    hc = predict(n_device_layers(24, hw, shape, rest="host-compute"), hw, shape)
    assert hc.crossings == 32 and hc.bytes_crossed == {"gpu->host": 16 * 40_000, "host->gpu": 16 * 40_000}
    assert hc.bytes_read["host"]["weights"] == 16 * 360_000_000 and hc.bytes_read["gpu"]["kv"] == 2 * GB
    st_ = predict(n_device_layers(24, hw, shape, rest="streamed"), hw, shape)
    assert st_.crossings == 16 and st_.bytes_crossed == {"host->gpu": 16 * 360_000_000}
    assert st_.memory_bytes["gpu"] == 24 * 360_000_000 + 2 * GB + 2 * 360_000_000  # two staging buffers
    llama = predict(n_device_layers(24, hw, shape), hw, shape)  # rest resident on the host, KV too
    assert llama.crossings == 1 and llama.bytes_read["host"] == {"weights": 16 * 360_000_000,
                                                                 "kv": 16 * 50_000_000, "copied": 0}


def test_auto_picks_best_predicted_that_fits(example):
    hw, shape = load_hardware_toml(example)
    assert auto(hw, shape).layout.label() == "40 gpu"
    small = Hardware([Device("gpu", 10 * GB, 1792 * GB), Device("host", 128 * GB, 80 * GB, host=True)],
                     hw.links)
    predictions = [predict(layout, small, shape) for layout in candidates(small, shape)]
    chosen = choose(predictions)
    assert chosen.fits and not predict(n_device_layers(40, small, shape), small, shape).fits
    assert chosen.tokens_per_s == max(p.tokens_per_s for p in predictions if p.fits)
    assert chosen.layout.label() == "22 gpu + 18 host-compute"  # 22 * 0.36 + 2 KV <= 10 GB


def test_nothing_fits_is_an_error():
    hw = Hardware([Device("gpu", 1 * GB, 100 * GB), Device("host", 2 * GB, 10 * GB, host=True)],
                  [Link("gpu", "host", 10 * GB)])
    with pytest.raises(JitllmError, match="no layout fits"):
        auto(hw, ModelShape.uniform(4, 8 * GB, 0, 1000))


@settings(max_examples=60, deadline=None)
@given(gpu_gb=st.floats(0.5, 64), host_gb=st.floats(1, 256), gpu_bw=st.floats(10, 3000),
       host_bw=st.floats(5, 500), link_bw=st.floats(1, 100), latency_us=st.floats(0, 50),
       layers=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=24), kv_gb=st.floats(0, 8))
def test_planner_never_picks_over_capacity(gpu_gb, host_gb, gpu_bw, host_bw, link_bw, latency_us, layers, kv_gb):
    hw = Hardware([Device("gpu", int(gpu_gb * GB), gpu_bw * GB), Device("host", int(host_gb * GB), host_bw * GB,
                                                                        True)],
                  [Link("gpu", "host", link_bw * GB, latency_us * 1e-6)])
    shape = ModelShape(len(layers), [int(x * GB) for x in layers], [int(kv_gb * GB / len(layers))] * len(layers),
                       8192)
    predictions = [predict(layout, hw, shape) for layout in candidates(hw, shape)]
    if not any(p.fits for p in predictions):
        with pytest.raises(JitllmError):
            choose(predictions)
        return
    chosen = choose(predictions)
    assert all(chosen.memory_bytes[d] <= chosen.capacity_bytes[d] for d in chosen.memory_bytes)
    assert chosen.tokens_per_s == max(p.tokens_per_s for p in predictions if p.fits)


def test_link_bandwidth_per_direction_and_latency():
    hw = Hardware([Device("gpu", 10 * GB, 1000 * GB), Device("host", 100 * GB, 100 * GB, True)],
                  [Link("gpu", "host", 10 * GB, latency_s=1e-3, bandwidth_ba_Bps=20 * GB)])
    shape = ModelShape.uniform(2, 2 * GB, 0, 0)
    p = predict(Layout((("gpu", "resident"), ("gpu", "streamed"))), hw, shape)
    assert p.seconds["host->gpu"] == pytest.approx(1e-3 + 1 * GB / (20 * GB))
    assert p.seconds["gpu"] == pytest.approx(1 * GB / (1000 * GB))


def test_bad_layouts_are_errors(example):
    hw, shape = load_hardware_toml(example)
    with pytest.raises(JitllmError, match="needs an accelerator"):
        predict(Layout((("host", "streamed"),) * 40), hw, shape)
    with pytest.raises(JitllmError, match="unknown residency"):
        predict(Layout((("gpu", "swapped"),) * 40), hw, shape)
    with pytest.raises(JitllmError, match="unknown device"):
        predict(Layout((("tpu", "resident"),) * 40), hw, shape)
    with pytest.raises(JitllmError, match="41"):
        n_device_layers(41, hw, shape)


def test_plan_table_marks_auto_choice(example, capsys):
    rc, out, _ = plan(capsys, "--what-if", str(example), "--n-device-layers", "24")
    assert rc == 0
    lines = out.splitlines()
    assert "gpu GB/24" in lines[0] and "host GB/128" in lines[0] and "tok/s" in lines[0]
    chosen = [line for line in lines if line.startswith("*  ")]
    assert len(chosen) == 1 and "40 gpu" in chosen[0] and chosen[0].endswith("109.3")
    row = next(line for line in lines if "24 gpu + 16 host-compute" in line)
    assert row.split()[-1] == "12.8" and row.split()[-2] == "32"
    assert next(line for line in lines if "24 gpu + 16 streamed" in line).split()[-1] == "10.3"


def test_plan_json(example, capsys):
    rc, out, _ = plan(capsys, "--what-if", str(example), "--json", "--n-device-layers", "24")
    assert rc == 0
    rows = json.loads(out)
    assert sum(r["chosen"] for r in rows) == 1
    for r in rows:
        assert {"layout", "device_layers", "residencies", "tokens_per_s", "crossings", "bytes_read",
                "bytes_crossed", "memory_bytes", "fits"} <= r.keys()
        assert len(r["residencies"]) == 40 and set(r["bytes_read"]) == {"gpu", "host"}
    hc = next(r for r in rows if r["layout"] == "24 gpu + 16 host-compute")
    assert hc["device_layers"] == 24 and hc["residencies"][24] == ["gpu", "host-compute"]
    assert hc["tokens_per_s"] == pytest.approx(12.8, rel=0.03)


def test_sweep_and_unified_crossover(tmp_path, capsys):
    path = tmp_path / "big.toml"
    path.write_text(EXAMPLE.replace("memory_gb = 24", "memory_gb = 96").replace("layers = 40", "layers = 80")
                    .replace("layer_gb = 0.36", "layer_gb = 0.75").replace("kv_gb = 2.0", "kv_gb = 4.0"))
    hw, shape = load_hardware_toml(path)
    table = sweep(hw, shape)
    reference = unified(635 * GB, shape).tokens_per_s
    assert reference == pytest.approx(635 / 64)
    host_compute = [p.tokens_per_s for p in table["host-compute"]]
    assert host_compute == sorted(host_compute)  # more device layers, never slower
    expected = max(k for k in range(81) if host_compute[k] < reference)
    rc, out, _ = plan(capsys, "--what-if", str(path), "--sweep", "--compare-unified", "635")
    assert rc == 0 and f"falls below it at {expected} gpu layers or fewer" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 81
    rc, out, _ = plan(capsys, "--what-if", str(path), "--compare-unified", "635", "--json")
    data = json.loads(out)
    assert len(data["layouts"]) == 3 * 81 and data["unified"]["host_compute_below_at"] == expected


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.replace("bandwidth_gbs = 1792\n", ""), "[devices.gpu] bandwidth_gbs: missing"),
    (lambda s: s.replace("[links.gpu-host]", "[links.gpu-cpu]"), "[links.gpu-cpu]"),
    (lambda s: s.replace("memory_gb = 128", "memory_gb = -128"), "[devices.host] memory_gb: must be positive"),
    (lambda s: s.replace("latency_us = 0", "latency_us = -1"), "[links.gpu-host] latency_us"),
    (lambda s: s.replace("bandwidth_gbs = 63", "bandwidth_gbs = \"fast\""), "[links.gpu-host] bandwidth_gbs"),
    (lambda s: s.replace("kv_gb = 2.0", "kv_gbs = 2.0"), "[model] kv_gbs: unknown field"),
    (lambda s: s.replace("host = true", ""), "no device has host = true"),
    (lambda s: s.replace("layers = 40", "layers = 0"), "[model] layers"),
    (lambda s: s + "layers_gb = [1.0]\n", "exactly one of layer_gb and layers_gb"),
    (lambda s: s.replace("[model]", "[model"), "not valid TOML"),
])
def test_bad_hardware_files(tmp_path, capsys, edit, field):
    path = tmp_path / "bad.toml"
    path.write_text(edit(EXAMPLE))
    with pytest.raises(JitllmError) as info:
        load_hardware_toml(path)
    assert str(path) in str(info.value) and field in str(info.value)
    rc, out, err = plan(capsys, "--what-if", str(path))
    assert rc == 2 and not out and field in err


def test_hardware_file_options(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(EXAMPLE.replace("bandwidth_gbs = 63", "bandwidth_gbs_ab = 50\nbandwidth_gbs_ba = 60")
                    .replace("layers = 40\nlayer_gb = 0.36\nkv_gb = 2.0", "layers_gb = [1, 2]\nkv_gb = [0.5, 0.25]"))
    hw, shape = load_hardware_toml(path)
    assert hw.link("host", "gpu").bandwidth("gpu", "host") == 50 * GB
    assert hw.link("host", "gpu").bandwidth("host", "gpu") == 60 * GB
    assert shape.unit_bytes == [1 * GB, 2 * GB] and shape.kv_bytes == [GB // 2, GB // 4]
    path.write_text(EXAMPLE.split("[model]")[0])
    assert load_hardware_toml(path)[1] is None


def test_plan_for_this_machine_and_without_model_section(tmp_path, capsys):
    rc, out, _ = plan(capsys, "--context", "256")  # the default model on the devices found here
    assert rc == 0 and "\n*" in out and "tok/s" in out
    path = tmp_path / "hw.toml"
    path.write_text(EXAMPLE.split("[model]")[0])
    rc, _, err = plan(capsys, "--what-if", str(path))
    assert rc == 2 and "no [model] section" in err
