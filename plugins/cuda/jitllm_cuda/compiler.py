"""CUDA C -> cubin with NVRTC in-process (no GPU needed), cached on disk by (source, arch, toolchain, options)."""
from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path

from jitllm_core.cache import cache_dir, digest, write_atomic
from jitllm_core.errors import BackendError

# No FMA contraction: a*b+c stays two IEEE operations, as in the IR and the interpreter.
OPTIONS = ("--fmad=false", "--std=c++17")


@functools.cache
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise BackendError(f"cuda: NVRTC is not importable ({e}); install cuda-bindings and nvidia-cuda-nvrtc==13.0.*")
    return nvrtc


def _ok(result, what):
    err, *vals = result
    if err != _nvrtc().nvrtcResult.NVRTC_SUCCESS:
        raise BackendError(f"cuda: {what} failed: {err.name}")
    return vals[0] if len(vals) == 1 else vals


def _pkg_version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@functools.cache
def toolchain() -> str:
    """NVRTC and header versions: part of every cache key."""
    major, minor = _ok(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return (f"nvrtc {major}.{minor} ({_pkg_version('nvidia-cuda-nvrtc')}), "
            f"headers {_pkg_version('nvidia-cuda-runtime')}")


@functools.cache
def supported_archs() -> tuple:
    return tuple(_ok(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def check_arch(arch: str) -> str:
    """'sm_90' -> 'sm_90', or a BackendError naming what this NVRTC can target."""
    m = re.fullmatch(r"sm_(\d+)[af]?", arch or "")
    if not m or int(m[1]) not in supported_archs():
        known = ", ".join(f"sm_{a}" for a in supported_archs())
        raise BackendError(f"cuda: unknown GPU architecture {arch!r}; this NVRTC ({toolchain()}) targets: {known}")
    return arch


def device_arch(major: int, minor: int) -> str:
    """The arch to build for a device of compute capability major.minor: its own, else the newest one of the same
    major below it (cubins run on later minors of their major)."""
    same = [a for a in supported_archs() if a // 10 == major and a % 10 <= minor]
    if not same:
        raise BackendError(f"cuda: this NVRTC ({toolchain()}) cannot build for compute capability {major}.{minor}")
    return f"sm_{max(same)}"


@functools.cache
def include_dir() -> str:
    """The nvidia-cuda-runtime wheel's include folder (cuda_fp16.h lives there)."""
    try:
        files = importlib.metadata.files("nvidia-cuda-runtime") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "cuda_fp16.h":
            return str(Path(f.locate()).parent)
    raise BackendError("cuda: cuda_fp16.h not found; install nvidia-cuda-runtime==13.0.*")


def cache_key(source: str, arch: str) -> str:
    return digest(source, arch, toolchain(), *OPTIONS)


def compile_cubin(source: str, arch: str, name: str = "kernel") -> tuple[bytes, bool]:
    """Return (cubin, came_from_cache)."""
    path = cache_dir("cuda") / f"{cache_key(source, check_arch(arch))}.cubin"
    if path.exists():
        return path.read_bytes(), True
    cubin = _nvrtc_compile(source, arch, name)
    write_atomic(path, cubin)
    return cubin, False


def _nvrtc_compile(source, arch, name):
    nv = _nvrtc()
    prog = _ok(nv.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), f"-I{include_dir()}".encode(), *(o.encode() for o in OPTIONS)]
        (err,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nv.nvrtcResult.NVRTC_SUCCESS:
            size = _ok(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _ok(nv.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise BackendError(f"cuda: NVRTC could not compile {name} for {arch}:\n{log.decode(errors='replace')}")
        size = _ok(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _ok(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nv.nvrtcDestroyProgram(prog)
