#include "core/device.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/args_impl.h"
#include "core/backend_impl.h"

/* Slot 0 is the host; slots 1.. are CUDA devices. */
static _Atomic size_t mem_current[1 + DEVICE_MAX_CUDA];
static _Atomic size_t mem_peak[1 + DEVICE_MAX_CUDA];
static _Atomic size_t mem_comm[1 + DEVICE_MAX_CUDA];
static _Atomic size_t mem_allocs[1 + DEVICE_MAX_CUDA];

static int mem_slot(device_t dev) {
  if (dev.type == DEVICE_CPU) return 0;
  if (dev.index < 0 || dev.index >= DEVICE_MAX_CUDA) return -1;
  return 1 + dev.index;
}

static void mem_account_add(int slot, size_t bytes) {
  atomic_fetch_add(&mem_allocs[slot], 1);
  size_t now = atomic_fetch_add(&mem_current[slot], bytes) + bytes;
  size_t peak = atomic_load(&mem_peak[slot]);
  while (now > peak && !atomic_compare_exchange_weak(&mem_peak[slot], &peak, now)) {
  }
}

mem_stats_t mem_stats(device_t dev) {
  int slot = mem_slot(dev);
  if (slot < 0) return (mem_stats_t){0, 0, 0, 0};
  return (mem_stats_t){atomic_load(&mem_current[slot]), atomic_load(&mem_peak[slot]),
                       atomic_load(&mem_comm[slot]), atomic_load(&mem_allocs[slot])};
}

void mem_note_comm(device_t dev, size_t bytes, bool held) {
  int slot = mem_slot(dev);
  if (slot < 0) return;
  if (held)
    atomic_fetch_add(&mem_comm[slot], bytes);
  else
    atomic_fetch_sub(&mem_comm[slot], bytes);
}

void mem_reset_peak(device_t dev) {
  int slot = mem_slot(dev);
  if (slot >= 0) atomic_store(&mem_peak[slot], atomic_load(&mem_current[slot]));
}

size_t mem_os_allocs(device_t dev) { return dev.type == DEVICE_CPU ? cpu_host_os_allocs() : 0; }

void mem_empty_cache(device_t dev) {
  if (dev.type == DEVICE_CPU) cpu_host_empty_cache();
}

static device_wait_hook_t _Atomic wait_hook;

void device_set_wait_hook(device_wait_hook_t hook) { atomic_store(&wait_hook, hook); }
device_wait_hook_t device_wait_hook(void) { return atomic_load(&wait_hook); }

double device_clock_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static _Atomic size_t host_waits;

size_t device_host_waits(void) { return atomic_load(&host_waits); }

fsdpc_status_t device_poll(int (*ready)(void *ctx, fsdpc_status_t *st), void *ctx,
                           const char *what) {
  ARG_NONNULL(ready);
  atomic_fetch_add(&host_waits, 1);
  double start = device_clock_seconds(), next_ask = 1e-3;
  for (;;) {
    fsdpc_status_t st = STATUS_OK;
    int r = ready(ctx, &st);
    if (r > 0) return STATUS_OK;
    if (r < 0) return st != STATUS_OK ? st : err_set(STATUS_EINTERNAL, "%s failed", what);
    double waited = device_clock_seconds() - start;
    device_wait_hook_t hook = atomic_load(&wait_hook);
    if (hook != NULL && waited >= next_ask) {
      FSDPC_TRY(hook(what, waited));
      next_ask = waited + 1e-3;
    }
    if (waited < 1e-3) { /* short waits (most): poll */
      sched_yield();
    } else {
      struct timespec nap = {0, 20000}; /* 20 us */
      nanosleep(&nap, NULL);
    }
  }
}

const char *device_str(device_t dev, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  if (dev.type == DEVICE_CPU)
    snprintf(buf, size, "cpu");
  else
    snprintf(buf, size, "cuda:%d", dev.index);
  return buf;
}

int device_cuda_compiled(void) { return cuda_backend() != NULL; }

int device_cuda_count(void) { return cuda_backend() ? cuda_backend()->device_count() : 0; }

static const char *const want_names[] = {"auto", "cpu", "cuda"};

int device_want_parse(const char *s, device_want_t *out) {
  for (int i = 0; i < 3; i++)
    if (s != NULL && strcmp(s, want_names[i]) == 0) {
      *out = (device_want_t)i;
      return 1;
    }
  return 0;
}

const char *device_want_name(device_want_t w) {
  return w >= DEVICE_WANT_AUTO && w <= DEVICE_WANT_CUDA ? want_names[w] : "?";
}

const char *device_uuid_str(const device_uuid_t *u, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  if (u == NULL) {
    snprintf(buf, size, "?");
    return buf;
  }
  const uint8_t *b = u->b;
  snprintf(buf, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
           b[14], b[15]);
  return buf;
}

fsdpc_status_t device_cuda_uuid(int index, device_uuid_t *out) {
  ARG_NONNULL(out);
  memset(out, 0, sizeof *out);
  int n = device_cuda_count();
  if (index < 0 || index >= n)
    return err_set(STATUS_ENODEV, "cuda:%d requested, but %d CUDA device(s) are present", index, n);
  return cuda_backend()->device_uuid(index, out->b);
}

fsdpc_status_t device_choose_node(device_want_t want, int local_ranks, const device_seen_t *seen,
                                  int me, bool may_share, device_type_t *out, char *why,
                                  size_t why_size) {
  ARG_NONNULL(out);
  ARG_NONNULL(seen);
  if (why != NULL && why_size > 0) why[0] = 0;
  *out = DEVICE_CPU;
  if (want == DEVICE_WANT_CPU) return STATUS_OK;
  if (want != DEVICE_WANT_AUTO && want != DEVICE_WANT_CUDA)
    return err_set(STATUS_EINVAL, "device_choose_node: unknown choice %d", (int)want);
  if (local_ranks < 1 || me < 0 || me >= local_ranks)
    return err_set(STATUS_EINVAL, "device_choose_node: local rank %d of %d", me, local_ranks);
  char text[512] = "", way[160] = "";
  if (seen[me].count <= 0) {
    snprintf(text, sizeof text, "%s",
             device_cuda_compiled() ? "this rank sees no CUDA device (no GPU, no driver, or "
                                      "CUDA_VISIBLE_DEVICES hides them)"
                                    : "the library was built without CUDA");
  } else {
    for (int r = 0; r < local_ranks && !text[0]; r++)
      if (seen[r].count <= 0)
        snprintf(text, sizeof text, "local rank %d of this node sees no CUDA device", r);
    for (int a = 0; a < local_ranks && !text[0] && !may_share; a++)
      for (int b = a + 1; b < local_ranks && !text[0]; b++)
        if (memcmp(&seen[a].pick, &seen[b].pick, sizeof seen[a].pick) == 0) {
          char u[48];
          int most = seen[me].count;
          snprintf(text, sizeof text,
                   "local ranks %d and %d of this node would share CUDA device %s (%d rank%s, "
                   "%d device%s seen by rank %d; NCCL needs one per rank)",
                   a, b, device_uuid_str(&seen[a].pick, u, sizeof u), local_ranks,
                   local_ranks == 1 ? "" : "s", seen[a].count, seen[a].count == 1 ? "" : "s", a);
          snprintf(way, sizeof way,
                   "start at most %d rank%s per node, or give each rank a device of its own "
                   "(Slurm: --gpus-per-task=1)",
                   most, most == 1 ? "" : "s");
        }
  }
  if (!text[0]) {
    *out = DEVICE_CUDA;
    return STATUS_OK;
  }
  if (want == DEVICE_WANT_AUTO) {
    /* a rank that sees no device at all needs no word: the CPU is what auto means there */
    bool seen_any = false;
    for (int r = 0; r < local_ranks; r++) seen_any |= seen[r].count > 0;
    if (seen_any && why != NULL)
      snprintf(why, why_size, "%s: running on the CPU%s%s", text, way[0] ? "; " : "", way);
    return STATUS_OK;
  }
  return err_set(STATUS_ENODEV, "%s: %s%sask for the CPU (cpu)%s", text, way, way[0] ? ", or " : "",
                 way[0] ? "" : ", or for auto");
}

fsdpc_status_t device_check(device_t dev) {
  if (dev.type == DEVICE_CPU) return STATUS_OK;
  if (dev.type != DEVICE_CUDA) return err_set(STATUS_EINVAL, "unknown device type %d", dev.type);
  if (!device_cuda_compiled())
    return err_set(STATUS_ENODEV, "cuda:%d requested, but the library was built without CUDA",
                   dev.index);
  int n = device_cuda_count();
  if (dev.index < 0 || dev.index >= n || dev.index >= DEVICE_MAX_CUDA)
    return err_set(STATUS_ENODEV, "cuda:%d requested, but %d CUDA device(s) are present", dev.index,
                   n);
  return STATUS_OK;
}

static const backend_t *backend_of(device_t dev) {
  return dev.type == DEVICE_CUDA ? cuda_backend() : cpu_backend();
}

static fsdpc_status_t alloc_as(device_t dev, size_t bytes, bool zeroed, void **out) {
  if (out == NULL) return err_set(STATUS_EINVAL, "device_alloc: out is NULL");
  *out = NULL;
  FSDPC_TRY(device_check(dev));
  if (bytes == 0) return STATUS_OK;
  FSDPC_TRY(backend_of(dev)->alloc(dev.index, bytes, zeroed, out));
  mem_account_add(mem_slot(dev), bytes);
  return STATUS_OK;
}

static void free_as(device_t dev, void *ptr, size_t bytes, bool zeroed) {
  if (ptr == NULL) return;
  backend_of(dev)->free(dev.index, ptr, bytes, zeroed);
  atomic_fetch_sub(&mem_current[mem_slot(dev)], bytes);
}

fsdpc_status_t device_alloc(device_t dev, size_t bytes, void **out) {
  return alloc_as(dev, bytes, false, out);
}
void device_free(device_t dev, void *ptr, size_t bytes) { free_as(dev, ptr, bytes, false); }

fsdpc_status_t device_alloc_zeroed(device_t dev, size_t bytes, void **out) {
  return alloc_as(dev, bytes, true, out);
}
void device_free_zeroed(device_t dev, void *ptr, size_t bytes) { free_as(dev, ptr, bytes, true); }

fsdpc_status_t device_memcpy(device_t dst_dev, void *dst, device_t src_dev, const void *src,
                             size_t bytes) {
  if (bytes == 0) return STATUS_OK;
  if (dst == NULL || src == NULL) return err_set(STATUS_EINVAL, "device_memcpy: NULL pointer");
  if (dst_dev.type == DEVICE_CPU && src_dev.type == DEVICE_CPU) {
    memmove(dst, src, bytes);
    return STATUS_OK;
  }
  FSDPC_TRY(device_check(dst_dev));
  FSDPC_TRY(device_check(src_dev));
  return cuda_backend()->memcpy(dst_dev, dst, src_dev, src, bytes);
}

fsdpc_status_t device_upload(device_t dev, void *dst, const void *src, size_t bytes) {
  if (bytes == 0) return STATUS_OK;
  if (dst == NULL || src == NULL) return err_set(STATUS_EINVAL, "device_upload: NULL pointer");
  if (dev.type == DEVICE_CPU) {
    memmove(dst, src, bytes);
    return STATUS_OK;
  }
  FSDPC_TRY(device_check(dev));
  return cuda_backend()->upload(dev.index, dst, src, bytes);
}

fsdpc_status_t device_stream_sync(device_t dev) {
  FSDPC_TRY(device_check(dev));
  return backend_of(dev)->stream_sync(dev.index);
}

stream_t *stream_current(device_t dev) {
  if (dev.type != DEVICE_CUDA || !device_cuda_compiled()) return NULL;
  return cuda_backend()->stream_current(dev.index);
}

void stream_set_current(device_t dev, stream_t *s) {
  if (dev.type == DEVICE_CUDA && device_cuda_compiled())
    cuda_backend()->stream_set_current(dev.index, s);
}

static fsdpc_status_t stream_new_at(device_t dev, bool high, stream_t **out) {
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(device_check(dev));
  if (dev.type == DEVICE_CPU) return STATUS_OK;
  return backend_of(dev)->stream_new(dev.index, high, out);
}

fsdpc_status_t stream_new(device_t dev, stream_t **out) { return stream_new_at(dev, false, out); }

fsdpc_status_t device_staging_alloc(device_t dev, size_t bytes, void **out) {
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(device_check(dev));
  if (bytes == 0) return STATUS_OK;
  if (dev.type == DEVICE_CUDA) return cuda_backend()->host_alloc_pinned(bytes, out);
  size_t rounded = (bytes + 63) / 64 * 64;
  *out = aligned_alloc(64, rounded);
  if (*out == NULL) return err_set(STATUS_ENOMEM, "staging memory: %zu bytes", bytes);
  return STATUS_OK;
}

fsdpc_status_t device_pin_host_memory(device_t dev) {
  FSDPC_TRY(device_check(dev));
  if (dev.type == DEVICE_CUDA)
    cpu_host_set_pinning(cuda_backend()->host_register, cuda_backend()->host_unregister);
  return STATUS_OK;
}

void device_staging_free(device_t dev, void *p) {
  if (p == NULL) return;
  if (dev.type == DEVICE_CUDA && cuda_backend() != NULL)
    cuda_backend()->host_free_pinned(p);
  else
    free(p);
}

fsdpc_status_t stream_copy_async(device_t dev, stream_t *s, void *dst, const void *src,
                                 size_t bytes) {
  if (bytes == 0) return STATUS_OK;
  if (dst == NULL || src == NULL) return err_set(STATUS_EINVAL, "stream_copy_async: NULL pointer");
  FSDPC_TRY(device_check(dev));
  if (dev.type == DEVICE_CPU) {
    memmove(dst, src, bytes);
    return STATUS_OK;
  }
  if (s == NULL) s = stream_current(dev);
  return cuda_backend()->copy_async(s, dst, src, bytes);
}

fsdpc_status_t stream_delay(device_t dev, stream_t *s, double seconds) {
  FSDPC_TRY(device_check(dev));
  if (dev.type == DEVICE_CPU || seconds <= 0) return STATUS_OK;
  if (s == NULL) s = stream_current(dev);
  return cuda_backend()->delay(s, seconds);
}
fsdpc_status_t stream_new_high(device_t dev, stream_t **out) {
  return stream_new_at(dev, true, out);
}

void stream_free(stream_t *s) {
  if (s != NULL) cuda_backend()->stream_free(s); /* only CUDA makes streams */
}

fsdpc_status_t stream_wait_event(stream_t *s, event_t *e) {
  if (s == NULL || e == NULL) return STATUS_OK;
  return cuda_backend()->stream_wait_event(s, e);
}

fsdpc_status_t stream_synchronize(stream_t *s) {
  return s == NULL ? STATUS_OK : cuda_backend()->stream_synchronize(s);
}

fsdpc_status_t event_new(device_t dev, event_t **out) {
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(device_check(dev));
  if (dev.type == DEVICE_CPU) return STATUS_OK;
  return backend_of(dev)->event_new(dev.index, out);
}

void event_free(event_t *e) {
  if (e != NULL) cuda_backend()->event_free(e);
}

fsdpc_status_t event_record(event_t *e, stream_t *s) {
  return e == NULL ? STATUS_OK : cuda_backend()->event_record(e, s);
}

fsdpc_status_t event_synchronize(event_t *e) {
  return e == NULL ? STATUS_OK : cuda_backend()->event_synchronize(e);
}
