/*
 * The CUDA emulator's device side: included before every CUDA source that cu2cpp.py rewrote
 * for the host compiler. The CUDA headers give the types (dim3, uint4, __nv_bfloat16 with its
 * host conversions); this header gives what only the device compiler has: the thread's
 * coordinates, __syncthreads, warp shuffles, the rounding intrinsics, and emu_cfg, which runs
 * a launch's body once for every thread of the grid (runtime.cpp).
 *
 *   emu_cfg(grid, 256, 0, stream) << [&]() { my_kernel(x, n); };   // was my_kernel<<<...>>>(x, n)
 *
 * Blocks run one after another and a block's threads take turns on one host thread, switching
 * at barriers and shuffles only, in thread order or from the last thread to the first (blocks
 * alternate): a read of what another thread writes with no barrier between them comes too
 * early in one of the two orders; races between blocks or with atomics are not found here.
 */
#ifndef FSDPC_TESTS_CUDA_EMU_H
#define FSDPC_TESTS_CUDA_EMU_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>

#include "emu_dl.h"

/* device code is host code here; shared memory is one static copy (blocks never overlap) */
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

/* the running thread's coordinates */
extern uint3 emu_threadIdx, emu_blockIdx;
extern dim3 emu_blockDim, emu_gridDim;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

/* A barrier of the block's threads (those that have not returned). */
void emu_syncthreads(void);
#define __syncthreads() emu_syncthreads()

/* The running thread's lane in its warp. */
int emu_lane(void);
/* Every lane of the running thread's warp offers a word; returns lane src's. */
uint64_t emu_warp_exchange(uint64_t mine, int src);

template <typename T>
static inline T emu_shuffle(T v, int src) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
  uint64_t w = 0;
  memcpy(&w, &v, sizeof v);
  w = emu_warp_exchange(w, src);
  T r;
  memcpy(&r, &w, sizeof r);
  return r;
}

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  (void)mask;
  int lane = emu_lane(), src = lane ^ lane_mask;
  return emu_shuffle(v, src / width == lane / width ? src : lane);
}

template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  (void)mask;
  return emu_shuffle(v, emu_lane() / width * width + src % width);
}

/* the device's rounding intrinsics: the host's operations (built without contraction) */
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

/* The device's global timer: the host's monotonic clock, in nanoseconds. */
unsigned long long emu_globaltimer(void);

/* A launch's configuration; `cfg << body` checks it as the runtime would (an invalid one sets
 * the error cudaGetLastError returns, and nothing runs), then runs body for every thread. */
struct emu_cfg {
  dim3 grid, block;
  size_t shared;
  cudaStream_t stream;
  emu_cfg(dim3 g, dim3 b, size_t m = 0, cudaStream_t s = 0)
      : grid(g), block(b), shared(m), stream(s) {}
  void operator<<(const std::function<void()> &body) const;
};

#endif
