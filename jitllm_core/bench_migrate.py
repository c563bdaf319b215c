"""`jitllm bench migrate`: pause time and bytes of moving all layers between devices, against history length.

For each history length the engine holds a session with that many tokens of KV cache; all layers then move
from one device to another and the next token's logits are compared with a run that did not move.
"""
from __future__ import annotations

import os
import time

import numpy as np

from . import registry
from .errors import JitllmError


def memcpy_bandwidth():
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(b, a)
    return 5 * a.nbytes / (time.perf_counter() - t)


def run(model=None, histories=(256, 1800, 7000), file=None):
    os.environ.setdefault("JITLLM_CPU_DEVICES", "2")  # cpu:0 and cpu:1, when the registry has not probed yet
    from .engine import Engine
    names = list(registry.all_devices())
    if "cpu:1" not in names:
        raise JitllmError("bench migrate needs two CPU devices: run with JITLLM_CPU_DEVICES=2")
    accels = [d for d in names if not d.startswith("cpu:")]   # each one there and back: cpu:0 -> d -> cpu:0
    routes = [("cpu:0", "cpu:1"), ("cpu:1", "cpu:0")] + [r for d in accels for r in (("cpu:0", d), (d, "cpu:0"))]
    bw = memcpy_bandwidth()
    eng = Engine(model, devices=["cpu:0", "cpu:1"] + accels, placement="cpu:0", max_context=max(histories) + 64)
    layers = f"0-{eng.config.n_layer - 1}"
    print(f"memcpy bandwidth {bw / 1e9:.1f} GB/s; moving layers {layers} of {os.path.basename(eng.model_path)}",
          file=file)
    print(f"{'history':>7} {'route':>20} {'pause ms':>9} {'MB pre':>8} {'MB pause':>9} {'pause GB/s':>10} "
          f"{'of memcpy':>9} {'recomputed':>10}", file=file)
    rng = np.random.default_rng(0)
    rows = []
    for n in histories:
        ids = [int(i) for i in rng.integers(100, eng.config.vocab - 100, n)]
        probe = int(rng.integers(100, 1000))
        eng.migrate(layers, "cpu:0")
        with eng.session() as s:
            s.feed(ids)
            want = s.feed([probe])
        with eng.session() as s:
            s.feed(ids)
            for src, dst in routes:
                r = eng.migrate(layers, dst)
                if not r.ok:
                    raise JitllmError(str(r))
                rows.append((n, src, dst, r))
                gbs = r.bytes_in_pause / (r.pause_ms / 1e3) / 1e9 if r.pause_ms else 0.0
                print(f"{n:7d} {src + '->' + dst:>20} {r.pause_ms:9.2f} {r.bytes_precopied / 1e6:8.2f} "
                      f"{r.bytes_in_pause / 1e6:9.3f} {gbs:10.2f} {gbs * 1e9 / bw:9.1%} {r.recomputed_tokens:10d}",
                      file=file)
            got = s.feed([probe])
        tol = 0.0 if len(routes) == 2 else 1e-3
        match = float(np.abs(got - want).max()) <= tol
        print(f"{'':7} next-token logits after the moves {'match' if match else 'DIFFER'} "
              f"(max diff {np.abs(got - want).max():.2e})", file=file)
    eng.close()
    return rows
