"""Several threads on one CPU device: the same results as one thread, bit for bit (each parallel iteration is
computed whole by one thread), including the barriers the runtime leaves out between independent launches."""
import numpy as np
import pytest

import jitllm_core as jl
from backend_check import assert_matches_interpreter, assert_timed_program_times_each_launch
from conftest import backend_device
from ir_cases import CASES, inputs_for


@pytest.fixture
def two_threads():
    dev = backend_device("cpu:1")
    before = dev.threads
    dev.configure(threads=2)
    yield dev
    dev.configure(threads=before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ir_cases_with_two_threads(two_threads, case):
    build, scalars = CASES[case]
    k = build()
    assert_matches_interpreter(two_threads, k, inputs_for(k), scalars)


def test_model_logits_independent_of_thread_count(default_model, two_threads):
    eng = jl.Engine(default_model, devices=["cpu:1"])
    ids = eng.tokenizer.encode("Threads must not change a single bit of the result, said the compiler.") * 2
    two = eng.score(ids)
    out2 = eng.generate(ids[:20], max_tokens=12, ignore_eos=True).token_ids
    two_threads.configure(threads=1)
    one = eng.score(ids)
    out1 = eng.generate(ids[:20], max_tokens=12, ignore_eos=True).token_ids
    eng.close()
    assert np.array_equal(one, two) and out1 == out2


def _count_kernel():
    """A kernel that adds one to each of its buffer's first n elements, in parallel."""
    from jitllm_core import ir
    k = ir.Kernel("count_iterations")
    k.buffer("y", "i32", 4096, True)
    with k.parallel("i", k.scalar("n")) as i:
        k.store("y", i, k.load("y", i) + 1)
    return k.finish()


def _counting_program(dev):
    """Three launches of `_count_kernel`: twice on one buffer (a barrier between them), once on another."""
    from jitllm_core.plugin import Launch
    k = _count_kernel()
    a, b = dev.alloc(4096 * 4), dev.alloc(4096 * 4)
    return dev.program([Launch(k, {"y": a}, {"n": "n"}), Launch(k, {"y": a}, {"n": "n"}),
                        Launch(k, {"y": b}, {"n": "n"})]), a, b


def test_claimed_iterations_cover_each_run_once(two_threads):
    """Half a parallel loop is claimed in chunks from a counter per launch: every iteration runs exactly once in
    every run of a program (the counters start from zero again), for two independent launches back to back (no
    barrier between them), for loops with fewer iterations than threads x 2, and either side of the length up to
    which a loop that streams no weights is split into even shares with nothing claimed (lower.STATIC_ITERATIONS)."""
    from jitllm_core.plugin import Launch
    k = _count_kernel()
    dev = two_threads
    dev.configure(threads=3)
    a, b = dev.alloc(4096 * 4), dev.alloc(4096 * 4)
    prog = dev.program([Launch(k, {"y": a}, {"n": "na"}), Launch(k, {"y": b}, {"n": "nb"})])
    from jitllm_cpu_llvm import lower
    even = 3 * lower.STATIC_ITERATIONS
    runs = [(4096, 1), (1, 4096), (1000, 5), (4096, 4096), (even, even + 1), (0, 2), (3, even - 1)]
    for na, nb in runs:
        prog.run({"na": na, "nb": nb})
    for buf, ns in ((a, [r[0] for r in runs]), (b, [r[1] for r in runs])):
        got = dev.download(buf).view(np.int32)
        assert np.array_equal(got, sum((np.arange(4096) < n).astype(np.int32) for n in ns))
    dev.free(a), dev.free(b)


def test_threads_that_sleep_at_every_barrier_wait_for_one_another(monkeypatch):
    """With no time to spin, a thread that reaches a barrier first sleeps (Linux's futex; elsewhere it yields) and
    the last one in wakes it: every run of a program completes, each launch after the one it depends on. A lost
    wake-up would leave the program waiting: it runs on a thread of its own, given 60 s, on a device of its own."""
    import threading
    runtime = pytest.importorskip("jitllm_cpu_llvm.runtime")
    monkeypatch.setattr(runtime, "SPIN_TICKS", 0)
    monkeypatch.setattr(runtime, "SPIN_TICKS_SHARED", 0)
    dev = runtime.CpuDevice("cpu:asleep", 3, 1 << 26)
    prog, a, b = _counting_program(dev)
    runs = [1 + (r * 997) % 4096 for r in range(3000)]
    done = threading.Thread(target=lambda: [prog.run({"n": n}) for n in runs], daemon=True)
    done.start()
    done.join(60)
    assert not done.is_alive(), "a program whose threads sleep at its barriers did not finish"
    counts = sum((np.arange(4096) < n).astype(np.int32) for n in runs)
    assert np.array_equal(dev.download(a).view(np.int32), 2 * counts)
    assert np.array_equal(dev.download(b).view(np.int32), counts)
    dev.free(a), dev.free(b)


def test_barriers_spin_briefly_while_other_tasks_want_the_cpus(two_threads):
    """The workers give a barrier's waiting threads little time to spin while more tasks are runnable than there
    are CPUs: here busy processes, as many as leave fewer CPUs than the step's threads."""
    import os
    import subprocess
    import sys
    import time
    if not os.path.exists("/proc/loadavg"):
        pytest.skip("no /proc/loadavg: the barrier spins as long wherever it runs")
    workers = two_threads.workers
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(workers.cpus - workers.nth + 1)]
    try:
        time.sleep(0.5)
        assert any(workers.shared() for _ in range(20))
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_timed_program_times_each_launch_in_order(two_threads):
    """A timed program (the profile's: thread 0 notes the time after each launch's barrier), on two threads."""
    assert_timed_program_times_each_launch(two_threads, 1 << 22)


def test_profile_times_launches_on_their_own_without_timed_programs(two_threads, monkeypatch):
    """A device without timed programs (the CPU's switched off here): the profile times each launch in a program
    of its own, and says so."""
    from jitllm_core import ir
    from jitllm_core.plugin import Launch
    from jitllm_core.profile import ON_ITS_OWN, _launch_seconds
    k = ir.Kernel("plus_one")
    k.buffer("x", "f32", 64), k.buffer("y", "f32", 64, True)
    with k.parallel("i", 64) as i:
        k.store("y", i, k.load("x", i) + 1.0)
    k = k.finish()
    dev = two_threads
    monkeypatch.setattr(dev, "timed_program", lambda launches: None)
    a, b = dev.alloc(256), dev.alloc(256)
    dev.upload(a, np.zeros(64, np.float32))
    seconds, how = _launch_seconds(dev, [Launch(k, {"x": a, "y": b}), Launch(k, {"x": b, "y": a})], {}, 2)
    assert how == ON_ITS_OWN and len(seconds) == 2 and all(s > 0 for s in seconds)
    assert np.array_equal(dev.download(a).view(np.float32), np.full(64, 2, np.float32))
    dev.free(a), dev.free(b)


@pytest.mark.parametrize("var,value", [("JITLLM_THREADS", "two"), ("JITLLM_THREADS", "0"),
                                       ("JITLLM_CPU_DEVICES", "-1")])
def test_a_bad_thread_variable_is_named_where_the_cpu_is_listed(monkeypatch, var, value):
    runtime = pytest.importorskip("jitllm_cpu_llvm.runtime")
    monkeypatch.setenv(var, value)
    with pytest.raises(jl.JitllmError, match=f"^{var}='{value}': must be a whole number"):
        runtime.make_devices()
