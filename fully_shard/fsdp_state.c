/* The per-step context of a model under fully_shard, kept by its root group: the orders the
 * groups run in, which drive prefetching, backward's place in them, and (fsdp_comm.c) the
 * reduction in flight. */
#include <stdlib.h>

#include "core/args_impl.h"
#include "fully_shard/fsdp_impl.h"

fsdpc_status_t gvec_push(gvec_t *a, fsdp_group_t *g) {
  ARRAY_GROW(a->v, a->n, a->cap, 16, "fully_shard");
  a->v[a->n++] = g;
  return STATUS_OK;
}

void fsdp_state_free(fsdp_state_t *s) {
  free(s->fwd_order.v);
  free(s->prev_fwd_order.v);
  free(s->bwd_order.v);
  *s = (fsdp_state_t){0};
}

fsdpc_status_t fsdp_state_pre_forward(fsdp_state_t *s, fsdp_group_t *g, fsdp_group_t **next) {
  *next = NULL;
  if (g->is_root) { /* a new step: the forward order just recorded becomes the last one */
    gvec_t t = s->prev_fwd_order;
    s->prev_fwd_order = s->fwd_order;
    s->fwd_order = t;
    s->fwd_order.n = 0;
    s->bwd_order.n = 0;
  }
  FSDPC_TRY(gvec_push(&s->fwd_order, g));
  const gvec_t *prev = &s->prev_fwd_order;
  int pos = s->fwd_order.n - 1;
  if (pos + 1 < prev->n && prev->v[pos] == g) *next = prev->v[pos + 1];
  return STATUS_OK;
}

fsdpc_status_t fsdp_state_post_forward(fsdp_state_t *s, fsdp_group_t *g) {
  return gvec_push(&s->bwd_order, g);
}

void fsdp_state_backward_begins(fsdp_state_t *s) {
  s->bwd_pos = s->bwd_order.n;
  s->in_backward = true;
}

fsdp_group_t *fsdp_state_pre_backward(fsdp_state_t *s, const fsdp_group_t *g) {
  int i = s->bwd_pos - 1;
  while (i >= 0 && s->bwd_order.v[i] != g) i--;
  if (i >= 0) s->bwd_pos = i;
  return i > 0 ? s->bwd_order.v[i - 1] : NULL;
}

/* Drops g's prefetch, if one is in flight: what it gathered or cast holds the shards as they
 * were, which an optimizer step is about to change. */
static void drop_prefetch(fsdp_group_t *g) {
  if (g->gathering) fsdp_reshard(g);
}

void fsdp_state_backward_ends(fsdp_state_t *s) {
  s->in_backward = false;
  fsdp_state_drop_prefetches(s);
}

void fsdp_state_drop_prefetches(fsdp_state_t *s) {
  /* what a prefetch can have started: the groups of this forward (backward prefetches among
   * them), those of the last one (forward prefetches follow its order; a group it ran may not
   * have run in this one), and what the explicit lists of this forward's groups name */
  for (int i = 0; i < s->fwd_order.n; i++) {
    fsdp_group_t *g = s->fwd_order.v[i];
    drop_prefetch(g);
    for (int k = 0; k < g->n_fwd_prefetch; k++) drop_prefetch(g->fwd_prefetch[k]);
    for (int k = 0; k < g->n_bwd_prefetch; k++) drop_prefetch(g->bwd_prefetch[k]);
  }
  for (int i = 0; i < s->prev_fwd_order.n; i++) drop_prefetch(s->prev_fwd_order.v[i]);
}
