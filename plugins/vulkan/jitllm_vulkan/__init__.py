"""jitllm backend plugin "vulkan": lowers the kernel IR to GLSL compute shaders (SPIR-V via glslc) and runs
whole-step programs as pre-recorded Vulkan command buffers. Contains no per-op kernels."""
from jitllm_core.plugin import hookimpl

from .runtime import VulkanBackend, VulkanBuffer, VulkanDevice, VulkanProgram
from .transfer import VulkanHostStaged, VulkanMapped

__all__ = ["VulkanBackend", "VulkanDevice", "VulkanBuffer", "VulkanProgram", "VulkanMapped", "VulkanHostStaged",
           "jitllm_backends", "jitllm_transfer_paths"]


@hookimpl
def jitllm_backends():
    return [VulkanBackend()]


@hookimpl
def jitllm_transfer_paths():
    return [VulkanMapped(), VulkanHostStaged()]
