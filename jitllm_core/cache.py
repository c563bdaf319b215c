"""Where compiled artifacts and measurements live on disk (JITLLM_CACHE_DIR, default ~/.cache/jitllm)."""
import hashlib
import json
import os
import time
from pathlib import Path


def cache_dir(*sub) -> Path:
    root = Path(os.environ.get("JITLLM_CACHE_DIR") or Path.home() / ".cache" / "jitllm")
    d = root.joinpath(*sub)
    d.mkdir(parents=True, exist_ok=True)
    return d


def digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def write_atomic(path: Path, data: bytes):
    """Write via a temporary file so a concurrent reader never sees half an artifact."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def recorded(key):
    """The value measured on this machine under `key` (what it depends on), or None."""
    path = cache_dir("measure") / f"{digest(key)}.json"
    return json.loads(path.read_text()) if path.exists() else None


def record(key, value):
    write_atomic(cache_dir("measure") / f"{digest(key)}.json", json.dumps(value).encode())


def measured(key, fn):
    """fn()'s value (JSON), measured once per machine: recorded under `key`."""
    value = recorded(key)
    if value is None:
        value = fn()
        record(key, value)
    return value


def seconds(fn):
    """Wall seconds of one call of fn."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
