"""Work an engine does beside its replies -- compiling the programs that drafts run in -- kept from slowing them.

Such work, lowering in Python and compiling, took the cores and the interpreter's lock from a reply that was
decoding: SmolLM2's first reply of 96 tokens, in a process whose batched programs were not yet compiled, took 5.1-5.7
s instead of 1.4 (two threads of a Zen 1). At the least CPU priority it still took 2.2-2.5 s -- a reply's threads meet
at a barrier after each kernel, and a core given to other work for a moment stalls them all (so did a process of
mere arithmetic at nice 19: 1.2 -> 2.1-2.3 s). So background work (`start`) waits, at the points where it may
(`pause`: between kernels), while any reply is running (`reply_started` .. `reply_ended`), unless someone waits for
it (`wait`); it runs at the least CPU priority where the OS has priorities per thread (Linux: the compile processes
it starts share it), and on a daemon thread, so that a process's exit does not wait for it.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading

_cond = threading.Condition()
_replies = _waiters = 0
_local = threading.local()


def start(fn, name) -> concurrent.futures.Future:
    """fn() on a daemon thread of its own, as background work; a future of its result."""
    future = concurrent.futures.Future()

    def body():
        _local.background = True
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # no priorities per thread here: the same work, at the same priority
            pass
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 (the work's error is its waiter's)
            future.set_exception(e)
    threading.Thread(target=body, name=name, daemon=True).start()
    return future


def in_background() -> bool:
    """Whether the calling thread is background work's (`start`)."""
    return getattr(_local, "background", False)


def pause():
    """On background work's thread: wait while a reply runs and nobody waits for the work. Elsewhere: nothing."""
    if in_background():
        with _cond:
            _cond.wait_for(lambda: not _replies or _waiters)


def wait(future):
    """Wait for background work's future, letting the work run meanwhile even while replies run; the future."""
    global _waiters
    with _cond:
        _waiters += 1
        _cond.notify_all()
    try:
        concurrent.futures.wait([future])
    finally:
        with _cond:
            _waiters -= 1
    return future


def reply_started():
    global _replies
    with _cond:
        _replies += 1


def reply_ended():
    global _replies
    with _cond:
        _replies -= 1
        _cond.notify_all()
