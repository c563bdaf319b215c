"""Finds backend plugins (entry-point group `jitllm.backends`), probes their devices, and picks transfer paths.

A plugin that fails to import or probe is recorded with its reason and skipped. JITLLM_PLUGINS=a,b restricts
which entry points load.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import threading
import traceback
from dataclasses import dataclass

from .errors import BackendError, JitllmError
from .plugin import BackendUnavailable, HostStaged, plugin_manager

_lock = threading.RLock()
_state = None
_probed = {}  # backend -> its status (`_probe`)


@dataclass
class DeviceInfo:
    name: str
    backend: str
    memory_bytes: int
    status: str
    detail: str


def _load():
    """(the plugins that failed to import, as statuses; the backends; the transfer paths): nothing probed yet."""
    pm = plugin_manager()
    wanted = {p.strip() for p in os.environ.get("JITLLM_PLUGINS", "").split(",") if p.strip()}
    failed, paths = [], []
    for ep in sorted(importlib.metadata.entry_points(group="jitllm.backends"), key=lambda e: e.name):
        if wanted and ep.name not in wanted:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as e:  # a broken plugin must not take the engine down
            failed.append(dict(name=ep.name, status="failed", reason=f"import failed: {e!r}", devices=[], backend=None))
            continue
    backends = [be for bes in pm.hook.jitllm_backends() for be in bes]
    for ps in pm.hook.jitllm_transfer_paths():
        paths.extend(ps)
    paths.append(HostStaged())
    return failed, backends, sorted(paths, key=lambda p: p.priority)


def _probe(be):
    """Backend be's status, its devices found when it is first asked for (an engine on named devices probes only
    their backends: a Vulkan instance made and a CUDA driver looked for took 0.22 s of a CPU engine's start)."""
    with _lock:
        if be not in _probed:
            try:
                _probed[be] = dict(name=be.name, status="ok", reason="", devices=be.probe(), backend=be)
            except BackendUnavailable as e:
                _probed[be] = dict(name=be.name, status="unavailable", reason=str(e), devices=[], backend=be)
            except Exception as e:
                reason = f"probe failed: {e!r} ({traceback.format_exc(limit=1).strip().splitlines()[-1]})"
                _probed[be] = dict(name=be.name, status="failed", reason=reason, devices=[], backend=be)
        return _probed[be]


def _get():
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def backend_status():
    failed, backends, _ = _get()
    return failed + [_probe(be) for be in backends]


def all_devices() -> dict:
    return {d.name: d for st in backend_status() for d in st["devices"]}


def devices():
    out = []
    for st in backend_status():
        for d in st["devices"]:
            out.append(DeviceInfo(d.name, st["name"], d.caps.memory_bytes, "ok", d.describe()))
        if not st["devices"]:
            out.append(DeviceInfo(f"{st['name']}:-", st["name"], 0, st["status"], st["reason"]))
    return out


def lookup(name, names):
    """The key of `names` that `name` means, or None: "cpu" and "cpu:0" name each other, so the same
    placement works whether or not the CPU is split (JITLLM_CPU_DEVICES)."""
    if name in names:
        return name
    alias = {"cpu": "cpu:0", "cpu:0": "cpu"}.get(name)
    return alias if alias in names else None


def device(name):
    # the backend the name is of ("cpu", "cpu:1", "vulkan:0") probed alone first; every backend only if it has none
    own = {d.name: d for be in _get()[1] if be.name == name.split(":")[0] for d in _probe(be)["devices"]}
    devs = own if lookup(name, own) is not None else all_devices()
    found = lookup(name, devs)
    if found is not None:
        return devs[found]
    if not devs:
        raise JitllmError("no backend is installed or none found a device; install one, e.g. "
                          "`pip install jitllm-cpu-llvm` (from the repository: `pip install ./plugins/cpu_llvm`); "
                          "`jitllm devices` shows what was found")
    why = "; ".join(f"{s['name']}: {s['reason']}" for s in backend_status() if s["status"] != "ok")
    raise JitllmError(f"no device named {name!r} (available: {', '.join(devs)}){'; ' + why if why else ''}")


@functools.lru_cache(maxsize=None)
def transfer_paths(src, dst):
    """Paths that can copy src -> dst, cheapest first."""
    return [p for p in _get()[2] if p.supports(src, dst)]


def copy(src_buf, src_off, dst_buf, dst_off, nbytes, paths=None):
    """Copy through the cheapest path, falling down the chain when one fails; returns the mechanism used."""
    errors = []
    for p in paths or transfer_paths(src_buf.device, dst_buf.device):
        try:
            p.copy(src_buf, src_off, dst_buf, dst_off, nbytes)
            return p.mechanism
        except Exception as e:
            errors.append(f"{p.mechanism}: {e}")
    raise BackendError(f"copy {src_buf.device.name} -> {dst_buf.device.name} failed: {'; '.join(errors)}")
