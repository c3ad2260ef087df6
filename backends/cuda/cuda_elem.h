/*
 * Private to the CUDA sources of backends/cuda/: typed loads and stores of the float dtypes, for
 * kernels instantiated per storage type (no per-element dtype switch in their loops), and the
 * blocks of a many-tensor launch. The conversions are those of dtype_load and dtype_store: to f32
 * exactly, from f32 rounding to nearest even.
 */
#ifndef FSDPC_BASE_CUDA_ELEM_H
#define FSDPC_BASE_CUDA_ELEM_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>

static __device__ inline float tof(float v) { return v; }
static __device__ inline float tof(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ inline float tof(__half v) { return __half2float(v); }

template <typename T>
static __device__ inline T fromf(float v);
template <>
__device__ inline float fromf<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 fromf<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ inline __half fromf<__half>(float v) {
  return __float2half_rn(v);
}

/* v rounded to T and back: what storing v in T and loading it again gives. */
template <typename T>
static __device__ inline float round_to(float v) {
  return tof(fromf<T>(v));
}

/* N elements of T in one aligned load or store (16 bytes for N = 16 / sizeof(T)). */
template <typename T, int N = 16 / sizeof(T)>
struct alignas(N * sizeof(T)) pack {
  T v[N];
};

/* A many-tensor kernel's argument: count entries of up to N, each with its first_block, passed
 * by value (table_entry checks that it fits a kernel's 4 KB of arguments). */
template <typename Entry, int N>
struct entry_table {
  int count;
  Entry e[N];
};

/* The entry of a many-tensor table (entry i owns blocks [e[i].first_block, e[i + 1].first_block),
 * the last one up to the grid's end) this block works on, and the block's place b among the
 * entry's nb blocks: the last entry whose first block is at or before this one, found by
 * halving (first_block never decreases): 7 dependent argument loads for a full table of 120,
 * where a scan from the front took a later entry's blocks up to 120. */
template <typename Table>
__device__ static int table_entry(const Table &t, int64_t *b, int64_t *nb) {
  static_assert(sizeof(Table) <= 4096, "a kernel's arguments: at most 4 KB");
  int i = 0, hi = t.count - 1;
  while (i < hi) {
    int mid = (i + hi + 1) / 2;
    if ((int64_t)blockIdx.x >= t.e[mid].first_block)
      i = mid;
    else
      hi = mid - 1;
  }
  *b = blockIdx.x - t.e[i].first_block;
  *nb = (i + 1 < t.count ? t.e[i + 1].first_block : (int64_t)gridDim.x) - t.e[i].first_block;
  return i;
}

#endif
