"""cpu:i <-> cpu:j: both arenas live in one address space, so a move is one memcpy."""
import ctypes

from jitllm_core.plugin import TransferPath


class CpuPeer(TransferPath):
    mechanism = "peer"
    priority = 0

    def supports(self, src, dst):
        return src.backend == "cpu" and dst.backend == "cpu"

    def copy(self, src, src_off, dst, dst_off, nbytes):
        ctypes.memmove(dst.addr + dst_off, src.addr + src_off, nbytes)

    def cost_s(self, nbytes):
        return nbytes / 20e9
