"""The cost model applied to the devices at hand: measured bandwidths (cached per machine), the model's real
unit sizes, and the mapping from a planned layout to the engine's placement.

The engine computes a host-compute unit on the host CPU device with its weights *and* its KV cache in host
memory (llama.cpp's split), which is the cost model's "host" rest; the planner offers that and "streamed".
"""
from __future__ import annotations

import json
import time

import numpy as np

from . import costmodel as cm
from .cache import cache_dir, digest


def _measured(key, fn):
    path = cache_dir("measure") / f"{digest(key)}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = fn()
    path.write_text(json.dumps(value))
    return value


def host_read_bandwidth():
    """STREAM-style read: bytes summed per second over an array much larger than the caches."""
    def run():
        a = np.ones(32 << 20, np.float64)  # 256 MB
        a.sum()
        best = min(_timed(a.sum) for _ in range(3))
        return a.nbytes / best
    return _measured(("host-read", _cpu_model()), run)


def link_bandwidth(dev):
    """Host -> device upload bandwidth and latency of a device (measured once per machine)."""
    def run():
        buf = dev.alloc(32 << 20)
        try:
            data = np.ones(32 << 20, np.uint8)
            dev.upload(buf, data)
            bw = data.nbytes / min(_timed(lambda: dev.upload(buf, data)) for _ in range(3))
            lat = min(_timed(lambda: dev.upload(buf, data[:64])) for _ in range(5))
            return [bw, lat]
        finally:
            dev.free(buf)
    return _measured(("link", dev.backend, dev.describe()), run)


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def hardware(devices: dict, arenas: dict, host: str, reserve=0) -> cm.Hardware:
    """The devices as the cost model sees them; `reserve` bytes of each are kept for activations."""
    host_bw = host_read_bandwidth()
    devs, links = [], []
    for name, d in devices.items():
        bw = host_bw if name == host else (d.caps.bandwidth_Bps or host_bw)
        devs.append(cm.Device(name, max(0, arenas[name].free_bytes - reserve), bw, host=name == host))
        if name != host:
            if d.backend == "cpu":  # another CPU partition: a memcpy in the same memory
                links.append(cm.Link(host, name, host_bw / 2, 0.0))
            else:
                bw_link, lat = link_bandwidth(d)
                links.append(cm.Link(host, name, bw_link, lat))
    return cm.Hardware(devs, links)


def shape(eng) -> cm.ModelShape:
    m = eng.model
    units = m.units
    weights = [sum(eng._tensor_bytes(n, u) for n in m.weight_shapes(u)) for u in units]
    kv = [m.kv_bytes_per_layer() if isinstance(u, int) else 0 for u in units]
    return cm.ModelShape(len(units), weights, kv, eng.config.dim * 4)


def candidates(hw, shp):
    """The cost model's candidates that this engine can run (see the module docstring)."""
    return [lay for lay in cm.candidates(hw, shp) if all(res != "host-compute" for _, res in lay.units)]


def to_placement(layout: cm.Layout, units) -> dict:
    return {u: (dev, res) for u, (dev, res) in zip(units, layout.units)}


def from_placement(placement: dict, units) -> cm.Layout:
    return cm.Layout(tuple(placement[u] for u in units))
