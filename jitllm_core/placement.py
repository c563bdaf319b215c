"""Turns the user's `placement` argument into unit -> device name."""
from __future__ import annotations

from .errors import JitllmError

# an accelerator beats the CPU backend; a Vulkan device that is itself a CPU emulation (lavapipe) does not
_RANK = {"cuda": 3, "vulkan": 2, "cpu": 1}


def _rank(dev):
    if dev.backend == "vulkan" and dev.caps.extra.get("device_type") == "cpu":
        return 0
    return _RANK.get(dev.backend, 1)


def resolve(placement, model, devices: dict) -> dict:
    units = model.units
    layers = [u for u in units if isinstance(u, int)]
    if placement == "auto" or placement is None:
        best = max(devices.values(), key=_rank).name
        return {u: best for u in units}
    if isinstance(placement, str):
        dev = _lookup(placement, devices)
        return {u: dev for u in units}
    if not isinstance(placement, dict):
        raise JitllmError(f"placement must be 'auto', a device name or a dict device -> layers, not {placement!r}")
    out = {}
    for name, which in placement.items():
        dev = _lookup(name, devices)
        for u in ([which] if isinstance(which, (int, str)) else list(which)):
            if u not in units:
                raise JitllmError(f"placement: unknown unit {u!r} (layers 0..{len(layers) - 1}, 'embed', 'head')")
            if u in out:
                raise JitllmError(f"placement: unit {u!r} is placed twice")
            out[u] = dev
    missing = [u for u in layers if u not in out]
    if missing:
        raise JitllmError(f"placement: layers {missing[0]}..{missing[-1]} have no device")
    out.setdefault("embed", out[layers[0]])
    out.setdefault("head", out[layers[-1]])
    return {u: out[u] for u in units}


def _lookup(name, devices):
    if name in devices:
        return name
    alias = {"cpu": "cpu:0", "cpu:0": "cpu"}.get(name)
    if alias in devices:
        return alias
    raise JitllmError(f"placement names device {name!r}, which is not in this engine's devices "
                      f"({', '.join(devices)})")
