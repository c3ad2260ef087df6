/*
 * The CUDA emulator's runtime: the CUDA runtime API the backend calls, on the host. Device
 * memory is host memory (each allocation fenced, see below); streams and events are handles
 * with nothing behind them, since every operation is complete when its call returns; a launch
 * runs its grid's blocks one after another, each block's threads as fibers on the calling
 * thread that switch only at __syncthreads and warp shuffles (x86-64).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_emu.h"

uint3 emu_threadIdx, emu_blockIdx;
dim3 emu_blockDim, emu_gridDim;

/* ---- threads of a block ---- */

/* Saves the callee-saved registers on the current stack and its pointer in *from, then
 * resumes the stack `to` (swapcontext without its two system calls a switch). */
extern "C" void emu_switch(void **from, void *to);
asm(".text\n.globl emu_switch\n.type emu_switch, @function\nemu_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".size emu_switch, .-emu_switch\n");

namespace {

const size_t kStack = 256 << 10; /* a thread's stack: the kernels' locals and their calls */

struct fiber {
  void *sp;
  char *stack;
  bool done;
  uint3 idx;
};

/* a barrier: arrived of alive threads are waiting; each release starts a new generation */
struct barrier {
  int alive, arrived;
  unsigned gen;
};

struct warp {
  barrier bar;
  uint64_t word[32];
};

std::mutex launch_lock; /* one launch at a time: the state below is the running block's */
unsigned long launches; /* so far: a launch's blocks alternate their threads' order from it */
const std::function<void()> *body;
std::vector<fiber> fibers;
void *sched; /* the launching thread's stack while a fiber runs */
int cur;
bool progress;
barrier block_bar;
warp warps[32];
cudaError_t last_error = cudaSuccess;

void yield_to_scheduler() { emu_switch(&fibers[cur].sp, sched); }

void fiber_main() {
  (*body)();
  fibers[cur].done = true;
  emu_switch(&fibers[cur].sp, sched);
  abort(); /* a finished fiber is never resumed */
}

/* Waits at b until all its alive threads have arrived. */
void arrive(barrier &b) {
  unsigned gen = b.gen;
  progress = true;
  if (++b.arrived == b.alive) {
    b.arrived = 0;
    b.gen++;
    return;
  }
  while (b.gen == gen) yield_to_scheduler();
}

/* A thread has returned: the barriers wait for one fewer. */
void leave(barrier &b) {
  b.alive--;
  if (b.arrived > 0 && b.arrived == b.alive) {
    b.arrived = 0;
    b.gen++;
  }
}

int linear_tid() {
  return (int)(emu_threadIdx.x +
               emu_blockDim.x * (emu_threadIdx.y + emu_blockDim.y * emu_threadIdx.z));
}

/* Runs the current block's n threads to their ends, round robin from barrier to barrier: in
 * thread order, or from the last thread to the first (reverse), so that a thread reading what
 * another writes without a barrier between them reads it too early in one of the two orders. */
void run_block(int n, bool reverse) {
  if ((int)fibers.size() < n) fibers.resize(n);
  for (int t = 0; t < n; t++) {
    fiber &f = fibers[t];
    if (f.stack == NULL) {
      f.stack = (char *)mmap(NULL, kStack, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (f.stack == MAP_FAILED) {
        perror("cuda emulator: a thread's stack");
        abort();
      }
    }
    /* the first switch pops six zeroed registers and returns into fiber_main with the stack
     * as a call leaves it (16-byte aligned below the return address) */
    void **top = (void **)(f.stack + kStack);
    top[-1] = NULL;
    top[-2] = (void *)fiber_main;
    for (int r = 3; r <= 8; r++) top[-r] = NULL;
    f.sp = top - 8;
    f.done = false;
    f.idx.x = t % emu_blockDim.x;
    f.idx.y = t / emu_blockDim.x % emu_blockDim.y;
    f.idx.z = t / (emu_blockDim.x * emu_blockDim.y);
  }
  block_bar = barrier{n, 0, 0};
  for (int w = 0; w < (n + 31) / 32; w++)
    warps[w].bar = barrier{n - 32 * w < 32 ? n - 32 * w : 32, 0, 0};
  for (int remaining = n; remaining > 0;) {
    progress = false;
    for (int k = 0; k < n; k++) {
      int t = reverse ? n - 1 - k : k;
      fiber &f = fibers[t];
      if (f.done) continue;
      cur = t;
      emu_threadIdx = f.idx;
      emu_switch(&sched, f.sp);
      if (f.done) {
        progress = true;
        remaining--;
        leave(block_bar);
        leave(warps[t / 32].bar);
      }
    }
    if (!progress && remaining > 0) {
      fprintf(stderr,
              "cuda emulator: every thread of block (%u, %u, %u) waits at a barrier or shuffle "
              "that the others never reach\n",
              emu_blockIdx.x, emu_blockIdx.y, emu_blockIdx.z);
      abort();
    }
  }
}

}  // namespace

void emu_syncthreads(void) { arrive(block_bar); }

int emu_lane(void) { return linear_tid() % 32; }

uint64_t emu_warp_exchange(uint64_t mine, int src) {
  int t = linear_tid();
  warp &w = warps[t / 32];
  w.word[t % 32] = mine;
  arrive(w.bar); /* every lane's word is in */
  uint64_t got = w.word[src];
  arrive(w.bar); /* every lane has read before the next exchange writes */
  return got;
}

void emu_cfg::operator<<(const std::function<void()> &fn) const {
  unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || shared > 48 << 10) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  std::lock_guard<std::mutex> hold(launch_lock);
  body = &fn;
  emu_blockDim = block;
  emu_gridDim = grid;
  unsigned long block = launches++;
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        emu_blockIdx = uint3{x, y, z};
        run_block((int)threads, block++ % 2 == 1);
      }
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

unsigned long long emu_globaltimer(void) { return (unsigned long long)(1e9 * now()); }

/* ---- device memory ----
 * Each allocation has pages of its own and ends at most 255 bytes (its 256-byte alignment)
 * before a page no access may touch; it starts filled with 0xff bytes (NaN in every float
 * dtype), as device memory holds whatever it held. A freed allocation's pages stay mapped and
 * inaccessible for the next 4,096 frees. So a kernel or copy that reads or writes past an
 * allocation's end, or after its free, stops the program at that access rather than reading
 * another tensor's bytes. */

namespace {
struct region {
  char *base;
  size_t bytes;
};
const size_t kPage = 4096;
std::mutex mem_lock;
std::unordered_map<void *, region> live;
std::deque<region> freed;
}  // namespace

extern "C" {

cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) {
  size_t data = (bytes + kPage - 1) / kPage * kPage;
  char *base =
      (char *)mmap(NULL, data + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return cudaErrorMemoryAllocation;
  mprotect(base + data, kPage, PROT_NONE);
  char *ptr = (char *)((uintptr_t)(base + data - bytes) & ~(uintptr_t)255);
  memset(ptr, 0xff, bytes);
  std::lock_guard<std::mutex> hold(mem_lock);
  live[ptr] = region{base, data + kPage};
  *p = ptr;
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t) {
  if (p == NULL) return cudaSuccess;
  std::lock_guard<std::mutex> hold(mem_lock);
  auto it = live.find(p);
  if (it == live.end()) {
    fprintf(stderr, "cuda emulator: cudaFree of %p, which is no live allocation\n", p);
    abort();
  }
  region r = it->second;
  live.erase(it);
  mprotect(r.base, r.bytes, PROT_NONE);
  freed.push_back(r);
  if (freed.size() > 4096) {
    munmap(freed.front().base, freed.front().bytes);
    freed.pop_front();
  }
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) { return cudaMallocAsync(p, bytes, 0); }
cudaError_t cudaFree(void *p) { return cudaFreeAsync(p, 0); }

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned) {
  return posix_memalign(p, 64, bytes ? bytes : 1) == 0 ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }
cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void *, size_t, unsigned) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void *) { return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned) {
  *d = h;
  return cudaSuccess;
}

/* ---- copies and fills: done when they return ---- */

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind, cudaStream_t) {
  memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, n, kind, 0);
}
cudaError_t cudaMemcpyPeerAsync(void *dst, int, const void *src, int, size_t n, cudaStream_t) {
  memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind, cudaStream_t) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  for (size_t r = 0; r < height; r++)
    memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
  memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t width, size_t height,
                              cudaStream_t) {
  if (width > pitch) return cudaErrorInvalidPitchValue;
  for (size_t r = 0; r < height; r++) memset((char *)p + r * pitch, v, width);
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t fn, void *data) {
  fn(data); /* the stream's earlier work is done */
  return cudaSuccess;
}

/* ---- errors and the device: one, of compute capability 9.0 ---- */

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorString(cudaError_t e) {
  static thread_local char text[64];
  snprintf(text, sizeof text, "CUDA error %d (emulated)", (int)e);
  return text;
}
const char *cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }

cudaError_t cudaGetDeviceCount(int *n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "CUDA emulator");
  p->major = 9;
  p->multiProcessorCount = 4;
  p->totalGlobalMem = (size_t)8 << 30;
  p->maxThreadsPerBlock = 1024;
  p->warpSize = 32;
  for (int i = 0; i < 16; i++) p->uuid.bytes[i] = (char)(0xe0 + i);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
static int pool_token;
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int) {
  *pool = (cudaMemPool_t)&pool_token;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void *) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  *free_bytes = (size_t)6 << 30;
  *total = (size_t)8 << 30;
  return cudaSuccess;
}

/* ---- streams and events: handles only; an event keeps its record's time ---- */

struct emu_handle {
  double t;
};

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
  *s = (cudaStream_t) new emu_handle{0};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int) {
  return cudaStreamCreateWithFlags(s, flags);
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete (emu_handle *)s;
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) {
  *e = (cudaEvent_t) new emu_handle{now()};
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete (emu_handle *)e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  ((emu_handle *)e)->t = now();
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned) {
  return cudaEventRecord(e, s);
}
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = (float)(1e3 * (((emu_handle *)b)->t - ((emu_handle *)a)->t));
  return cudaSuccess;
}

}  // extern "C"
