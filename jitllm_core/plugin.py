"""The backend plugin contract: what a plugin registers, and the base classes it fills in.

A plugin is a module (or object) registered in the entry-point group ``jitllm.backends``. It implements pluggy
hooks (project name ``jitllm``):

    @hookimpl
    def jitllm_backends():        -> list[Backend]
    @hookimpl
    def jitllm_transfer_paths():  -> list[TransferPath]     (optional)

A Backend's ``probe()`` returns its Devices or raises ``BackendUnavailable(reason)``. A Device allocates
Buffers, copies bytes in and out, and turns a list of kernel launches (kernel IR + bound buffers) into a
Program that runs them all, in order, as one unit per step. That is the whole contract: op semantics live in
the core's IR, never in a plugin.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pluggy

from . import ir
from .errors import BackendError

hookspec = pluggy.HookspecMarker("jitllm")
hookimpl = pluggy.HookimplMarker("jitllm")


class BackendUnavailable(BackendError):
    """Raised by Backend.probe() with the reason the backend has no usable device here."""


class Specs:
    @hookspec
    def jitllm_backends(self):
        """Return a list of Backend objects."""

    @hookspec
    def jitllm_transfer_paths(self):
        """Return a list of TransferPath objects."""


class Backend:
    name = "?"
    threads = 1   # Caps.threads of the devices it targets, for ahead-of-time compilation (no device at hand)

    def probe(self) -> list["Device"]:
        raise NotImplementedError


class Buffer:
    """Device memory. ``host_view()`` returns a writable uint8 NumPy view when the memory is host-visible."""

    def __init__(self, device, nbytes):
        self.device, self.nbytes = device, nbytes

    def host_view(self):
        return None


@dataclass
class Launch:
    """One kernel call in a program: its IR, buffer bindings (param -> Buffer) and scalar bindings
    (param -> name of a per-step value, default the param's own name)."""
    kernel: ir.Kernel
    buffers: dict
    scalars: dict = field(default_factory=dict)

    def scalar_name(self, param):
        return self.scalars.get(param, param)

    def buffer(self, param, device):
        """The Buffer bound to kernel parameter `param`, checked to be on `device` and large enough."""
        p, buf = self.kernel.buffers[param], self.buffers.get(param)
        need = p.size * ir.STORAGE_DTYPES[p.dtype]
        if buf is None or buf.device is not device or buf.nbytes < need:
            got = "nothing" if buf is None else f"{buf.nbytes} bytes on {buf.device.name}"
            raise BackendError(f"kernel {self.kernel.name}: buffer {param!r} needs {need} bytes on {device.name}, "
                               f"bound to {got}")
        return buf


class Program:
    """Compiled launches for one device. ``run(values)`` executes them all in order; values maps scalar
    names to ints. Returns when the results are visible to ``download``."""

    def run(self, values: dict):
        raise NotImplementedError

    def ready(self):
        """Wait until the program can run, raising its compile error if it has one (a device may compile in the
        background, so that the engine lowers the next program meanwhile). Default: ready when made."""


@dataclass
class Caps:
    memory_bytes: int
    bandwidth_Bps: float = 0.0     # measured or estimated device-memory read bandwidth
    subgroup_size: int = 1
    fp16: bool = False
    int8: bool = False
    host_visible: bool = False     # device memory can be mapped by the host
    max_buffer_bytes: int = 1 << 62
    threads: int = 1               # parallel iterations it runs at once: CPU worker threads, a GPU's resident threads
    registers: int = 0             # f32 values one thread holds in vector registers (0: not said): register tiles' size
    extra: dict = field(default_factory=dict)

    @property
    def tile_dots(self) -> bool:
        """Whether the device runs TileDot as matrix instructions (extra["tile_dots"]), so that its prefill steps take
        integer tile matmuls (`Llama._tile_matmul`) and it holds their buffers."""
        return bool(self.extra.get("tile_dots"))


class Device:
    """A place where units run. Subclasses implement the methods below."""
    name = "?"         # "cpu", "cpu:1", "vulkan:0", "cuda:0"
    backend = "?"
    caps: Caps

    def alloc(self, nbytes: int) -> Buffer:
        raise NotImplementedError

    def free(self, buf: Buffer):
        raise NotImplementedError

    def upload(self, buf: Buffer, data: np.ndarray, offset: int = 0):
        """Copy the bytes of `data` into buf at byte offset."""
        raise NotImplementedError

    def download(self, buf: Buffer, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """Return a uint8 copy of nbytes at byte offset."""
        raise NotImplementedError

    def program(self, launches: list[Launch]) -> Program:
        """Compile (cached) and bind launches into a runnable whole-step program."""
        raise NotImplementedError

    def timed_program(self, launches: list[Launch]) -> Program | None:
        """Optional (profiles): a program whose run(values) returns each launch's seconds, the launches run in order
        as in a step, each followed by a barrier. None: the profile times each launch in a program of its own."""
        return None

    def synchronize(self):
        pass

    def describe(self) -> str:
        return self.name

    # Optional: lowering options whose best value depends on the machine more than on the kernel (how far ahead
    # a CPU prefetches streamed weights, say). option -> candidate values (JSON-able), the first the default;
    # the core measures them on each kernel tag (ir.Kernel.tune_as) and calls `tune` with the fastest.
    tunables: dict = {}
    tuned: dict = {}  # tag -> the options `tune` gave it (reports show them)
    cache_bytes = 0  # its largest cache, where known: the tuner's copies of a streamed buffer exceed it
    lowering = ""  # the version of the code that lowers kernels: measurements recorded under another are redone

    def tune(self, tag: str, options: dict):
        """Kernels tagged `tag` compile with these options (option -> value) from now on."""
        raise NotImplementedError


class TransferPath:
    """Copies bytes between buffers of two devices. mechanism: 'peer' | 'mapped' | 'host-staged'."""
    mechanism = "host-staged"
    priority = 0        # lower is cheaper; the registry tries cheaper paths first

    def supports(self, src: Device, dst: Device) -> bool:
        raise NotImplementedError

    def copy(self, src: Buffer, src_off: int, dst: Buffer, dst_off: int, nbytes: int):
        raise NotImplementedError

    def cost_s(self, nbytes: int) -> float:
        return nbytes / 10e9


class HostStaged(TransferPath):
    """The core's generic path: download to host memory, upload to the target, in chunks."""
    mechanism = "host-staged"
    priority = 100
    chunk = 16 << 20

    def supports(self, src, dst):
        return True

    def copy(self, src, src_off, dst, dst_off, nbytes):
        for o in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - o)
            dst.device.upload(dst, src.device.download(src, n, src_off + o), dst_off + o)


def plugin_manager():
    pm = pluggy.PluginManager("jitllm")
    pm.add_hookspecs(Specs)
    return pm
