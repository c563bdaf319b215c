"""GLSL -> SPIR-V with the `glslc` binary (Debian's libshaderc cannot be loaded in-process), cached on disk
as <cache>/vulkan/<digest(glslc version, target env, source)>.spv."""
from __future__ import annotations

import functools
import shutil
import subprocess

from jitllm_core.cache import cache_dir, digest, write_atomic

from .glsl import LoweringError

TARGET_ENV = "vulkan1.1"  # subgroup operations are core in 1.1


@functools.cache
def glslc_version() -> str:
    """First line of `glslc --version`; raises FileNotFoundError when glslc is not installed."""
    exe = shutil.which("glslc")
    if exe is None:
        raise FileNotFoundError("glslc not found on PATH (it compiles the generated GLSL to SPIR-V; "
                                "install the 'glslc' package)")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def spirv(source: str) -> bytes:
    path = cache_dir("vulkan") / f"{digest(glslc_version(), TARGET_ENV, source)}.spv"
    if path.exists():
        return path.read_bytes()
    r = subprocess.run(["glslc", "-fshader-stage=compute", f"--target-env={TARGET_ENV}", "-O", "-", "-o", "-"],
                       input=source.encode(), capture_output=True)
    if r.returncode != 0:
        numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))
        raise LoweringError(f"glslc failed:\n{r.stderr.decode()}\n{numbered}")
    write_atomic(path, r.stdout)
    return r.stdout
