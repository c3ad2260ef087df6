/*
 * Private to the CUDA sources of base/: typed loads and stores of the float dtypes, for kernels
 * instantiated per storage type (no per-element dtype switch in their loops). The conversions
 * are those of dtype_load and dtype_store: to f32 exactly, from f32 rounding to nearest even.
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

#endif
