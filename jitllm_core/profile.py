"""Per-kernel profile of one step (a decode step, or a prefill step of several tokens): the time of every kernel,
its weight bytes and GB/s, and a prefill matmul's GFLOP/s (and its share of the device's multiply-add peak, where
that is measured: `planner.multiply_add_peak`), next to the whole-step time.

Where the device can time launches inside one program (Device.timed_program), the step's launches run in order
as in the step, with a barrier after each: weights come from memory as they do in a step, and the kernels' sum
can exceed the whole step by the barriers the step leaves out (independent launches, such as the q, k and v
projections, run back to back there). Elsewhere each launch runs in a program of its own, repeated, so that a
launch's weights may come from cache and the difference to the whole step is dispatch overhead."""
from __future__ import annotations

import time

import numpy as np

from .ir import STORAGE_DTYPES, WEIGHTS
from .plugin import Launch

IN_SEQUENCE = "launches timed in sequence, a barrier after each"
ON_ITS_OWN = "each launch timed on its own, repeated (its weights may come from cache)"


def _median_time(fn, repeats):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def profile_decode(eng, prompt_tokens=32, repeats=5, step_tokens=1):
    """Rows of (unit, kernel, seconds, bytes read from weights, flops where the kernel counts them) for one step
    of step_tokens tokens (1: a decode step) at position prompt_tokens, the whole step's time, and how the
    launches were timed (IN_SEQUENCE or ON_ITS_OWN: the last device's way, where several devices differ)."""
    seq = eng.new_sequence()
    prefill = step_tokens > 1
    try:
        with eng._lock:
            history = list(range(1, prompt_tokens + 1))
            for i in range(0, prompt_tokens, eng.model.T):
                eng._step(seq, history[i:i + eng.model.T], 0)
            values = {"pos": seq.n, "n_tokens": step_tokens, "t0": step_tokens - 1, **eng.model.constants}
            rows = []
            for seg in eng.segments:
                dev = eng.devices[seg.device]
                slot = seg.slot if seg.streamed is not None else None
                bound = [(u, ln) for u in seg.units for ln in eng._bind(u, seg.device, slot=slot, prefill=prefill)]
                seconds, how = _launch_seconds(dev, [Launch(ln.kernel, ln.buffers, ln.scalars) for _, ln in bound],
                                          values, repeats)
                for (u, ln), s in zip(bound, seconds):
                    w = ln.kernel.buffers.get(WEIGHTS)  # the weights (or their dequantized copy) it reads
                    read = ln.kernel.w_read(step_tokens) if ln.kernel.w_read else w and w.size
                    nbytes = read * STORAGE_DTYPES[w.dtype] if w else 0
                    # tokens it computes: from the step's t0 where it takes it (the last layer's, the LM head's)
                    first = values[ln.scalar_name("t0")] if "t0" in ln.kernel.scalars else 0
                    flops = ln.kernel.flops(step_tokens - first) if ln.kernel.flops else 0
                    rows.append((u, ln.kernel.name, s, nbytes, flops))
            whole = _median_time(lambda: [(seg.prefill if prefill else seg.program).run(values)
                                          for seg in eng.segments], repeats)
        return rows, whole, how
    finally:
        eng.free_sequence(seq)


def _launch_seconds(dev, launches, values, repeats):
    """Median seconds of each launch, and how they were timed: in one timed program where the device has them,
    else each on its own."""
    prog = dev.timed_program(launches)
    if prog is not None:
        prog.run(values)
        return list(np.median([prog.run(values) for _ in range(repeats)], axis=0)), IN_SEQUENCE
    out = []
    for ln in launches:
        one = dev.program([ln])
        one.run(values)
        out.append(_median_time(lambda: one.run(values), repeats))
    return out, ON_ITS_OWN


def print_profile(rows, whole, how, file=None, peak=None):
    """The rows of `profile_decode` by kernel; peak: FLOP/s of the device's multiply-adds, for a column of each
    kernel's share of it (above 100 %: matrix units, or integer dots, do its products)."""
    by_kernel = {}
    for u, name, s, b, f in rows:
        kind = "_".join(name.split("_")[:3]) if name.startswith(("matmul", "gemm")) else name.split("_")[0]
        agg = by_kernel.setdefault(kind, [0, 0.0, 0, 0])
        agg[0] += 1
        agg[1] += s
        agg[2] += b
        agg[3] += f
    total = sum(r[2] for r in rows)
    print(f"{'kernel':32} {'calls':>5} {'ms':>8} {'share':>6} {'MB':>8} {'GB/s':>7} {'GFLOP/s':>8}"
          + (f" {'% of peak':>9}" if peak else ""), file=file)
    for kind, (n, s, b, f) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:32} {n:5d} {s * 1e3:8.3f} {s / total:6.1%} {b / 1e6:8.2f} {b / s / 1e9 if b else 0:7.1f}"
              f" {f / s / 1e9 if f else 0:8.1f}" + (f" {f / s / peak:9.0%}" if peak and f else ""), file=file)
    print(f"sum of kernels {total * 1e3:.3f} ms; whole step {whole * 1e3:.3f} ms; "
          f"outside kernels {max(0.0, whole - total) * 1e3:.3f} ms ({how})", file=file)
    if peak:
        print(f"the device's f32 multiply-add peak: {peak / 1e9:.1f} GFLOP/s (independent chains of multiply-adds "
              "from cache, on the same threads)", file=file)
