"""The CUDA backend's runtime without a GPU: libcuda.c here stands in for the driver (build it, start a process
with it on LD_LIBRARY_PATH, call install()); kernel sources then run in the host emulation."""
import ctypes
import subprocess
from pathlib import Path

import cuda_host_emu as emu

_LAUNCH = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint, ctypes.c_int,
                           ctypes.POINTER(ctypes.c_uint64))


def build(dest: Path) -> Path:
    """Compile the stand-in driver into dest/libcuda.so.1; returns dest (the folder for LD_LIBRARY_PATH)."""
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", str(Path(__file__).with_name("libcuda.c")),
                    "-o", str(dest / "libcuda.so.1"), "-ldl"], check=True, capture_output=True, text=True)
    return dest


@_LAUNCH
def _on_launch(src, name, blocks, nargs, args):
    emu.launch(emu.library(src.decode()), name.decode(), blocks, [args[i] for i in range(nargs)])


def install():
    """In a process whose libcuda is the stand-in: 'cubins' become the kernel sources, launches run emulated."""
    from jitllm_cuda import compiler
    compiler.compile_cubin = lambda source, arch, name="kernel": (source.encode(), False)
    ctypes.CDLL("libcuda.so.1").fake_set_launch(_on_launch)
