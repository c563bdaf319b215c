"""Per-kernel profile of one step (a decode step, or a prefill step of several tokens): each launch is run on its
own and timed, so the time of every kernel, its weight bytes and GB/s, and a prefill matmul's GFLOP/s are visible
next to the whole-step time (the difference is dispatch overhead)."""
from __future__ import annotations

import time

import numpy as np

from .ir import STORAGE_DTYPES
from .plugin import Launch


def _median_time(fn, repeats):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def profile_decode(eng, prompt_tokens=32, repeats=5, step_tokens=1):
    """Rows of (unit, kernel, seconds, bytes read from weights, flops where the kernel counts them) for one step
    of step_tokens tokens (1: a decode step) at position prompt_tokens, plus the whole step's time."""
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
                for u in seg.units:
                    slot = seg.slot if seg.streamed is not None else None
                    for ln in eng._bind(u, seg.device, slot=slot, prefill=prefill):
                        prog = dev.program([Launch(ln.kernel, ln.buffers, ln.scalars)])
                        prog.run(values)
                        w = ln.kernel.buffers.get("w")  # the weights (or their dequantized copy) it reads
                        read = ln.kernel.w_read(step_tokens) if ln.kernel.w_read else w and w.size
                        nbytes = read * STORAGE_DTYPES[w.dtype] if w else 0
                        flops = ln.kernel.flops(step_tokens) if ln.kernel.flops else 0
                        rows.append((u, ln.kernel.name, _median_time(lambda: prog.run(values), repeats), nbytes, flops))
            whole = _median_time(lambda: [(seg.prefill if prefill else seg.program).run(values)
                                          for seg in eng.segments], repeats)
        return rows, whole
    finally:
        eng.free_sequence(seq)


def print_profile(rows, whole, file=None):
    by_kernel = {}
    for u, name, s, b, f in rows:
        kind = "_".join(name.split("_")[:3]) if name.startswith(("matmul", "gemm")) else name.split("_")[0]
        agg = by_kernel.setdefault(kind, [0, 0.0, 0, 0])
        agg[0] += 1
        agg[1] += s
        agg[2] += b
        agg[3] += f
    total = sum(r[2] for r in rows)
    print(f"{'kernel':32} {'calls':>5} {'ms':>8} {'share':>6} {'MB':>8} {'GB/s':>7} {'GFLOP/s':>8}", file=file)
    for kind, (n, s, b, f) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:32} {n:5d} {s * 1e3:8.3f} {s / total:6.1%} {b / 1e6:8.2f} {b / s / 1e9 if b else 0:7.1f}"
              f" {f / s / 1e9 if f else 0:8.1f}", file=file)
    print(f"sum of kernels {total * 1e3:.3f} ms; whole step {whole * 1e3:.3f} ms; "
          f"outside kernels {max(0.0, whole - total) * 1e3:.3f} ms", file=file)
