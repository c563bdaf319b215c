"""Turns the user's `placement` argument into unit -> (device, residency).

    "auto"                                    the cost model's best layout that fits (one device: all there)
    "vulkan:0"                                every unit resident there
    {"cpu": range(0, 15), "vulkan:0": range(15, 30)}             resident; embed/head follow the first/last layer
    {"vulkan:0": {"resident": range(0, 12), "streamed": range(12, 30)}}     with residencies
"""
from __future__ import annotations

from . import costmodel as cm
from . import planner, registry
from .errors import JitllmError

RESIDENCIES = ("resident", "streamed")  # host-compute is "resident on the host CPU device"


def _rank(dev):
    """Where a model that fits goes: an accelerator before the host CPU, and a device that is itself an
    emulation on the CPU (caps.extra device_type "cpu", e.g. lavapipe) last; then the faster memory."""
    emulated = dev.caps.extra.get("device_type") == "cpu" and dev.backend != "cpu"
    return (0 if emulated else 1 if dev.backend == "cpu" else 2, dev.caps.bandwidth_Bps)


def resolve(eng, placement, n_device_layers=None) -> dict:
    units, devices = eng.model.units, eng.devices
    if n_device_layers is not None or placement in ("auto", None):
        return _planned(eng, n_device_layers)
    if isinstance(placement, str):
        dev = device_name(placement, devices)
        return {u: (dev, "resident") for u in units}
    if not isinstance(placement, dict):
        raise JitllmError(f"placement must be 'auto', a device name or a dict device -> layers, not {placement!r}")
    return _explicit(placement, units, devices)


def _planned(eng, n_device_layers):
    """One device, or everything fits the best one: all there. Otherwise the cost model decides."""
    units, devices = eng.model.units, eng.devices
    best = max(devices.values(), key=_rank).name
    shp = planner.shape(eng.model)

    def reserve(caps):  # a device's activations (a device of matrix instructions holds its tile matmuls' too)
        return eng.model.activation_bytes(caps.tile_dots)

    fits = eng.arenas[best].free_bytes >= sum(shp.unit_bytes) + sum(shp.kv_bytes) + reserve(devices[best].caps)
    if len(devices) == 1:
        return {u: (best, "resident") for u in units}
    host = eng.host_device()
    if host is None:
        raise JitllmError("planning a split needs a CPU device among the engine's devices")
    hw = planner.hardware(devices, eng.arenas, host, reserve=reserve)
    if n_device_layers is None and fits:  # the best device holds it all: no split to weigh
        eng.plan = cm.predict(cm.Layout(((best, "resident"),) * len(units)), hw, shp)
        return {u: (best, "resident") for u in units}
    accel = next((n for n in sorted(devices, key=lambda n: _rank(devices[n]), reverse=True) if n != host), None)
    if n_device_layers is not None:
        eng.plan = cm.predict(cm.n_device_layers(int(n_device_layers), hw, shp, accel, "host"), hw, shp)
    else:
        eng.plan = cm.choose([cm.predict(lay, hw, shp) for lay in planner.candidates(hw, shp)])
    return planner.to_placement(eng.plan.layout, units)


def _explicit(placement, units, devices):
    layers = [u for u in units if isinstance(u, int)]
    out = {}
    for name, which in placement.items():
        dev = device_name(name, devices)
        groups = which.items() if isinstance(which, dict) else [("resident", which)]
        for residency, members in groups:
            if residency not in RESIDENCIES:
                raise JitllmError(f"placement: unknown residency {residency!r} (one of {', '.join(RESIDENCIES)})")
            for u in ([members] if isinstance(members, (int, str)) else list(members)):
                if u not in units:
                    raise JitllmError(f"placement: unknown unit {u!r} (layers 0..{len(layers) - 1}, 'embed', 'head')")
                if u in out:
                    raise JitllmError(f"placement: unit {u!r} is placed twice")
                out[u] = (dev, residency)
    missing = [u for u in layers if u not in out]
    if missing:
        raise JitllmError(f"placement: layers {missing[0]}..{missing[-1]} have no device")
    if "embed" not in out and out[layers[0]][1] == "streamed":
        raise JitllmError("placement: say where 'embed' goes when layer 0 is streamed")
    out.setdefault("embed", (out[layers[0]][0], "resident"))
    out.setdefault("head", (out[layers[-1]][0], "resident"))
    return {u: out[u] for u in units}


def device_name(name, devices):
    found = registry.lookup(name, devices)
    if found is not None:
        return found
    raise JitllmError(f"placement names device {name!r}, which is not in this engine's devices "
                      f"({', '.join(devices)})")
