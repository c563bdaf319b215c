"""jitllm backend plugin for NVIDIA GPUs: lowers the kernel IR to CUDA C, compiles it with NVRTC and runs each step's
launches as one CUDA graph. Nothing here loads the CUDA driver until the backend probes."""
from jitllm_core.plugin import hookimpl

from .backend import CudaBackend

__all__ = ["CudaBackend"]


@hookimpl
def jitllm_backends():
    return [CudaBackend()]


@hookimpl
def jitllm_transfer_paths():
    from .transfer import CudaPeer, CudaStaged
    return [CudaPeer(), CudaStaged()]
