/*
 * Redistribution, one mesh dimension at a time.
 *
 * Planning follows the nested-shard rule: walking mesh dimensions from the last to the
 * first, a dimension whose target is Shard(d) is first replicated if the mesh dimensions
 * before it do not already shard d the way the target does; then walking first to last,
 * every dimension still off its target moves there. This guarantees that whenever mesh
 * dimension i changes a shard of tensor dimension d, no later mesh dimension shards d, so
 * each step works on contiguous chunks of the "logical" shape (the global shape cut by the
 * mesh dimensions before i).
 *
 * Steps (W = size of mesh dimension i, c = chunk size, padding to c makes blocks equal):
 *   Shard(d)  -> Replicate   all-gather of padded chunks, then unpad
 *   Partial   -> Replicate   all-reduce
 *   Partial   -> Shard(d)    reduce-scatter of padded chunks
 *   Shard(d)  -> Shard(e)    all-to-all of padded blocks
 *   Replicate -> Shard(d)    local chunk, no communication
 *   Replicate -> Partial     sum: kept on coordinate 0, zeros elsewhere; avg/max: kept
 *   Shard(d)  -> Partial(sum)  the shard placed into zeros, no communication
 *   other Partial targets    through Replicate (two steps)
 *
 * Strided shards take a general path instead: reduce Partial dimensions, gather every
 * rank's box over all mesh dimensions, assemble the full value and cut the target out.
 */
#include <stdlib.h>
#include <string.h>

#include "dtensor/dtensor_impl.h"

typedef struct step {
  int dim;
  placement_t from, to;
} step_t;

static int plan_steps(int n, const placement_t *src, const placement_t *dst, step_t *steps) {
  placement_t cur[MESH_MAX_DIMS];
  memcpy(cur, src, sizeof(placement_t) * (size_t)n);
  int ns = 0;
  for (int i = n - 1; i >= 0; i--) {
    placement_t target = dst[i];
    if (target.kind == PLACEMENT_SHARD) {
      for (int j = 0; j < i; j++)
        if (placement_is_shard(cur[j], target.dim) != placement_is_shard(dst[j], target.dim))
          target = placement_replicate();
    }
    if (!placement_equal(cur[i], target)) {
      steps[ns++] = (step_t){i, cur[i], target};
      cur[i] = target;
    }
  }
  for (int i = 0; i < n; i++) {
    if (!placement_equal(cur[i], dst[i])) {
      steps[ns++] = (step_t){i, cur[i], dst[i]};
      cur[i] = dst[i];
    }
  }
  return ns;
}

/* ---- helpers on local tensors ---- */

/* A non-owning tensor of `shape` over block k (of `block` elements each) of buf. */
static fsdpc_status_t block_of(fsdpc_tensor_t *out, const fsdpc_tensor_t *buf, int64_t k,
                               int64_t block, int ndim, const int64_t *shape) {
  char *base = buf->data;
  if (block > 0) base += (size_t)(k * block) * dtype_size(buf->dtype);
  return tensor_wrap(out, block > 0 ? base : NULL, buf->dtype, buf->device, ndim, shape);
}

/* A view of t with extents `shape`, starting at `off` along dim and at 0 elsewhere. */
static fsdpc_status_t view_region(fsdpc_tensor_t *out, const fsdpc_tensor_t *t, int dim,
                                  int64_t off, const int64_t *shape) {
  int64_t offset[TENSOR_MAX_DIMS] = {0};
  offset[dim] = off;
  return tensor_narrow_box(out, t, offset, shape);
}

/* Copies src into dst at `off` along dim (0 elsewhere). */
static fsdpc_status_t copy_region(fsdpc_tensor_t *dst, int dim, int64_t off,
                                  const fsdpc_tensor_t *src) {
  fsdpc_tensor_t region;
  FSDPC_TRY(view_region(&region, dst, dim, off, src->shape));
  fsdpc_status_t st = tensor_copy(&region, src);
  tensor_free(&region);
  return st;
}

typedef struct ctx {
  pg_t *pg;
  int W, r;
  int64_t L[TENSOR_MAX_DIMS]; /* logical shape at this mesh dimension */
} ctx_t;

static void with_dim(const fsdpc_tensor_t *t, int d, int64_t v, int64_t *shape) {
  memcpy(shape, t->shape, sizeof(int64_t) * TENSOR_MAX_DIMS);
  shape[d] = v;
}

/* Block k (shape B, nb elements) of buf receives chunk k along dim of x, at its origin. */
static fsdpc_status_t pack_chunks(const ctx_t *c, fsdpc_tensor_t *buf, int64_t nb, const int64_t *B,
                                  const fsdpc_tensor_t *x, int dim) {
  for (int k = 0; k < c->W && nb > 0; k++) {
    int64_t ok, lk;
    placement_chunk_range(x->shape[dim], c->W, k, &ok, &lk);
    fsdpc_tensor_t blk = {0}, part = {0};
    fsdpc_status_t st = block_of(&blk, buf, k, nb, x->ndim, B);
    if (st == STATUS_OK) st = tensor_narrow(&part, x, dim, ok, lk);
    if (st == STATUS_OK) st = copy_region(&blk, dim, 0, &part);
    tensor_free(&part);
    tensor_free(&blk);
    FSDPC_TRY(st);
  }
  return STATUS_OK;
}

/* Chunk k along dim of out receives block k (shape B, nb elements) of buf, cut at its origin
 * to the chunk's extents. */
static fsdpc_status_t unpack_chunks(const ctx_t *c, fsdpc_tensor_t *out, const fsdpc_tensor_t *buf,
                                    int64_t nb, const int64_t *B, int dim) {
  for (int k = 0; k < c->W && nb > 0; k++) {
    int64_t ok, region[TENSOR_MAX_DIMS];
    with_dim(out, dim, 0, region);
    placement_chunk_range(out->shape[dim], c->W, k, &ok, &region[dim]);
    fsdpc_tensor_t blk = {0}, part = {0};
    fsdpc_status_t st = block_of(&blk, buf, k, nb, out->ndim, B);
    if (st == STATUS_OK) st = view_region(&part, &blk, dim, 0, region);
    if (st == STATUS_OK) st = copy_region(out, dim, ok, &part);
    tensor_free(&part);
    tensor_free(&blk);
    FSDPC_TRY(st);
  }
  return STATUS_OK;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

static fsdpc_status_t shard_to_replicate(const ctx_t *c, const fsdpc_tensor_t *x, int d,
                                         fsdpc_tensor_t *out) {
  int64_t P[TENSOR_MAX_DIMS], F[TENSOR_MAX_DIMS];
  with_dim(x, d, placement_chunk_size(c->L[d], c->W), P);
  with_dim(x, d, c->L[d], F);
  FSDPC_TRY(tensor_init(out, x->dtype, x->device, x->ndim, F));
  if (d == 0 && c->L[0] % c->W == 0) /* even rows: the gathered buffer is the result */
    return pg_all_gather(c->pg, x->data, out->data, (size_t)tensor_numel(x), x->dtype, NULL);
  fsdpc_tensor_t send = {0}, recv = {0};
  fsdpc_status_t st = STATUS_OK;
  int64_t nb = numel_of(x->ndim, P), R[1] = {nb * c->W};
  FSDPC_TRY_GOTO(st, tensor_zeros(&send, x->dtype, x->device, x->ndim, P));
  FSDPC_TRY_GOTO(st, copy_region(&send, d, 0, x));
  FSDPC_TRY_GOTO(st, tensor_init(&recv, x->dtype, x->device, 1, R));
  FSDPC_TRY_GOTO(st, pg_all_gather(c->pg, send.data, recv.data, (size_t)nb, x->dtype, NULL));
  st = unpack_chunks(c, out, &recv, nb, P, d);
cleanup:
  tensor_free(&send);
  tensor_free(&recv);
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

static fsdpc_status_t partial_to_replicate(const ctx_t *c, const fsdpc_tensor_t *x, reduce_op_t op,
                                           fsdpc_tensor_t *out) {
  FSDPC_TRY(tensor_clone(out, x, x->dtype, x->device));
  fsdpc_status_t st =
      pg_all_reduce(c->pg, out->data, out->data, (size_t)tensor_numel(out), out->dtype, op, NULL);
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

static fsdpc_status_t partial_to_shard(const ctx_t *c, const fsdpc_tensor_t *x, reduce_op_t op,
                                       int d, fsdpc_tensor_t *out) {
  int64_t P[TENSOR_MAX_DIMS];
  with_dim(x, d, placement_chunk_size(c->L[d], c->W), P);
  fsdpc_tensor_t send = {0}, recv = {0}, mine = {0};
  fsdpc_status_t st = STATUS_OK;
  int64_t nb = numel_of(x->ndim, P), S[1] = {nb * c->W}, orr, lr;
  FSDPC_TRY_GOTO(st, tensor_zeros(&send, x->dtype, x->device, 1, S));
  FSDPC_TRY_GOTO(st, pack_chunks(c, &send, nb, P, x, d));
  FSDPC_TRY_GOTO(st, tensor_init(&recv, x->dtype, x->device, x->ndim, P));
  FSDPC_TRY_GOTO(st,
                 pg_reduce_scatter(c->pg, send.data, recv.data, (size_t)nb, x->dtype, op, NULL));
  placement_chunk_range(c->L[d], c->W, c->r, &orr, &lr);
  FSDPC_TRY_GOTO(st, tensor_narrow(&mine, &recv, d, 0, lr));
  st = tensor_clone(out, &mine, x->dtype, x->device);
cleanup:
  tensor_free(&mine);
  tensor_free(&send);
  tensor_free(&recv);
  return st;
}

/* Block k sent to rank k is my d-chunk of its e-chunk; block k received from rank k is its
 * d-chunk of my e-chunk. Both padded to (chunk of d, chunk of e). */
static fsdpc_status_t shard_to_shard(const ctx_t *c, const fsdpc_tensor_t *x, int d, int e,
                                     fsdpc_tensor_t *out) {
  int64_t B[TENSOR_MAX_DIMS], O[TENSOR_MAX_DIMS], oer, ler;
  with_dim(x, d, placement_chunk_size(c->L[d], c->W), B);
  B[e] = placement_chunk_size(c->L[e], c->W);
  placement_chunk_range(c->L[e], c->W, c->r, &oer, &ler);
  with_dim(x, d, c->L[d], O);
  O[e] = ler;
  int64_t nb = numel_of(x->ndim, B), S[1] = {nb * c->W};
  fsdpc_tensor_t send = {0}, recv = {0};
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, tensor_init(out, x->dtype, x->device, x->ndim, O));
  FSDPC_TRY_GOTO(st, tensor_zeros(&send, x->dtype, x->device, 1, S));
  FSDPC_TRY_GOTO(st, tensor_init(&recv, x->dtype, x->device, 1, S));
  FSDPC_TRY_GOTO(st, pack_chunks(c, &send, nb, B, x, e));
  FSDPC_TRY_GOTO(st, pg_all_to_all(c->pg, send.data, recv.data, (size_t)nb, x->dtype, NULL));
  st = unpack_chunks(c, out, &recv, nb, B, d);
cleanup:
  tensor_free(&send);
  tensor_free(&recv);
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

static fsdpc_status_t replicate_to_shard(const ctx_t *c, const fsdpc_tensor_t *x, int d,
                                         fsdpc_tensor_t *out) {
  int64_t o, l;
  placement_chunk_range(x->shape[d], c->W, c->r, &o, &l);
  fsdpc_tensor_t part;
  FSDPC_TRY(tensor_narrow(&part, x, d, o, l));
  fsdpc_status_t st = tensor_clone(out, &part, x->dtype, x->device);
  tensor_free(&part);
  return st;
}

static fsdpc_status_t to_partial(const ctx_t *c, const fsdpc_tensor_t *x, placement_t from,
                                 reduce_op_t op, fsdpc_tensor_t *out) {
  if (from.kind == PLACEMENT_REPLICATE) {
    if (op == REDUCE_SUM && c->r != 0)
      return tensor_zeros(out, x->dtype, x->device, x->ndim, x->shape);
    return tensor_ref(out, x);
  }
  /* Shard(d) -> Partial(sum): the shard in place inside zeros. */
  int d = from.dim;
  int64_t F[TENSOR_MAX_DIMS], o, l;
  with_dim(x, d, c->L[d], F);
  placement_chunk_range(c->L[d], c->W, c->r, &o, &l);
  FSDPC_TRY(tensor_zeros(out, x->dtype, x->device, x->ndim, F));
  fsdpc_status_t st = copy_region(out, d, o, x);
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

/* Checks the planner's promise: no mesh dimension after i shards tensor dimension d. */
static fsdpc_status_t check_inner(const placement_t *cur, int n, int i, int d) {
  for (int j = i + 1; j < n; j++)
    if (placement_is_shard(cur[j], d))
      return err_set(STATUS_EINTERNAL,
                     "redistribute: mesh dim %d changes a shard of tensor dim %d that mesh dim "
                     "%d also shards",
                     i, d, j);
  return STATUS_OK;
}

/* Runs one step on mesh dimension s->dim; replaces *x with the result. */
static fsdpc_status_t run_step(const dtensor_t *src, const placement_t *cur, const step_t *s,
                               fsdpc_tensor_t *x) {
  mesh_t *mesh = src->mesh;
  int n = mesh_ndim(mesh), shape[MESH_MAX_DIMS], coord[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, coord);
  ctx_t c = {.pg = mesh_group(mesh, s->dim), .W = shape[s->dim], .r = coord[s->dim]};
  int64_t off[TENSOR_MAX_DIMS];
  placements_local_box(src->ndim, src->shape, s->dim, shape, cur, coord, c.L, off);

  placement_t from = s->from, to = s->to;
  if (from.kind == PLACEMENT_SHARD) FSDPC_TRY(check_inner(cur, n, s->dim, from.dim));
  if (to.kind == PLACEMENT_SHARD) FSDPC_TRY(check_inner(cur, n, s->dim, to.dim));

  fsdpc_tensor_t out = {0};
  fsdpc_status_t st;
  if (from.kind == PLACEMENT_SHARD && to.kind == PLACEMENT_REPLICATE)
    st = shard_to_replicate(&c, x, from.dim, &out);
  else if (from.kind == PLACEMENT_PARTIAL && to.kind == PLACEMENT_REPLICATE)
    st = partial_to_replicate(&c, x, from.op, &out);
  else if (from.kind == PLACEMENT_PARTIAL && to.kind == PLACEMENT_SHARD)
    st = partial_to_shard(&c, x, from.op, to.dim, &out);
  else if (from.kind == PLACEMENT_SHARD && to.kind == PLACEMENT_SHARD)
    st = shard_to_shard(&c, x, from.dim, to.dim, &out);
  else if (from.kind == PLACEMENT_REPLICATE && to.kind == PLACEMENT_SHARD)
    st = replicate_to_shard(&c, x, to.dim, &out);
  else if (to.kind == PLACEMENT_PARTIAL)
    st = to_partial(&c, x, from, to.op, &out);
  else
    st = err_set(STATUS_EINTERNAL, "redistribute: no rule for this step");
  if (st != STATUS_OK) return st;
  tensor_free(x);
  *x = out;
  return STATUS_OK;
}

/* Steps into a Partial target other than from Replicate or Shard->Partial(sum) go through
 * Replicate. */
static int needs_replicate_first(placement_t from, placement_t to) {
  if (to.kind != PLACEMENT_PARTIAL || from.kind == PLACEMENT_REPLICATE) return 0;
  if (from.kind == PLACEMENT_SHARD) return to.op != REDUCE_SUM;
  return 1; /* Partial(a) -> Partial(b), a != b */
}

/* ---- the general path for strided shards ---- */

static int has_strided(int n, const placement_t *pl) {
  for (int i = 0; i < n; i++)
    if (pl[i].kind == PLACEMENT_SHARD && pl[i].split_factor > 1) return 1;
  return 0;
}

static fsdpc_status_t gather_full(const dtensor_t *src, fsdpc_tensor_t *full) {
  mesh_t *mesh = src->mesh;
  int n = mesh_ndim(mesh), shape[MESH_MAX_DIMS], coord[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, coord);
  fsdpc_tensor_t x = {0}, buf = {0}, next = {0}, blk = {0};
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY(tensor_ref(&x, &src->local));
  for (int i = 0; i < n; i++) { /* reduce every Partial dimension first */
    if (src->pl[i].kind != PLACEMENT_PARTIAL) continue;
    fsdpc_tensor_t reduced;
    FSDPC_TRY_GOTO(st, tensor_clone(&reduced, &x, x.dtype, x.device));
    tensor_free(&x);
    x = reduced;
    FSDPC_TRY_GOTO(st, pg_all_reduce(mesh_group(mesh, i), x.data, x.data, (size_t)tensor_numel(&x),
                                     x.dtype, src->pl[i].op, NULL));
  }
  int64_t maxbox = 0, ls[TENSOR_MAX_DIMS], off[TENSOR_MAX_DIMS];
  int c[MESH_MAX_DIMS];
  for (int idx = 0; idx < mesh_numel(mesh); idx++) {
    mesh_unravel(mesh, idx, c);
    placements_local_box(src->ndim, src->shape, n, shape, src->pl, c, ls, off);
    int64_t ne = numel_of(src->ndim, ls);
    if (ne > maxbox) maxbox = ne;
  }
  int64_t count = maxbox;
  FSDPC_TRY_GOTO(st, tensor_zeros(&buf, x.dtype, x.device, 1, &count));
  if (tensor_numel(&x) > 0) {
    fsdpc_tensor_t flat, head;
    FSDPC_TRY_GOTO(st, tensor_view(&flat, &x, 1, (int64_t[]){tensor_numel(&x)}));
    st = tensor_narrow(&head, &buf, 0, 0, tensor_numel(&x));
    if (st == STATUS_OK) st = tensor_copy(&head, &flat);
    tensor_free(&flat);
    tensor_free(&head);
    if (st != STATUS_OK) goto cleanup;
  }
  for (int i = n - 1; i >= 0; i--) { /* row-major order of coordinates when done */
    int64_t total = count * shape[i];
    FSDPC_TRY_GOTO(st, tensor_init(&next, x.dtype, x.device, 1, &total));
    FSDPC_TRY_GOTO(
        st, pg_all_gather(mesh_group(mesh, i), buf.data, next.data, (size_t)count, x.dtype, NULL));
    tensor_free(&buf);
    buf = next;
    memset(&next, 0, sizeof next);
    count = total;
  }
  FSDPC_TRY_GOTO(st, tensor_init(full, x.dtype, x.device, src->ndim, src->shape));
  for (int idx = 0; idx < mesh_numel(mesh) && maxbox > 0; idx++) {
    mesh_unravel(mesh, idx, c);
    placements_local_box(src->ndim, src->shape, n, shape, src->pl, c, ls, off);
    FSDPC_TRY_GOTO(st, block_of(&blk, &buf, idx, maxbox, src->ndim, ls));
    fsdpc_tensor_t region = {0};
    st = tensor_narrow_box(&region, full, off, ls);
    if (st == STATUS_OK) st = tensor_copy(&region, &blk);
    tensor_free(&region);
    tensor_free(&blk);
    if (st != STATUS_OK) goto cleanup;
  }
cleanup:
  tensor_free(&x);
  tensor_free(&buf);
  tensor_free(&next);
  tensor_free(&blk);
  if (st != STATUS_OK) tensor_free(full);
  return st;
}

fsdpc_status_t dtensor_redistribute(const dtensor_t *src, const placement_t *dst, dtensor_t **out) {
  if (src == NULL || dst == NULL || out == NULL)
    return err_set(STATUS_EINVAL, "dtensor_redistribute: %s is NULL",
                   out == NULL   ? "out"
                   : src == NULL ? "src (the DTensor)"
                                 : "dst (the placements)");
  *out = NULL;
  mesh_t *mesh = src->mesh;
  int n = mesh_ndim(mesh), shape[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, NULL);
  fsdpc_status_t ok = placements_check(src->ndim, n, shape, dst);
  if (ok == STATUS_OK)
    ok = placements_check_dtype(n, dst, src->local.dtype, "dtensor_redistribute");
  /* FSDPC_CHECK_COLLECTIVES: a rank whose arguments differ, or fail here alone, is named on
   * every rank (the others would wait in collectives it never makes) */
  if (pg_checking_calls())
    ok = dtensor_agree_args(mesh, src->local.dtype, src->ndim, src->shape, dst, DTENSOR_ALL_RANKS,
                            ok, "dtensor_redistribute");
  FSDPC_TRY(ok);
  if (tensor_is_meta(&src->local))
    return err_set(STATUS_EINVAL,
                   "dtensor_redistribute: the DTensor is meta, with no memory (a model built "
                   "for deferred initialisation: allocate its shards with "
                   "nn_module_materialize first)");
  if (!device_equal(src->local.device, mesh_device(mesh))) {
    char a[16], b[16];
    return err_set(STATUS_EINVAL,
                   "dtensor_redistribute: the local shard is on %s (offloaded), the mesh on %s; "
                   "copy it to the mesh's device first",
                   device_str(src->local.device, a, sizeof a),
                   device_str(mesh_device(mesh), b, sizeof b));
  }
  fsdpc_tensor_t x = {0};
  fsdpc_status_t st = STATUS_OK;
  if (has_strided(n, src->pl) || has_strided(n, dst)) {
    fsdpc_tensor_t full = {0};
    FSDPC_TRY(gather_full(src, &full));
    st = local_from_full(&full, mesh, dst, &x);
    tensor_free(&full);
    if (st != STATUS_OK) return st;
  } else {
    step_t steps[2 * MESH_MAX_DIMS];
    int ns = plan_steps(n, src->pl, dst, steps);
    placement_t cur[MESH_MAX_DIMS];
    memcpy(cur, src->pl, sizeof(placement_t) * (size_t)n);
    FSDPC_TRY(tensor_ref(&x, &src->local));
    for (int k = 0; k < ns; k++) {
      step_t s = steps[k];
      if (needs_replicate_first(s.from, s.to)) {
        step_t first = {s.dim, s.from, placement_replicate()};
        FSDPC_TRY_GOTO(st, run_step(src, cur, &first, &x));
        cur[s.dim] = placement_replicate();
        s.from = placement_replicate();
      }
      FSDPC_TRY_GOTO(st, run_step(src, cur, &s, &x));
      cur[s.dim] = s.to;
    }
  }
  st = dtensor_wrap_owned(&x, mesh, dst, src->ndim, src->shape, out);
cleanup:
  tensor_free(&x);
  return st;
}
