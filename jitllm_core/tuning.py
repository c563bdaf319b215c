"""Lowering options tuned by measurement on the machine at hand (Device.tunables), once per machine.

What suits one CPU does not suit another: software prefetches of streamed weights sped a Zen 5's decode matvecs up
and slowed a Zen 3's 4-bit ones by a third (docs/benchmarks.md). So a device may offer candidates for such an
option, and before the engine compiles a device's programs each kernel tag (ir.Kernel.tune_as) among them gets
the fastest: the tag's largest kernel, compiled with each combination of candidates, runs over copies of its
largest buffer that together exceed the caches (as a step streams its weights from memory), the candidates
alternated round by round; each one's best round decides (a busy moment only adds time). The choice is cached per machine, device configuration and tag
(a tag's kernels share their inner loop: the first model's largest one speaks for them).
"""
from __future__ import annotations

import itertools

import numpy as np

from . import ir
from .cache import measured, seconds
from .errors import BackendError
from .plugin import Launch

ROTATION_BYTES = 64 << 20  # the copies of a kernel's streamed buffer one measured run reads: past the caches
ROUNDS = 5


def tune(dev, kernels, progress=None):
    """Give dev the measured options for each tag among kernels (as `Device.tune`)."""
    if not dev.tunables:
        return
    largest = {}
    for k in kernels:
        if k.tune_tag and _nbytes(k) > _nbytes(largest.get(k.tune_tag)):
            largest[k.tune_tag] = k
    names, candidates = list(dev.tunables), list(itertools.product(*dev.tunables.values()))
    for i, (tag, k) in enumerate(sorted(largest.items())):
        if progress:
            progress("tuning kernels", i, len(largest))
        key = ("tuning", dev.backend, dev.describe(), tag, repr(dev.tunables))  # per tag: a layout's loop
        try:
            best = measured(key, lambda: _fastest(dev, k, [dict(zip(names, c)) for c in candidates]))
        except BackendError:  # no room for the copies (a tight memory budget): the defaults, not cached
            best = 0
        dev.tune(tag, dict(zip(names, candidates[best])))


def _fastest(dev, k, variants):
    """Index of the fastest of the option variants for kernel k on dev."""
    streamed = max(k.buffers, key=lambda p: _buffer_bytes(k, p))
    copies = max(2, ROTATION_BYTES // _buffer_bytes(k, streamed))
    bufs = []
    try:
        for p in k.buffers:
            for _ in range(copies if p == streamed else 1):
                bufs.append((p, dev.alloc(_buffer_bytes(k, p))))
                dev.upload(bufs[-1][1], _filler(k.buffers[p]))
        shared = {p: b for p, b in bufs if p != streamed}
        launches = [Launch(k, {**shared, streamed: b}) for p, b in bufs if p == streamed]
        programs = []
        for v in variants:  # a program takes its kernels' options when made (and may compile while the next is)
            dev.tune(k.tune_tag, v)
            programs.append(dev.program(launches))
        for prog in programs:
            prog.run(k.tune_scalars)  # compiled and warm
        times = [[] for _ in programs]
        for _ in range(ROUNDS):
            for prog, t in zip(programs, times):
                t.append(seconds(lambda: prog.run(k.tune_scalars)))
        return int(np.argmin([min(t) for t in times]))
    finally:
        for _, b in bufs:
            dev.free(b)


def _buffer_bytes(k, p):
    b = k.buffers[p]
    return b.size * ir.STORAGE_DTYPES[b.dtype]


def _nbytes(k):
    return sum(_buffer_bytes(k, p) for p in k.buffers) if k else 0


def _filler(b):
    """Contents that keep every value finite and normal: ones for floats, 0x11 bytes for integers and packed
    blocks (their f16 scales then 6.5e-5)."""
    if b.dtype == "f32":
        return np.ones(b.size, np.float32)
    return np.full(b.size * ir.STORAGE_DTYPES[b.dtype], 0x11, np.uint8)
