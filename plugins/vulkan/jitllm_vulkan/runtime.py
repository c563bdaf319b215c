"""The Vulkan runtime, on the PyPI `vulkan` (cffi) bindings: devices, buffers and whole-step programs.

A Program is ONE command buffer recorded at build time for all its launches. Per-step values (scalars, and
the workgroup counts of dispatches whose size depends on them) live in a small host-visible control buffer
that run() fills before each submit; dispatches read their counts from it with vkCmdDispatchIndirect.
Every submit is waited on with a fence, so uploads, downloads and runs are ordered on the host.

Env switches (read when the device is set up) force the fallbacks, for tests and for drivers that lie:
JITLLM_VULKAN_NO_SMALL_STORAGE=1 (8/16-bit values in 32-bit words), JITLLM_VULKAN_NO_SUBGROUP=1 (shared-
memory tree reductions), JITLLM_VULKAN_MAX_RANGE=<bytes> (split buffers over smaller descriptors),
JITLLM_VULKAN_NO_HOST_VISIBLE=1 (staging-buffer copies instead of mapped memory).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from jitllm_core.cache import cache_dir, digest, write_atomic
from jitllm_core.errors import BackendError
from jitllm_core.ir import STORAGE_DTYPES
from jitllm_core.plugin import Backend, BackendUnavailable, Buffer, Caps, Device, Program

from .compile import glslc_version, spirv
from .glsl import Target, lower

vk = None  # the `vulkan` module, imported by probe(): importing it without libvulkan raises OSError
STAGING_BYTES = 16 << 20


def _flag(name) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _barrier(cmd, src_stage, dst_stage, src_access, dst_access):
    mb = vk.VkMemoryBarrier(srcAccessMask=src_access, dstAccessMask=dst_access)
    vk.vkCmdPipelineBarrier(cmd, src_stage, dst_stage, 0, 1, [mb], 0, None, 0, None)


def _full_barrier(cmd):
    """Everything written before (transfers, shaders, host) is visible to everything after."""
    _barrier(cmd, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
             vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
             vk.VK_ACCESS_MEMORY_WRITE_BIT, vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT)


# ----------------------------------------------------------------------------------------------- backend
class VulkanBackend(Backend):
    name = "vulkan"
    api = 0           # instance API version
    _instance = None
    _devices = None

    def probe(self) -> list["VulkanDevice"]:
        global vk
        if VulkanBackend._devices is not None:
            return VulkanBackend._devices
        try:
            import vulkan
        except OSError as e:  # the cffi module dlopens libvulkan at import
            raise BackendUnavailable(f"Vulkan loader (libvulkan.so.1) not found: {e}") from None
        except ImportError as e:
            raise BackendUnavailable(f"the 'vulkan' Python package is not installed: {e}") from None
        vk = vulkan
        try:
            glslc_version()
        except (OSError, FileNotFoundError) as e:
            raise BackendUnavailable(str(e)) from None
        try:
            # a device's usable version is min(this, its own): ask for what the loader has (8-bit storage is
            # core from 1.2 on), up to 1.3
            VulkanBackend.api = min(vk.vkEnumerateInstanceVersion(), vk.VK_MAKE_VERSION(1, 3, 0))
            app = vk.VkApplicationInfo(pApplicationName="jitllm", applicationVersion=1, pEngineName="jitllm",
                                       engineVersion=1, apiVersion=VulkanBackend.api)
            VulkanBackend._instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
        except vk.VkErrorIncompatibleDriver:
            raise BackendUnavailable("no Vulkan driver (ICD) found by the loader (vkCreateInstance: "
                                     "VK_ERROR_INCOMPATIBLE_DRIVER); check VK_ICD_FILENAMES / the installed ICDs"
                                     ) from None
        except (vk.VkError, vk.VkException) as e:
            raise BackendUnavailable(f"vkCreateInstance failed: {type(e).__name__}") from None
        devices, skipped = [], []
        for i, pd in enumerate(vk.vkEnumeratePhysicalDevices(VulkanBackend._instance)):
            try:
                devices.append(VulkanDevice(i, pd))
            except BackendUnavailable as e:
                skipped.append(f"vulkan:{i}: {e}")
        if not devices:
            raise BackendUnavailable("; ".join(skipped) or "the Vulkan driver reports no physical device")
        VulkanBackend._devices = devices
        return devices


# ----------------------------------------------------------------------------------------------- buffers
class VulkanBuffer(Buffer):
    def __init__(self, device, nbytes, handle, memory, size, view):
        super().__init__(device, nbytes)
        self.handle, self.memory, self.size, self._view = handle, memory, size, view

    def host_view(self):
        """Writable uint8 view of the mapped memory (host-visible devices), else None."""
        return None if self._view is None else self._view[:self.nbytes]


# ----------------------------------------------------------------------------------------------- device
class VulkanDevice(Device):
    backend = "vulkan"

    def __init__(self, index: int, pd):
        self.name, self.pd = f"vulkan:{index}", pd
        props = vk.vkGetPhysicalDeviceProperties(pd)
        self.props, lim = props, props.limits
        version = min(props.apiVersion, VulkanBackend.api)
        api = (vk.VK_VERSION_MAJOR(version), vk.VK_VERSION_MINOR(version))
        if api < (1, 1):
            raise BackendUnavailable(f"{props.deviceName} supports Vulkan {api[0]}.{api[1]}; 1.1 is needed")
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)
        compute = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise BackendUnavailable(f"{props.deviceName} has no compute queue")
        self.queue_family = compute[0]
        # ns per timestamp tick where the compute queue has timestamps (timed programs), else 0
        self.timestamp_ns = lim.timestampPeriod if families[self.queue_family].timestampValidBits else 0.0

        sg = vk.VkPhysicalDeviceSubgroupProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
        m3 = vk.VkPhysicalDeviceMaintenance3Properties(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, pNext=sg)
        vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=m3))
        f16 = vk.VkPhysicalDevice16BitStorageFeatures(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES)
        f8 = vk.VkPhysicalDevice8BitStorageFeatures(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES,
                                                    pNext=f16)
        vk.vkGetPhysicalDeviceFeatures2(pd, vk.VkPhysicalDeviceFeatures2(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f8))
        exts = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None)}
        small = not _flag("JITLLM_VULKAN_NO_SMALL_STORAGE")
        self.storage16 = small and bool(f16.storageBuffer16BitAccess)  # core in 1.1
        self.storage8 = small and bool(f8.storageBuffer8BitAccess) and (api >= (1, 2) or "VK_KHR_8bit_storage" in exts)
        self.extensions = [e for e in ("VK_KHR_8bit_storage",) if self.storage8 and api < (1, 2)]
        subgroup_ops = (not _flag("JITLLM_VULKAN_NO_SUBGROUP")
                        and bool(sg.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT)
                        and bool(sg.supportedOperations & vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT))

        mp = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        types = [(mp.memoryTypes[i].propertyFlags, mp.memoryTypes[i].heapIndex) for i in range(mp.memoryTypeCount)]
        heaps = [mp.memoryHeaps[i].size for i in range(mp.memoryHeapCount)]
        coherent = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        local = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
        # device memory: the largest device-local heap (a small BAR window is not where weights go);
        # mapped when that heap's type is also host-visible (UMA, resizable BAR, lavapipe)
        big = max((heaps[h] for f, h in types if f & local), default=max(heaps))
        cands = [i for i, (f, h) in enumerate(types) if f & local and heaps[h] == big] or list(range(len(types)))
        mapped = [i for i in cands if types[i][0] & coherent == coherent and not _flag("JITLLM_VULKAN_NO_HOST_VISIBLE")]
        self.mem_types = mapped + [i for i in cands if i not in mapped]
        self.mappable = bool(mapped)
        host = [i for i, (f, h) in enumerate(types) if f & coherent == coherent]
        self.host_types = sorted(host, key=lambda i: not types[i][0] & local)  # control + staging buffers

        max_range = lim.maxStorageBufferRange
        if os.environ.get("JITLLM_VULKAN_MAX_RANGE"):  # chunks must stay aligned for descriptor offsets
            forced = int(os.environ["JITLLM_VULKAN_MAX_RANGE"])
            max_range = min(max_range, max(forced, lim.minStorageBufferOffsetAlignment, 16))
        lanes = min(256, lim.maxComputeWorkGroupInvocations, lim.maxComputeWorkGroupSize[0])
        self.max_groups = lim.maxComputeWorkGroupCount[0]
        # lavapipe & co run a workgroup as SIMD-width coroutines that switch at every barrier: there, a
        # workgroup-per-iteration loop gets one subgroup (its reductions need no shared memory at all)
        cpu = props.deviceType == vk.VK_PHYSICAL_DEVICE_TYPE_CPU
        self.target = Target(subgroup_size=sg.subgroupSize, subgroup_ops=subgroup_ops, storage16=self.storage16,
                             storage8=self.storage8, max_range=max_range, max_lanes=1 << (lanes.bit_length() - 1),
                             wg_lanes=sg.subgroupSize if cpu else 256,
                             max_descriptors=min(lim.maxPerStageDescriptorStorageBuffers,
                                                 lim.maxDescriptorSetStorageBuffers))
        kinds = {vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "cpu", vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "integrated-gpu",
                 vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete-gpu",
                 vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual-gpu"}
        self.caps = Caps(memory_bytes=int(big), subgroup_size=sg.subgroupSize, fp16=self.storage16,
                         int8=self.storage8, host_visible=self.mappable,
                         max_buffer_bytes=int(m3.maxMemoryAllocationSize),
                         # lavapipe runs workgroups on the CPU's threads; Vulkan does not say how many threads a
                         # GPU runs at once (thousands on any GPU)
                         threads=(os.cpu_count() or 1) if cpu else 1 << 14,
                         extra={"device_name": props.deviceName, "device_type": kinds.get(props.deviceType, "other"),
                                "api_version": f"{api[0]}.{api[1]}", "subgroup_ops": subgroup_ops,
                                "max_storage_buffer_range": max_range, "max_workgroup_size": lanes,
                                # ops.prefill_matmul gives wrong sums for some tokens here (lavapipe, any
                                # subgroup size, at the default model's shapes): a lowering bug not found yet
                                # (docs/backend-vulkan.md); prefill steps run the decode matmul for every token,
                                # as on a GPU
                                "prefill_matmul": False})
        self._dev = None
        self._lock = threading.RLock()
        self._pipelines, self._layouts, self._lowered = {}, {}, {}

    def describe(self) -> str:
        c = self.caps
        return (f"{self.name} {c.extra['device_name']} ({c.extra['device_type']}, Vulkan {c.extra['api_version']}, "
                f"{c.memory_bytes >> 20} MiB, subgroup {c.subgroup_size}, fp16 storage {c.fp16}, "
                f"int8 storage {c.int8}, "
                f"{'mapped' if c.host_visible else 'staged'} memory)")

    # -- logical device (created on first use: probing stays cheap)
    def _vk(self):
        if self._dev is not None:
            return self._dev
        with self._lock:
            if self._dev is not None:
                return self._dev
            f16 = vk.VkPhysicalDevice16BitStorageFeatures(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES,
                storageBuffer16BitAccess=self.storage16)
            f8 = vk.VkPhysicalDevice8BitStorageFeatures(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES, pNext=f16,
                storageBuffer8BitAccess=self.storage8)
            q = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.queue_family, queueCount=1, pQueuePriorities=[1.0])
            info = vk.VkDeviceCreateInfo(pNext=f8, queueCreateInfoCount=1, pQueueCreateInfos=[q],
                                         enabledExtensionCount=len(self.extensions),
                                         ppEnabledExtensionNames=self.extensions or None)
            dev = vk.vkCreateDevice(self.pd, info, None)
            self.queue = vk.vkGetDeviceQueue(dev, self.queue_family, 0)
            self.pool = vk.vkCreateCommandPool(dev, vk.VkCommandPoolCreateInfo(
                flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=self.queue_family), None)
            self.fence = vk.vkCreateFence(dev, vk.VkFenceCreateInfo(), None)
            self.xfer = vk.vkAllocateCommandBuffers(dev, vk.VkCommandBufferAllocateInfo(
                commandPool=self.pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
            p = self.props
            tag = digest(bytes(p.pipelineCacheUUID), p.vendorID, p.deviceID, p.driverVersion)
            self.cache_path = cache_dir("vulkan") / f"pipelines-{tag}.bin"
            data = self.cache_path.read_bytes() if self.cache_path.exists() else b""
            self.pcache = vk.vkCreatePipelineCache(dev, vk.VkPipelineCacheCreateInfo(
                initialDataSize=len(data), pInitialData=vk.ffi.from_buffer(data) if data else None), None)
            self._dev = dev
            self.staging = None if self.mappable else self._buffer(STAGING_BYTES, self.host_types, mapped=True)
            return dev

    def _buffer(self, nbytes, type_order, mapped, usage=0) -> VulkanBuffer:
        dev = self._vk()
        size = max(16, -(-nbytes // 16) * 16)  # shaders read whole words; descriptors want > 0 bytes
        if size > self.caps.max_buffer_bytes:
            raise BackendError(f"{self.name}: {nbytes} bytes exceeds the device's largest allocation "
                               f"({self.caps.max_buffer_bytes} bytes)")
        usage |= (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                  | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        handle = vk.vkCreateBuffer(dev, vk.VkBufferCreateInfo(size=size, usage=usage,
                                                              sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(dev, handle)
        order = [i for i in type_order if req.memoryTypeBits & (1 << i)]
        try:
            memory = vk.vkAllocateMemory(dev, vk.VkMemoryAllocateInfo(allocationSize=req.size,
                                                                      memoryTypeIndex=order[0]), None)
        except (IndexError, vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as e:
            vk.vkDestroyBuffer(dev, handle, None)
            raise BackendError(f"{self.name}: cannot allocate {nbytes} bytes ({type(e).__name__})") from None
        vk.vkBindBufferMemory(dev, handle, memory, 0)
        view = None
        if mapped:
            view = np.frombuffer(vk.vkMapMemory(dev, memory, 0, size, 0), np.uint8)
        return VulkanBuffer(self, nbytes, handle, memory, size, view)

    # -- Device contract
    def alloc(self, nbytes: int) -> VulkanBuffer:
        return self._buffer(nbytes, self.mem_types, self.mappable)

    def free(self, buf: VulkanBuffer):
        if buf.handle is None:
            return
        with self._lock:
            if buf._view is not None:
                buf._view = None
                vk.vkUnmapMemory(self._dev, buf.memory)
            vk.vkDestroyBuffer(self._dev, buf.handle, None)
            vk.vkFreeMemory(self._dev, buf.memory, None)
            buf.handle = buf.memory = None

    def upload(self, buf: VulkanBuffer, data: np.ndarray, offset: int = 0):
        self.write(buf, offset, np.ascontiguousarray(data).reshape(-1).view(np.uint8))

    def download(self, buf: VulkanBuffer, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        out = np.empty(buf.nbytes - offset if nbytes is None else nbytes, np.uint8)
        self.read(buf, offset, out)
        return out

    def synchronize(self):
        if self._dev is not None:
            with self._lock:
                vk.vkQueueWaitIdle(self.queue)

    def program(self, launches) -> "VulkanProgram":
        return VulkanProgram(self, launches)

    def timed_program(self, launches):
        return VulkanProgram(self, launches, timed=True) if self.timestamp_ns else None

    # -- byte copies: through the mapping, or chunked through the staging buffer
    def _check(self, buf, offset, n):
        if buf.device is not self or buf.handle is None:
            raise BackendError(f"{self.name}: buffer is freed or belongs to {buf.device.name}")
        if offset < 0 or offset + n > buf.nbytes:
            raise BackendError(f"{self.name}: bytes [{offset}, {offset + n}) outside a {buf.nbytes}-byte buffer")

    def write(self, buf: VulkanBuffer, offset: int, data: np.ndarray):
        """Copy uint8 `data` into buf at byte offset."""
        self._check(buf, offset, data.size)
        if buf._view is not None:
            buf._view[offset:offset + data.size] = data
            return
        with self._lock:
            for o in range(0, data.size, STAGING_BYTES):
                n = min(STAGING_BYTES, data.size - o)
                self.staging._view[:n] = data[o:o + n]
                self._copy(self.staging, 0, buf, offset + o, n)

    def read(self, buf: VulkanBuffer, offset: int, out: np.ndarray):
        """Copy out.size bytes of buf at byte offset into uint8 `out`."""
        self._check(buf, offset, out.size)
        if buf._view is not None:
            out[:] = buf._view[offset:offset + out.size]
            return
        with self._lock:
            for o in range(0, out.size, STAGING_BYTES):
                n = min(STAGING_BYTES, out.size - o)
                self._copy(buf, offset + o, self.staging, 0, n)
                out[o:o + n] = self.staging._view[:n]

    def _copy(self, src, src_off, dst, dst_off, n):
        cmd = self.xfer
        vk.vkResetCommandBuffer(cmd, 0)
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        _full_barrier(cmd)
        region = vk.VkBufferCopy(srcOffset=src_off, dstOffset=dst_off, size=n)
        vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [region])
        _full_barrier(cmd)
        vk.vkEndCommandBuffer(cmd)
        self.submit(cmd)

    def submit(self, cmd):
        with self._lock:
            vk.vkQueueSubmit(self.queue, 1, [vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[cmd])], self.fence)
            vk.vkWaitForFences(self._dev, 1, [self.fence], vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF)
            vk.vkResetFences(self._dev, 1, [self.fence])

    # -- compiled objects, cached per device
    def lowered(self, kernel):
        key = kernel.key()
        if key not in self._lowered:
            self._lowered[key] = lower(kernel, self.target)
        return self._lowered[key]

    def layouts(self, chunks: tuple):
        """(descriptor set layout, pipeline layout) for a kernel whose bindings hold `chunks` descriptors each
        (binding 0: the control buffer)."""
        if chunks not in self._layouts:
            dev = self._vk()
            binds = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                     descriptorCount=c, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                     for i, c in enumerate((1,) + chunks)]
            dsl = vk.vkCreateDescriptorSetLayout(dev, vk.VkDescriptorSetLayoutCreateInfo(
                bindingCount=len(binds), pBindings=binds), None)
            push = vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=4)
            pl = vk.vkCreatePipelineLayout(dev, vk.VkPipelineLayoutCreateInfo(
                setLayoutCount=1, pSetLayouts=[dsl], pushConstantRangeCount=1, pPushConstantRanges=[push]), None)
            self._layouts[chunks] = (dsl, pl)
        return self._layouts[chunks]

    def pipeline(self, source: str, layout):
        key = (source, layout)
        if key not in self._pipelines:
            dev, code = self._vk(), spirv(source)
            module = vk.vkCreateShaderModule(dev, vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code), None)
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module,
                                                       pName="main")
            info = vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)
            self._pipelines[key] = vk.vkCreateComputePipelines(dev, self.pcache, 1, [info], None)[0]
            vk.vkDestroyShaderModule(dev, module, None)
            self._pipelines_dirty = True
        return self._pipelines[key]

    def save_pipeline_cache(self):
        """Persist the driver's pipeline cache (next process skips the driver's shader compile)."""
        if not getattr(self, "_pipelines_dirty", False):
            return
        size = vk.ffi.new("size_t*")
        vk.lib.vkGetPipelineCacheData(self._dev, self.pcache, size, vk.ffi.NULL)
        data = vk.ffi.new("char[]", size[0])
        vk.lib.vkGetPipelineCacheData(self._dev, self.pcache, size, data)
        write_atomic(self.cache_path, bytes(vk.ffi.buffer(data, size[0])))
        self._pipelines_dirty = False


# ----------------------------------------------------------------------------------------------- programs
class VulkanProgram(Program):
    """All launches of one step, recorded once into one command buffer. timed: a timestamp query after each
    launch's closing barrier (run returns the launches' seconds)."""

    def __init__(self, device: VulkanDevice, launches, timed=False):
        self.device = d = device
        dev = d._vk()
        self.n_launches, self.queries = len(launches), None
        lows = [d.lowered(ln.kernel) for ln in launches]
        # control buffer: [indirect dispatch counts: 3 words each][per-launch slots: scalars, spills]
        n_indirect = sum(len(low.dispatches) for low in lows if low.deps)
        bases, at = [], 3 * n_indirect
        for low in lows:
            bases.append(at)
            at += low.slots
        self.ctl = d._buffer(4 * max(at, 1), d.host_types, mapped=True, usage=vk.VK_BUFFER_USAGE_INDIRECT_BUFFER_BIT)
        self.words = self.ctl._view.view(np.int32)
        self.words[:] = 0
        n_desc = sum(1 + sum(b.chunks for b in low.bindings) for low in lows)
        self.pool = vk.vkCreateDescriptorPool(dev, vk.VkDescriptorPoolCreateInfo(
            maxSets=max(1, len(launches)), poolSizeCount=1, pPoolSizes=[vk.VkDescriptorPoolSize(
                type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=max(1, n_desc))]), None)
        with d._lock:
            self.cmd = vk.vkAllocateCommandBuffers(dev, vk.VkCommandBufferAllocateInfo(
                commandPool=d.pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        # per step: every launch's scalars go to their slots in one store; dispatch sizes that depend on
        # them go to the indirect slots
        self.slot_idx = np.array([b + i for ln, b in zip(launches, bases) for i in range(len(ln.kernel.scalars))],
                                 np.int64)
        self.slot_names = [ln.scalar_name(p) for ln in launches for p in ln.kernel.scalars]
        self.sized = []  # (lowered, [(param, value name)] of its deps, first indirect slot)
        cmd, indirect = self.cmd, 0
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo())
        if timed:
            self.queries = vk.vkCreateQueryPool(dev, vk.VkQueryPoolCreateInfo(
                queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=len(launches) + 1), None)
            vk.vkCmdResetQueryPool(cmd, self.queries, 0, len(launches) + 1)
        _full_barrier(cmd)
        self._stamp(0)
        for i, (ln, low, base) in enumerate(zip(launches, lows, bases)):
            dsl, pl = d.layouts(tuple(b.chunks for b in low.bindings))
            dset = vk.vkAllocateDescriptorSets(dev, vk.VkDescriptorSetAllocateInfo(
                descriptorPool=self.pool, descriptorSetCount=1, pSetLayouts=[dsl]))[0]
            vk.vkUpdateDescriptorSets(dev, len(low.bindings) + 1, self._writes(ln, low, dset), 0, None)
            dynamic = bool(low.deps)
            if dynamic:
                self.sized.append((low, [(p, ln.scalar_name(p)) for p in low.deps], indirect))
            counts = None if dynamic else low.group_counts({}, d.max_groups)
            for j, disp in enumerate(low.dispatches):
                vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, d.pipeline(disp.source, pl))
                vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pl, 0, 1, [dset], 0, None)
                vk.vkCmdPushConstants(cmd, pl, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, vk.ffi.new("int32_t[1]", [base]))
                if dynamic:
                    vk.vkCmdDispatchIndirect(cmd, self.ctl.handle, 12 * indirect)
                    indirect += 1
                else:
                    vk.vkCmdDispatch(cmd, counts[j], 1, 1)
                # a launch boundary (and a top-level Barrier) is a full barrier
                _barrier(cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                         vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_DRAW_INDIRECT_BIT,
                         vk.VK_ACCESS_SHADER_WRITE_BIT, vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT)
            self._stamp(i + 1)
        _full_barrier(cmd)  # results visible to the host and to later submissions
        vk.vkEndCommandBuffer(cmd)
        with d._lock:
            d.save_pipeline_cache()

    def _stamp(self, i):
        """A timed program's timestamp i, once the work recorded before it is done."""
        if self.queries is not None:
            vk.vkCmdWriteTimestamp(self.cmd, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.queries, i)

    def _writes(self, ln, low, dset):
        ctl = vk.VkDescriptorBufferInfo(buffer=self.ctl.handle, offset=0, range=self.ctl.size)
        writes = [vk.VkWriteDescriptorSet(dstSet=dset, dstBinding=0, descriptorCount=1,
                                          descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, pBufferInfo=[ctl])]
        for i, b in enumerate(low.bindings):
            p, buf = ln.kernel.buffers[b.param], ln.buffer(b.param, self.device)
            if buf.handle is None:
                raise BackendError(f"{ln.kernel.name}: buffer {b.param!r} was freed")
            need = p.size * STORAGE_DTYPES[p.dtype]
            words = -(-need // 4) * 4
            infos = [vk.VkDescriptorBufferInfo(buffer=buf.handle, offset=c * b.chunk_bytes,
                                               range=max(4, min(b.chunk_bytes, words - c * b.chunk_bytes)))
                     for c in range(b.chunks)]
            writes.append(vk.VkWriteDescriptorSet(dstSet=dset, dstBinding=i + 1, descriptorCount=b.chunks,
                                                  descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                  pBufferInfo=infos))
        return writes

    def run(self, values: dict):
        d = self.device
        try:
            vals = [values[n] for n in self.slot_names]
        except KeyError as e:
            raise BackendError(f"program run: no value for scalar {e.args[0]!r}") from None
        with d._lock:
            self.words[self.slot_idx] = vals
            for low, names, indirect in self.sized:
                counts = low.group_counts({p: int(values[v]) for p, v in names}, d.max_groups)
                self.words[3 * indirect:3 * (indirect + len(counts))] = [x for c in counts for x in (c, 1, 1)]
            d.submit(self.cmd)
            if self.queries is not None:
                n = self.n_launches + 1
                ticks = vk.ffi.new("uint64_t[]", n)
                vk.vkGetQueryPoolResults(d._dev, self.queries, 0, n, 8 * n, ticks, 8,
                                         vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
                return list(np.diff(np.array(list(ticks), np.float64)) * d.timestamp_ns * 1e-9)

    def __del__(self):
        d = self.device
        if d._dev is None or vk is None:
            return
        try:
            with d._lock:
                vk.vkFreeCommandBuffers(d._dev, d.pool, 1, [self.cmd])
                if self.queries is not None:
                    vk.vkDestroyQueryPool(d._dev, self.queries, None)
                vk.vkDestroyDescriptorPool(d._dev, self.pool, None)
                d.free(self.ctl)
        except Exception:  # interpreter shutdown: the process is going away anyway
            pass
