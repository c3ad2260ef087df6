#include "checkpoint/ckpt_reshard.h"

#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "checkpoint/dcp.h"
#include "checkpoint/train_ckpt.h"

#define PATH_LEN 4400

typedef struct target {
  int world;
  ckpt_placements_fn placements;
  void *ctx;
} target_t;

/* The parameter a tensor of a folder belongs to: NAME for NAME.exp_avg / NAME.exp_avg_sq. */
static void param_of(const char *name, char *out, size_t size) {
  snprintf(out, size, "%s", name);
  size_t l = strlen(out);
  if (l > 8 && strcmp(out + l - 8, ".exp_avg") == 0) out[l - 8] = 0;
  if (l > 11 && strcmp(out + l - 11, ".exp_avg_sq") == 0) out[l - 11] = 0;
}

/* Rank rank's box of tensor t: *mine false when the rank holds none (a replica other than the
 * first, or an empty chunk). */
static fsdpc_status_t rank_box(const target_t *tg, const dcp_tensor_t *t, int rank, bool *mine,
                               int64_t *local, int64_t *off) {
  char param[1024];
  param_of(t->name, param, sizeof param);
  int md = 0, shape[MESH_MAX_DIMS], coord[MESH_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  FSDPC_TRY(tg->placements(tg->ctx, param, t->ndim, &md, shape, pl));
  FSDPC_TRY(placements_check(t->ndim, md, shape, pl));
  int size = 1;
  for (int d = 0; d < md; d++) size *= shape[d];
  if (size != tg->world)
    return err_set(STATUS_EINVAL, "%s: placed on a mesh of %d ranks, not %d", t->name, size,
                   tg->world);
  *mine = true;
  for (int d = md - 1, q = rank; d >= 0; d--) {
    coord[d] = q % shape[d];
    q /= shape[d];
    if (pl[d].kind == PLACEMENT_REPLICATE && coord[d] != 0) *mine = false;
  }
  placements_local_box(t->ndim, t->shape, md, shape, pl, coord, local, off);
  for (int d = 0; d < t->ndim; d++)
    if (local[d] == 0) *mine = false;
  return STATUS_OK;
}

/* The boxes rank rank saves of every tensor of the folder r reads, written as one file of
 * the folder's files (files NULL: only counted into *held_out). */
static fsdpc_status_t reshard_rank(const target_t *tg, dcp_reader_t *r, const char *out_folder,
                                   int rank, const dcp_folder_t *folder, int *held_out) {
  const dcp_tensor_t *t;
  int n;
  FSDPC_TRY(dcp_reader_list(r, &t, &n));
  dcp_box_t *boxes = calloc((size_t)(n ? n : 1), sizeof *boxes);
  fsdpc_tensor_t *held = calloc((size_t)(n ? n : 1), sizeof *held);
  int nb = 0;
  fsdpc_status_t st = boxes && held ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int64_t local[TENSOR_MAX_DIMS], off[TENSOR_MAX_DIMS];
    bool mine = false;
    st = rank_box(tg, &t[i], rank, &mine, local, off);
    if (st != STATUS_OK || !mine) continue;
    if (folder == NULL) {
      nb++;
      continue;
    }
    st = tensor_init(&held[nb], t[i].dtype, device_cpu(), t[i].ndim, local);
    if (st != STATUS_OK) break;
    boxes[nb].name = t[i].name;
    boxes[nb].value = &held[nb];
    memcpy(boxes[nb].offset, off, sizeof off);
    nb++;
  }
  if (st == STATUS_OK && folder != NULL) st = dcp_reader_read_boxes(r, boxes, nb);
  if (st == STATUS_OK && folder != NULL && nb > 0) {
    char path[PATH_LEN + 64], name[32];
    dcp_shard_name(rank, name, sizeof name);
    st = file_join(path, sizeof path, out_folder, name);
    if (st == STATUS_OK) st = dcp_write_file(path, boxes, nb, folder);
  }
  *held_out = nb;
  for (int i = 0; folder && i < nb; i++) tensor_free(&held[i]);
  free(held);
  free(boxes);
  return st;
}

/* One folder (model or optimizer state) laid out for the target's ranks: the files of the
 * ranks that hold a box, each listing them all, with the source's block size. */
static fsdpc_status_t reshard_folder(const target_t *tg, const char *from, const char *to,
                                     int *files_out, uint64_t *id_out) {
  dcp_reader_t *r;
  FSDPC_TRY(dcp_reader_open(from, &r));
  char **files = calloc((size_t)tg->world, sizeof(char *));
  int *holds = calloc((size_t)tg->world, sizeof(int)), n_files = 0;
  fsdpc_status_t st = files && holds ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  for (int rank = 0; rank < tg->world && st == STATUS_OK; rank++) {
    st = reshard_rank(tg, r, to, rank, NULL, &holds[rank]);
    if (st == STATUS_OK && holds[rank] > 0) {
      if ((files[n_files] = malloc(32)) == NULL) {
        st = err_set(STATUS_ENOMEM, "out of host memory");
        break;
      }
      snprintf(files[n_files++], 32, "shard-%05d.safetensors", rank);
    }
  }
  uint64_t block = 0;
  dcp_folder_t folder = {(const char *const *)files, n_files, dcp_new_save_id()};
  if (st == STATUS_OK && dcp_reader_checks(r, &block) == DCP_CHECKS_BLOCKS)
    st = dcp_set_block_bytes(block);
  if (st == STATUS_OK && mkdir(to, 0755) != 0)
    st = err_set(STATUS_EIO, "%s: cannot create: %s", to, strerror(errno));
  for (int rank = 0; rank < tg->world && st == STATUS_OK; rank++) {
    int nb = 0;
    if (holds[rank] > 0) st = reshard_rank(tg, r, to, rank, &folder, &nb);
  }
  if (st == STATUS_OK) *files_out += n_files;
  *id_out = folder.save_id;
  for (int i = 0; i < n_files; i++) free(files[i]);
  free(files);
  free(holds);
  dcp_reader_close(r);
  return st;
}

fsdpc_status_t ckpt_reshard_training(const char *dir, const char *out, int world,
                                     ckpt_placements_fn placements, void *ctx,
                                     const char *saved_under, int *files) {
  if (world < 1) return err_set(STATUS_EINVAL, "reshard: world size %d", world);
  char path[PATH_LEN], *text = NULL;
  FSDPC_TRY(file_join(path, sizeof path, dir, "train_state.json"));
  if (access(path, F_OK) != 0)
    return err_set(STATUS_EINVAL, "%s: not a training checkpoint (no train_state.json)", dir);
  FSDPC_TRY(ckpt_check_state(dir));
  FSDPC_TRY(file_read_text(path, FILE_TEXT_MAX, &text));
  cJSON *state = cJSON_Parse(text), *under = saved_under ? cJSON_Parse(saved_under) : NULL;
  free(text);
  fsdpc_status_t st = STATUS_OK;
  if (!cJSON_IsObject(state))
    st = err_set(STATUS_EFORMAT, "%s: not a JSON object", path);
  else if (saved_under && !cJSON_IsObject(under))
    st = err_set(STATUS_EINVAL, "reshard: saved_under is not a JSON object");
  if (st == STATUS_OK && under) {
    cJSON_DeleteItemFromObjectCaseSensitive(state, "saved_under");
    cJSON_AddItemToObject(state, "saved_under", under);
    under = NULL;
  }
  cJSON_Delete(under);
  if (st == STATUS_OK) st = file_check_output_dir(out, "reshard: OUT", false);
  if (st == STATUS_OK) st = file_check_outside(out, dir, "reshard: OUT");
  char tmp[PATH_LEN + 16];
  if (st == STATUS_OK) st = file_make_temp_dir(out, tmp, sizeof tmp);
  bool made = st == STATUS_OK;
  target_t tg = {world, placements, ctx};
  int n_files = 0;
  uint64_t ids[2] = {0, 0};
  bool has_optim = false;
  const char *subs[2] = {"model", "optim"};
  for (int k = 0; k < 2 && st == STATUS_OK; k++) {
    char from[PATH_LEN + 16], to[PATH_LEN + 16];
    st = file_join(from, sizeof from, dir, subs[k]);
    if (st == STATUS_OK) st = file_join(to, sizeof to, tmp, subs[k]);
    if (st != STATUS_OK) break;
    if (k == 1 && !file_is_dir(from)) break; /* weights only */
    st = reshard_folder(&tg, from, to, &n_files, &ids[k]);
    has_optim = k == 1 && st == STATUS_OK;
  }
  char *state_text = st == STATUS_OK ? cJSON_Print(state) : NULL;
  if (st == STATUS_OK && state_text == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK)
    st = ckpt_commit_state(tmp, out, state_text, &ids[0], has_optim ? &ids[1] : NULL);
  else if (made)
    file_discard_temp_dir(tmp);
  free(state_text);
  cJSON_Delete(state);
  if (st == STATUS_OK && files) *files = n_files;
  return st;
}
