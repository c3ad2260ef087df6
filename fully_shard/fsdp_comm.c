/* fully_shard's data path: unshard (copy-in, all-gather, copy-out), reshard, and the
 * post-backward reduce-scatter / all-reduce of gradients; and the one-rank path, which has
 * nothing to gather or add up and skips the flat buffers.
 *
 * On CUDA, copy-in runs on the device's copy-in stream and reductions on its reduce stream;
 * each waits for the compute stream by an event recorded where the work is issued, and the
 * compute stream waits for the all-gather (pg_wait) and, at the end of backward, for the
 * last reduction. Memory is stream-ordered: a buffer is freed on the stream that last used
 * it, or on one ordered after that. Nothing synchronises the device. On the CPU the streams
 * are absent and the collectives are nonblocking MPI ones completed at the same points. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/fast_path_impl.h"
#include "core/kernels.h"
#include "fully_shard/fsdp_impl.h"

/* ---- streams ---- */

static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
static fsdp_streams_t device_streams[DEVICE_MAX_CUDA];

fsdpc_status_t fsdp_streams_of(device_t dev, fsdp_streams_t **out) {
  *out = NULL;
  if (dev.type != DEVICE_CUDA) return STATUS_OK;
  if (dev.index < 0 || dev.index >= DEVICE_MAX_CUDA)
    return err_set(STATUS_ENODEV, "fully_shard: no CUDA device %d", dev.index);
  fsdp_streams_t *s = &device_streams[dev.index];
  fsdpc_status_t st = STATUS_OK;
  pthread_mutex_lock(&streams_lock);
  if (s->reduced == NULL) {
    st = stream_new_high(dev, &s->copy_in);
    if (st == STATUS_OK) st = stream_new_high(dev, &s->reduce);
    if (st == STATUS_OK) st = stream_new_high(dev, &s->all_reduce);
    if (st == STATUS_OK) st = event_new(dev, &s->issued);
    if (st == STATUS_OK) st = event_new(dev, &s->packed);
    if (st == STATUS_OK) st = event_new(dev, &s->scattered);
    if (st == STATUS_OK) st = event_new(dev, &s->reduced);
    if (st != STATUS_OK) {
      stream_free(s->copy_in);
      stream_free(s->reduce);
      stream_free(s->all_reduce);
      event_free(s->issued);
      event_free(s->packed);
      event_free(s->scattered);
      memset(s, 0, sizeof *s);
    }
  }
  pthread_mutex_unlock(&streams_lock);
  if (st == STATUS_OK) *out = s;
  return st;
}

/* Makes side (one of g's side streams) the current stream of dev; with after_current,
 * ordered after all work queued so far on the stream that was current, through the device's
 * issued event (a wait takes the event as recorded at that moment, so one event serves every
 * call). *prev receives that stream. No-op on the CPU. */
static fsdpc_status_t side_enter(const fsdp_group_t *g, device_t dev, stream_t *side,
                                 bool after_current, stream_t **prev) {
  *prev = stream_current(dev);
  if (side == NULL) return STATUS_OK;
  if (after_current) {
    FSDPC_TRY(event_record(g->streams->issued, *prev));
    FSDPC_TRY(stream_wait_event(side, g->streams->issued));
  }
  stream_set_current(dev, side);
  return STATUS_OK;
}

static void side_exit(device_t dev, stream_t *side, stream_t *prev) {
  if (side != NULL) stream_set_current(dev, prev);
}

static stream_t *copy_in_stream(const fsdp_group_t *g) {
  return g->streams ? g->streams->copy_in : NULL;
}
static stream_t *reduce_stream(const fsdp_group_t *g) {
  return g->streams ? g->streams->reduce : NULL;
}

/* ---- unshard / reshard ---- */

/* The one-rank path (fsdp.h): one rank with its shards where it computes. Its shard is the
 * whole tensor (W = 1 leaves no padding rows), so unshard views it, or casts it once into
 * param_dtype, without the flat buffer and its two copies. */
static fast_path_t one_rank =
    FAST_PATH_INIT("FSDPC_FSDP_ONE_RANK", "fsdp_set_one_rank_path(false)");

void fsdp_set_one_rank_path(bool on) { fast_path_set(&one_rank, on); }

static bool one_rank_group(const fsdp_group_t *g) {
  return g->W == 1 && !g->offload && fast_path_off(&one_rank)[0] == '\0';
}

static bool local_unshard(const fsdp_group_t *g) {
  return one_rank_group(g) && g->post_forward_slice.storage == NULL;
}

void fsdp_emit(fsdp_group_t *g, const char *event) {
  if (g->on_event) g->on_event(event, g, g->on_event_user);
}

/* Copies gathered for one tensor_copy_many: FSDP's copy-in, copy-out and gradient packing
 * each go to the device as one launch rather than one per parameter and rank. A zeroed list
 * is empty. */
enum { kCopiesInline = 32 }; /* two units' parameters: their lists stay off the heap */
typedef struct copies {
  fsdpc_tensor_t *dst, *src; /* the inline arrays, then the heap's once they are full */
  int n, cap;
  fsdpc_tensor_t dst_in[kCopiesInline], src_in[kCopiesInline];
} copies_t;

/* Doubles c's capacity, on the heap. */
static bool copies_grow(copies_t *c) {
  int cap = 2 * c->cap;
  fsdpc_tensor_t *d = malloc(sizeof *d * (size_t)cap), *s = malloc(sizeof *s * (size_t)cap);
  if (d == NULL || s == NULL) {
    free(d);
    free(s);
    return false;
  }
  memcpy(d, c->dst, sizeof *d * (size_t)c->n);
  memcpy(s, c->src, sizeof *s * (size_t)c->n);
  if (c->dst != c->dst_in) {
    free(c->dst);
    free(c->src);
  }
  c->dst = d;
  c->src = s;
  c->cap = cap;
  return true;
}

/* When st is STATUS_OK, adds the copy of src into dst to c, which takes both tensors (the
 * caller's are zeroed); otherwise, or when c cannot grow, frees them. Returns the status. */
static fsdpc_status_t copies_add(copies_t *c, fsdpc_status_t st, fsdpc_tensor_t *dst,
                                 fsdpc_tensor_t *src) {
  if (st == STATUS_OK && c->cap == 0) {
    c->dst = c->dst_in;
    c->src = c->src_in;
    c->cap = kCopiesInline;
  }
  if (st == STATUS_OK && c->n == c->cap && !copies_grow(c))
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory for %d copies", 2 * c->cap);
  if (st != STATUS_OK) {
    tensor_free(dst);
    tensor_free(src);
    return st;
  }
  c->dst[c->n] = *dst;
  c->src[c->n++] = *src;
  memset(dst, 0, sizeof *dst);
  memset(src, 0, sizeof *src);
  return STATUS_OK;
}

static void copies_free(copies_t *c) {
  for (int i = 0; i < c->n; i++) {
    tensor_free(&c->dst[i]);
    tensor_free(&c->src[i]);
  }
  if (c->dst != c->dst_in) {
    free(c->dst);
    free(c->src);
  }
  c->dst = c->src = NULL;
  c->n = c->cap = 0;
}

/* Runs the gathered copies (when st is STATUS_OK) and frees the list. */
static fsdpc_status_t copies_run(copies_t *c, fsdpc_status_t st) {
  if (st == STATUS_OK) st = tensor_copy_many(c->dst, c->src, c->n);
  copies_free(c);
  return st;
}

/* Adds the copy of chunk r (of W, the chunk rule on dimension dim) of full to or from a flat
 * buffer, where it lies contiguously, in the chunk's own shape, from element pos. Empty chunks
 * add nothing. */
static fsdpc_status_t add_chunk_of(copies_t *c, int dim, int W, int r, fsdpc_tensor_t *full,
                                   fsdpc_tensor_t *flat, int64_t pos, bool to_flat) {
  int64_t start, len, shape[TENSOR_MAX_DIMS], extent = full->shape[dim];
  placement_chunk_range(extent, W, r, &start, &len);
  if (len == 0) return STATUS_OK;
  memcpy(shape, full->shape, sizeof shape);
  shape[dim] = len;
  fsdpc_tensor_t rows = {0}, slot = {0}, slot_nd = {0};
  fsdpc_status_t st = tensor_narrow(&rows, full, dim, start, len);
  if (st == STATUS_OK) st = tensor_narrow(&slot, flat, 0, pos, tensor_numel(&rows));
  if (st == STATUS_OK) st = tensor_view(&slot_nd, &slot, full->ndim, shape);
  tensor_free(&slot);
  return to_flat ? copies_add(c, st, &slot_nd, &rows) : copies_add(c, st, &rows, &slot_nd);
}

/* The same for fp's unsharded tensor (or its gradient) chunked over the shard group. */
static fsdpc_status_t add_chunk(copies_t *c, const fsdp_param_t *fp, int W, int r,
                                fsdpc_tensor_t *full, fsdpc_tensor_t *flat, int64_t pos,
                                bool to_flat) {
  return add_chunk_of(c, fp->dim, W, r, full, flat, pos, to_flat);
}

/* *out: the first len rows (along fp's shard dimension) of flat from element pos, viewed in
 * the shard's shape. */
static fsdpc_status_t rows_at(const fsdp_param_t *fp, const fsdpc_tensor_t *flat, int64_t pos,
                              int64_t len, fsdpc_tensor_t *out) {
  int64_t shape[TENSOR_MAX_DIMS];
  memcpy(shape, fp->shape, sizeof shape);
  shape[fp->dim] = len;
  fsdpc_tensor_t head = {0};
  fsdpc_status_t st = tensor_narrow(&head, flat, 0, pos, len * fp->row);
  if (st == STATUS_OK) st = tensor_view(out, &head, fp->ndim, shape);
  tensor_free(&head);
  return st;
}

/* HFSDP: the 1/S shards brought up to date from the masters, one all-gather over the
 * replicas: every replica's chunk of each shard, in the shards' dtype. On the current stream,
 * before anything reads the shards. */
static fsdpc_status_t replica_refresh(fsdp_group_t *g) {
  device_t dev = mesh_device(g->mesh);
  int64_t total = g->sub_block * g->R;
  fsdpc_tensor_t buf;
  FSDPC_TRY(tensor_zeros(&buf, g->own_dtype, dev, 1, &total));
  copies_t c = {0};
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) { /* this replica's chunks, packed */
    fsdp_param_t *fp = &g->params[i];
    fsdpc_tensor_t slot = {0}, master = {0};
    st = rows_at(fp, &buf, g->rrank * g->sub_block + fp->sub_offset, fp->master.shape[fp->dim],
                 &slot);
    if (st == STATUS_OK) st = tensor_ref(&master, &fp->master);
    st = copies_add(&c, st, &slot, &master);
  }
  st = copies_run(&c, st);
  char *base = buf.data;
  if (st == STATUS_OK)
    st = pg_all_gather(g->replicate,
                       base + (size_t)(g->rrank * g->sub_block) * dtype_size(g->own_dtype),
                       buf.data, (size_t)g->sub_block, g->own_dtype, NULL);
  for (int i = 0; i < g->n && st == STATUS_OK; i++) { /* every replica's, into the shard */
    fsdp_param_t *fp = &g->params[i];
    fsdpc_tensor_t shard = {0};
    st = rows_at(fp, &fp->padded, 0, fp->len, &shard);
    for (int q = 0; q < g->R && st == STATUS_OK; q++)
      st = add_chunk_of(&c, fp->dim, g->R, q, &shard, &buf, q * g->sub_block + fp->sub_offset,
                        false);
    tensor_free(&shard);
  }
  st = copies_run(&c, st);
  tensor_free(&buf);
  if (st == STATUS_OK) g->stale = false;
  return st;
}

/* *out: fp's padded shard where copy-in reads it, on dev: the shard itself, or, offloaded,
 * its bytes uploaded into a device tensor on the current stream without a host wait (the
 * cast into param_dtype then runs on the device, with the other copies of the group). */
static fsdpc_status_t shard_on_device(const fsdp_group_t *g, const fsdp_param_t *fp, device_t dev,
                                      fsdpc_tensor_t *out) {
  int64_t n = fp->rows * fp->row;
  if (!g->offload) return tensor_view(out, &fp->padded, 1, &n);
  FSDPC_TRY(tensor_init(out, fp->padded.dtype, dev, 1, &n));
  fsdpc_status_t st =
      stream_copy_async(dev, stream_current(dev), out->data, fp->padded.data, tensor_nbytes(out));
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

/* Starts gathering the group: copy-in and a nonblocking all-gather (or, after an integer
 * reshard, the all-gather of the kept slices within the post-forward group). */
fsdpc_status_t fsdp_unshard_start(fsdp_group_t *g) {
  g->kept = false; /* in use again: a step holds it from here */
  if (g->unsharded || g->gathering) return STATUS_OK;
  if (g->n == 0) {
    g->unsharded = true;
    return STATUS_OK;
  }
  for (int i = 0; i < g->n; i++)
    if (tensor_is_meta(&g->params[i].padded))
      return err_set(STATUS_EINVAL,
                     "fully_shard: parameter %s has no memory yet (the model was built for "
                     "deferred initialisation): call nn_module_materialize and initialise it "
                     "before the first forward",
                     g->params[i].p->fqn);
  /* HFSDP: the masters changed since the shard was filled (nothing changes them during a
   * backward: a group unsharded again there, one of several modules or a module called twice,
   * gathers what its forward did) */
  if (g->hfsdp && g->stale && !(g->root != NULL && g->root->state.in_backward))
    FSDPC_TRY(replica_refresh(g));
  if (local_unshard(g)) { /* nothing to gather: fsdp_unshard_wait makes the tensors */
    g->gathering = g->gather_local = true;
    fsdp_emit(g, "unshard");
    return STATUS_OK;
  }
  device_t dev = mesh_device(g->mesh);
  if (g->streams != NULL && g->copied == NULL) FSDPC_TRY(event_new(dev, &g->copied));
  /* copy-in reads shards the optimizer may just have written on the compute stream; offloaded
   * shards live on the host, written synchronously */
  bool slice = g->post_forward_slice.storage != NULL;
  stream_t *prev;
  FSDPC_TRY(side_enter(g, dev, copy_in_stream(g), slice || !g->offload, &prev));
  int64_t total = g->block * g->W;
  fsdpc_status_t st = tensor_init(&g->gather, g->param_dtype, dev, 1, &total);
  if (st != STATUS_OK) {
    side_exit(dev, copy_in_stream(g), prev);
    return st;
  }
  g->gathering = true;
  fsdp_emit(g, "unshard");
  if (slice) {
    int64_t count = tensor_numel(&g->post_forward_slice);
    st = pg_all_gather(g->post_forward, g->post_forward_slice.data, g->gather.data, (size_t)count,
                       g->param_dtype, &g->pending);
  } else {
    /* copy-in: this rank's padded shards, cast, into its block of the gather buffer */
    copies_t c = {0};
    for (int i = 0; i < g->n && st == STATUS_OK; i++) {
      fsdp_param_t *fp = &g->params[i];
      int64_t n = fp->rows * fp->row;
      fsdpc_tensor_t slot = {0}, shard = {0};
      st = tensor_narrow(&slot, &g->gather, 0, g->rank * g->block + fp->offset, n);
      if (st == STATUS_OK) st = shard_on_device(g, fp, dev, &shard);
      st = copies_add(&c, st, &slot, &shard);
    }
    st = copies_run(&c, st);
    if (st == STATUS_OK && g->W > 1) {
      char *base = g->gather.data;
      st = pg_all_gather(g->shard, base + (size_t)(g->rank * g->block) * dtype_size(g->param_dtype),
                         g->gather.data, (size_t)g->block, g->param_dtype, &g->pending);
    }
  }
  if (st == STATUS_OK) st = event_record(g->copied, copy_in_stream(g));
  side_exit(dev, copy_in_stream(g), prev);
  return st;
}

/* Completes the started gather: the current stream waits for copy-in and the all-gather. */
static fsdpc_status_t gather_wait(fsdp_group_t *g) {
  fsdpc_status_t st = pg_wait(g->pending);
  g->pending = NULL;
  g->gathering = g->gather_local = g->prepared = false;
  if (g->copied != NULL) {
    fsdpc_status_t s2 = stream_wait_event(stream_current(mesh_device(g->mesh)), g->copied);
    if (st == STATUS_OK) st = s2;
  }
  return st;
}

/* Elements of fp's unsharded tensor. */
static int64_t fp_numel(const fsdp_param_t *fp) {
  int64_t n = 1;
  for (int d = 0; d < fp->ndim; d++) n *= fp->shape[d];
  return n;
}

/* The elements n tensors of dt take in a buffer shared on dev: on CUDA, to the next 256-byte
 * boundary (cuBLASLt's and the 16-byte kernels' alignment); on the CPU, n (no padding: the
 * state's bytes stay those of the tensors). */
static int64_t aligned_numel(int64_t n, dtype_t dt, device_t dev) {
  if (dev.type != DEVICE_CUDA) return n;
  int64_t per = 256 / (int64_t)dtype_size(dt);
  return (n + per - 1) / per * per;
}

/* Whether fp's unsharded tensor needs memory of its own: gathered, always; on the one-rank path,
 * when its shard is not in param_dtype already (else it is viewed). */
static bool unshard_needs(const fsdp_group_t *g, const fsdp_param_t *fp, bool local) {
  return !local || fp->padded.dtype != g->param_dtype;
}

/* The param_dtype elements the unsharded shapes of the parameters want(g, fp, arg) picks take
 * in a buffer, each from a 256-byte boundary (full_in lays them out in order); *count of
 * them. */
static int64_t group_numel(const fsdp_group_t *g,
                           bool (*want)(const fsdp_group_t *, const fsdp_param_t *, bool), bool arg,
                           int *count) {
  int64_t total = 0;
  *count = 0;
  for (int i = 0; i < g->n; i++)
    if (want(g, &g->params[i], arg)) {
      total += aligned_numel(fp_numel(&g->params[i]), g->param_dtype, mesh_device(g->mesh));
      (*count)++;
    }
  return total;
}

/* One param_dtype buffer on g's device for the parameters want picks (group_numel), then
 * extra elements: one allocation rather than one a parameter. *buf stays empty when fewer
 * than least (>= 1) are picked. */
static fsdpc_status_t group_buffer(const fsdp_group_t *g,
                                   bool (*want)(const fsdp_group_t *, const fsdp_param_t *, bool),
                                   bool arg, int least, int64_t extra, fsdpc_tensor_t *buf) {
  int count;
  int64_t total = group_numel(g, want, arg, &count) + extra;
  memset(buf, 0, sizeof *buf);
  if (count < least) return STATUS_OK;
  return tensor_init(buf, g->param_dtype, mesh_device(g->mesh), 1, &total);
}

/* The buffer of every unsharded tensor that needs memory, then slots elements for the
 * one-rank path's pre-backward (the unit's gradient slots; *room receives that tail when
 * slots > 0): one allocation rather than two. The tensors are views into it, so it is freed
 * with the last of them: at reshard, or with the gradients, which the one-rank path adds into
 * the sharded ones in the same post-backward. (Empty parameters still get their empty
 * views.) */
static fsdpc_status_t unshard_buffer(fsdp_group_t *g, bool local, int64_t slots,
                                     fsdpc_tensor_t *buf, fsdpc_tensor_t *room) {
  FSDPC_TRY(group_buffer(g, unshard_needs, local, 1, slots, buf));
  if (buf->storage == NULL || slots == 0) return STATUS_OK;
  return tensor_narrow(room, buf, 0, tensor_numel(buf) - slots, slots);
}

/* *full: fp's unsharded shape viewed at element *pos of buf, which then moves past it. */
static fsdpc_status_t full_in(const fsdp_param_t *fp, const fsdpc_tensor_t *buf, int64_t *pos,
                              fsdpc_tensor_t *full) {
  int64_t n = fp_numel(fp);
  fsdpc_tensor_t slot = {0};
  fsdpc_status_t st = tensor_narrow(&slot, buf, 0, *pos, n);
  if (st == STATUS_OK) st = tensor_view(full, &slot, fp->ndim, fp->shape);
  tensor_free(&slot);
  *pos += aligned_numel(n, buf->dtype, buf->device);
  return st;
}

/* fp's unsharded tensor from the gathered buffer: every rank's rows, added to c to copy out. */
static fsdpc_status_t gathered_full(fsdp_group_t *g, const fsdp_param_t *fp,
                                    const fsdpc_tensor_t *buf, int64_t *pos, fsdpc_tensor_t *full,
                                    copies_t *c) {
  FSDPC_TRY(full_in(fp, buf, pos, full));
  fsdpc_status_t st = STATUS_OK;
  for (int r = 0; r < g->W && st == STATUS_OK; r++)
    st = add_chunk(c, fp, g->W, r, full, &g->gather, r * g->block + fp->offset, false);
  return st;
}

/* fp's unsharded tensor under local_unshard: its shard, viewed, or its place in buf, into which
 * the cast goes (added to c; a NULL c: cast already, by the unshard that prepared g). */
static fsdpc_status_t local_full(fsdp_group_t *g, const fsdp_param_t *fp, const fsdpc_tensor_t *buf,
                                 int64_t *pos, fsdpc_tensor_t *full, copies_t *c) {
  fsdpc_tensor_t shard;
  FSDPC_TRY(tensor_view(&shard, &fp->padded, fp->ndim, fp->shape));
  if (!unshard_needs(g, fp, true)) {
    *full = shard;
    return STATUS_OK;
  }
  fsdpc_tensor_t dst = {0};
  fsdpc_status_t st = full_in(fp, buf, pos, full);
  if (c == NULL) {
    tensor_free(&shard);
    return st;
  }
  if (st == STATUS_OK) st = tensor_ref(&dst, full);
  return copies_add(c, st, &dst, &shard);
}

/* The joint unshard of the one-rank path: a unit's pre-forward or pre-backward that casts its
 * shards also casts those of the units it prefetches, into one buffer, in one launch, where
 * each would take an allocation and a launch of its own at its own hook. A prefetched unit
 * keeps its place in the buffer (gather, prepared) until its hook makes its tensors there.
 * Its memory: the next unit's unsharded tensors from this one's hook on, as the all-gather
 * prefetched for it holds them on several ranks. */
static fast_path_t joint =
    FAST_PATH_INIT("FSDPC_FSDP_JOINT_UNSHARD", "fsdp_set_joint_unshard(false)");

void fsdp_set_joint_unshard(bool on) { fast_path_set(&joint, on); }

static bool frees_together(const fsdp_group_t *g);
static bool reserves(const fsdp_group_t *g);
static int64_t slots_numel(const fsdp_group_t *g, bool before_unshard);

/* Whether a module of a lies inside (or is) a module of b. */
static bool inside(const fsdp_group_t *a, const fsdp_group_t *b) {
  for (int i = 0; i < a->n_modules; i++)
    for (const nn_module_t *m = a->modules[i]; m != NULL; m = nn_module_parent(m))
      for (int j = 0; j < b->n_modules; j++)
        if (m == b->modules[j]) return true;
  return false;
}

/* Whether g, about to cast its shards on the one-rank path, takes the casts of p, which it
 * prefetches: p started on that path and not prepared, on g's device in g's param_dtype, both
 * freed at the same point of their calls (after forward, or after backward) and neither call
 * inside the other's (not the root, not nested units), so that neither keeps the other's
 * memory beyond its own call. */
static bool joins(const fsdp_group_t *g, const fsdp_group_t *p, bool backward) {
  if (p == g || !p->initialised || !p->gathering || !p->gather_local || p->prepared ||
      p->gather.storage != NULL || g->is_root || p->is_root || p->param_dtype != g->param_dtype ||
      !device_equal(mesh_device(p->mesh), mesh_device(g->mesh)))
    return false;
  bool freed = backward ? g->reshard_after_backward && p->reshard_after_backward
                        : g->reshard_after_forward == 1 && p->reshard_after_forward == 1;
  return freed && !inside(g, p) && !inside(p, g);
}

/* The elements of g's place in a joint buffer: its tensors that need memory, then slots
 * elements; 0 when none of its tensors does. */
static int64_t place_numel(const fsdp_group_t *g, int64_t slots) {
  int count;
  int64_t n = group_numel(g, unshard_needs, true, &count);
  return count < 1 ? 0 : n + slots;
}

enum { kJoinMax = 8 }; /* the prefetched groups a joint unshard takes at most */

/* On the one-rank path, the buffer of g's unsharded tensors and slots elements (*buf, with the
 * slots' tail in *room when slots > 0) and of the places of the groups of ahead that join g
 * (their gather; listed in joined[0..*n_joined), to be marked prepared once the casts, added
 * to c, have run). */
static fsdpc_status_t joint_buffer(fsdp_group_t *g, int64_t slots, fsdp_group_t *const *ahead,
                                   int n_ahead, bool backward, fsdpc_tensor_t *buf,
                                   fsdpc_tensor_t *room, copies_t *c, fsdp_group_t **joined,
                                   int *n_joined) {
  int64_t mine = place_numel(g, slots), total = mine, places[kJoinMax] = {0}, more[kJoinMax] = {0};
  *n_joined = 0;
  n_ahead = n_ahead < kJoinMax ? n_ahead : kJoinMax;
  for (int k = 0; k < n_ahead; k++) {
    bool again = false; /* a list that names a group twice: its place once */
    for (int j = 0; j < k && !again; j++) again = ahead[j] == ahead[k];
    if (again || !joins(g, ahead[k], backward)) continue;
    if (backward && frees_together(ahead[k]) && reserves(ahead[k]))
      more[k] = slots_numel(ahead[k], true);
    places[k] = place_numel(ahead[k], more[k]);
    total += places[k];
  }
  if (total == mine) return unshard_buffer(g, true, slots, buf, room);
  fsdpc_tensor_t all;
  FSDPC_TRY(tensor_init(&all, g->param_dtype, mesh_device(g->mesh), 1, &total));
  fsdpc_status_t st = STATUS_OK;
  if (mine > 0) st = tensor_narrow(buf, &all, 0, 0, mine);
  if (st == STATUS_OK && mine > 0 && slots > 0)
    st = tensor_narrow(room, buf, 0, mine - slots, slots);
  int64_t at = mine;
  for (int k = 0; k < n_ahead && st == STATUS_OK; k++) {
    if (places[k] == 0) continue;
    fsdp_group_t *p = ahead[k];
    st = tensor_narrow(&p->gather, &all, 0, at, places[k]);
    at += places[k];
    int64_t pos = 0;
    p->prepared_slots = more[k];
    joined[(*n_joined)++] = p;
    for (int i = 0; i < p->n && st == STATUS_OK; i++) {
      fsdpc_tensor_t full = {0};
      st = local_full(p, &p->params[i], &p->gather, &pos, &full, c);
      tensor_free(&full);
    }
  }
  tensor_free(&all);
  return st;
}

/* After a joint unshard's casts (st: how they went): the joined groups are prepared, or, when
 * the casts did not run, their places dropped (each casts at its own hook). */
static void joint_done(fsdp_group_t **joined, int n, fsdpc_status_t st) {
  for (int k = 0; k < n; k++) {
    joined[k]->prepared = st == STATUS_OK;
    if (st != STATUS_OK) {
      tensor_free(&joined[k]->gather);
      joined[k]->prepared_slots = 0;
    }
  }
}

/* Completes a started gather: waits, then copies rank r's rows of each parameter out into
 * the unsharded tensors (on the one-rank path: views or casts each shard, with the casts of
 * the groups of ahead that join it: joint_buffer), all in one tensor_copy_many, into one
 * buffer (with slots elements after them, *room: unshard_buffer). A group prepared by such a
 * joint unshard makes its tensors where that one cast them. */
static fsdpc_status_t unshard_wait(fsdp_group_t *g, int64_t slots, fsdpc_tensor_t *room,
                                   fsdp_group_t *const *ahead, int n_ahead, bool backward) {
  if (!g->gathering) return STATUS_OK;
  bool local = g->gather_local, prepared = g->prepared;
  fsdpc_tensor_t buf = {0};
  if (prepared) { /* its place, cast already: its tensors, then its slots */
    buf = g->gather;
    memset(&g->gather, 0, sizeof g->gather);
    slots = g->prepared_slots;
  }
  fsdpc_status_t st = gather_wait(g);
  tensor_free(&g->post_forward_slice);
  int64_t pos = 0;
  copies_t c = {0};
  fsdp_group_t *joined[kJoinMax];
  int n_joined = 0;
  if (st == STATUS_OK && prepared && slots > 0 && room != NULL)
    st = tensor_narrow(room, &buf, 0, tensor_numel(&buf) - slots, slots);
  else if (st == STATUS_OK && local && !prepared && fast_path_off(&joint)[0] == '\0')
    st = joint_buffer(g, slots, ahead, n_ahead, backward, &buf, room, &c, joined, &n_joined);
  else if (st == STATUS_OK && !prepared)
    st = unshard_buffer(g, local, slots, &buf, room);
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    fsdpc_tensor_t full = {0};
    st = local ? local_full(g, fp, &buf, &pos, &full, prepared ? NULL : &c)
               : gathered_full(g, fp, &buf, &pos, &full, &c);
    if (st == STATUS_OK) {
      tensor_free(&fp->p->compute);
      fp->p->compute = full;
    } else {
      tensor_free(&full);
    }
  }
  st = copies_run(&c, st);
  joint_done(joined, n_joined, st);
  tensor_free(&buf);
  tensor_free(&g->gather);
  if (st == STATUS_OK) g->unsharded = true;
  return st;
}

fsdpc_status_t fsdp_unshard_wait(fsdp_group_t *g) {
  return unshard_wait(g, 0, NULL, NULL, 0, false);
}

fsdpc_status_t fsdp_unshard(fsdp_group_t *g) {
  ARG_NONNULL(g);
  FSDPC_TRY(fsdp_unshard_start(g));
  return fsdp_unshard_wait(g);
}

void fsdp_reshard(fsdp_group_t *g) {
  if (g == NULL) return;
  g->kept = false;
  if (g->gathering) { /* a prefetch nobody used: complete it, then drop it */
    gather_wait(g);
    tensor_free(&g->gather);
  }
  bool had = g->unsharded || g->post_forward_slice.storage != NULL;
  for (int i = 0; i < g->n; i++) tensor_free(&g->params[i].p->compute);
  tensor_free(&g->post_forward_slice);
  g->unsharded = false;
  if (had) fsdp_emit(g, "reshard");
}

/* Integer reshard after forward: keep blocks [i*W/N, (i+1)*W/N) of the gathered buffer
 * (i = this rank's place in its group of N), rebuilt from the unsharded parameters, then
 * free those. Local. */
fsdpc_status_t fsdp_reshard_to_slice(fsdp_group_t *g) {
  int N = g->reshard_after_forward, per = g->W / N, first = (g->rank % N) * per;
  int64_t count = (int64_t)per * g->block;
  fsdpc_tensor_t slice;
  FSDPC_TRY(tensor_zeros(&slice, g->param_dtype, mesh_device(g->mesh), 1, &count));
  copies_t c = {0};
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    for (int b = first; b < first + per && st == STATUS_OK; b++)
      st = add_chunk(&c, fp, g->W, b, &fp->p->compute, &slice, (b - first) * g->block + fp->offset,
                     true);
  }
  st = copies_run(&c, st);
  fsdp_reshard(g);
  if (st == STATUS_OK)
    g->post_forward_slice = slice;
  else
    tensor_free(&slice);
  return st;
}

/* ---- gradient reduction ---- */

/* One buffer for a unit's gradients (reserved at its pre-backward): on a GPU, where an allocation
 * and a free are calls into the driver's allocator (about 1.5 us each on an H200's host), it saves
 * two of them for each gradient but one, a unit's nine in a Llama layer. */
static fast_path_t unit_grads =
    FAST_PATH_INIT("FSDPC_FSDP_GRAD_BUFFER", "fsdp_set_grad_buffer(false)");

void fsdp_set_grad_buffer(bool on) { fast_path_set(&unit_grads, on); }

/* Whether fp's slot would be taken: a trainable parameter whose gradient an operation has formed
 * in place before (nn_param_grad_memory), in param_dtype (before_unshard: the unshard about to
 * make its tensor will make it in param_dtype). */
static bool takes_slot(const fsdp_group_t *g, const fsdp_param_t *fp, bool before_unshard) {
  const nn_param_t *p = fp->p;
  return p->requires_grad && p->grad_slot_used &&
         (before_unshard || p->compute.dtype == g->param_dtype);
}

/* The elements of g's slots in one buffer (full_in's layout), or 0 when fewer than two would be
 * taken (one allocation either way). */
static int64_t slots_numel(const fsdp_group_t *g, bool before_unshard) {
  int count;
  int64_t n = group_numel(g, takes_slot, before_unshard, &count);
  return count < 2 ? 0 : n;
}

/* Drops the slots no gradient took. */
static void drop_slots(fsdp_group_t *g) {
  for (int i = 0; i < g->n; i++) tensor_free(&g->params[i].p->grad_slot);
}

/* Whether a pre-backward reserves g's slots: on a GPU, unless accumulating over backwards
 * without a reduction (the gradients have their memory). */
static bool reserves(const fsdp_group_t *g) {
  if (mesh_device(g->mesh).type != DEVICE_CUDA || fast_path_off(&unit_grads)[0] != '\0')
    return false;
  for (int i = 0; i < g->n; i++)
    if (g->params[i].p->compute_grad.storage != NULL || g->params[i].p->grad_slot.storage != NULL)
      return false;
  return true;
}

/* Lays g's slots out in g->grad_buf: room (the unshard buffer's tail) when it has their size,
 * else a buffer of their own. */
static fsdpc_status_t reserve_grads(fsdp_group_t *g, const fsdpc_tensor_t *room) {
  if (!reserves(g)) return STATUS_OK;
  tensor_free(&g->grad_buf); /* one whose gradients were dropped since (zero_grad) */
  if (room->storage != NULL && tensor_numel(room) == slots_numel(g, false))
    FSDPC_TRY(tensor_ref(&g->grad_buf, room));
  else
    FSDPC_TRY(group_buffer(g, takes_slot, false, 2, 0, &g->grad_buf));
  int64_t pos = 0;
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < g->n && st == STATUS_OK && g->grad_buf.storage != NULL; i++)
    if (takes_slot(g, &g->params[i], false))
      st = full_in(&g->params[i], &g->grad_buf, &pos, &g->params[i].p->grad_slot);
  if (st != STATUS_OK) {
    drop_slots(g);
    tensor_free(&g->grad_buf);
  }
  return st;
}

/* Whether a gradient of dtype dt reaches reduce_dtype without rounding. */
static bool exact_in(dtype_t dt, dtype_t reduce_dtype) {
  return dt == reduce_dtype || reduce_dtype == DTYPE_F32;
}

/* Whether g's next post-backward frees its unsharded tensors and its gradients both, on the
 * stream that computed them: the one-rank path's reduction (local_reduce, for gradients in
 * param_dtype, as the slots hold them), which syncs, then reshard. */
static bool frees_together(const fsdp_group_t *g) {
  bool local = g->gathering ? g->gather_local : local_unshard(g);
  return local && !g->unsharded && g->sync && g->reshard_after_backward && g->divide_factor <= 0 &&
         (g->replicate == NULL || pg_size(g->replicate) <= 1) &&
         exact_in(g->param_dtype, g->reduce_dtype);
}

/* Pre-backward: unshards g (after starting ahead, when ahead join it: joint_buffer) and, on a
 * GPU, reserves its slots. */
static fsdpc_status_t unshard_for_backward(fsdp_group_t *g, fsdp_group_t *const *ahead,
                                           int n_ahead) {
  int64_t slots = frees_together(g) && reserves(g) ? slots_numel(g, true) : 0;
  fsdpc_tensor_t room = {0}; /* the unshard buffer's tail, when it made one */
  fsdpc_status_t st = fsdp_unshard_start(g);
  if (st == STATUS_OK) st = unshard_wait(g, slots, &room, ahead, n_ahead, true);
  if (st == STATUS_OK) st = reserve_grads(g, &room);
  tensor_free(&room);
  return st;
}

fsdpc_status_t fsdp_unshard_ahead(fsdp_group_t *g, fsdp_group_t *const *ahead, int n_ahead,
                                  bool backward) {
  /* a cast on the one-rank path to come: the prefetches start first, to join it */
  bool joint_cast =
      !g->unsharded && (g->gathering ? g->gather_local && !g->prepared : local_unshard(g));
  if (joint_cast) {
    FSDPC_TRY(fsdp_unshard_start(g));
    for (int k = 0; k < n_ahead; k++) FSDPC_TRY(fsdp_unshard_start(ahead[k]));
    return backward ? unshard_for_backward(g, ahead, n_ahead)
                    : unshard_wait(g, 0, NULL, ahead, n_ahead, false);
  }
  FSDPC_TRY(backward ? unshard_for_backward(g, NULL, 0) : fsdp_unshard(g));
  for (int k = 0; k < n_ahead; k++) FSDPC_TRY(fsdp_unshard_start(ahead[k]));
  return STATUS_OK;
}

static bool has_grad(const nn_param_t *p) {
  return p->requires_grad && (p->compute_grad.storage != NULL || p->compute_grad.ndim > 0);
}

fsdpc_status_t fsdp_widen_grads(fsdp_group_t *g) {
  bool widened = false;
  for (int i = 0; i < g->n; i++) {
    nn_param_t *p = g->params[i].p;
    if (!has_grad(p) || g->reduce_dtype == DTYPE_COUNT ||
        dtype_size(p->compute_grad.dtype) >= dtype_size(g->reduce_dtype))
      continue;
    fsdpc_tensor_t wide;
    FSDPC_TRY(tensor_clone(&wide, &p->compute_grad, g->reduce_dtype, p->compute_grad.device));
    tensor_free(&p->compute_grad);
    p->compute_grad = wide;
    widened = true;
  }
  /* the narrow gradients' buffer (slots a GPU's pre-backward laid out) goes with them: only
   * what is still a view of it keeps its memory */
  if (widened) {
    drop_slots(g);
    tensor_free(&g->grad_buf);
  }
  return STATUS_OK;
}

/* One rank, no replicas, shards where it computes, the plain average (of one), and contiguous
 * gradients that reduce_dtype holds exactly: the reduction has nothing to add up, so
 * reduce_local adds the gradients themselves into the sharded gradients, with no packed buffer
 * and nothing left in flight; the same values as the packed path. */
static fsdpc_status_t reduce_local(fsdp_group_t *g);

static bool local_reduce(const fsdp_group_t *g) {
  if (!one_rank_group(g) || g->divide_factor > 0) return false;
  if (g->replicate != NULL && pg_size(g->replicate) > 1) return false;
  for (int i = 0; i < g->n; i++) {
    const fsdpc_tensor_t *grad = &g->params[i].p->compute_grad;
    if (g->params[i].reducing &&
        (!exact_in(grad->dtype, g->reduce_dtype) || !tensor_is_contiguous(grad)))
      return false;
  }
  return true;
}

/* Marks, in every rank's block of the reduce buffer, which trainable parameters have a
 * gradient here: their presence elements 1, the others 0. The reduction sums them with the
 * gradients, so every rank learns which parameters got a gradient on any rank. */
static fsdpc_status_t mark_presence(fsdp_group_t *g, int64_t block) {
  int64_t shape[2] = {g->W, block};
  fsdpc_tensor_t all = {0}, tail = {0}, one = {0};
  fsdpc_status_t st = tensor_view(&all, &g->red_send, 2, shape);
  if (st == STATUS_OK) st = tensor_narrow(&tail, &all, 1, g->red_grads, g->red_params);
  if (st == STATUS_OK) st = tensor_fill(&tail, 1.0);
  for (int i = 0; i < g->n && st == STATUS_OK && g->red_missing; i++) {
    const fsdp_param_t *fp = &g->params[i];
    if (!fp->trainable || fp->reducing) continue;
    st = tensor_narrow(&one, &tail, 1, fp->red_index, 1);
    if (st == STATUS_OK) st = tensor_fill(&one, 0.0);
    tensor_free(&one);
  }
  tensor_free(&tail);
  tensor_free(&all);
  return st;
}

/* The reduce layout is fixed over the group's trainable parameters, whichever of them have a
 * gradient on this rank: a parameter without one (a path this rank's batch did not take)
 * contributes zeros, so that every rank reduces the same number of elements in the same
 * places; each parameter's presence element tells every rank whether any rank had one. */
fsdpc_status_t fsdp_reduce_start(fsdp_group_t *g) {
  FSDPC_TRY(fsdp_reduce_finish(g->root));
  drop_slots(g); /* g->grad_buf now holds only the gradients formed in it */
  int64_t flat = 0, sub = 0;
  int params = 0;
  bool any = false, missing = false;
  for (int i = 0; i < g->n; i++) {
    fsdp_param_t *fp = &g->params[i];
    fp->reducing = has_grad(fp->p);
    fp->trainable = fp->p->requires_grad;
    if (!fp->trainable) continue;
    fp->red_offset = flat;
    fp->sub_red_offset = sub;
    fp->red_index = params++;
    flat += fp->rows * fp->row;
    sub += fp->sub_rows * fp->row;
    any |= fp->reducing;
    missing |= !fp->reducing;
  }
  g->red_last = g->is_last_backward;
  g->sub_red_grads = sub;
  g->sub_red_block = g->hfsdp ? fsdp_align_block(sub + params, g->reduce_dtype) : 0;
  bool local = flat > 0 && local_reduce(g);
  if (flat == 0 || (local && !any)) {
    tensor_free(&g->grad_buf);
    return STATUS_OK;
  }
  if (local) return reduce_local(g);
  device_t dev = mesh_device(g->mesh);
  stream_t *prev;
  FSDPC_TRY(
      side_enter(g, dev, reduce_stream(g), true, &prev)); /* after the gradients are computed */
  g->red_grads = flat;
  g->red_params = params;
  g->red_missing = missing;
  int64_t block = fsdp_align_block(flat + params, g->reduce_dtype), total = block * g->W;
  reduce_op_t op = g->divide_factor > 0 ? REDUCE_SUM : REDUCE_AVG;
  fsdpc_status_t st = tensor_zeros(&g->red_send, g->reduce_dtype, dev, 1, &total);
  /* rank-major pack: block r holds chunk r of every trainable parameter, each padded to its
   * rows, then the presence elements; the unsharded gradients are freed here, on the stream
   * that read them last */
  copies_t c = {0};
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    if (!fp->reducing) continue;
    for (int r = 0; r < g->W && st == STATUS_OK; r++)
      st = add_chunk(&c, fp, g->W, r, &fp->p->compute_grad, &g->red_send,
                     r * block + fp->red_offset, true);
  }
  st = copies_run(&c, st);
  if (st == STATUS_OK) st = mark_presence(g, block);
  /* a gradient whose memory another tensor still holds (handed on by reference) is freed by
   * that tensor later, on the compute stream: the compute stream waits for the pack first, so
   * that the block cannot be reused before the pack has read it */
  bool shared = false;
  for (int i = 0; i < g->n; i++)
    if (g->params[i].reducing) {
      const fsdpc_tensor_t *grad = &g->params[i].p->compute_grad;
      shared |= grad->storage != g->grad_buf.storage && tensor_storage_shared(grad);
      tensor_free(&g->params[i].p->compute_grad);
    }
  /* the gradients' buffer: held by another tensor when one still does once they are freed */
  shared |= g->grad_buf.storage != NULL && tensor_storage_shared(&g->grad_buf);
  tensor_free(&g->grad_buf);
  if (st == STATUS_OK && shared && g->streams != NULL) {
    st = event_record(g->streams->packed, reduce_stream(g));
    if (st == STATUS_OK) st = stream_wait_event(prev, g->streams->packed);
  }
  if (st == STATUS_OK && g->W > 1) {
    st = tensor_init(&g->red_recv, g->reduce_dtype, dev, 1, &block);
    if (st == STATUS_OK)
      st = pg_reduce_scatter(g->shard, g->red_send.data, g->red_recv.data, (size_t)block,
                             g->reduce_dtype, op, &g->red_work);
  } else if (st == STATUS_OK) {
    st = tensor_ref(&g->red_recv, &g->red_send);
  }
  g->red_flat = block;
  g->root->state.reducing = g;
  side_exit(dev, reduce_stream(g), prev);
  if (st != STATUS_OK) fsdp_reduce_drop(g);
  return st;
}

void fsdp_reduce_drop(fsdp_group_t *g) {
  if (g->red_work != NULL) pg_wait(g->red_work);
  g->red_work = NULL;
  tensor_free(&g->grad_buf);
  tensor_free(&g->red_send);
  tensor_free(&g->red_recv);
  g->red_sub = false;
  g->red_flat = 0;
  if (g->root != NULL && g->root->state.reducing == g) g->root->state.reducing = NULL;
}

/* HFSDP: the shard group's reduced block recv (every trainable parameter's len rows at
 * red_offset, then the presence elements) reduce-scattered over the replicas: block q of the
 * send buffer holds replica q's chunk of each, then all the presence elements. recv becomes
 * this replica's block (red_sub: the layout of sub_red_offset and sub_red_grads). */
static fsdpc_status_t replica_scatter(fsdp_group_t *g, fsdpc_tensor_t *recv, reduce_op_t op) {
  device_t dev = mesh_device(g->mesh);
  int64_t block = g->sub_red_block, total = block * g->R;
  fsdpc_tensor_t send = {0}, out = {0};
  FSDPC_TRY(tensor_zeros(&send, g->reduce_dtype, dev, 1, &total));
  copies_t c = {0};
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    if (!fp->trainable) continue;
    fsdpc_tensor_t shard = {0};
    st = rows_at(fp, recv, fp->red_offset, fp->len, &shard);
    for (int q = 0; q < g->R && st == STATUS_OK; q++)
      st = add_chunk_of(&c, fp->dim, g->R, q, &shard, &send, q * block + fp->sub_red_offset, true);
    tensor_free(&shard);
  }
  for (int q = 0; q < g->R && st == STATUS_OK; q++) { /* the presence elements, whole */
    fsdpc_tensor_t from = {0}, to = {0};
    st = tensor_narrow(&from, recv, 0, g->red_grads, g->red_params);
    if (st == STATUS_OK)
      st = tensor_narrow(&to, &send, 0, q * block + g->sub_red_grads, g->red_params);
    st = copies_add(&c, st, &to, &from);
  }
  st = copies_run(&c, st);
  if (st == STATUS_OK) st = tensor_init(&out, g->reduce_dtype, dev, 1, &block);
  if (st == STATUS_OK)
    st = pg_reduce_scatter(g->replicate, send.data, out.data, (size_t)block, g->reduce_dtype, op,
                           NULL);
  tensor_free(&send);
  if (st != STATUS_OK) {
    tensor_free(&out);
    return st;
  }
  tensor_free(recv);
  *recv = out;
  g->red_sub = true;
  return STATUS_OK;
}

/* HSDP: all-reduces recv over the replicate group (HFSDP: reduce-scatters it, replica_scatter),
 * or parks it (sums it into the partial result) while all-reduce is off. *parked tells
 * which. */
static fsdpc_status_t replicate_reduce(fsdp_group_t *g, fsdpc_tensor_t *recv, reduce_op_t op,
                                       bool *parked) {
  *parked = false;
  if (g->replicate == NULL || pg_size(g->replicate) == 1) return STATUS_OK;
  bool have = g->partial.storage != NULL;
  if (have && tensor_numel(&g->partial) != g->red_flat)
    return err_set(STATUS_EINVAL,
                   "fully_shard: parameters with gradients changed between "
                   "backward passes without all-reduce");
  if (!g->all_reduce) {
    *parked = true;
    return have ? kernel_axpy(&g->partial, 1.0f, recv) : tensor_ref(&g->partial, recv);
  }
  if (have) {
    FSDPC_TRY(kernel_axpy(recv, 1.0f, &g->partial));
    tensor_free(&g->partial);
  }
  if (g->hfsdp) return replica_scatter(g, recv, op);
  return pg_all_reduce(g->replicate, recv->data, recv->data, (size_t)g->red_flat, g->reduce_dtype,
                       op, NULL);
}

/* Whether the reduction creates fp's sharded gradient: a trainable parameter without one yet
 * that had a gradient here, or (present, the presence elements, NULL when every trainable
 * parameter had one) on another rank. */
static bool takes_new_grad(const fsdp_param_t *fp, const float *present) {
  if (!fp->trainable || fp->p->grad != NULL) return false;
  return fp->reducing || (present != NULL && present[fp->red_index] != 0.0f);
}

static const fsdpc_tensor_t *local_value(const fsdp_param_t *fp) {
  return dtensor_local(fp->p->value);
}

/* Whether fp's new gradient goes into buf (of the group's first new gradient's dtype and
 * device). */
static bool in_grad_buffer(const fsdp_param_t *fp, const float *present,
                           const fsdpc_tensor_t *buf) {
  const fsdpc_tensor_t *v = local_value(fp);
  return buf->storage != NULL && takes_new_grad(fp, present) && v->dtype == buf->dtype &&
         device_equal(v->device, buf->device);
}

/* One buffer for the sharded gradients the reduction creates (a step's first; those of the
 * first one's dtype and device), each from a 256-byte boundary: one allocation a group rather
 * than one a parameter. The gradients are views into it, freed with the last of them. *buf
 * stays empty when fewer than two would share it. */
static fsdpc_status_t grad_buffer(const fsdp_group_t *g, const float *present,
                                  fsdpc_tensor_t *buf) {
  memset(buf, 0, sizeof *buf);
  const fsdpc_tensor_t *like = NULL;
  int64_t total = 0;
  int count = 0;
  for (int i = 0; i < g->n; i++) {
    const fsdp_param_t *fp = &g->params[i];
    if (!takes_new_grad(fp, present)) continue;
    const fsdpc_tensor_t *v = local_value(fp);
    if (like == NULL) like = v;
    if (v->dtype != like->dtype || !device_equal(v->device, like->device)) continue;
    total += aligned_numel(tensor_numel(v), v->dtype, v->device);
    count++;
  }
  if (count < 2) return STATUS_OK;
  return tensor_init(buf, like->dtype, like->device, 1, &total);
}

/* Adds grad, fp's reduced shard (any float dtype), into its sharded gradient: added now, or
 * for the first gradient of a step, a new sharded gradient (in buf at *pos when
 * in_grad_buffer) whose copy of grad goes into c (a group's first gradients are cast in one
 * tensor_copy_many). */
static fsdpc_status_t add_local_grad(copies_t *c, fsdp_param_t *fp, const fsdpc_tensor_t *grad,
                                     const fsdpc_tensor_t *buf, const float *present,
                                     int64_t *pos) {
  if (fp->p->grad != NULL) return nn_param_accumulate_local_grad(fp->p, grad);
  const fsdpc_tensor_t *local = local_value(fp);
  fsdpc_tensor_t dst = {0}, src = {0}, mem = {0};
  fsdpc_status_t st = tensor_view(&src, grad, local->ndim, local->shape);
  if (st == STATUS_OK && in_grad_buffer(fp, present, buf)) {
    int64_t n = tensor_numel(local);
    st = tensor_narrow(&mem, buf, 0, *pos, n);
    *pos += aligned_numel(n, buf->dtype, buf->device);
    if (st == STATUS_OK) st = nn_param_new_local_grad_in(fp->p, &mem, &dst);
    tensor_free(&mem);
  } else if (st == STATUS_OK) {
    st = nn_param_new_local_grad(fp->p, &dst);
  }
  return copies_add(c, st, &dst, &src);
}

/* The reduction of the one-rank path: each gradient added into its sharded gradient at once,
 * on the current stream (the one that computed it), then freed. */
static fsdpc_status_t reduce_local(fsdp_group_t *g) {
  copies_t c = {0};
  fsdpc_tensor_t buf;
  int64_t pos = 0;
  fsdpc_status_t st = grad_buffer(g, NULL, &buf);
  for (int i = 0; i < g->n && st == STATUS_OK; i++)
    if (g->params[i].reducing)
      st = add_local_grad(&c, &g->params[i], &g->params[i].p->compute_grad, &buf, NULL, &pos);
  st = copies_run(&c, st);
  tensor_free(&buf);
  for (int i = 0; i < g->n; i++)
    if (g->params[i].reducing) tensor_free(&g->params[i].p->compute_grad);
  tensor_free(&g->grad_buf);
  return st;
}

/* Whether a trainable parameter of g has a sharded gradient already. */
static bool has_local_grads(const fsdp_group_t *g) {
  for (int i = 0; i < g->n; i++)
    if (g->params[i].trainable && g->params[i].p->grad != NULL) return true;
  return false;
}

fsdpc_status_t fsdp_reduce_finish(fsdp_group_t *root) {
  fsdp_group_t *g = root->state.reducing;
  if (g == NULL) return STATUS_OK;
  root->state.reducing = NULL;
  device_t dev = mesh_device(g->mesh);
  stream_t *prev;
  fsdpc_status_t st = side_enter(g, dev, reduce_stream(g), false, &prev);
  if (st != STATUS_OK) {
    fsdp_reduce_drop(g);
    return st;
  }
  st = pg_wait(g->red_work);
  g->red_work = NULL;
  tensor_free(&g->red_send);
  /* HSDP: the all-reduce and what follows it on a stream of their own, after the
   * reduce-scatter */
  stream_t *last = reduce_stream(g);
  if (st == STATUS_OK && g->streams != NULL && g->replicate != NULL && pg_size(g->replicate) > 1) {
    st = event_record(g->streams->scattered, g->streams->reduce);
    if (st == STATUS_OK) st = stream_wait_event(g->streams->all_reduce, g->streams->scattered);
    if (st == STATUS_OK) {
      last = g->streams->all_reduce;
      stream_set_current(dev, last);
    }
  }
  reduce_op_t op = g->divide_factor > 0 ? REDUCE_SUM : REDUCE_AVG;
  bool parked = false;
  if (st == STATUS_OK) st = replicate_reduce(g, &g->red_recv, op, &parked);
  if (st == STATUS_OK && !parked && g->divide_factor > 0)
    st = kernel_scale(&g->red_recv, (float)(1.0 / g->divide_factor));
  /* offloaded: a step's first gradients go from the device straight into their new sharded
   * gradients on the host; gradients to add to (accumulation) come over in one copy first */
  fsdpc_tensor_t host = {0}, *red = &g->red_recv;
  if (st == STATUS_OK && !parked && g->offload && has_local_grads(g)) {
    st = tensor_clone(&host, &g->red_recv, g->reduce_dtype, device_cpu());
    red = &host;
  }
  /* a rank that had no gradient for some parameter reads the presence elements: a parameter
   * no rank had a gradient for gets none (as a parameter outside the graph), the others the
   * reduced gradient, to which this rank added zeros */
  fsdpc_tensor_t present = {0}, tail = {0};
  if (st == STATUS_OK && !parked && g->red_missing) {
    st = tensor_narrow(&tail, red, 0, g->red_sub ? g->sub_red_grads : g->red_grads, g->red_params);
    if (st == STATUS_OK) st = tensor_clone(&present, &tail, DTYPE_F32, device_cpu());
    tensor_free(&tail);
  }
  copies_t c = {0};
  const float *presence = present.data; /* NULL when every trainable parameter had a gradient */
  fsdpc_tensor_t buf = {0};
  int64_t pos = 0;
  if (st == STATUS_OK && !parked) st = grad_buffer(g, presence, &buf);
  for (int i = 0; i < g->n && st == STATUS_OK && !parked; i++) {
    fsdp_param_t *fp = &g->params[i];
    if (!fp->trainable) continue;
    if (!fp->reducing && presence[fp->red_index] == 0.0f) continue;
    fsdpc_tensor_t mine;
    st = tensor_narrow(&mine, red, 0, g->red_sub ? fp->sub_red_offset : fp->red_offset,
                       tensor_numel(local_value(fp)));
    if (st == STATUS_OK) st = add_local_grad(&c, fp, &mine, &buf, presence, &pos);
    tensor_free(&mine);
  }
  st = copies_run(&c, st);
  tensor_free(&buf);
  tensor_free(&present);
  tensor_free(&host);
  tensor_free(&g->red_recv);
  g->red_flat = 0;
  /* HFSDP: the optimizer step that follows a last backward changes the masters */
  if (st == STATUS_OK && !parked && g->hfsdp && g->red_last) g->stale = true;
  g->red_sub = false;
  if (st == STATUS_OK && g->streams != NULL) st = event_record(g->streams->reduced, last);
  side_exit(dev, last, prev);
  return st;
}

fsdpc_status_t fsdp_finish_backward(fsdp_group_t *root) {
  FSDPC_TRY(fsdp_reduce_finish(root));
  if (root->streams == NULL) return STATUS_OK;
  return stream_wait_event(stream_current(mesh_device(root->mesh)), root->streams->reduced);
}
