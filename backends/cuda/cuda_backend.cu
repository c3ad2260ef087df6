/*
 * CUDA backend: memory from the stream-ordered pool, strided casting copies, fills,
 * streams and events. Kernels first, then launchers; every launcher runs on the current
 * stream of its device and checks cudaGetLastError().
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend_impl.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_elem.h"

struct stream {
  int device;
  cudaStream_t s;
};

struct event {
  int device;
  cudaEvent_t e;
};

/* ======================= kernels ======================= */

struct copy_args {
  int ndim;
  int64_t shape[BACKEND_MAX_DIMS];
  int64_t dst_stride[BACKEND_MAX_DIMS];
  int64_t src_stride[BACKEND_MAX_DIMS];
};

__device__ static double load_elem(int dt, const void *p, int64_t i) {
  switch (dt) {
    case DTYPE_F32: return ((const float *)p)[i];
    case DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case DTYPE_F16: return __half2float(((const __half *)p)[i]);
    case DTYPE_I32: return ((const int32_t *)p)[i];
    case DTYPE_I64: return (double)((const int64_t *)p)[i];
  }
  return 0.0;
}

__device__ static int64_t saturate_i64(double v, double lo, double hi) {
  if (v != v) return 0;
  if (v <= lo) return (int64_t)lo;
  if (v >= hi) return (int64_t)hi;
  return (int64_t)v;
}

/* Same rounding as dtype_store(): floats through f32 with round-to-nearest-even. */
__device__ static void store_elem(int dt, void *p, int64_t i, double v) {
  switch (dt) {
    case DTYPE_F32: ((float *)p)[i] = (float)v; break;
    case DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
    case DTYPE_F16: ((__half *)p)[i] = __float2half_rn((float)v); break;
    case DTYPE_I32:
      ((int32_t *)p)[i] = (int32_t)saturate_i64(v, -2147483648.0, 2147483647.0);
      break;
    case DTYPE_I64:
      ((int64_t *)p)[i] = saturate_i64(v, -9223372036854775808.0, 9223372036854774784.0);
      break;
  }
}

__global__ static void copy_kernel(copy_args a, void *dst, int dst_dt, const void *src, int src_dt,
                                   int elem_size, int64_t n) {
  for (int64_t lin = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; lin < n;
       lin += (int64_t)gridDim.x * blockDim.x) {
    int64_t rest = lin, doff = 0, soff = 0;
    if (a.ndim == 1) { /* coalesced (a cast of a whole tensor): no divisions */
      doff = lin * a.dst_stride[0];
      soff = lin * a.src_stride[0];
    } else { /* unrolled: constant indices keep the arguments out of local memory */
#pragma unroll
      for (int j = 0; j < BACKEND_MAX_DIMS; j++) {
        int d = BACKEND_MAX_DIMS - 1 - j;
        if (d >= a.ndim) continue;
        int64_t k = rest % a.shape[d];
        rest /= a.shape[d];
        doff += k * a.dst_stride[d];
        soff += k * a.src_stride[d];
      }
    }
    if (dst_dt == src_dt) {
      switch (elem_size) {
        case 2: ((uint16_t *)dst)[doff] = ((const uint16_t *)src)[soff]; break;
        case 4: ((uint32_t *)dst)[doff] = ((const uint32_t *)src)[soff]; break;
        case 8: ((uint64_t *)dst)[doff] = ((const uint64_t *)src)[soff]; break;
      }
    } else {
      store_elem(dst_dt, dst, doff, load_elem(src_dt, src, soff));
    }
  }
}

/* Whether a cast between float dtypes D and S from src to dst may go eight at a time. */
template <typename D, typename S>
__host__ __device__ static bool cast_packs(const void *dst, const void *src) {
  return (uintptr_t)dst % (8 * sizeof(D)) == 0 && (uintptr_t)src % (8 * sizeof(S)) == 0;
}

/* Elements [first, n) of a cast between float dtypes (copy_kernel's rounding), step apart:
 * eight at a time where both ends are aligned for it, each thread loading and storing whole
 * packs, the rest one by one. */
template <typename D, typename S>
__device__ static void cast_range(void *dst, const void *src, int64_t n, int64_t first,
                                  int64_t step) {
  int64_t nvec = cast_packs<D, S>(dst, src) ? n / 8 : 0;
  for (int64_t v = first; v < nvec; v += step) {
    pack<S, 8> a = ((const pack<S, 8> *)src)[v];
    pack<D, 8> b;
#pragma unroll
    for (int j = 0; j < 8; j++) b.v[j] = fromf<D>(tof(a.v[j]));
    ((pack<D, 8> *)dst)[v] = b;
  }
  for (int64_t i = nvec * 8 + first; i < n; i += step)
    ((D *)dst)[i] = fromf<D>(tof(((const S *)src)[i]));
}

/* A cast of n contiguous elements between float dtypes, the grid striding over them. */
template <typename D, typename S>
__global__ static void cast_kernel(D *dst, const S *src, int64_t n) {
  cast_range<D, S>(dst, src, n, blockIdx.x * (int64_t)blockDim.x + threadIdx.x,
                   (int64_t)gridDim.x * blockDim.x);
}

/* Calls f(D(), S()) for a cast to D from S between two different float dtypes and returns
 * true; false for any other pair. */
#pragma nv_exec_check_disable
template <typename F>
__host__ __device__ static bool with_float_cast(int ddt, int sdt, F f) {
  switch (ddt * 8 + sdt) {
    case DTYPE_BF16 * 8 + DTYPE_F32: f(__nv_bfloat16(), float()); return true;
    case DTYPE_F16 * 8 + DTYPE_F32: f(__half(), float()); return true;
    case DTYPE_F32 * 8 + DTYPE_BF16: f(float(), __nv_bfloat16()); return true;
    case DTYPE_F32 * 8 + DTYPE_F16: f(float(), __half()); return true;
    case DTYPE_BF16 * 8 + DTYPE_F16: f(__nv_bfloat16(), __half()); return true;
    case DTYPE_F16 * 8 + DTYPE_BF16: f(__half(), __nv_bfloat16()); return true;
  }
  return false;
}

/* Many contiguous copies in one launch (tensor_copy_many): entry i owns the blocks from its
 * first_block to the next entry's; a same-dtype entry moves 16-byte words where both ends
 * allow (elements otherwise), a cast between float dtypes converts eight elements at a time
 * as cast_kernel does (the same rounding). */
enum { kCopyTable = 120 }; /* entries per launch: the table stays under 4 KB of arguments */
/* 16-byte words a thread of a same-dtype copy loads before it stores them. On an H200
 * (bench-fsdp-step, llama-100m) four took FSDP's copy-out from 73% to 81-86% of the device's
 * copy bandwidth; casts keep one pack a thread: four packs took the packing's bf16 -> f32 from
 * 75-86% to 69%. */
enum { kCopyWords = 4 };

struct copy_entry {
  void *dst;
  const void *src;
  int64_t n; /* elements */
  int first_block;
  int8_t dst_dt, src_dt, elem_size;
};

typedef entry_table<copy_entry, kCopyTable> copy_table;
/* A launch of at most kCopySmall entries (a fully_shard unit's parameters) passes a table of
 * that size: 0.5 KB of arguments rather than 3.8 KB, which every launch copies; of at most
 * kCopyMedium (two units' casts in a joint unshard), 1 KB. */
enum { kCopySmall = 16, kCopyMedium = 32 };
typedef entry_table<copy_entry, kCopySmall> copy_table_small;
typedef entry_table<copy_entry, kCopyMedium> copy_table_medium;

template <typename Table>
__global__ static void copy_many_kernel(Table t) {
  int64_t b, nb;
  const copy_entry &x = t.e[table_entry(t, &b, &nb)];
  int64_t first = b * blockDim.x + threadIdx.x, step = nb * blockDim.x;
  if (x.dst_dt == x.src_dt) {
    int64_t bytes = x.n * x.elem_size;
    const char *s = (const char *)x.src;
    char *d = (char *)x.dst;
    if (((uintptr_t)s | (uintptr_t)d) % 16 == 0) {
      int64_t nvec = bytes / 16, v = first;
      const uint4 *from = (const uint4 *)s;
      uint4 *to = (uint4 *)d;
      for (; v + (kCopyWords - 1) * step < nvec; v += kCopyWords * step) { /* all in flight */
        uint4 w[kCopyWords];
#pragma unroll
        for (int u = 0; u < kCopyWords; u++) w[u] = from[v + u * step];
#pragma unroll
        for (int u = 0; u < kCopyWords; u++) to[v + u * step] = w[u];
      }
      for (; v < nvec; v += step) to[v] = from[v];
      for (int64_t k = nvec * 16 + first; k < bytes; k += step) d[k] = s[k];
      return;
    }
    for (int64_t e = first; e < x.n; e += step) /* off the vectors' alignment: element-wise */
      switch (x.elem_size) {
        case 2: ((uint16_t *)d)[e] = ((const uint16_t *)s)[e]; break;
        case 4: ((uint32_t *)d)[e] = ((const uint32_t *)s)[e]; break;
        case 8: ((uint64_t *)d)[e] = ((const uint64_t *)s)[e]; break;
      }
    return;
  }
  with_float_cast(x.dst_dt, x.src_dt, [&](auto d, auto s) {
    cast_range<decltype(d), decltype(s)>(x.dst, x.src, x.n, first, step);
  });
}

template <typename T>
__global__ static void fill_kernel(T *p, T value, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    p[i] = value;
}

/* ======================= launchers ======================= */

static pthread_mutex_t lib_stream_lock = PTHREAD_MUTEX_INITIALIZER;
static stream_t lib_streams[DEVICE_MAX_CUDA];
static int lib_stream_ready[DEVICE_MAX_CUDA];
static __thread stream_t *current_streams[DEVICE_MAX_CUDA];

static int grid_for(int64_t n, int block) {
  int64_t g = (n + block - 1) / block;
  if (g > 65535) g = 65535;
  return g < 1 ? 1 : (int)g;
}

/* Launches cast_kernel for a cast between two float dtypes; false for any other pair. */
static bool cast_contiguous(void *dst, int ddt, const void *src, int sdt, int64_t n,
                            cudaStream_t s) {
  return with_float_cast(ddt, sdt, [&](auto d, auto from) {
    using D = decltype(d);
    using S = decltype(from);
    int64_t nvec = cast_packs<D, S>(dst, src) ? n / 8 : 0,
            work = nvec > n - 8 * nvec ? nvec : n - 8 * nvec;
    cast_kernel<<<grid_for(work, 256), 256, 0, s>>>((D *)dst, (const S *)src, n);
  });
}

/* The devices this process sees: fixed for its life (CUDA_VISIBLE_DEVICES is read once, when
 * the runtime starts), so counted once; every allocation and copy checks its device against
 * it. */
static int device_count_seen = 0;
static pthread_once_t device_count_once = PTHREAD_ONCE_INIT;

static void count_devices(void) {
  if (cudaGetDeviceCount(&device_count_seen) != cudaSuccess) {
    cudaGetLastError(); /* no driver (error 35) or no device: zero devices */
    device_count_seen = 0;
  }
}

static int cuda_device_count(void) {
  pthread_once(&device_count_once, count_devices);
  return device_count_seen;
}

static fsdpc_status_t cuda_device_uuid(int index, uint8_t out[16]) {
  cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return err_set(STATUS_ECUDA, "cudaGetDeviceProperties(%d): %s", index, cudaGetErrorString(e));
  }
  memcpy(out, p.uuid.bytes, 16);
  return STATUS_OK;
}

/* Every launch asks for its stream: once the library stream exists, no lock (ready is
 * published with release order after the stream is made). */
static stream_t *cuda_stream_current(int index) {
  if (current_streams[index] != NULL) return current_streams[index];
  if (__atomic_load_n(&lib_stream_ready[index], __ATOMIC_ACQUIRE)) return &lib_streams[index];
  pthread_mutex_lock(&lib_stream_lock);
  if (!lib_stream_ready[index]) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(index);
    lib_streams[index].device = index;
    if (cudaStreamCreateWithFlags(&lib_streams[index].s, cudaStreamNonBlocking) != cudaSuccess)
      lib_streams[index].s = 0; /* fall back to the legacy stream; errors surface later */
    /* device memory comes from the device's stream-ordered pool (cudaMallocAsync), which by
     * default hands every free byte back to the driver at each synchronisation: a step's
     * buffers would then be mapped afresh every step. The pool keeps what it has instead. */
    cudaMemPool_t pool;
    uint64_t keep = UINT64_MAX;
    if (cudaDeviceGetDefaultMemPool(&pool, index) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
      cudaGetLastError(); /* advice only: allocations still work, at the default's cost */
    cudaSetDevice(prev);
    __atomic_store_n(&lib_stream_ready[index], 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&lib_stream_lock);
  return &lib_streams[index];
}

static void cuda_stream_set_current(int index, stream_t *s) { current_streams[index] = s; }

static cudaStream_t raw_stream(int index) { return cuda_stream_current(index)->s; }

static fsdpc_status_t cuda_alloc(int index, size_t bytes, bool zeroed, void **out) {
  CUDA_TRY(cuda_use_device(index));
  cudaError_t e = cudaMallocAsync(out, bytes, raw_stream(index));
  const char *what = "cudaMallocAsync";
  if (e == cudaSuccess && zeroed) {
    e = cudaMemsetAsync(*out, 0, bytes, raw_stream(index));
    what = "cudaMemsetAsync";
    if (e != cudaSuccess) cudaFreeAsync(*out, raw_stream(index));
  }
  if (e == cudaSuccess) return STATUS_OK;
  char where[96]; /* formatted only on failure: this is every device allocation's path */
  snprintf(where, sizeof where, "%s of %zu bytes on cuda:%d", what, bytes, index);
  return cuda_status(e, where);
}

static void cuda_free(int index, void *ptr, size_t bytes, bool zeroed) {
  (void)bytes;
  (void)zeroed;
  cuda_use_device(index);
  cudaFreeAsync(ptr, raw_stream(index));
}

/* Copies within one device. Same-dtype copies whose rows are contiguous go to the runtime's
 * copies (1-D, or 2-D with row pitches), which run at the device's copy bandwidth; casts and
 * other layouts go through copy_kernel. */
static fsdpc_status_t cuda_copy(int index, const copy_desc_t *desc) {
  copy_desc_t d = *desc;
  int64_t n = 1;
  for (int i = 0; i < d.ndim; i++) n *= d.shape[i];
  if (n == 0) return STATUS_OK;
  int nd = copy_desc_coalesce(&d);
  CUDA_TRY(cuda_use_device(index));
  cudaStream_t s = raw_stream(index);
  size_t esz = dtype_size(d.src_dtype);
  if (d.dst_dtype == d.src_dtype && d.dst_stride[nd - 1] == 1 && d.src_stride[nd - 1] == 1) {
    size_t row = (size_t)d.shape[nd - 1] * esz;
    if (nd == 1)
      return cuda_status(cudaMemcpyAsync(d.dst, d.src, row, cudaMemcpyDeviceToDevice, s),
                         "cudaMemcpyAsync (device to device)");
    size_t pitch_max = (size_t)1 << 31; /* the runtime's limit on a 2-D copy's pitches */
    if (nd == 2 && d.dst_stride[0] >= d.shape[1] && d.src_stride[0] >= d.shape[1] &&
        (size_t)d.dst_stride[0] * esz < pitch_max && (size_t)d.src_stride[0] * esz < pitch_max)
      return cuda_status(cudaMemcpy2DAsync(d.dst, (size_t)d.dst_stride[0] * esz, d.src,
                                           (size_t)d.src_stride[0] * esz, row,
                                           (size_t)d.shape[0], cudaMemcpyDeviceToDevice, s),
                         "cudaMemcpy2DAsync (device to device)");
  }
  if (nd == 1 && d.dst_stride[0] == 1 && d.src_stride[0] == 1 &&
      cast_contiguous(d.dst, d.dst_dtype, d.src, d.src_dtype, n, s)) {
    CUDA_TRY(cudaGetLastError());
    return STATUS_OK;
  }
  copy_args a;
  a.ndim = nd;
  for (int i = 0; i < nd; i++) {
    a.shape[i] = d.shape[i];
    a.dst_stride[i] = d.dst_stride[i];
    a.src_stride[i] = d.src_stride[i];
  }
  const int block = 256;
  copy_kernel<<<grid_for(n, block), block, 0, s>>>(a, d.dst, d.dst_dtype, d.src, d.src_dtype,
                                                   (int)esz, n);
  CUDA_TRY(cudaGetLastError());
  return STATUS_OK;
}

/* Launches the first t.count entries of t from a table of Small's size. */
template <typename Small>
static void launch_copies_in(const copy_table &t, int64_t blocks, cudaStream_t s) {
  Small small;
  small.count = t.count;
  memcpy(small.e, t.e, sizeof(copy_entry) * (size_t)t.count);
  copy_many_kernel<<<(unsigned)blocks, 256, 0, s>>>(small);
}

static bool float_dtype(dtype_t dt) {
  return dt == DTYPE_F32 || dt == DTYPE_BF16 || dt == DTYPE_F16;
}

/* The contiguous copies (same dtype, or between float dtypes) of descs in launches of up to
 * kCopyTable, each given blocks by its size (1024 at most); any other one by cuda_copy. */
static fsdpc_status_t cuda_copy_many(int index, const copy_desc_t *descs, int n) {
  CUDA_TRY(cuda_use_device(index));
  cudaStream_t s = raw_stream(index);
  copy_table t;
  t.count = 0;
  int64_t blocks = 0;
  for (int i = 0; i <= n; i++) {
    if (i == n || t.count == kCopyTable) { /* launch what the table holds */
      if (t.count > kCopyMedium)
        copy_many_kernel<<<(unsigned)blocks, 256, 0, s>>>(t);
      else if (t.count > kCopySmall)
        launch_copies_in<copy_table_medium>(t, blocks, s);
      else if (t.count > 0)
        launch_copies_in<copy_table_small>(t, blocks, s);
      if (t.count > 0) CUDA_TRY(cudaGetLastError());
      t.count = 0;
      blocks = 0;
      if (i == n) break;
    }
    copy_desc_t d = descs[i];
    int64_t numel = 1;
    for (int k = 0; k < d.ndim; k++) numel *= d.shape[k];
    if (numel == 0) continue;
    int nd = copy_desc_coalesce(&d);
    bool same = d.dst_dtype == d.src_dtype;
    if (nd != 1 || d.dst_stride[0] != 1 || d.src_stride[0] != 1 ||
        !(same || (float_dtype(d.dst_dtype) && float_dtype(d.src_dtype)))) {
      FSDPC_TRY(cuda_copy(index, &descs[i]));
      continue;
    }
    copy_entry &e = t.e[t.count++];
    e.dst = d.dst;
    e.src = d.src;
    e.n = numel;
    e.first_block = (int)blocks;
    e.dst_dt = (int8_t)d.dst_dtype;
    e.src_dt = (int8_t)d.src_dtype;
    e.elem_size = (int8_t)dtype_size(d.src_dtype);
    /* per thread: kCopyWords 16-byte words of a same-dtype copy, one pack of a cast */
    int64_t per = same ? 256 * kCopyWords : 256;
    int64_t units = same ? numel * e.elem_size / 16 : numel / 8;
    int64_t nb = (units + per - 1) / per;
    blocks += nb < 1 ? 1 : nb > 1024 ? 1024 : nb;
  }
  return STATUS_OK;
}

static fsdpc_status_t cuda_fill(int index, void *ptr, size_t elem_size, size_t n,
                                uint64_t pattern) {
  if (n == 0) return STATUS_OK;
  CUDA_TRY(cuda_use_device(index));
  const int block = 256;
  cudaStream_t s = raw_stream(index);
  int grid = grid_for((int64_t)n, block);
  switch (elem_size) {
    case 2:
      fill_kernel<<<grid, block, 0, s>>>((uint16_t *)ptr, (uint16_t)pattern, (int64_t)n);
      break;
    case 4:
      fill_kernel<<<grid, block, 0, s>>>((uint32_t *)ptr, (uint32_t)pattern, (int64_t)n);
      break;
    case 8: fill_kernel<<<grid, block, 0, s>>>((uint64_t *)ptr, pattern, (int64_t)n); break;
    default: return err_set(STATUS_EINVAL, "cuda fill: element size %zu", elem_size);
  }
  CUDA_TRY(cudaGetLastError());
  return STATUS_OK;
}

static fsdpc_status_t cuda_stream_sync_dev(int index) {
  return cuda_wait_stream(raw_stream(index), "device_stream_sync");
}

static fsdpc_status_t cuda_memcpy(device_t dst_dev, void *dst, device_t src_dev, const void *src,
                                  size_t bytes) {
  int index = dst_dev.type == DEVICE_CUDA ? dst_dev.index : src_dev.index;
  CUDA_TRY(cuda_use_device(index));
  cudaStream_t s = raw_stream(index);
  if (dst_dev.type == DEVICE_CUDA && src_dev.type == DEVICE_CUDA && dst_dev.index != src_dev.index)
    CUDA_TRY(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, bytes, s));
  else
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (dst_dev.type == DEVICE_CPU || src_dev.type == DEVICE_CPU)
    /* the caller uses the host memory next */
    FSDPC_TRY(cuda_wait_stream(s, "a copy to or from the host"));
  return STATUS_OK;
}

/* Uploads: the host's bytes copied into a page-locked block, which the device reads on the
 * current stream while the call returns; a block is taken again once the event recorded
 * after its copy has passed. A few blocks of 64 KiB to 4 MiB (a batch's token ids and
 * targets); a larger copy, or one while every block is in use, is a plain device_memcpy. */
enum { UPLOAD_BLOCKS = 16 };
static const size_t kUploadMin = (size_t)64 << 10, kUploadMax = (size_t)4 << 20;
static struct upload {
  void *p;
  size_t bytes;
  int device;
  cudaEvent_t done; /* recorded after the block's last copy */
  bool in_use;      /* taken by a call that has not recorded done yet */
} uploads[UPLOAD_BLOCKS];
static pthread_mutex_t uploads_lock = PTHREAD_MUTEX_INITIALIZER;

/* A free block of at least bytes on device index, else NULL. */
static struct upload *upload_take(int index, size_t bytes) {
  struct upload *got = NULL;
  pthread_mutex_lock(&uploads_lock);
  for (int i = 0; i < UPLOAD_BLOCKS && got == NULL; i++) {
    struct upload *u = &uploads[i];
    if (u->in_use || (u->p != NULL && (u->device != index || u->bytes < bytes))) continue;
    if (u->p != NULL) {
      cudaError_t e = cudaEventQuery(u->done);
      if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        continue;
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        continue;
      }
    } else {
      size_t n = kUploadMin;
      while (n < bytes) n *= 2;
      if (cudaHostAlloc(&u->p, n, cudaHostAllocPortable) != cudaSuccess) {
        (void)cudaGetLastError();
        u->p = NULL;
        break;
      }
      if (cudaEventCreateWithFlags(&u->done, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFreeHost(u->p);
        u->p = NULL;
        break;
      }
      u->bytes = n;
      u->device = index;
    }
    u->in_use = true;
    got = u;
  }
  pthread_mutex_unlock(&uploads_lock);
  return got;
}

static fsdpc_status_t cuda_upload(int index, void *dst, const void *src, size_t bytes) {
  CUDA_TRY(cuda_use_device(index));
  cudaStream_t s = raw_stream(index);
  struct upload *u = bytes <= kUploadMax ? upload_take(index, bytes) : NULL;
  if (u == NULL) {
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    return cuda_wait_stream(s, "a copy from the host");
  }
  memcpy(u->p, src, bytes);
  cudaError_t e = cudaMemcpyAsync(dst, u->p, bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaEventRecord(u->done, s);
  if (e != cudaSuccess) /* the block may still be read: wait for the stream first */
    (void)cuda_drain_stream(s, "a copy from the host");
  pthread_mutex_lock(&uploads_lock);
  u->in_use = false;
  pthread_mutex_unlock(&uploads_lock);
  return cuda_status(e, "a copy from the host (cudaMemcpyAsync)");
}

static fsdpc_status_t cuda_stream_new(int index, bool high, stream_t **out) {
  stream_t *s = (stream_t *)calloc(1, sizeof *s);
  if (s == NULL) return err_set(STATUS_ENOMEM, "stream_new: out of host memory");
  s->device = index;
  int least = 0, greatest = 0; /* numerically lower is higher priority */
  cudaError_t e = cuda_use_device(index);
  if (e == cudaSuccess && high) e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess)
    e = cudaStreamCreateWithPriority(&s->s, cudaStreamNonBlocking, high ? greatest : least);
  if (e != cudaSuccess) {
    free(s);
    char what[48];
    snprintf(what, sizeof what, "stream_new on cuda:%d", index);
    return cuda_status(e, what);
  }
  *out = s;
  return STATUS_OK;
}

static void cuda_stream_free(stream_t *s) {
  cudaStreamDestroy(s->s);
  free(s);
}

static fsdpc_status_t cuda_stream_wait_event(stream_t *s, event_t *e) {
  CUDA_TRY(cudaStreamWaitEvent(s->s, e->e, 0));
  return STATUS_OK;
}

static fsdpc_status_t cuda_stream_synchronize(stream_t *s) {
  return cuda_wait_stream(s->s, "stream_synchronize");
}

static fsdpc_status_t cuda_event_new(int index, event_t **out) {
  event_t *ev = (event_t *)calloc(1, sizeof *ev);
  if (ev == NULL) return err_set(STATUS_ENOMEM, "event_new: out of host memory");
  ev->device = index;
  cudaError_t e = cuda_use_device(index);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev->e, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    free(ev);
    char what[48];
    snprintf(what, sizeof what, "event_new on cuda:%d", index);
    return cuda_status(e, what);
  }
  *out = ev;
  return STATUS_OK;
}

static void cuda_event_free(event_t *e) {
  cudaEventDestroy(e->e);
  free(e);
}

static fsdpc_status_t cuda_event_record(event_t *e, stream_t *s) {
  CUDA_TRY(cudaEventRecord(e->e, s->s));
  return STATUS_OK;
}

static fsdpc_status_t cuda_event_synchronize(event_t *e) {
  return cuda_wait_event(e->e, "event_synchronize");
}

static fsdpc_status_t cuda_host_alloc_pinned(size_t bytes, void **out) {
  *out = NULL;
  cudaError_t e = cudaHostAlloc(out, bytes, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    *out = NULL;
    cudaGetLastError();
    return err_set(STATUS_ENOMEM, "cudaHostAlloc of %zu bytes: %s", bytes, cudaGetErrorString(e));
  }
  return STATUS_OK;
}

static void cuda_host_free_pinned(void *p) {
  if (p != NULL) cudaFreeHost(p);
}

static bool cuda_host_register(void *p, size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

static void cuda_host_unregister(void *p) {
  if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
}

static fsdpc_status_t cuda_copy_async(stream_t *s, void *dst, const void *src, size_t bytes) {
  CUDA_TRY(cuda_use_device(s->device));
  CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s->s));
  return STATUS_OK;
}

/* Spins until the device's global timer has advanced ns nanoseconds. */
__global__ void delay_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

static fsdpc_status_t cuda_delay(stream_t *s, double seconds) {
  CUDA_TRY(cuda_use_device(s->device));
  delay_kernel<<<1, 1, 0, s->s>>>((unsigned long long)(seconds * 1e9));
  CUDA_TRY(cudaGetLastError());
  return STATUS_OK;
}

static const backend_t cuda_table = {
    /* .name = */ "cuda",
    /* .alloc = */ cuda_alloc,
    /* .free = */ cuda_free,
    /* .copy = */ cuda_copy,
    /* .copy_many = */ cuda_copy_many,
    /* .fill = */ cuda_fill,
    /* .stream_sync = */ cuda_stream_sync_dev,
    /* .device_count = */ cuda_device_count,
    /* .device_uuid = */ cuda_device_uuid,
    /* .memcpy = */ cuda_memcpy,
    /* .stream_current = */ cuda_stream_current,
    /* .stream_set_current = */ cuda_stream_set_current,
    /* .stream_new = */ cuda_stream_new,
    /* .stream_free = */ cuda_stream_free,
    /* .stream_wait_event = */ cuda_stream_wait_event,
    /* .stream_synchronize = */ cuda_stream_synchronize,
    /* .event_new = */ cuda_event_new,
    /* .event_free = */ cuda_event_free,
    /* .event_record = */ cuda_event_record,
    /* .event_synchronize = */ cuda_event_synchronize,
    /* .host_alloc_pinned = */ cuda_host_alloc_pinned,
    /* .host_free_pinned = */ cuda_host_free_pinned,
    /* .host_register = */ cuda_host_register,
    /* .host_unregister = */ cuda_host_unregister,
    /* .copy_async = */ cuda_copy_async,
    /* .delay = */ cuda_delay,
    /* .upload = */ cuda_upload,
};

extern "C" const backend_t *cuda_backend(void) { return &cuda_table; }

/* Raw handles for other CUDA-aware parts of the library (NCCL groups, cuBLAS). */
extern "C" cudaStream_t cuda_stream_raw(stream_t *s) { return s->s; }
extern "C" cudaEvent_t cuda_event_raw(event_t *e) { return e->e; }
