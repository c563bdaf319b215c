"""The cost model applied to the devices at hand: measured bandwidths (cached per machine), the model's real
unit sizes, and the mapping from a planned layout to the engine's placement.

The engine computes a host-compute unit on the host CPU device with its weights *and* its KV cache in host
memory (llama.cpp's split), which is the cost model's "host" rest; the planner offers that and "streamed".
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import costmodel as cm
from . import ir, ops
from .cache import measured, seconds
from .plugin import Launch
from .quant import ROWS


@contextlib.contextmanager
def _best_seconds(dev, k):
    """A function of `runs`: the least seconds of that many runs of kernel k (an input x of ones, an output y) on
    dev, after one run to warm it; its buffers are made once and freed on exit."""
    x, y = dev.alloc(k.buffers["x"].size * 4), dev.alloc(k.buffers["y"].size * 4)
    try:
        dev.upload(x, np.ones(k.buffers["x"].size, np.float32))
        prog = dev.program([Launch(k, {"x": x, "y": y})])
        prog.run({})
        yield lambda runs: min(seconds(lambda: prog.run({})) for _ in range(runs))
    finally:
        dev.free(x)
        dev.free(y)


@contextlib.contextmanager
def bandwidth_meter(dev, rows=4096):
    """A function of `runs` that measures the STREAM-style read bandwidth of a device's memory (the best of the
    runs), with a kernel of its own: every row of a rows x 4096 f32 matrix (64 MB by default) summed, rows spread
    over the device's threads or workgroups. The matrix is uploaded once and freed on exit."""
    cols = 4096
    k = ir.Kernel(f"read_bandwidth_{rows}x{cols}")
    k.buffer("x", "f32", rows * cols), k.buffer("y", "f32", rows, True)
    with k.parallel("r", rows) as r:
        k.store("y", r, ir.reduce("add", "c", cols, lambda c: k.load("x", r * cols + c), "reduce"))
    with _best_seconds(dev, k.finish()) as best:
        yield lambda runs: rows * cols * 4 / best(runs)


def multiply_add_kernel(slices, chains=16, columns=4096) -> ir.Kernel:
    """y[s, l] = sum over chains i of sum_c x[c] * (l + i) / 1000: each of ROWS lanes of each of `slices` parallel
    iterations runs `chains` independent sums of products, an input value a column (one broadcast, from cache)
    times a multiplier of each chain's -- the prefill matmul's register tile without its weight loads."""
    k = ir.Kernel(f"multiply_add_peak_{slices}_c{chains}_x{columns}")
    k.buffer("x", "f32", columns), k.buffer("y", "f32", slices * ROWS, True)
    with k.parallel("s", slices) as s:
        with k.loop("l", ROWS, "vector") as l:
            ms = [k.let(f"m{i}", ir.f32(l + i) * 1e-3) for i in range(chains)]
            # one after another: the lowering runs sibling sums in one loop, the chains' multiply-adds side by side
            sums = [k.let(f"s{i}", ir.reduce("add", "c", columns, lambda c, m=m: k.load("x", c) * m, "serial"))
                    for i, m in enumerate(ms)]
            k.store("y", s * ROWS + l, sum(sums[1:], sums[0]))
    k.flops = lambda n_tokens: 2 * slices * ROWS * chains * columns
    return k.finish()


def multiply_add_meter(dev, slices=256) -> ir.Kernel:
    """dev's `multiply_add_kernel`: at least `slices` parallel iterations, and four lanes for each thread the
    device runs at once (Caps.threads); as many chains as its prefill tile has accumulators (ops.gemm_tile: more
    than its registers hold spill -- 16 chains of 16 lanes in AVX2's 16 registers measured half a Zen 1's peak)."""
    groups, tokens = ops.gemm_tile(dev.caps.registers)
    return multiply_add_kernel(max(slices, 4 * dev.caps.threads // ROWS), chains=groups * tokens)


def multiply_add_peak(dev, runs=5, slices=256):
    """FLOP/s of a device's f32 multiply-adds at their peak (the best of `runs` of `multiply_add_meter`, on all
    its threads or workgroups): what bounds the exact mode's prefill matmuls where no matrix unit runs them."""
    k = multiply_add_meter(dev, slices)
    with _best_seconds(dev, k) as best:
        return k.flops(1) / best(runs)


def read_bandwidth(dev, rows=4096, runs=3):
    """The best of `runs` measurements of `bandwidth_meter`."""
    with bandwidth_meter(dev, rows) as measure:
        return measure(runs)


def device_bandwidth(dev):
    """read_bandwidth, measured once per machine and device configuration."""
    return measured(("device-read", dev.backend, dev.describe()), lambda: read_bandwidth(dev))


def link_bandwidth(dev):
    """Host -> device upload bandwidth and latency of a device (measured once per machine)."""
    def run():
        buf = dev.alloc(32 << 20)
        try:
            data = np.ones(32 << 20, np.uint8)
            dev.upload(buf, data)
            bw = data.nbytes / min(seconds(lambda: dev.upload(buf, data)) for _ in range(3))
            lat = min(seconds(lambda: dev.upload(buf, data[:64])) for _ in range(5))
            return [bw, lat]
        finally:
            dev.free(buf)
    return measured(("link", dev.backend, dev.describe()), run)


def hardware(devices: dict, arenas: dict, host: str, reserve=lambda caps: 0) -> cm.Hardware:
    """The devices as the cost model sees them; `reserve(caps)` bytes of each are kept for activations."""
    host_bw = device_bandwidth(devices[host])
    devs, links = [], []
    for name, d in devices.items():
        bw = d.caps.bandwidth_Bps or device_bandwidth(d)
        devs.append(cm.Device(name, max(0, arenas[name].free_bytes - reserve(d.caps)), bw, host=name == host))
        if name != host:
            if d.backend == "cpu":  # another CPU partition: a memcpy in the same memory
                links.append(cm.Link(host, name, host_bw / 2, 0.0))
            else:
                bw_link, lat = link_bandwidth(d)
                links.append(cm.Link(host, name, bw_link, lat))
    return cm.Hardware(devs, links)


def shape(model) -> cm.ModelShape:
    """The cost model's view of a Llama (its units' weight and KV bytes, one activation row)."""
    units = model.units
    kv = [model.kv_bytes(u) if isinstance(u, int) else 0 for u in units]
    return cm.ModelShape(len(units), [model.unit_bytes(u) for u in units], kv, model.cfg.dim * 4)


def candidates(hw, shp, accel=None):
    """The cost model's candidates that this engine can run (see the module docstring)."""
    return [lay for lay in cm.candidates(hw, shp, accel) if all(res != "host-compute" for _, res in lay.units)]


def to_placement(layout: cm.Layout, units=None) -> dict:
    """unit -> (device, residency) for the engine's units; without units, the engine's placement argument
    {device: {residency: [unit index, ...]}} with the model's units in order (embed, layers, head)."""
    if units is not None:
        return {u: (dev, res) for u, (dev, res) in zip(units, layout.units)}
    n = len(layout.units)
    names = ["embed"] + list(range(n - 2)) + ["head"]
    out = {}
    for u, (dev, res) in zip(names, layout.units):
        out.setdefault(dev, {}).setdefault(res, []).append(u)
    return out

