/*
 * Devices, streams, events and the one accounting point for memory.
 *
 * A device is a plain value: the host CPU or CUDA device i. Every allocation of tensor
 * memory goes through device_alloc()/device_free(), which keep the current and peak byte
 * counts per device:
 *
 *   void *p;
 *   FSDPC_TRY(device_alloc(device_cuda(0), 1 << 20, &p));   // from CUDA's stream-ordered pool
 *   mem_stats_t s = mem_stats(device_cuda(0));        // s.current == 1 << 20
 *   device_free(device_cuda(0), p, 1 << 20);
 *
 * CUDA work of this thread runs on the device's current stream (stream_current()); a
 * library-owned non-blocking stream per device unless stream_set_current() chose another.
 * Host code that reads device results copies them with tensor_copy(), which waits for that
 * one stream, never for the whole device. On the CPU, streams and events are NULL and every
 * operation completes before it returns.
 */
#ifndef FSDPC_BASE_DEVICE_H
#define FSDPC_BASE_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define DEVICE_MAX_CUDA 16

typedef enum device_type { DEVICE_CPU = 0, DEVICE_CUDA = 1 } device_type_t;

typedef struct device {
  device_type_t type;
  int index; /* CUDA ordinal; 0 for the CPU */
} device_t;

static inline device_t device_cpu(void) { return (device_t){DEVICE_CPU, 0}; }
static inline device_t device_cuda(int index) { return (device_t){DEVICE_CUDA, index}; }
static inline int device_equal(device_t a, device_t b) {
  return a.type == b.type && a.index == b.index;
}

/* "cpu" or "cuda:N" into buf (at least 16 bytes); returns buf. */
const char *device_str(device_t dev, char *buf, size_t size);

/* 1 when the library was built with CUDA support. */
int device_cuda_compiled(void);

/* Number of usable CUDA devices: 0 without CUDA support, without a driver or without a GPU. */
int device_cuda_count(void);

/* Which device a program asks for: the CPU, CUDA, or CUDA where every rank of the node has a
 * device of its own (NCCL refuses two ranks on one device). */
typedef enum device_want { DEVICE_WANT_AUTO = 0, DEVICE_WANT_CPU, DEVICE_WANT_CUDA } device_want_t;

/* "auto", "cpu" or "cuda" into *out; false for anything else. */
int device_want_parse(const char *s, device_want_t *out);
const char *device_want_name(device_want_t w);

/* A CUDA device's identity, the same in every process that sees it whatever its ordinal
 * there (CUDA_VISIBLE_DEVICES and cgroups renumber the devices a process sees). */
typedef struct device_uuid {
  uint8_t b[16];
} device_uuid_t;

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's spelling) into buf (at least 41
 * bytes); returns buf. */
const char *device_uuid_str(const device_uuid_t *u, char *buf, size_t size);

/* The UUID of this process's CUDA device index (0 .. device_cuda_count() - 1). */
fsdpc_status_t device_cuda_uuid(int index, device_uuid_t *out);

/* What a rank of a node reports for the choice: how many CUDA devices it sees and the UUID of
 * the one it would take, its local rank modulo that count (nothing when it sees none). */
typedef struct device_seen {
  int count;
  device_uuid_t pick;
} device_seen_t;

/* The device type of local rank me of a node whose local_ranks ranks see seen[0 ..
 * local_ranks - 1], under want:
 *   cpu:  the CPU;
 *   auto: CUDA when every rank sees a device and no two would take the same one; else the
 *         CPU, and why (why_size bytes, may be NULL) names the rank that sees none or the two
 *         that would share one (NCCL refuses two ranks on a device); else why is "";
 *   cuda: the same choice, with STATUS_ENODEV naming the rank or ranks and the way out where
 *         auto would take the CPU.
 * One visible device per rank (Slurm's --gpus-per-task=1, CUDA_VISIBLE_DEVICES=$LOCAL_RANK)
 * and every device visible to every rank both give each rank its own. may_share: ranks may
 * share a device (the host-staged process groups; NCCL refuses it), so only a rank that sees
 * none falls short. Local: no device or MPI call (world_choose_device gathers seen over the
 * node and applies it). */
fsdpc_status_t device_choose_node(device_want_t want, int local_ranks, const device_seen_t *seen,
                                  int me, bool may_share, device_type_t *out, char *why,
                                  size_t why_size);

/* Checks that dev exists (the CPU always does). */
fsdpc_status_t device_check(device_t dev);

/* Allocates bytes on dev (64-byte aligned on the host; CUDA's stream-ordered pool on the
 * current stream for CUDA) and accounts for them. bytes == 0 gives *out == NULL. */
fsdpc_status_t device_alloc(device_t dev, size_t bytes, void **out);

/* Releases memory from device_alloc; bytes must be the size it was allocated with.
 * device_free(dev, NULL, 0) is a no-op. */
void device_free(device_t dev, void *ptr, size_t bytes);

/* device_alloc of zero-filled memory (on the host, blocks of 1 MiB or more come zeroed from
 * the operating system, outside the malloc heap). Release it with device_free_zeroed. */
fsdpc_status_t device_alloc_zeroed(device_t dev, size_t bytes, void **out);
void device_free_zeroed(device_t dev, void *ptr, size_t bytes);

/* Copies bytes between any two devices (host<->device, device<->device). Blocks until the
 * data is usable by the host when dst is the host; otherwise ordered on the current stream. */
fsdpc_status_t device_memcpy(device_t dst_dev, void *dst, device_t src_dev, const void *src,
                             size_t bytes);

/* Copies bytes from the host to dev without waiting for the device: the bytes are staged
 * through page-locked memory, and the call returns once src may be reused. The copy is ordered
 * on dev's current stream: only work on that stream, or ordered after it by an event, may read
 * dst. On the CPU a plain copy. */
fsdpc_status_t device_upload(device_t dev, void *dst, const void *src, size_t bytes);

/* Waits until all work queued on the current stream of dev is done (no-op on the CPU). */
fsdpc_status_t device_stream_sync(device_t dev);

/* ---- host waits for device work ----
 *
 * A host wait for device work (device_stream_sync, a copy to the host, stream_synchronize,
 * event_synchronize) polls rather than blocks, and about every millisecond asks the wait
 * hook, when one is set, whether to go on: a status other than STATUS_OK ends the wait with
 * that status (the work stays queued). The world (mesh/world.h) sets the hook: it ends a wait
 * once the job is stopped or the wait outlasts the collective watchdog, aborting the NCCL
 * communicators first, so that a collective a rank will never join cannot hang the others. */
typedef fsdpc_status_t (*device_wait_hook_t)(const char *what, double waited_s);
void device_set_wait_hook(device_wait_hook_t hook);
device_wait_hook_t device_wait_hook(void);

/* Calls ready(ctx, &st) until it returns 1 (done), or -1 (failed: returns st), asking the
 * wait hook between polls (what names the wait; waited_s counts from the first poll). The
 * loop of every host wait above. */
fsdpc_status_t device_poll(int (*ready)(void *ctx, fsdpc_status_t *st), void *ctx,
                           const char *what);

/* How many host waits (device_poll calls) this process has made: a training micro-step on a
 * GPU makes none (tests compare the count before and after one). */
size_t device_host_waits(void);

/* Seconds on the system's monotonic clock: the differences of two calls time an interval. */
double device_clock_seconds(void);

/* ---- memory accounting ---- */

typedef struct mem_stats {
  size_t current; /* bytes allocated now */
  size_t peak;    /* highest value of current since start or the last reset */
  size_t comm;    /* bytes the collective library (NCCL) holds on the device, apart from current
                   * and peak: measured as the drop in the device's free memory while each of
                   * its communicators was made, given back when it is closed */
  size_t allocs;  /* allocations so far (device_alloc and device_alloc_zeroed calls that took
                   * memory): on a GPU each is a call into the driver's pool allocator */
} mem_stats_t;

mem_stats_t mem_stats(device_t dev);

/* Sets peak to the current value. */
void mem_reset_peak(device_t dev);

/* Counts bytes the collective library took (held) or gave back (!held) on dev in its comm. */
void mem_note_comm(device_t dev, size_t bytes, bool held);

/* Host memory is cached: freed blocks of 64 KiB and more are kept and handed out again for
 * the same size, live plus cached bytes staying under 1.25 times their peak (CUDA memory
 * comes from CUDA's own pool allocator). mem_os_allocs counts the blocks the CPU cache has
 * taken from the operating system (a steady training step takes none; 0 for CUDA devices);
 * mem_empty_cache gives the cached blocks back and restarts the peak the bound follows from
 * the live bytes (CPU; a no-op for CUDA). */
size_t mem_os_allocs(device_t dev);
void mem_empty_cache(device_t dev);

/* ---- streams and events (CUDA; NULL handles on the CPU) ---- */

typedef struct stream stream_t;
typedef struct event event_t;

/* The current stream of this thread on dev (never freed by the caller). */
stream_t *stream_current(device_t dev);

/* Makes s (created by stream_new on the same device, or NULL for the library stream) the
 * current stream of this thread on dev. */
void stream_set_current(device_t dev, stream_t *s);

/* Creates a non-blocking stream on dev; *out is NULL on the CPU. Free with stream_free. */
fsdpc_status_t stream_new(device_t dev, stream_t **out);
/* stream_new at the device's highest priority: work queued there is scheduled ahead of work
 * of the default priority (the library's side streams for communication and its copies, so
 * that they are not stuck behind queued compute). */
fsdpc_status_t stream_new_high(device_t dev, stream_t **out);
void stream_free(stream_t *s);
fsdpc_status_t stream_wait_event(stream_t *s, event_t *e);
fsdpc_status_t stream_synchronize(stream_t *s);

/* Events are created without timing. event_record(e, s) captures the work queued on s. */
fsdpc_status_t event_new(device_t dev, event_t **out);
void event_free(event_t *e);
fsdpc_status_t event_record(event_t *e, stream_t *s);
fsdpc_status_t event_synchronize(event_t *e);

/* ---- host staging (the host-staged process group: device data exchanged through host
 * memory) ---- */

/* Host memory for dev's asynchronous copies: page-locked on CUDA, plain (64-byte aligned) on
 * the CPU. bytes == 0 gives NULL. Free with device_staging_free on the same device. */
fsdpc_status_t device_staging_alloc(device_t dev, size_t bytes, void **out);
void device_staging_free(device_t dev, void *p);

/* On a CUDA device: the host tensors of 4 MiB and more made from now on are page-locked, so
 * that their copies to and from dev run at the bus's speed and beside the compute (fully_shard's
 * offloaded state asks for it); those the system refuses to lock stay pageable. A no-op on the
 * CPU. */
fsdpc_status_t device_pin_host_memory(device_t dev);

/* Copies bytes between dev's memory and staging memory (either way), ordered on s (a stream
 * of dev) after the work queued there, without waiting for it; on the CPU, at once. */
fsdpc_status_t stream_copy_async(device_t dev, stream_t *s, void *dst, const void *src,
                                 size_t bytes);

/* Queues on s a kernel that keeps it busy for about seconds, delaying the work queued after
 * it (tests that make a missing stream order show as a wrong result); a no-op on the CPU. */
fsdpc_status_t stream_delay(device_t dev, stream_t *s, double seconds);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
