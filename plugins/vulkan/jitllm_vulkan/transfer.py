"""Transfer paths between a Vulkan device and the CPU, and between two Vulkan devices."""
from __future__ import annotations

from jitllm_core.plugin import HostStaged, TransferPath

from .runtime import STAGING_BYTES


def _vulkan(d) -> bool:
    return d.backend == "vulkan"


def _copy(src, src_off, dst, dst_off, nbytes):
    """Bytes move through a host view (a mapping, or a CPU buffer) when one side has it; otherwise in chunks
    through host memory (the core's HostStaged copy). VulkanDevice.read/write map or stage as the buffer allows."""
    if _vulkan(src.device) and not _vulkan(dst.device) and dst.host_view() is not None:
        src.device.read(src, src_off, dst.host_view()[dst_off:dst_off + nbytes])
        return
    view = src.host_view()
    if view is not None and _vulkan(dst.device):
        dst.device.write(dst, dst_off, view[src_off:src_off + nbytes])
        return
    HostStaged().copy(src, src_off, dst, dst_off, nbytes)


class VulkanMapped(TransferPath):
    """vulkan <-> cpu where the Vulkan memory is host-visible: one memcpy through the mapping."""
    mechanism = "mapped"
    priority = 10

    def supports(self, src, dst):
        return any(_vulkan(a) and a.caps.host_visible and b.backend == "cpu" for a, b in ((src, dst), (dst, src)))

    def copy(self, src, src_off, dst, dst_off, nbytes):
        _copy(src, src_off, dst, dst_off, nbytes)

    def cost_s(self, nbytes):
        return 2e-6 + nbytes / 8e9


class VulkanHostStaged(TransferPath):
    """vulkan <-> cpu without host-visible memory (through the device's staging buffer, in chunks), and
    vulkan:i <-> vulkan:j (through host memory)."""
    mechanism = "host-staged"
    priority = 50

    def supports(self, src, dst):
        if _vulkan(src) and _vulkan(dst):
            return src is not dst
        return any(_vulkan(a) and not a.caps.host_visible and b.backend == "cpu" for a, b in ((src, dst), (dst, src)))

    def copy(self, src, src_off, dst, dst_off, nbytes):
        _copy(src, src_off, dst, dst_off, nbytes)

    def cost_s(self, nbytes):
        return 50e-6 * (1 + nbytes // STAGING_BYTES) + nbytes / 4e9
