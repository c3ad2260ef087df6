/* fully_shard's data path: unshard (copy-in, all-gather, copy-out), reshard, and the
 * post-backward reduce-scatter / all-reduce of gradients. */
#include <stdlib.h>
#include <string.h>

#include "base/kernels.h"
#include "fully_shard/fsdp_impl.h"

/* ---- unshard / reshard ---- */

void fsdp_emit(fsdp_group_t *g, const char *event) {
  if (g->on_event) g->on_event(event, g, g->on_event_user);
}

/* Starts gathering the group: copy-in and a nonblocking all-gather (or, after an integer
 * reshard, the all-gather of the kept slices within the post-forward group). */
status_t fsdp_unshard_start(fsdp_group_t *g) {
  if (g->unsharded || g->gathering) return STATUS_OK;
  if (g->n == 0) {
    g->unsharded = true;
    return STATUS_OK;
  }
  int64_t total = g->flat * g->W;
  TRY(tensor_init(&g->gather, g->param_dtype, mesh_device(g->mesh), 1, &total));
  g->gathering = true;
  fsdp_emit(g, "unshard");
  status_t st = STATUS_OK;
  if (g->post_forward_slice.storage != NULL) {
    int64_t count = tensor_numel(&g->post_forward_slice);
    return pg_all_gather(g->post_forward, g->post_forward_slice.data, g->gather.data, (size_t)count,
                         g->param_dtype, &g->pending);
  }
  /* copy-in: this rank's padded shards, cast, into its block of the gather buffer */
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    tensor_t slot, flat;
    int64_t n = fp->rows * fp->row;
    if ((st = tensor_narrow(&slot, &g->gather, 0, g->rank * g->flat + fp->offset, n)) != STATUS_OK)
      break;
    st = tensor_view(&flat, &fp->padded, 1, &n);
    if (st == STATUS_OK) st = tensor_copy(&slot, &flat);
    tensor_free(&flat);
    tensor_free(&slot);
  }
  if (st == STATUS_OK && g->W > 1) {
    char *base = g->gather.data;
    st = pg_all_gather(g->shard, base + (size_t)(g->rank * g->flat) * dtype_size(g->param_dtype),
                       g->gather.data, (size_t)g->flat, g->param_dtype, &g->pending);
  }
  return st;
}

/* Copies chunk r (of W, the chunk rule on dim 0) of the unsharded tensor full to or from a
 * flat buffer, where its rows lie contiguously from element pos. Empty chunks copy nothing. */
static status_t chunk_copy(const fsdp_param_t *fp, int W, int r, tensor_t *full, tensor_t *flat,
                           int64_t pos, bool to_flat) {
  int64_t start, len, shape[TENSOR_MAX_DIMS];
  chunk_range(fp->n0, W, r, &start, &len);
  if (len == 0) return STATUS_OK;
  memcpy(shape, full->shape, sizeof shape);
  shape[0] = len;
  tensor_t rows = {0}, slot = {0}, slot_nd = {0};
  status_t st = tensor_narrow(&rows, full, 0, start, len);
  if (st == STATUS_OK) st = tensor_narrow(&slot, flat, 0, pos, len * fp->row);
  if (st == STATUS_OK) st = tensor_view(&slot_nd, &slot, full->ndim, shape);
  if (st == STATUS_OK) st = to_flat ? tensor_copy(&slot_nd, &rows) : tensor_copy(&rows, &slot_nd);
  tensor_free(&rows);
  tensor_free(&slot);
  tensor_free(&slot_nd);
  return st;
}

/* Completes a started gather: waits, then copies rank r's rows of each parameter out into
 * the unsharded tensors. */
status_t fsdp_unshard_wait(fsdp_group_t *g) {
  if (!g->gathering) return STATUS_OK;
  status_t st = pg_wait(g->pending);
  g->pending = NULL;
  g->gathering = false;
  tensor_free(&g->post_forward_slice);
  device_t dev = mesh_device(g->mesh);
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    const dtensor_t *v = fp->p->value;
    tensor_t full;
    if ((st = tensor_init(&full, g->param_dtype, dev, dtensor_ndim(v), dtensor_shape(v))) !=
        STATUS_OK)
      break;
    for (int r = 0; r < g->W && st == STATUS_OK; r++)
      st = chunk_copy(fp, g->W, r, &full, &g->gather, r * g->flat + fp->offset, false);
    if (st == STATUS_OK) {
      tensor_free(&fp->p->compute);
      fp->p->compute = full;
    } else {
      tensor_free(&full);
    }
  }
  tensor_free(&g->gather);
  if (st == STATUS_OK) g->unsharded = true;
  return st;
}

status_t fsdp_unshard(fsdp_group_t *g) {
  TRY(fsdp_unshard_start(g));
  return fsdp_unshard_wait(g);
}

void fsdp_reshard(fsdp_group_t *g) {
  if (g->gathering) { /* a prefetch nobody used: complete it, then drop it */
    pg_wait(g->pending);
    g->pending = NULL;
    g->gathering = false;
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
status_t fsdp_reshard_to_slice(fsdp_group_t *g) {
  int N = g->reshard_after_forward, per = g->W / N, first = (g->rank % N) * per;
  int64_t count = (int64_t)per * g->flat;
  tensor_t slice;
  TRY(tensor_zeros(&slice, g->param_dtype, mesh_device(g->mesh), 1, &count));
  status_t st = STATUS_OK;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    for (int b = first; b < first + per && st == STATUS_OK; b++)
      st = chunk_copy(fp, g->W, b, &fp->p->compute, &slice, (b - first) * g->flat + fp->offset,
                      true);
  }
  fsdp_reshard(g);
  if (st == STATUS_OK)
    g->post_forward_slice = slice;
  else
    tensor_free(&slice);
  return st;
}

/* ---- gradient reduction ---- */

static bool has_grad(const nn_param_t *p) {
  return p->requires_grad && (p->compute_grad.storage != NULL || p->compute_grad.ndim > 0);
}

status_t fsdp_reduce_grads(fsdp_group_t *g) {
  int64_t flat = 0;
  for (int i = 0; i < g->n; i++)
    if (has_grad(g->params[i].p)) flat += g->params[i].rows * g->params[i].row;
  if (flat == 0) return STATUS_OK;
  device_t dev = mesh_device(g->mesh);
  int64_t total = flat * g->W;
  reduce_op_t op = g->divide_factor > 0 ? REDUCE_SUM : REDUCE_AVG;
  tensor_t send, recv = {0};
  TRY(tensor_zeros(&send, g->reduce_dtype, dev, 1, &total));
  status_t st = STATUS_OK;
  /* rank-major pack: block r holds chunk r of every parameter, each padded to its rows */
  int64_t off = 0;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    if (!has_grad(fp->p)) continue;
    for (int r = 0; r < g->W && st == STATUS_OK; r++)
      st = chunk_copy(fp, g->W, r, &fp->p->compute_grad, &send, r * flat + off, true);
    off += fp->rows * fp->row;
  }
  if (st == STATUS_OK) {
    if (g->W > 1) {
      st = tensor_init(&recv, g->reduce_dtype, dev, 1, &flat);
      if (st == STATUS_OK)
        st = pg_reduce_scatter(g->shard, send.data, recv.data, (size_t)flat, g->reduce_dtype, op,
                               NULL);
    } else {
      st = tensor_ref(&recv, &send);
    }
  }
  if (st == STATUS_OK && g->replicate != NULL && pg_size(g->replicate) > 1) {
    /* HSDP: without all-reduce, park the partial result; with it, add what was parked */
    bool parked = g->partial.storage != NULL;
    if (parked && tensor_numel(&g->partial) != flat)
      st = err_set(STATUS_EINVAL,
                   "fully_shard: parameters with gradients changed between "
                   "backward passes without all-reduce");
    if (st == STATUS_OK && !g->all_reduce) {
      st = parked ? kernel_axpy(&g->partial, 1.0f, &recv) : tensor_ref(&g->partial, &recv);
      if (st == STATUS_OK) {
        for (int i = 0; i < g->n; i++)
          if (has_grad(g->params[i].p)) tensor_free(&g->params[i].p->compute_grad);
      }
      tensor_free(&send);
      tensor_free(&recv);
      return st;
    }
    if (st == STATUS_OK && parked) {
      st = kernel_axpy(&recv, 1.0f, &g->partial);
      tensor_free(&g->partial);
    }
    if (st == STATUS_OK)
      st = pg_all_reduce(g->replicate, recv.data, recv.data, (size_t)flat, g->reduce_dtype, op,
                         NULL);
  }
  if (st == STATUS_OK && g->divide_factor > 0)
    st = kernel_scale(&recv, (float)(1.0 / g->divide_factor));
  off = 0;
  for (int i = 0; i < g->n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[i];
    if (!has_grad(fp->p)) continue;
    const tensor_t *local = dtensor_local(fp->p->value);
    tensor_t mine;
    st = tensor_narrow(&mine, &recv, 0, off, tensor_numel(local));
    if (st == STATUS_OK) st = nn_param_accumulate_local_grad(fp->p, &mine);
    tensor_free(&mine);
    tensor_free(&fp->p->compute_grad);
    off += fp->rows * fp->row;
  }
  tensor_free(&send);
  tensor_free(&recv);
  return st;
}
