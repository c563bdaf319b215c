// A stand-in libcuda.so.1 so that the CUDA backend's runtime (contexts, memory, staged copies, graph capture,
// per-step scalars, transfer paths) runs through the real cuda-bindings on a machine without a GPU.
// Device memory is host memory and every stream runs synchronously. A "module" is the kernel's CUDA source (the
// test makes the compiler return it instead of a cubin); kernel launches, direct or replayed from a captured
// graph, are handed to a callback that runs the source in the host emulation (tests/cuda_host_emu.py).
// Two devices, sm_90; only the entry points the backend uses exist.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
enum { OK = 0, INVALID_CONTEXT = 201, NOT_FOUND = 500, PEER_ALREADY_ENABLED = 704 };
typedef struct { const char* src; char name[64]; int nparams; } Fn;
typedef struct { int kernel; void* dst; const void* src; size_t n; Fn* fn; unsigned grid; uint64_t args[32]; } Node;
typedef struct { Node nodes[8192]; int n; } Graph;
typedef struct { Graph* capture; } Stream;
typedef void (*LaunchFn)(const char* src, const char* name, unsigned grid, int nargs, uint64_t* args);

static __thread void* current;
static LaunchFn on_launch;
static int peer_enabled[4];
void fake_set_launch(LaunchFn f) { on_launch = f; }

#define NEED_CTX if (!current) return INVALID_CONTEXT
CUresult cuInit(unsigned flags) { return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuGetExportTable(const void** table, const void* id) { *table = 0; return NOT_FOUND; }  // asked by NVRTC
CUresult cuGetErrorString(CUresult e, const char** s) { *s = "fake driver error"; return OK; }
CUresult cuGetErrorName(CUresult e, const char** s) { *s = "FAKE_ERROR"; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 2; return OK; }
CUresult cuDeviceGet(int* d, int i) { *d = i; return OK; }
CUresult cuDeviceGetName(char* s, int len, int d) { snprintf(s, len, "Fake GPU %d", d); return OK; }
CUresult cuDeviceTotalMem(size_t* b, int d) { *b = (size_t)1 << 30; return OK; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) {
  switch (attr) {  // compute capability 9.0, warp 32, 4 SMs, 1 GHz x 1024-bit memory
    case 75: *v = 9; break; case 76: *v = 0; break; case 10: *v = 32; break; case 16: *v = 4; break;
    case 36: *v = 1000000; break; case 37: *v = 1024; break; default: *v = 0;
  }
  return OK;
}
CUresult cuDeviceCanAccessPeer(int* r, int d, int peer) { *r = 1; return OK; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)(intptr_t)(0x1000 + d); return OK; }
CUresult cuCtxSetCurrent(void* c) { current = c; return OK; }
CUresult cuCtxSynchronize(void) { NEED_CTX; return OK; }
CUresult cuCtxEnablePeerAccess(void* peer, unsigned flags) {
  NEED_CTX;
  int i = (int)((intptr_t)current - 0x1000) * 2 + (int)((intptr_t)peer - 0x1000);
  if (peer_enabled[i]) return PEER_ALREADY_ENABLED;
  peer_enabled[i] = 1;
  return OK;
}
CUresult cuStreamCreate(void** s, unsigned flags) { NEED_CTX; *s = calloc(1, sizeof(Stream)); return OK; }
CUresult cuStreamSynchronize(void* s) { return OK; }
CUresult cuEventCreate(void** e, unsigned flags) { NEED_CTX; *e = malloc(8); return OK; }
CUresult cuEventRecord(void* e, void* s) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* start, void* end) { *ms = *(double*)end - *(double*)start; return OK; }
CUresult cuEventSynchronize(void* e) { return OK; }
CUresult cuEventDestroy(void* e) { free(e); return OK; }
CUresult cuMemAlloc(void** p, size_t n) { NEED_CTX; *p = aligned_alloc(256, (n + 255) / 256 * 256); return OK; }
CUresult cuMemFree(void* p) { free(p); return OK; }
CUresult cuMemHostAlloc(void** p, size_t n, unsigned flags) { NEED_CTX; *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return OK; }
CUresult cuMemFreeHost(void* p) { free(p); return OK; }

static void stamp(double* event) {  // an event holds the time it was reached, in ms
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  *event = t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}
static void run(Node* n) {  // kernel: 0 a copy, 1 a launch, 2 an event record
  if (n->kernel == 2) stamp(n->dst);
  else if (!n->kernel) memcpy(n->dst, n->src, n->n);
  else if (on_launch) on_launch(n->fn->src, n->fn->name, n->grid, n->fn->nparams, n->args);
}
static CUresult submit(Stream* s, Node* n) {  // record while capturing, else run now
  if (s && s->capture) s->capture->nodes[s->capture->n++] = *n;
  else run(n);
  return OK;
}
CUresult cuMemcpyHtoDAsync(void* dst, const void* src, size_t n, void* s) {
  NEED_CTX; Node nd = {0, dst, src, n}; return submit(s, &nd);
}
CUresult cuMemcpyDtoHAsync(void* dst, const void* src, size_t n, void* s) {
  NEED_CTX; Node nd = {0, dst, src, n}; return submit(s, &nd);
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned flags) { Node nd = {2, e}; return submit(s, &nd); }
CUresult cuMemcpyPeerAsync(void* dst, void* dctx, const void* src, void* sctx, size_t n, void* s) {
  Node nd = {0, dst, src, n}; return submit(s, &nd);
}
CUresult cuModuleLoadData(void** m, const void* image) { NEED_CTX; *m = strdup(image); return OK; }
CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
  char pattern[80];
  snprintf(pattern, sizeof pattern, " %s(", name);
  const char* p = strstr(module, pattern);
  if (!p) return NOT_FOUND;
  Fn* fn = calloc(1, sizeof(Fn));
  fn->src = module;
  strncpy(fn->name, name, 63);
  for (p += strlen(pattern), fn->nparams = 1; *p != ')'; p++) fn->nparams += *p == ',';
  *f = fn;
  return OK;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* s, void** params, void** extra) {
  NEED_CTX;
  Node nd = {1, 0, 0, 0, f, gx};
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || !params || extra) return 1;  // what the backend promises
  for (int i = 0; i < nd.fn->nparams; i++) nd.args[i] = *(uint64_t*)params[i];
  return submit(s, &nd);
}
CUresult cuStreamBeginCapture(void* s, int mode) { ((Stream*)s)->capture = calloc(1, sizeof(Graph)); return OK; }
CUresult cuStreamEndCapture(void* s, void** g) { *g = ((Stream*)s)->capture; ((Stream*)s)->capture = 0; return OK; }
CUresult cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long flags) {
  *e = malloc(sizeof(Graph));
  memcpy(*e, g, sizeof(Graph));
  return OK;
}
CUresult cuGraphDestroy(void* g) { free(g); return OK; }
CUresult cuGraphExecDestroy(void* g) { free(g); return OK; }
CUresult cuGraphLaunch(void* e, void* s) {
  Graph* g = e;
  for (int i = 0; i < g->n; i++) run(&g->nodes[i]);
  return OK;
}
// cuda-bindings resolves every entry point through this
CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int version, unsigned long long flags, int* status) {
  *pfn = dlsym(RTLD_DEFAULT, sym);
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? OK : NOT_FOUND;
}
