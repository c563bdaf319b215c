"""jitllm backend plugin for the host CPU: lowers the kernel IR to LLVM with llvmlite."""
from jitllm_core.plugin import Backend, hookimpl


class CpuBackend(Backend):
    name = "cpu"

    def probe(self):
        from .runtime import make_devices
        return make_devices()


@hookimpl
def jitllm_backends():
    return [CpuBackend()]


@hookimpl
def jitllm_transfer_paths():
    from .transfer import CpuPeer
    return [CpuPeer()]
