"""The `jitllm` command line: devices, plan, errors, and the formatting of bench."""
import importlib.util
import io
import json
import re
import signal
import subprocess
import sys
import types

from pathlib import Path

import pytest

from jitllm_core import registry
from jitllm_core.cli import ChatSession, main

CLASSIC = (Path(__file__).parent / "classic_gpu.toml").read_text()  # the example, as written


@pytest.fixture
def only_plugins(monkeypatch):
    """Reload the registry with JITLLM_PLUGINS set (None: unset); the previous state comes back afterwards."""
    def load(value):
        if value is None:
            monkeypatch.delenv("JITLLM_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("JITLLM_PLUGINS", value)
        monkeypatch.setattr(registry, "_state", None)
    return load


def test_devices_without_any_backend_says_how_to_install_one(only_plugins, capsys):
    only_plugins("no-such-plugin")
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "no backend" in out.lower()
    assert "pip install jitllm-cpu-llvm" in out
    assert "pip install ./plugins/cpu_llvm" in out


def test_devices_lists_the_cpu(only_plugins, capsys):
    pytest.importorskip("jitllm_cpu_llvm")
    only_plugins(None)
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpu\s+ok\s+cpu", out, re.M), out


def test_a_named_device_probes_only_its_backend(only_plugins, monkeypatch):
    """An engine on named devices starts without probing the other backends (a Vulkan instance, a CUDA driver);
    asked for all, every backend is probed."""
    pytest.importorskip("jitllm_cpu_llvm")
    only_plugins(None)
    monkeypatch.setattr(registry, "_probed", {})
    assert registry.device("cpu").backend == "cpu"
    assert [be.name for be in registry._probed] == ["cpu"]
    registry.backend_status()
    assert set(registry._probed) == set(registry._get()[1])


def test_plan_what_if_reproduces_the_classic_example(tmp_path, capsys):
    hw = tmp_path / "hw.toml"
    hw.write_text(CLASSIC)
    assert main(["plan", "--what-if", str(hw)]) == 0
    chosen = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\*\s+\d", line)]
    assert len(chosen) == 1 and "40 gpu" in chosen[0] and chosen[0].endswith("109.3")

    assert main(["plan", "--what-if", str(hw), "--json", "--n-device-layers", "24"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sum(r["chosen"] for r in rows) == 1


def test_compile_with_a_missing_backend_is_a_clean_error(only_plugins, capsys):
    only_plugins("no-such-plugin")
    assert main(["compile", "--backend", "cuda", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jitllm: error: backend 'cuda'")
    assert "Traceback" not in err


@pytest.mark.parametrize("content", [None, b"NOTAGGUF" + bytes(64)], ids=["missing", "bad-magic"])
def test_bad_model_path_is_a_clean_error(tmp_path, capsys, content):
    pytest.importorskip("jitllm_core.engine")
    path = tmp_path / "broken-model.gguf"
    if content is not None:
        path.write_bytes(content)
    assert main(["run", "-m", str(path), "-p", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jitllm: error:") and "broken-model.gguf" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("prompt", [["-p", "The capital of France is"], ["The capital of France is"]],
                         ids=["option", "argument"])
def test_run_streams_a_reply_and_a_summary(capsys, prompt):
    pytest.importorskip("jitllm_core.engine")
    pytest.importorskip("jitllm_cpu_llvm")
    assert main(["run", "--raw", *prompt, "--max-tokens", "4", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    assert re.search(r"prompt tokens at .* tok/s; finish: (length|eos)\]", captured.err), captured.err


def test_a_reader_that_leaves_early_ends_the_run_quietly():
    """`jitllm run ... | head -c 8`: exit 141 as a shell command does, no traceback. (The prompt counts on past
    EOS; 256 tokens take most of a second, long after the reader has gone.)"""
    pytest.importorskip("jitllm_cpu_llvm")
    run = subprocess.Popen([sys.executable, "-c", "import sys; from jitllm_core.cli import main; sys.exit(main())",
                            "run", "--device", "cpu", "--max-tokens", "256", "--raw", "1, 2, 3, 4, 5,"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(run.stdout.read(8)) == 8
    run.stdout.close()
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == 141 and "Traceback" not in err and "Error" not in err, err


@pytest.mark.parametrize("args,problem", [
    (["--max-tokens", "-1"], "max_tokens must be a whole number >= 0, not -1"),
    (["--temperature", "-0.5"], "temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be a whole number >= 0"),
    (["--seed", "-1"], "seed must be a whole number >= 0"),
    (["--speculate", "-1"], "speculate must be a whole number >= 0"),
    (["-p", "hi"], "two prompts"),
])
def test_bad_run_options_are_refused_before_the_model_loads(tmp_path, capsys, args, problem):
    """The model named does not exist: the option's error, not the file's, shows it was checked first."""
    missing = tmp_path / "never-opened.gguf"
    assert main(["run", "-m", str(missing), *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jitllm: error: ") and problem in err and "never-opened" not in err, err
    assert "Traceback" not in err


def test_chat_session_commands(monkeypatch, capsys, default_model):
    """A real engine on two CPU devices: two turns, /reset between them, a live /move and /placement."""
    pytest.importorskip("jitllm_cpu_llvm")
    from conftest import backend_device
    import jitllm_core as jl
    backend_device("cpu:1")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/move 0-1 cpu:1\n/placement\n/reset\nagain\n/quit\nignored\n"))
    eng = jl.Engine(default_model, devices=["cpu:0", "cpu:1"], placement="cpu:0", max_context=256)
    session = ChatSession(eng, {"max_tokens": 4})
    assert session.loop() == 0
    out, err = capsys.readouterr()
    assert len([line for line in out.splitlines() if line.strip()]) == 2  # two replies
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["again"]  # /reset forgot turn 1
    assert re.search(r"\[migrate units 0-1 -> cpu:1: pause [0-9.]+ ms", err)
    assert eng.placement[0][0] == "cpu:1" and eng.placement[5][0] == "cpu:0"
    assert re.search(r"^\s*embed\S*\s+cpu:0", err, re.M)  # /placement's table
    eng.close()


def test_bench_report_ratios_and_bandwidth_fraction(capsys):
    bench = pytest.importorskip("jitllm_core.bench")
    results = [{"threads": 2, "bandwidth_Bps": 10e9, "bytes_per_token": {"jitllm": 100e6, "llama.cpp": 80e6},
                "jitllm": {"prompt_tok_s": 300.0, "decode_tok_s": 80.0, "bw_fraction": 0.85},
                "llama.cpp": {"prompt_tok_s": 200.0, "decode_tok_s": 50.0, "bw_fraction": 0.44},
                "tuned": {"cpu": {"matvec_R4K": {"prefetch": ()}}, "vulkan:0": {}},
                "pair_ratios": {"prompt_tok_s": (1.25, 1.75), "decode_tok_s": (1.5, 1.6)}}]
    bench.print_report(results, "m.gguf", 37, 64, 5, None)
    out = capsys.readouterr().out
    header, row = [line for line in out.splitlines() if re.match(r"\s*(threads|2)\s", line)]
    assert header.split()[:4] == ["threads", "prompt", "jitllm", "prompt"]
    # % of bw: each run's against the bandwidth beside it, the median (given); % of best: 100 MB per token x
    # 80 tok/s / 10 GB/s = 80% (llama.cpp: 80 MB x 50 tok/s -> 40%)
    assert row.split() == ["2", "300.0", "200.0", "1.50x", "80.0", "50.0", "1.60x", "10.0", "85%", "44%", "80%",
                           "40%"]
    assert "jitllm 100.0 MB" in out and "llama.cpp 80.0 MB" in out
    assert "lowering options tuned on this machine, cpu at 2 thread(s): matvec_R4K {'prefetch': ()}" in out
    assert "vulkan:0 at" not in out  # a device that tunes nothing says nothing
    assert "lowest-highest: 2 thread(s) prompt 1.25-1.75x, decode 1.50-1.60x" in out


def test_bench_pair_ratios_span_the_runs_taken_back_to_back():
    bench = pytest.importorskip("jitllm_core.bench")
    runs = {"jitllm": [(100.0, 40.0, 9e9), (90.0, 30.0, 8e9), (120.0, 45.0, 9e9)],
            "llama.cpp": [(100.0, 20.0, 9e9), (60.0, 30.0, 8e9), (100.0, 30.0, 9e9)]}
    assert bench.pair_ratios(runs) == {"prompt_tok_s": (1.0, 1.5), "decode_tok_s": (1.0, 2.0)}
    assert bench.pair_ratios({"jitllm": runs["jitllm"], "llama.cpp": []}) == {}  # no peer: no pairs


def test_targets_script_checks_each_row_against_its_target():
    """benchmarks/targets.py: the 1B shape's decode ratio (1.2x) and bandwidth (80 %), and the 256-token prompt's
    ratio, per thread count; a row under a target is reported missed."""
    pytest.importorskip("jitllm_core.bench")
    spec = importlib.util.spec_from_file_location("targets", Path(__file__).parents[1] / "benchmarks" / "targets.py")
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    row = lambda threads, decode, prompt, bw: {
        "threads": threads, "bandwidth_Bps": 40e9, "jitllm": {"prompt_tok_s": prompt, "decode_tok_s": decode,
                                                             "bw_fraction": bw},
        "llama.cpp": {"prompt_tok_s": 100.0, "decode_tok_s": 30.0, "bw_fraction": 0.6},
        "pair_ratios": {"prompt_tok_s": (0.9, 1.1), "decode_tok_s": (1.1, 1.3)}}
    checks = targets.bench_targets("1B shape", 256, [row(1, 37.5, 101.0, 0.85), row(2, 35.0, 99.0, 0.79)])
    assert [held for _, _, held in checks] == [True, True, True, False, False, False]
    assert checks[0][1] == "1.25x (pairs 1.10-1.30x)" and "2 thread(s)" in checks[3][0]
    assert len(targets.bench_targets("1B shape", 32, [row(1, 37.5, 101.0, 0.85)])) == 2  # no prompt target


def test_bench_pairs_each_run_with_the_bandwidth_measured_beside_it(monkeypatch):
    """A run's bandwidth is the better of the measurements just before and just after it; the warm-up run counts
    for neither engine; the best of all is returned too."""
    bench = pytest.importorskip("jitllm_core.bench")
    speeds = iter([(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)])   # warm-up, run 1, run 2
    monkeypatch.setattr(bench, "jitllm_once", lambda eng, ids, steps: next(speeds))
    marks = iter([5.0, 7.0, 6.0, 9.0])                        # before, after the warm-up, after run 1, after run 2
    runs, best = bench.interleaved_runs(None, None, [1], 4, 2, lambda n: next(marks))
    assert runs["jitllm"] == [(2.0, 20.0, 7.0), (3.0, 30.0, 9.0)] and runs["llama.cpp"] == [] and best == 9.0


def test_bench_peer_decodes_greedily_past_its_batch(default_model, cpu):
    """bench's llama.cpp peer takes each next token from the logits of the one it evaluated last, for prompts past
    llama.cpp's batch of 512 too, and so decodes what jitllm decodes on the default model (an independent check
    of both; skipped where llama-cpp-python, a benchmark set-up step, is not installed)."""
    pytest.importorskip("llama_cpp")
    from jitllm_core import Engine, bench
    crash = bench.peer_crash(default_model, 1)
    if crash:
        pytest.skip(crash)
    eng = Engine(default_model, devices=["cpu"], threads=1)
    ids = bench.prompt_ids(eng.tokenizer, 600)
    peer = bench.LlamaCpp(default_model, 1, 1024)
    try:
        peer.llm.reset()
        peer.llm.eval(ids)
        tokens = [peer.next_token()]
        for _ in range(5):
            peer.llm.eval([tokens[-1]])
            tokens.append(peer.next_token())
    finally:
        peer.close()
    assert tokens == eng.generate(ids, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids


def test_bench_reports_a_peer_that_crashes_instead_of_crashing(default_model, monkeypatch, capsys):
    """A llama.cpp that dies on a prompt's batch (its default build's AMX matmul on some CPUs) runs in a probe
    process first: bench says why the peer is not measured and goes on, instead of dying with it. The probe here is
    a process that dies of SIGSEGV as that one does; a probe that exits normally reports nothing."""
    from jitllm_core import bench
    monkeypatch.setattr(bench, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setattr(bench, "_system_info", lambda: "AVX512 = 1 | AMX_INT8 = 1 |")
    monkeypatch.setitem(sys.modules, "llama_cpp", sys.modules.get("llama_cpp") or types.ModuleType("llama_cpp"))
    assert bench.open_llama_cpp(default_model, 1, 64) is None
    err = capsys.readouterr().err
    assert f"died of signal {int(signal.SIGSEGV)} evaluating a 16-token batch of {default_model}" in err
    assert "without AMX" in err
    monkeypatch.setattr(bench, "PROBE", "pass")
    assert bench.peer_crash(default_model, 1) is None


def test_bench_batch_decodes_several_generations_at_once(cpu, capsys, monkeypatch):
    """`jitllm bench batch`: a row per count of sequences, every sequence's decode steps counted, and the engine's
    batched steps behind the rows of more than one."""
    bench_batch = pytest.importorskip("jitllm_core.bench_batch")
    from jitllm_core import engine
    monkeypatch.setattr(engine, "BATCH_WAIT", 1.0)  # a busy machine's threads still meet (test_batched_decode)
    results = bench_batch.run(threads=[1], sequences=[1, 3], prompt_tokens=8, decode_tokens=6, repeats=1,
                              llama_cpp=False)
    out = capsys.readouterr().out
    assert re.search(r"threads\s+sequences\s+decode tok/s\s+per sequence\s+x one", out)
    assert [(r["sequences"], r["decode_tok_s"] > 0) for r in results] == [(1, True), (3, True)]
    assert results[0]["batched_steps"] == 0 and results[1]["batched_steps"] > 0
    assert re.search(r"^\s+1\s+3\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+-\s+-$", out, re.M)
    with pytest.raises(Exception, match="--sequences"):
        bench_batch.run(sequences=[0], llama_cpp=False)


def test_bench_speculate_measures_replies_with_and_without_drafts(cpu, capsys):
    """`jitllm bench speculate`: a row per task, each reply with drafts checked to be the reply without (the bench
    raises otherwise), and the copy task's reply mostly drafts taken."""
    bench_speculate = pytest.importorskip("jitllm_core.bench_speculate")
    results = bench_speculate.run(threads=[1], decode_tokens=16, repeats=1, llama_cpp=False)
    out = capsys.readouterr().out
    assert re.search(r"threads\s+task\s+tokens\s+jitllm\s+speculating\s+x\s+drafts taken", out)
    assert [r["task"] for r in results] == list(bench_speculate.TASKS)
    assert all(r["on_tok_s"] > 0 and r["off_tok_s"] > 0 for r in results)
    assert results[0]["task"] == "copy" and results[0]["accepted"] > 0.5
    with pytest.raises(Exception, match="--speculate"):
        bench_speculate.run(speculate=0, llama_cpp=False)
