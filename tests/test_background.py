"""Background work (the programs drafts run in, compiled beside replies) waits while a reply runs, unless someone
waits for it; it runs at the least CPU priority, and a process's exit does not wait for it."""
import os
import subprocess
import sys
import threading
import time

import pytest

from jitllm_core import background


def paused_work(log):
    def work():
        background.pause()
        log.append(background.in_background())
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else None
    return work


def test_background_work_waits_while_a_reply_runs():
    log = []
    background.reply_started()
    try:
        future = background.start(paused_work(log), "test-work")
        time.sleep(0.3)
        assert not future.done() and not log, "background work ran during a reply"
    finally:
        background.reply_ended()
    assert future.result(timeout=30) in (19, None), "not at the least priority"
    assert log == [True] and not background.in_background()


def test_a_waiter_lets_background_work_run_during_a_reply():
    log = []
    background.reply_started()
    try:
        future = background.start(paused_work(log), "test-work")
        assert background.wait(future).done() and log == [True]
    finally:
        background.reply_ended()


def test_background_work_error_reaches_its_waiter():
    def fails():
        raise ValueError("the work's own error")
    with pytest.raises(ValueError, match="the work's own error"):
        background.wait(background.start(fails, "test-work")).result()


def test_exit_does_not_wait_for_background_work():
    code = "import time; from jitllm_core import background; background.start(lambda: time.sleep(120), 'w')"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert time.perf_counter() - t < 60


def test_engine_builds_draft_programs_only_between_replies(cpu):
    """An engine's batched programs (drafts run in them) are built while no reply runs: not while a streamed reply
    is open, and then on request (wait_compiled)."""
    import jitllm_core as jl
    with jl.Engine(None, devices=[cpu.name], speculate=4) as eng:
        stream = eng.generate("Once upon a time", max_tokens=64, ignore_eos=True, stream=True)
        next(stream)
        time.sleep(0.5)
        assert eng._batch_build is not None and not eng._batch_build.done(), "the build ran during the reply"
        stream.close()
        eng.wait_compiled()
        assert eng._batch_build.done() and eng._batch_build.exception() is None
