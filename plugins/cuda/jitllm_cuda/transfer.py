"""Transfer paths with a CUDA end. Devices are told apart by `backend` so that registering these paths never
imports the driver bindings."""
from __future__ import annotations

import numpy as np

from jitllm_core.plugin import TransferPath


def _cuda(dev):
    return getattr(dev, "backend", None) == "cuda"


class CudaPeer(TransferPath):
    """cuda:i -> cuda:j directly (cuMemcpyPeerAsync), where the two GPUs can reach each other."""
    mechanism = "peer"
    priority = 10

    def supports(self, src, dst):
        return _cuda(src) and _cuda(dst) and src is not dst and src.can_access_peer(dst)

    def copy(self, src, src_off, dst, dst_off, nbytes):
        from cuda.bindings import driver as cu

        from .device import call
        s, d = src.device, dst.device
        s.enable_peer(d)
        d.enable_peer(s)
        d.use()
        call(cu.cuMemcpyPeerAsync, dst.ptr + dst_off, d.ctx, src.ptr + src_off, s.ctx, nbytes, d.stream)
        call(cu.cuStreamSynchronize, d.stream)

    def cost_s(self, nbytes):
        return 10e-6 + nbytes / 25e9


class CudaStaged(TransferPath):
    """cuda <-> any other device (cpu, vulkan, a GPU without peer access) through the CUDA side's two pinned chunks:
    the other device's own upload/download of one chunk overlaps the DMA of the next."""
    mechanism = "host-staged"
    priority = 50

    def supports(self, src, dst):
        return src is not dst and (_cuda(src) or _cuda(dst))

    def copy(self, src, src_off, dst, dst_off, nbytes):
        if _cuda(src.device):
            src.device.from_device(src.ptr + src_off, nbytes,
                                   lambda o, chunk: dst.device.upload(dst, chunk, dst_off + o))
        else:
            dst.device.to_device(dst.ptr + dst_off, nbytes,
                                 lambda o, chunk: np.copyto(chunk, _read(src, src_off + o, chunk.size)))

    def cost_s(self, nbytes):
        return 20e-6 + nbytes / 10e9


def _read(buf, offset, n):
    view = buf.host_view()
    if view is not None:
        return view[offset:offset + n]
    return buf.device.download(buf, n, offset)
