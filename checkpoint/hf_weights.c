#include "checkpoint/hf_weights.h"

#include <stdlib.h>
#include <string.h>

#include "checkpoint/safetensors.h"

static status_t load_one(st_file_t *f, nn_param_t *p) {
  const st_info_t *t = st_find(f, p->fqn);
  if (t == NULL) return err_set(STATUS_EFORMAT, "%s: missing tensor '%s'", st_path(f), p->fqn);
  int nd = dtensor_ndim(p->value);
  const int64_t *shape = dtensor_shape(p->value);
  bool same = t->ndim == nd;
  for (int d = 0; same && d < nd; d++) same = t->shape[d] == shape[d];
  if (!same) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has shape %s, the model expects %s", st_path(f),
                   p->fqn, shape_str(t->ndim, t->shape, a, sizeof a),
                   shape_str(nd, shape, b, sizeof b));
  }
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(p->value, off);
  tensor_t dst;
  TRY(tensor_ref(&dst, dtensor_local(p->value)));
  status_t st = st_read_box(f, p->fqn, off, &dst);
  tensor_free(&dst);
  return st;
}

status_t ckpt_load_weights(nn_module_t *root, const char *path) {
  nn_param_t **ps = NULL;
  int n = 0;
  st_file_t *f = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, nn_named_parameters(root, &ps, &n));
  TRY_GOTO(st, st_open(&f, path));
  for (int i = 0; i < n; i++) TRY_GOTO(st, load_one(f, ps[i]));
  for (int i = 0; i < st_num_tensors(f); i++) {
    const char *name = st_tensor(f, i)->name;
    bool known = false;
    for (int j = 0; j < n && !known; j++) known = strcmp(ps[j]->fqn, name) == 0;
    if (!known)
      TRY_GOTO(st, err_set(STATUS_EFORMAT,
                           "%s: unexpected tensor '%s' (not a parameter of the "
                           "model)",
                           path, name));
  }
cleanup:
  st_close(f);
  free(ps);
  return st;
}

status_t ckpt_save_weights(nn_module_t *root, const char *path) {
  nn_param_t **ps = NULL;
  int n = 0;
  st_writer_t *w = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, nn_named_parameters(root, &ps, &n));
  TRY_GOTO(st, st_writer_new(&w));
  for (int i = 0; i < n; i++) {
    const dtensor_t *v = ps[i]->value;
    const placement_t *pl = dtensor_placements(v);
    for (int d = 0; d < mesh_ndim(dtensor_mesh(v)); d++)
      if (pl[d].kind != PLACEMENT_REPLICATE)
        TRY_GOTO(st, err_set(STATUS_EUNSUPPORTED,
                             "saving %s: parameter '%s' is not whole on "
                             "this rank (sharded or partial)",
                             path, ps[i]->fqn));
    TRY_GOTO(st, st_writer_add(w, ps[i]->fqn, dtensor_local(v)));
  }
  TRY_GOTO(st, st_writer_set_metadata(w, "format", "pt"));
  TRY_GOTO(st, st_writer_save(w, path));
cleanup:
  st_writer_free(w);
  free(ps);
  return st;
}
