"""Lowering options tuned by measurement on the machine at hand (Device.tunables), once per machine.

What suits one CPU does not suit another: software prefetches of streamed weights speed every decode matvec of an
Ice Lake and an Emerald Rapids up, and a Zen 3's 4-bit ones, while its 6-bit one streams faster without them on two
threads (docs/benchmarks-history.md). So a device may offer candidates for such an option, and before the engine
compiles a device's programs each kernel tag (ir.Kernel.tune_as) among them gets the fastest: the tag's kernel
with the most weights, compiled with each combination of candidates, runs over copies of its weights (else its
largest buffer) that together exceed the caches (as a step streams its weights from memory), the candidates
alternated round by round; each one's best round decides (a busy moment only adds time), and only by a margin
against the default. The choice is recorded per machine, device configuration, version of the device's lowering
(`Device.lowering`: other code, other timings), of this code, and tag (a tag's kernels share their inner loop: the
first model's largest one speaks for them).
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np

from . import ir
from .cache import digest, record, recorded, seconds
from .errors import BackendError
from .plugin import Launch

ROTATION_BYTES = 64 << 20  # the copies of a kernel's streamed buffer one measured run reads: past the caches
# or, on a device with a larger cache (Device.cache_bytes), this many times its size: on a Xeon whose L3 is said to
# be 480 MB, 64 MB of copies streamed at 29 GB/s on one thread whichever the prefetch, while from memory (1 GB) the
# candidates ranked as they do in decode steps, 14.0-16.0 GB/s (the deep prefetch the slowest)
CACHE_MULTIPLE = 1.5
# but no more copies than this: a program's launches cost time to make and run (a 36 KB matrix's 20,000 copies of
# 720 MB took 5.2 s a tag, 2,048 of them 2.1 s), and a model whose largest matrix of a layout is that small is read
# from the caches anyway
MAX_COPIES = 2048
ROUNDS = 15  # each candidate's runs, alternated (a run of 64 MB: 2-3 ms; a noisy moment must not decide)
# but no more rounds than fit in BUDGET_S once each candidate has run MIN_ROUNDS times: where memory is slow (a
# shared Xeon's 64 MB at 5 GB/s: 13 ms a run), 15 rounds of 4 candidates took 0.6-1.1 s a tag, a fifth of the cold
# start; a longer run is less at the mercy of a brief pause anyway (over copies past a 480 MB L3, 45 ms a run: the
# 1B shape's two tags measured in 2.7-3.2 s with 5 rounds, 1.8-2.4 s with 3, each of 3 tries choosing the same)
BUDGET_S, MIN_ROUNDS = 0.3, 3
# the least a candidate's best run must beat the default's by to replace it: candidates within the noise of one
# another (a Zen 5's R4 matvecs on two threads: 1.26-1.38 ms for all three prefetches, their order changing from
# one measurement to the next) keep the default, chosen by measuring whole steps (docs/benchmarks-history.md)
MARGIN = 0.03
RULES = digest(Path(__file__).read_bytes())  # this code: what other code measured is measured again
FORCED = {}  # option -> index of the candidate every tag gets whatever was measured (benchmarks/ab_decode.py)


def tune(dev, kernels, progress=None, measure=True):
    """Give dev the measured options for each tag among kernels (as `Device.tune`). measure=False: what was
    recorded, the defaults for the rest (while other work runs on the machine, a measurement would time it too)."""
    if not dev.tunables:
        return
    largest = {}
    for k in kernels:
        if k.tune_tag and _streamed_bytes(k) > _streamed_bytes(largest.get(k.tune_tag)):
            largest[k.tune_tag] = k
    names = list(dev.tunables)
    variants = [dict(zip(names, c)) for c in itertools.product(*dev.tunables.values())]
    best, probes = {}, {}
    try:  # every tag's variants compile (on a CPU, while the next are lowered) before any is measured
        for i, (tag, k) in enumerate(sorted(largest.items())):
            if progress:
                progress("tuning kernels", i, len(largest))
            # one per tag (a layout's loop) on this machine, configuration and version of the lowering code and
            # of this code
            key = ("tuning", dev.backend, dev.describe(), dev.lowering, tag, repr(dev.tunables), RULES)
            best[tag] = recorded(key)
            if best[tag] is None and measure:
                probes[tag] = key, _Probe(dev, k, variants)
        for tag, (key, probe) in probes.items():
            best[tag] = probe.fastest()
            record(key, best[tag])
    except BackendError:  # no room for the copies (a tight memory budget): the defaults, not recorded
        pass
    finally:
        for _, probe in probes.values():
            probe.free()
    forced = {o: dev.tunables[o][i] for o, i in FORCED.items() if o in dev.tunables}
    for tag in largest:
        dev.tune(tag, {**variants[best.get(tag) or 0], **forced})


class _Probe:
    """Kernel k compiled with each option variant, into programs that run it over copies of its weights."""

    def __init__(self, dev, k, variants):
        self.dev, self.k, self.bufs = dev, k, []
        streamed = _streamed(k)
        rotation = max(ROTATION_BYTES, int(CACHE_MULTIPLE * dev.cache_bytes))
        copies = min(MAX_COPIES, max(2, rotation // _buffer_bytes(k, streamed)))
        try:
            for p in k.buffers:
                # one filler for all the copies: one made anew for each, on fresh pages, took 0.16-1.7 s of the
                # default model's cold start
                filler = _filler(k.buffers[p])
                for _ in range(copies if p == streamed else 1):
                    self.bufs.append((p, dev.alloc(_buffer_bytes(k, p))))
                    dev.upload(self.bufs[-1][1], filler)
        except BackendError:
            self.free()
            raise
        shared = {p: b for p, b in self.bufs if p != streamed}
        launches = [Launch(k, {**shared, streamed: b}) for p, b in self.bufs if p == streamed]
        self.programs = []
        for v in variants:  # a program takes its kernels' options when it is made
            dev.tune(k.tune_tag, v)
            self.programs.append(dev.program(launches))

    def fastest(self):
        """Index of the fastest variant (`choose`): each one's best of ROUNDS runs (or of those that fit in
        BUDGET_S, at least MIN_ROUNDS), the variants alternated."""
        # compiled, not run to warm them (that run over 720 MB of copies took 0.45 s of the default model's cold
        # start): each candidate's best round decides, so a slow first one is outvoted
        for prog in self.programs:
            prog.ready()
        times = [[] for _ in self.programs]
        until = time.perf_counter() + BUDGET_S
        for r in range(ROUNDS):
            if r >= MIN_ROUNDS and time.perf_counter() > until:
                break
            for prog, t in zip(self.programs, times):
                t.append(seconds(lambda: prog.run(self.k.tune_scalars)))
        return choose([min(t) for t in times])

    def free(self):
        for _, b in self.bufs:
            self.dev.free(b)
        self.bufs = []


def choose(best):
    """The variant whose time (of `best`, the default's first) is least, if it beats the default's by MARGIN; else
    the default (0)."""
    i = int(np.argmin(best))
    return i if best[i] < (1 - MARGIN) * best[0] else 0


def _buffer_bytes(k, p):
    b = k.buffers[p]
    return b.size * ir.STORAGE_DTYPES[b.dtype]


def _streamed(k):
    """The buffer of k a step streams from memory: its weights (a matvec's input, sized for a step's tokens, can be
    larger but is read a token's worth at a time), or else its largest."""
    return ir.WEIGHTS if ir.WEIGHTS in k.buffers else max(k.buffers, key=lambda p: _buffer_bytes(k, p))


def _streamed_bytes(k):
    return _buffer_bytes(k, _streamed(k)) if k else 0


def _filler(b):
    """Contents that keep every value finite and normal: ones for floats, 0x11 bytes for integers and packed
    blocks (their f16 scales then 6.5e-5)."""
    if b.dtype == "f32":
        return np.ones(b.size, np.float32)
    return np.full(b.size * ir.STORAGE_DTYPES[b.dtype], 0x11, np.uint8)
