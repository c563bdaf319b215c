"""Fault injection for tests: named faults that the engine checks at the points where real failures happen."""
from __future__ import annotations

import threading

from .errors import BackendError

_active = {}
_lock = threading.Lock()


def inject(point, target="*", after_bytes=0):
    """Make `point` ('compile' | 'transfer') fail for device `target` (after `after_bytes` for transfers)."""
    with _lock:
        _active[point] = {"target": target, "left": after_bytes}


def clear():
    with _lock:
        _active.clear()


def check(point, device_name, nbytes=0):
    with _lock:
        f = _active.get(point)
        if not f or f["target"] not in ("*", device_name):
            return
        f["left"] -= nbytes
        if f["left"] < 0 or (nbytes == 0 and f["left"] == 0):  # a compile "passes no bytes": fires at 0
            raise BackendError(f"injected {point} fault on {device_name}")
