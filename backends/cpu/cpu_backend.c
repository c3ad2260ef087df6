#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/backend_impl.h"

/* Host memory. Blocks of at least CPU_MAPPED_MIN come straight from the operating system
 * (mmap), as transparent huge pages where the system offers them (2 MiB per page fault
 * instead of 4 KiB). Kept out of the malloc heap, the large buffers of a step (gathered
 * parameters, their gradients, communication buffers) cannot fragment it between long-lived
 * state, which otherwise grows a process's resident memory step after step (measured on a
 * 520M model over 8 ranks: 1.73 to 2.0 GB peak per rank with the heap, 1.45 GB this way).
 *
 * Blocks of at least CPU_CACHED_MIN are cached when freed, by rounded size, and handed out
 * again for the same size: a training step allocates the same sizes as the step before, and
 * without the cache each of them costs page faults again (the heap trims its top and
 * returns mapped blocks; measured on llama-small at 8 x 64: 45-70% more tokens/s with it).
 * The cache is bounded by the peak: when a request misses it, cached blocks are released
 * (oldest first) until live plus cached bytes fit under 1.25 times the highest live total
 * seen (the quarter lets the blocks of the forward and of the backward, sized differently,
 * both stay; with no slack a llama-small step still took ~100 blocks from the system, with
 * a quarter none). */
#define CPU_MAPPED_MIN ((size_t)4 << 20)
#define CPU_CACHED_MIN ((size_t)64 << 10)

/* Under AddressSanitizer a cached block is poisoned: a use after free still reports. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPU_CACHE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define CPU_CACHE_ASAN 1
#endif
#ifdef CPU_CACHE_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

typedef struct cached_block {
  void *p;
  size_t bytes; /* rounded */
} cached_block_t;

static struct {
  pthread_mutex_t mu;
  cached_block_t *blocks; /* oldest first */
  int n, cap;
  size_t live, cached, peak; /* bytes of cacheable blocks, rounded */
  size_t os_allocs;          /* blocks taken from the operating system */
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* cpu_host_set_pinning's functions (set once, under cache.mu) */
static bool (*pin_block)(void *p, size_t bytes);
static void (*unpin_block)(void *p);

void cpu_host_set_pinning(bool (*pin)(void *p, size_t bytes), void (*unpin)(void *p)) {
  pthread_mutex_lock(&cache.mu);
  pin_block = pin;
  unpin_block = unpin;
  pthread_mutex_unlock(&cache.mu);
}

static size_t rounded(size_t bytes) {
  size_t unit = bytes >= CPU_MAPPED_MIN ? (size_t)2 << 20 : (size_t)4 << 10;
  return (bytes + unit - 1) / unit * unit;
}

static void *os_alloc(size_t bytes) {
  if (bytes >= CPU_MAPPED_MIN) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE); /* advice only: failure is harmless */
#endif
    if (pin_block != NULL) pin_block(p, bytes); /* a refusal leaves the block pageable */
    return p;
  }
  return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

static void os_free(void *p, size_t bytes) {
  UNPOISON(p, bytes);
  if (bytes >= CPU_MAPPED_MIN) {
    if (unpin_block != NULL) unpin_block(p); /* a block never pinned: nothing to release */
    munmap(p, bytes);
  } else {
    free(p);
  }
}

/* Releases the oldest cached blocks until live + cached <= limit (under cache.mu). */
static void cache_trim(size_t limit) {
  int k = 0;
  while (k < cache.n && cache.live + cache.cached > limit) {
    os_free(cache.blocks[k].p, cache.blocks[k].bytes);
    cache.cached -= cache.blocks[k].bytes;
    k++;
  }
  if (k == 0) return;
  memmove(cache.blocks, cache.blocks + k, sizeof *cache.blocks * (size_t)(cache.n - k));
  cache.n -= k;
}

static void *cache_take(size_t bytes, bool *fresh) {
  pthread_mutex_lock(&cache.mu);
  void *p = NULL;
  for (int i = cache.n - 1; i >= 0 && p == NULL; i--) /* the most recently freed first */
    if (cache.blocks[i].bytes == bytes) {
      p = cache.blocks[i].p;
      memmove(cache.blocks + i, cache.blocks + i + 1,
              sizeof *cache.blocks * (size_t)(cache.n - i - 1));
      cache.n--;
      cache.cached -= bytes;
      UNPOISON(p, bytes);
    }
  cache.live += bytes;
  if (cache.live > cache.peak) cache.peak = cache.live;
  *fresh = p == NULL;
  if (p == NULL) {
    cache_trim(cache.peak + cache.peak / 4);
    p = os_alloc(bytes);
    if (p == NULL && cache.n > 0) { /* out of memory: give the whole cache back and retry */
      cache_trim(cache.live);
      p = os_alloc(bytes);
    }
    if (p == NULL)
      cache.live -= bytes;
    else
      cache.os_allocs++;
  }
  pthread_mutex_unlock(&cache.mu);
  return p;
}

static void cache_give(void *p, size_t bytes) {
  pthread_mutex_lock(&cache.mu);
  cache.live -= bytes;
  if (cache.n == cache.cap) {
    int cap = cache.cap ? 2 * cache.cap : 64;
    cached_block_t *b = realloc(cache.blocks, sizeof *b * (size_t)cap);
    if (b != NULL) {
      cache.blocks = b;
      cache.cap = cap;
    }
  }
  if (cache.n < cache.cap) {
    cache.blocks[cache.n++] = (cached_block_t){p, bytes};
    cache.cached += bytes;
    POISON(p, bytes);
  } else {
    os_free(p, bytes);
  }
  pthread_mutex_unlock(&cache.mu);
}

void *cpu_host_alloc(size_t bytes, bool zeroed) {
  if (bytes < CPU_CACHED_MIN) {
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (p != NULL && zeroed) memset(p, 0, bytes);
    return p;
  }
  bool fresh;
  size_t r = rounded(bytes);
  void *p = cache_take(r, &fresh);
  if (p != NULL && zeroed && !(fresh && r >= CPU_MAPPED_MIN)) /* mapped pages arrive zero */
    memset(p, 0, bytes);
  return p;
}

void cpu_host_free(void *p, size_t bytes) {
  if (p == NULL) return;
  if (bytes < CPU_CACHED_MIN)
    free(p);
  else
    cache_give(p, rounded(bytes));
}

size_t cpu_host_os_allocs(void) {
  pthread_mutex_lock(&cache.mu);
  size_t n = cache.os_allocs;
  pthread_mutex_unlock(&cache.mu);
  return n;
}

void cpu_host_empty_cache(void) {
  pthread_mutex_lock(&cache.mu);
  cache_trim(cache.live);
  cache.peak = cache.live;
  pthread_mutex_unlock(&cache.mu);
}

static fsdpc_status_t cpu_alloc(int index, size_t bytes, bool zeroed, void **out) {
  (void)index;
  void *p = cpu_host_alloc(bytes, zeroed);
  if (p == NULL) return err_set(STATUS_ENOMEM, "host allocation of %zu bytes failed", bytes);
  *out = p;
  return STATUS_OK;
}

static void cpu_free(int index, void *ptr, size_t bytes, bool zeroed) {
  (void)index;
  (void)zeroed;
  cpu_host_free(ptr, bytes);
}

/* n contiguous elements of float dtype st at src written as float dtype dt at dst. */
static void cast_row(dtype_t dt, void *dst, dtype_t st, const void *src, int64_t n) {
  if (st == DTYPE_F32) {
    dtype_from_f32(dt, src, dst, (size_t)n);
  } else if (dt == DTYPE_F32) {
    dtype_to_f32(st, src, dst, (size_t)n);
  } else { /* between two 16-bit dtypes: through f32, a tile at a time */
    float tile[512];
    for (int64_t i = 0; i < n; i += 512) {
      size_t k = (size_t)(n - i < 512 ? n - i : 512);
      dtype_to_f32(st, (const char *)src + i * 2, tile, k);
      dtype_from_f32(dt, tile, (char *)dst + i * 2, k);
    }
  }
}

static fsdpc_status_t cpu_copy(int index, const copy_desc_t *desc) {
  (void)index;
  copy_desc_t d = *desc;
  for (int i = 0; i < d.ndim; i++)
    if (d.shape[i] == 0) return STATUS_OK;
  int nd = copy_desc_coalesce(&d);
  size_t dsz = dtype_size(d.dst_dtype), ssz = dtype_size(d.src_dtype);
  int same = d.dst_dtype == d.src_dtype;
  int unit = d.dst_stride[nd - 1] == 1 && d.src_stride[nd - 1] == 1;
  int rows_contig = same && unit;
  /* casts between float dtypes of whole rows: the typed conversions (the same values as
   * dtype_store of dtype_load, element by element) */
  int rows_cast = !same && unit && dtype_is_float(d.dst_dtype) && dtype_is_float(d.src_dtype);
  int64_t inner = d.shape[nd - 1];
  int64_t outer = 1;
  for (int i = 0; i < nd - 1; i++) outer *= d.shape[i];

  int64_t idx[BACKEND_MAX_DIMS] = {0};
  for (int64_t o = 0; o < outer; o++) {
    int64_t doff = 0, soff = 0;
    for (int i = 0; i < nd - 1; i++) {
      doff += idx[i] * d.dst_stride[i];
      soff += idx[i] * d.src_stride[i];
    }
    char *dst = (char *)d.dst + doff * (int64_t)dsz;
    const char *src = (const char *)d.src + soff * (int64_t)ssz;
    if (rows_contig) {
      memcpy(dst, src, (size_t)inner * dsz);
    } else if (rows_cast) {
      cast_row(d.dst_dtype, dst, d.src_dtype, src, inner);
    } else if (same) {
      for (int64_t k = 0; k < inner; k++)
        memcpy(dst + k * d.dst_stride[nd - 1] * (int64_t)dsz,
               src + k * d.src_stride[nd - 1] * (int64_t)ssz, dsz);
    } else {
      for (int64_t k = 0; k < inner; k++)
        dtype_store(d.dst_dtype, dst, (size_t)(k * d.dst_stride[nd - 1]),
                    dtype_load(d.src_dtype, src, (size_t)(k * d.src_stride[nd - 1])));
    }
    for (int i = nd - 2; i >= 0; i--) { /* odometer over the outer dimensions */
      if (++idx[i] < d.shape[i]) break;
      idx[i] = 0;
    }
  }
  return STATUS_OK;
}

static fsdpc_status_t cpu_fill(int index, void *ptr, size_t elem_size, size_t n, uint64_t pattern) {
  (void)index;
  char *p = ptr;
  if (n == 0) return STATUS_OK;
  memcpy(p, &pattern, elem_size); /* little-endian: the low bytes hold the element */
  size_t done = 1;
  while (done < n) { /* doubling copies */
    size_t chunk = done < n - done ? done : n - done;
    memcpy(p + done * elem_size, p, chunk * elem_size);
    done += chunk;
  }
  return STATUS_OK;
}

static fsdpc_status_t cpu_stream_sync(int index) {
  (void)index;
  return STATUS_OK;
}

static const backend_t cpu_table = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .stream_sync = cpu_stream_sync,
};

const backend_t *cpu_backend(void) { return &cpu_table; }
