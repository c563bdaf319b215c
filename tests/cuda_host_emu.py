"""Run the CUDA backend's generated source on the host, without a GPU: g++ compiles it against a small shim of the
CUDA builtins it uses (threads of a block are real threads, __syncthreads/__syncwarp are barriers, shuffles go
through an exchange array), and the blocks of a grid run one after another. It checks what the lowering means
(task layout, lanes, reductions, barriers, conversions), not the GPU runtime."""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from jitllm_core.cache import cache_dir, write_atomic
from jitllm_cuda.lower import BLOCK, lower

SHIM = r"""
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <pthread.h>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct jl_dim3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
#define __align__(n) __attribute__((aligned(n)))
static thread_local jl_dim3 threadIdx, blockIdx;
static pthread_barrier_t jl_block_bar, jl_warp_bar[BLOCK / 32];
static uint64_t jl_xch[BLOCK];
inline void __syncthreads() { pthread_barrier_wait(&jl_block_bar); }
inline void __syncwarp(unsigned = 0xffffffffu) { pthread_barrier_wait(&jl_warp_bar[threadIdx.x / 32]); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
  uint64_t b = 0; memcpy(&b, &v, sizeof v); jl_xch[threadIdx.x] = b; __syncwarp();
  b = jl_xch[threadIdx.x ^ o]; __syncwarp(); T r; memcpy(&r, &b, sizeof r); return r;
}
struct __half { unsigned short x; };
inline float __half2float(__half h) { _Float16 f; memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; memcpy(&h.x, &f, 2); return h; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); return cmp;
}
template <class F> void jl_emu_grid(unsigned blocks, F f) {
  pthread_barrier_init(&jl_block_bar, nullptr, BLOCK);
  for (auto& b : jl_warp_bar) pthread_barrier_init(&b, nullptr, 32);
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < BLOCK; t++)
    ts.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (unsigned b = 0; b < blocks; b++) { blockIdx = {b, 0, 0}; f(); __syncthreads(); }
    });
  for (auto& t : ts) t.join();
  pthread_barrier_destroy(&jl_block_bar);
  for (auto& b : jl_warp_bar) pthread_barrier_destroy(&b);
}
"""


def available() -> bool:
    return shutil.which("g++") is not None


_libs = {}


def library(source: str) -> ctypes.CDLL:
    """Compile generated source for the host (cached on disk by content); each __global__ function F gets a
    launcher emu_F(void** args, unsigned blocks)."""
    wrappers = []
    for name, params in re.findall(r"__global__ void __launch_bounds__\(JL_BLOCK\) (\w+)\(([^)]*)\)", source):
        args = ", ".join(f"({p.strip().rsplit(' ', 1)[0]})p[{i}]" for i, p in enumerate(params.split(",")))
        wrappers.append(f'extern "C" void emu_{name}(void** p, unsigned blocks) '
                        f'{{ jl_emu_grid(blocks, [&] {{ {name}({args}); }}); }}')
    src = source + "\n".join(wrappers) + "\n"
    shim = f"#define BLOCK {BLOCK}\n{SHIM}"
    key = hashlib.sha256((shim + src).encode()).hexdigest()[:24]
    if key not in _libs:
        so = cache_dir("cuda-emu") / f"{key}.so"
        if not so.exists():
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "cuda_fp16.h").write_text(shim)
                (Path(tmp) / "k.cpp").write_text(src)
                subprocess.run(["g++", "-std=c++20", "-O0", "-w", "-shared", "-fPIC", "-pthread", f"-I{tmp}",
                                f"{tmp}/k.cpp", "-o", f"{tmp}/k.so"], check=True, capture_output=True, text=True)
                write_atomic(so, (Path(tmp) / "k.so").read_bytes())
        _libs[key] = ctypes.CDLL(str(so))
    return _libs[key]


def launch(lib, name, blocks, args):
    """Run __global__ function `name` of a library() over `blocks` blocks; args are pointer values."""
    getattr(lib, f"emu_{name}")((ctypes.c_void_p * len(args))(*args), ctypes.c_uint(blocks))


def run(kernel, bufs: dict, scalars: dict) -> dict:
    """Execute kernel on copies of bufs (storage-dtype NumPy arrays); returns the results."""
    low = lower(kernel)
    lib = library(low.source)
    # 16-byte padded copies: the generated 8/16-bit atomics touch whole aligned 32-bit words
    mem = {n: np.zeros(-(-a.nbytes // 16) * 4, np.uint32) for n, a in bufs.items()}
    for n, a in bufs.items():
        mem[n].view(np.uint8)[:a.nbytes] = a.view(np.uint8)
    sc = np.array([scalars[s] for s in low.scalars] or [0], np.int32)
    args = [mem[n].ctypes.data for n in kernel.buffers] + [sc.ctypes.data]
    for d in low.dispatches:
        launch(lib, d.name, d.blocks, args)
    return {n: mem[n].view(np.uint8)[:a.nbytes].view(a.dtype).copy() for n, a in bufs.items()}


class EmuDevice:
    """Just enough of a Device for tests/backend_check.py: buffers are host byte arrays, programs are emulated."""
    name = "cuda-host-emu"

    def alloc(self, nbytes):
        return np.zeros(nbytes, np.uint8)

    def free(self, buf):
        pass

    def upload(self, buf, data, offset=0):
        buf[offset:offset + data.nbytes] = data.view(np.uint8).reshape(-1)

    def download(self, buf, nbytes=None, offset=0):
        return buf[offset:offset + (buf.size - offset if nbytes is None else nbytes)].copy()

    def program(self, launches):
        return _EmuProgram(launches)


class _EmuProgram:
    def __init__(self, launches):
        self.launches = launches

    def run(self, values):
        for launch in self.launches:
            out = run(launch.kernel, launch.buffers, {s: values[launch.scalar_name(s)] for s in launch.kernel.scalars})
            for name, arr in out.items():
                launch.buffers[name][:] = arr
