"""Cost model and planner for placements: what one decode step costs under a layout, and which layout is best.

Pure arithmetic on a hardware description and a model shape; no engine needed. Formulas and assumptions
are in docs/planner.md.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .errors import JitllmError, is_whole

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

GB = 1e9
RESIDENCIES = ("resident", "host-compute", "streamed")
RESTS = ("host-compute", "streamed", "host")  # where n_device_layers puts the units not on the device


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    bandwidth_Bps: float
    host: bool = False


@dataclass(frozen=True)
class Link:
    """A transfer path between devices a and b; bandwidth_ba_Bps defaults to bandwidth_Bps (a -> b)."""
    a: str
    b: str
    bandwidth_Bps: float
    latency_s: float = 0.0
    bandwidth_ba_Bps: float | None = None

    def bandwidth(self, src: str, dst: str) -> float:
        if (src, dst) == (self.b, self.a) and self.bandwidth_ba_Bps is not None:
            return self.bandwidth_ba_Bps
        return self.bandwidth_Bps


@dataclass
class Hardware:
    devices: list[Device]
    links: list[Link]

    def __post_init__(self):
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise JitllmError(f"hardware: duplicate device names in {names}")
        if not any(d.host for d in self.devices):
            raise JitllmError("hardware: no host device")
        for link in self.links:
            for end in (link.a, link.b):
                self.device(end)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise JitllmError(f"hardware: unknown device {name!r} (known: {', '.join(d.name for d in self.devices)})")

    @property
    def host(self) -> Device:
        """The host: the first device with host=True (it holds host-computed and streamed weights)."""
        return next(d for d in self.devices if d.host)

    @property
    def accelerators(self) -> list[Device]:
        return [d for d in self.devices if not d.host]

    def has_link(self, a: str, b: str) -> bool:
        return any({link.a, link.b} == {a, b} for link in self.links)

    def link(self, a: str, b: str) -> Link:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise JitllmError(f"hardware: no link between {a} and {b}")


@dataclass
class ModelShape:
    """Per-unit weight and KV-cache bytes read in one decode step, and the bytes of one activation crossing."""
    n_units: int
    unit_bytes: list[int]
    kv_bytes: list[int]
    activation_bytes: int

    def __post_init__(self):
        if self.n_units < 1 or len(self.unit_bytes) != self.n_units or len(self.kv_bytes) != self.n_units:
            raise JitllmError(f"model shape: {self.n_units} units but {len(self.unit_bytes)} unit sizes "
                              f"and {len(self.kv_bytes)} KV sizes")

    @classmethod
    def uniform(cls, n_units: int, model_bytes: float, kv_bytes: float, activation_bytes: float) -> ModelShape:
        """n_units equal units sharing model_bytes of weights and kv_bytes of KV cache."""
        return cls(n_units, [round(model_bytes / n_units)] * n_units, [round(kv_bytes / n_units)] * n_units,
                   round(activation_bytes))


@dataclass(frozen=True)
class Layout:
    """Per unit: (device, residency). For host-compute and streamed units the device is the accelerator the
    unit belongs to (its KV cache and its place in the activation path); the weights stay in host memory."""
    units: tuple[tuple[str, str], ...]

    def runs(self) -> list[tuple[tuple[str, str], int]]:
        return [(key, len(list(group))) for key, group in itertools.groupby(self.units)]

    def label(self) -> str:
        return " + ".join(f"{n} {dev}" if res == "resident" else f"{n} {res}" for (dev, res), n in self.runs())

    def family(self) -> tuple[tuple[str, str], ...]:
        """The layout without its counts: '24 gpu + 16 streamed' and '39 gpu + 1 streamed' share one."""
        return tuple(key for key, _ in self.runs())


@dataclass
class Prediction:
    layout: Layout
    device_layers: int                       # units resident on an accelerator
    bytes_read: dict[str, dict[str, int]]    # device -> {"weights", "kv", "copied"} bytes per step
    bytes_crossed: dict[str, int]            # "src->dst" -> bytes per step (activations and streamed weights)
    crossings: int                           # activation crossings + streamed-weight copies per step
    memory_bytes: dict[str, int]             # device -> bytes held (weights, KV, staging buffers)
    capacity_bytes: dict[str, int]           # device -> memory size
    seconds: dict[str, float]                # device or "src->dst" -> seconds per step
    host_read_bytes: int                     # bytes read from host memory per step (compute and copies)

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.step_s

    @property
    def fits(self) -> bool:
        return all(self.memory_bytes[d] <= self.capacity_bytes[d] for d in self.memory_bytes)

    def to_dict(self) -> dict:
        return {"layout": self.layout.label(), "device_layers": self.device_layers,
                "residencies": [list(u) for u in self.layout.units], "tokens_per_s": self.tokens_per_s,
                "step_s": self.step_s, "fits": self.fits, "crossings": self.crossings,
                "bytes_read": self.bytes_read, "bytes_crossed": self.bytes_crossed,
                "host_read_bytes": self.host_read_bytes, "memory_bytes": self.memory_bytes,
                "capacity_bytes": self.capacity_bytes, "seconds": self.seconds}


def predict(layout: Layout, hw: Hardware, shape: ModelShape) -> Prediction:
    """Bytes, crossings, memory and time of one decode step (one token) under layout."""
    if len(layout.units) != shape.n_units:
        raise JitllmError(f"layout has {len(layout.units)} units, the model {shape.n_units}")
    host = hw.host.name
    read = {d.name: {"weights": 0, "kv": 0, "copied": 0} for d in hw.devices}
    memory = {d.name: 0 for d in hw.devices}
    crossed: dict[str, int] = {}
    link_s: dict[str, float] = {}
    staging: dict[str, int] = {}
    crossings = 0

    def cross(src: str, dst: str, nbytes: int) -> None:
        nonlocal crossings
        link, key = hw.link(src, dst), f"{src}->{dst}"
        crossed[key] = crossed.get(key, 0) + nbytes
        link_s[key] = link_s.get(key, 0.0) + link.latency_s + nbytes / link.bandwidth(src, dst)
        crossings += 1

    previous = None
    for i, (dev, residency) in enumerate(layout.units):
        weights, kv = shape.unit_bytes[i], shape.kv_bytes[i]
        if residency not in RESIDENCIES:
            raise JitllmError(f"unit {i}: unknown residency {residency!r} (one of {', '.join(RESIDENCIES)})")
        if hw.device(dev).host and residency != "resident":
            raise JitllmError(f"unit {i}: {residency} needs an accelerator, {dev} is a host device")
        if previous is not None and previous != dev:
            cross(previous, dev, shape.activation_bytes)
        previous = dev
        read[dev]["kv"] += kv
        memory[dev] += kv
        if residency == "resident":
            read[dev]["weights"] += weights
            memory[dev] += weights
        elif residency == "host-compute":
            read[host]["weights"] += weights
            memory[host] += weights
            cross(dev, host, shape.activation_bytes)
            cross(host, dev, shape.activation_bytes)
        else:  # streamed: copied to the device every step, into one of two staging buffers
            read[host]["copied"] += weights
            memory[host] += weights
            staging[dev] = max(staging.get(dev, 0), weights)
            cross(host, dev, weights)
    for dev, largest in staging.items():
        memory[dev] += 2 * largest
    seconds = {d.name: (read[d.name]["weights"] + read[d.name]["kv"]) / d.bandwidth_Bps for d in hw.devices}
    seconds.update(link_s)
    return Prediction(
        layout=layout,
        device_layers=sum(1 for dev, res in layout.units if res == "resident" and not hw.device(dev).host),
        bytes_read=read, bytes_crossed=crossed, crossings=crossings, memory_bytes=memory,
        capacity_bytes={d.name: d.memory_bytes for d in hw.devices}, seconds=seconds,
        host_read_bytes=sum(sum(read[d.name].values()) for d in hw.devices if d.host))


def n_device_layers(n: int, hw: Hardware, shape: ModelShape, accel: str | None = None,
                    rest: str = "host") -> Layout:
    """llama.cpp's knob: the first n units resident on accel (default: the first accelerator), the others
    `rest`: "host" (resident on the host, KV there too, like llama.cpp), "host-compute" or "streamed"."""
    if not 0 <= n <= shape.n_units:
        raise JitllmError(f"n_device_layers={n}: the model has {shape.n_units} units")
    if rest not in RESTS:
        raise JitllmError(f"rest={rest!r}: one of {', '.join(RESTS)}")
    if n == 0 and rest == "host":
        return Layout(((hw.host.name, "resident"),) * shape.n_units)
    if accel is None:
        if not hw.accelerators:
            raise JitllmError("n_device_layers: the hardware has no accelerator")
        accel = hw.accelerators[0].name
    other = (hw.host.name, "resident") if rest == "host" else (accel, rest)
    return Layout(((accel, "resident"),) * n + (other,) * (shape.n_units - n))


def candidates(hw: Hardware, shape: ModelShape, accel: str | None = None) -> list[Layout]:
    """Every layout auto considers, fitting or not: all on the host; for each accelerator (or just accel),
    k units resident on it and the rest host, host-compute or streamed, for every k from 0 to all."""
    layouts = [n_device_layers(0, hw, shape)]
    for device in [hw.device(accel)] if accel else hw.accelerators:
        layouts.append(n_device_layers(shape.n_units, hw, shape, device.name))
        if hw.has_link(device.name, hw.host.name):
            for rest, k in itertools.product(RESTS, range(shape.n_units)):
                layouts.append(n_device_layers(k, hw, shape, device.name, rest))
    return list(dict.fromkeys(layouts))


def choose(predictions: list[Prediction]) -> Prediction:
    """The fitting prediction with the best tokens/s (the first of equals)."""
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        def over(p):
            return {d: m for d, m in p.memory_bytes.items() if m > p.capacity_bytes[d]}
        closest = sorted(predictions, key=lambda p: sum(m - p.capacity_bytes[d] for d, m in over(p).items()))
        raise JitllmError("no layout fits in memory; closest: " + "; ".join(
            f"{p.layout.label()} needs " + ", ".join(
                f"{m / GB:.2f} GB on {d} (has {p.capacity_bytes[d] / GB:.2f})" for d, m in over(p).items())
            for p in closest[:3]))
    return max(fitting, key=lambda p: p.tokens_per_s)


def auto(hw: Hardware, shape: ModelShape, accel: str | None = None) -> Prediction:
    """What placement="auto" picks."""
    return choose([predict(layout, hw, shape) for layout in candidates(hw, shape, accel)])


def sweep(hw: Hardware, shape: ModelShape, accel: str | None = None) -> dict[str, list[Prediction]]:
    """For each way of placing the rest (RESTS): predictions for 0 .. n_units units resident on accel."""
    return {rest: [predict(n_device_layers(k, hw, shape, accel, rest), hw, shape)
                   for k in range(shape.n_units + 1)] for rest in RESTS}


def unified(bandwidth_Bps: float, shape: ModelShape) -> Prediction:
    """A unified-memory machine of that bandwidth holding the whole model (and its KV) in one memory."""
    size = sum(shape.unit_bytes) + sum(shape.kv_bytes)
    hw = Hardware([Device("unified", size, bandwidth_Bps, host=True)], [])
    return predict(n_device_layers(0, hw, shape), hw, shape)


# --- hardware files ---------------------------------------------------------------------------------------

def load_hardware_toml(path) -> tuple[Hardware, ModelShape | None]:
    """Read a what-if hardware file (format in docs/planner.md): devices, links and optionally a [model]."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise JitllmError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise JitllmError(f"{path}: not valid TOML: {e}") from None
    file = _File(path)
    file.keys("", data, {"devices", "links", "model"})
    devices_table = file.table("devices", data.get("devices"))
    if not devices_table:
        raise JitllmError(f"{path}: [devices]: no devices")
    devices = []
    for name, t in devices_table.items():
        section = f"devices.{name}"
        t = file.table(section, t)
        file.keys(section, t, {"memory_gb", "bandwidth_gbs", "host"})
        host = t.get("host", False)
        if not isinstance(host, bool):
            raise JitllmError(f"{path}: [{section}] host: expected true or false, got {host!r}")
        devices.append(Device(name, round(file.number(section, t, "memory_gb", positive=True) * GB),
                              file.number(section, t, "bandwidth_gbs", positive=True) * GB, host))
    if not any(d.host for d in devices):
        raise JitllmError(f"{path}: [devices]: no device has host = true")
    links, pairs = [], set()
    for name, t in file.table("links", data.get("links", {})).items():
        section = f"links.{name}"
        t = file.table(section, t)
        file.keys(section, t, {"bandwidth_gbs", "bandwidth_gbs_ab", "bandwidth_gbs_ba", "latency_us"})
        a, b = file.link_ends(section, name, [d.name for d in devices])
        if frozenset((a, b)) in pairs:
            raise JitllmError(f"{path}: [{section}]: a second link between {a} and {b}")
        pairs.add(frozenset((a, b)))
        both = None
        if "bandwidth_gbs" in t or not {"bandwidth_gbs_ab", "bandwidth_gbs_ba"} <= t.keys():
            both = file.number(section, t, "bandwidth_gbs", positive=True)
        links.append(Link(a, b, file.number(section, t, "bandwidth_gbs_ab", both, positive=True) * GB,
                          file.number(section, t, "latency_us", 0) * 1e-6,
                          file.number(section, t, "bandwidth_gbs_ba", both, positive=True) * GB))
    shape = file.model(file.table("model", data["model"])) if "model" in data else None
    return Hardware(devices, links), shape


class _File:
    """Field readers whose errors name the file, the section and the field."""

    def __init__(self, path):
        self.path = path

    def fail(self, section: str, field: str, problem: str):
        where = f" [{section}]" if section else ""
        raise JitllmError(f"{self.path}:{where} {field}: {problem}")

    def table(self, section: str, value) -> dict:
        if not isinstance(value, dict):
            raise JitllmError(f"{self.path}: [{section}]: expected a table, got {value!r}")
        return value

    def keys(self, section: str, t: dict, allowed: set[str]) -> None:
        for key in t.keys() - allowed:
            self.fail(section, key, f"unknown field (known: {', '.join(sorted(allowed))})")

    def number(self, section: str, t: dict, key: str, default=None, positive=False) -> float:
        if key not in t:
            if default is None:
                self.fail(section, key, "missing")
            return default
        return self.check(section, key, t[key], positive)

    def check(self, section: str, key: str, v, positive: bool) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.fail(section, key, f"expected a number, got {v!r}")
        if v < 0 or (positive and v == 0):
            self.fail(section, key, f"must be {'positive' if positive else 'zero or more'}, got {v}")
        return v

    def numbers(self, section: str, key: str, v, n: int) -> list[float]:
        if not isinstance(v, list) or len(v) != n:
            self.fail(section, key, f"expected a list of {n} numbers, got {v!r}")
        return [self.check(section, key, x, False) for x in v]

    def link_ends(self, section: str, name: str, devices: list[str]) -> tuple[str, str]:
        for i, ch in enumerate(name):
            if ch == "-" and name[:i] in devices and name[i + 1:] in devices and name[:i] != name[i + 1:]:
                return name[:i], name[i + 1:]
        raise JitllmError(f"{self.path}: [{section}]: name a link DEVICE-DEVICE with two different known "
                          f"devices (known: {', '.join(devices)})")

    def model(self, t: dict) -> ModelShape:
        self.keys("model", t, {"layers", "layer_gb", "layers_gb", "kv_gb", "activation_kb"})
        if ("layer_gb" in t) == ("layers_gb" in t):
            self.fail("model", "layer_gb", "give exactly one of layer_gb and layers_gb")
        if "layers" in t:
            n = t["layers"]
            if not is_whole(n) or n < 1:
                self.fail("model", "layers", f"expected a positive whole number, got {n!r}")
        elif "layers_gb" in t and isinstance(t["layers_gb"], list):
            n = len(t["layers_gb"])
        else:
            self.fail("model", "layers", "missing")
        if "layer_gb" in t:
            layers = [self.number("model", t, "layer_gb", positive=True)] * n
        else:
            layers = self.numbers("model", "layers_gb", t["layers_gb"], n)
        kv = t.get("kv_gb", 0)
        kv = self.numbers("model", "kv_gb", kv, n) if isinstance(kv, list) else \
            [self.check("model", "kv_gb", kv, False) / n] * n
        return ModelShape(n, [round(x * GB) for x in layers], [round(x * GB) for x in kv],
                          round(self.number("model", t, "activation_kb", 0) * 1e3))
