/* A checkpoint folder opened for reading: its files, which checks its records allow, and the
 * table of every tensor's chunks (checked to tile the tensor exactly). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/dcp_reader_impl.h"
#include "core/args_impl.h"
#include "core/file.h"

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The *.safetensors names directly in dir, sorted. */
static fsdpc_status_t list_files(const char *dir, char ***out, int *count) {
  *out = NULL;
  *count = 0;
  DIR *d = opendir(dir);
  if (d == NULL)
    return err_set(STATUS_EIO, "checkpoint: cannot open folder %s: %s", dir, strerror(errno));
  char **names = NULL;
  int n = 0, cap = 0;
  fsdpc_status_t st = STATUS_OK;
  struct dirent *e;
  while ((e = readdir(d)) != NULL && st == STATUS_OK) {
    size_t l = strlen(e->d_name);
    if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors") != 0) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **nn = realloc(names, sizeof(char *) * (size_t)cap);
      if (nn == NULL) {
        st = oom();
        break;
      }
      names = nn;
    }
    if ((names[n] = strdup(e->d_name)) == NULL)
      st = oom();
    else
      n++;
  }
  closedir(d);
  if (st == STATUS_OK && n == 0)
    st = err_set(STATUS_EFORMAT, "checkpoint: %s holds no .safetensors file", dir);
  if (st != STATUS_OK) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return st;
  }
  qsort(names, (size_t)n, sizeof(char *), cmp_str);
  *out = names;
  *count = n;
  return STATUS_OK;
}

/* Every file records the folder's files: the same list, naming exactly the files present. */
static fsdpc_status_t check_file_lists(const dcp_reader_t *r) {
  const dcp_integrity_t *ref = &r->files[0].it;
  for (int i = 1; i < r->n_files; i++) {
    const dcp_integrity_t *it = &r->files[i].it;
    bool same = it->n_files == ref->n_files && it->save_id == ref->save_id;
    for (int k = 0; same && k < it->n_files; k++) same = strcmp(it->files[k], ref->files[k]) == 0;
    if (!same)
      return err_set(STATUS_EFORMAT,
                     "checkpoint %s: %s and %s belong to different saves (their ids or file "
                     "lists differ): files of two checkpoints are mixed",
                     r->dir, r->files[0].base, r->files[i].base);
  }
  char **listed = malloc(sizeof(char *) * (size_t)(ref->n_files ? ref->n_files : 1));
  if (listed == NULL) return oom();
  memcpy(listed, ref->files, sizeof(char *) * (size_t)ref->n_files);
  qsort(listed, (size_t)ref->n_files, sizeof(char *), cmp_str);
  fsdpc_status_t st = STATUS_OK;
  int a = 0, b = 0; /* merge the two sorted lists: present (r->files) and listed */
  while (st == STATUS_OK && (a < r->n_files || b < ref->n_files)) {
    int c = a == r->n_files    ? 1
            : b == ref->n_files ? -1
                                : strcmp(r->files[a].base, listed[b]);
    if (c < 0)
      st = err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s is not one of the files this checkpoint lists (a file of "
                   "another checkpoint?)",
                   r->dir, r->files[a].base);
    else if (c > 0)
      st = err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s is missing (the checkpoint's files list it): the "
                   "checkpoint is incomplete",
                   r->dir, listed[b]);
    else if (b + 1 < ref->n_files && strcmp(listed[b], listed[b + 1]) == 0)
      st = err_set(STATUS_EFORMAT, "checkpoint %s: the files list names %s twice", r->dir,
                   listed[b]);
    a += c <= 0;
    b += c >= 0;
  }
  free(listed);
  return st;
}

/* How the folder's chunks are checked: every file has an integrity record, or none has one
 * (then a legacy crc32 on every chunk, or on none: a folder written by another tool). */
static fsdpc_status_t decide_checks(dcp_reader_t *r) {
  int with = 0;
  for (int i = 0; i < r->n_files; i++) with += r->files[i].has_integrity;
  if (with == r->n_files) {
    r->checks = DCP_CHECKS_BLOCKS;
    r->block_bytes = r->files[0].it.block_bytes;
    return check_file_lists(r);
  }
  if (with > 0) {
    int a = 0, b = 0;
    while (!r->files[a].has_integrity) a++;
    while (r->files[b].has_integrity) b++;
    return err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s has no %s record while %s has one: the record was "
                   "removed, or the file belongs to another checkpoint",
                   r->dir, r->files[b].base, DCP_INTEGRITY_KEY, r->files[a].base);
  }
  const rfile_t *with_crc = NULL;
  for (int i = 0; i < r->n_files && !with_crc; i++)
    for (int k = 0; k < st_num_tensors(r->files[i].f) && !with_crc; k++)
      if (r->files[i].has_crc[k]) with_crc = &r->files[i];
  r->checks = with_crc ? DCP_CHECKS_CHUNKS : DCP_CHECKS_NONE;
  for (int i = 0; i < r->n_files && with_crc; i++)
    for (int k = 0; k < st_num_tensors(r->files[i].f); k++) {
      const st_info_t *t = st_tensor(r->files[i].f, k);
      if (!r->files[i].has_crc[k] && t->end > t->begin)
        return err_set(STATUS_EFORMAT,
                       "%s: tensor '%s' has no crc32 while the other chunks of the folder (in "
                       "%s) have one: a checksum was removed",
                       st_path(r->files[i].f), t->name, with_crc->base);
    }
  return STATUS_OK;
}

/* A (name, file, position) of every tensor of every file, to sort by name. */
typedef struct ref {
  const char *name;
  int file, index;
} ref_t;

static int cmp_ref(const void *a, const void *b) {
  const ref_t *x = a, *y = b;
  int c = strcmp(x->name, y->name);
  return c ? c : x->file - y->file;
}

static void fill_chunk(const dcp_reader_t *r, int file, int index, chunk_t *c) {
  const rfile_t *rf = &r->files[file];
  const st_info_t *t = st_tensor(rf->f, index);
  c->file = file;
  c->info = t;
  memcpy(c->off, rf->offs[index], sizeof c->off);
  if (r->checks == DCP_CHECKS_BLOCKS) {
    c->block = rf->it.block_bytes;
    c->hash = rf->it.hashes + rf->first_block[index];
  } else if (r->checks == DCP_CHECKS_CHUNKS) {
    c->block = t->end - t->begin > 0 ? t->end - t->begin : 1;
    c->crc = rf->crc[index];
  }
}

/* The chunks of one tensor tile it exactly: no two overlap and their elements add up to the
 * tensor's (every chunk lies inside it: the shape is the largest end). */
static fsdpc_status_t check_tiling(const dcp_reader_t *r, const dcp_tensor_t *t, const chunk_t *c,
                                   int nc) {
  int nd = t->ndim;
  uint64_t total = 1, sum = 0;
  bool huge = false;
  for (int d = 0; d < nd; d++) huge |= __builtin_mul_overflow(total, (uint64_t)t->shape[d], &total);
  for (int k = 0; k < nc; k++) {
    uint64_t v = 1;
    for (int d = 0; d < nd; d++) v *= (uint64_t)c[k].info->shape[d]; /* bounded by the file */
    huge |= __builtin_add_overflow(sum, v, &sum);
  }
  char a[96];
  if (huge)
    return err_set(STATUS_EFORMAT,
                   "checkpoint %s: tensor '%s' of shape %s: its elements, or its chunks', "
                   "number more than 2^64",
                   r->dir, t->name, tensor_shape_str(nd, t->shape, a, sizeof a));
  if (sum != total)
    return err_set(STATUS_EFORMAT,
                   "checkpoint %s: the chunks of tensor '%s' hold %llu elements, its shape %s has "
                   "%llu: a chunk is missing, repeated or misplaced",
                   r->dir, t->name, (unsigned long long)sum,
                   tensor_shape_str(nd, t->shape, a, sizeof a), (unsigned long long)total);
  if (nd == 0) return STATUS_OK; /* one chunk of one element */
  /* sweep along dimension 0: only chunks whose rows meet can overlap */
  int *order = malloc(sizeof(int) * (size_t)nc);
  if (order == NULL) return oom();
  for (int k = 0; k < nc; k++) order[k] = k;
  for (int i = 1; i < nc; i++) /* insertion sort by first row: chunks come nearly sorted */
    for (int j = i; j > 0 && c[order[j - 1]].off[0] > c[order[j]].off[0]; j--) {
      int x = order[j];
      order[j] = order[j - 1];
      order[j - 1] = x;
    }
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < nc && st == STATUS_OK; i++) {
    const chunk_t *p = &c[order[i]];
    for (int j = i + 1; j < nc && st == STATUS_OK; j++) {
      const chunk_t *q = &c[order[j]];
      if (q->off[0] >= p->off[0] + p->info->shape[0]) break;
      bool meet = true;
      for (int d = 0; d < nd && meet; d++)
        meet = q->off[d] < p->off[d] + p->info->shape[d] && p->off[d] < q->off[d] + q->info->shape[d];
      if (meet)
        st = err_set(STATUS_EFORMAT,
                     "checkpoint %s: tensor '%s': the chunks in %s and %s overlap: the "
                     "checkpoint is corrupt",
                     r->dir, t->name, r->files[p->file].base, r->files[q->file].base);
    }
  }
  free(order);
  return st;
}

/* Folds the chunks of one tensor into its description and checks them. */
static fsdpc_status_t fold_tensor(const dcp_reader_t *r, const chunk_t *c, int nc,
                                  dcp_tensor_t *e) {
  const st_info_t *t = c[0].info;
  if ((e->name = strdup(t->name)) == NULL) return oom();
  e->dtype = t->dtype;
  e->dtype_name = t->dtype_name;
  e->ndim = t->ndim;
  for (int q = 0; q < nc; q++) {
    const st_info_t *ci = c[q].info;
    if (ci->ndim != t->ndim || strcmp(ci->dtype_name, t->dtype_name) != 0)
      return err_set(STATUS_EFORMAT,
                     "%s: tensor '%s' is stored as %s with %d dimensions here and as %s with %d "
                     "in %s",
                     st_path(r->files[c[q].file].f), t->name, ci->dtype_name, ci->ndim,
                     t->dtype_name, t->ndim, r->files[c[0].file].base);
    for (int d = 0; d < t->ndim; d++) {
      if (c[q].off[d] + ci->shape[d] > e->shape[d]) e->shape[d] = c[q].off[d] + ci->shape[d];
    }
    e->chunks++;
    e->bytes += ci->end - ci->begin;
  }
  return check_tiling(r, e, c, nc);
}

/* The tensor table: every name once, its chunks together. */
static fsdpc_status_t build_table(dcp_reader_t *r) {
  int total = 0;
  for (int i = 0; i < r->n_files; i++) total += st_num_tensors(r->files[i].f);
  size_t m = (size_t)(total > 0 ? total : 1);
  ref_t *refs = malloc(sizeof(ref_t) * m);
  r->chunks = calloc(m, sizeof(chunk_t));
  r->list = calloc(m, sizeof(dcp_tensor_t));
  r->first = calloc(m + 1, sizeof(int));
  if (refs == NULL || r->chunks == NULL || r->list == NULL || r->first == NULL) {
    free(refs);
    return oom();
  }
  int k = 0;
  for (int i = 0; i < r->n_files; i++)
    for (int j = 0; j < st_num_tensors(r->files[i].f); j++)
      refs[k++] = (ref_t){st_tensor(r->files[i].f, j)->name, i, j};
  qsort(refs, (size_t)total, sizeof(ref_t), cmp_ref);
  for (int i = 0; i < total; i++) fill_chunk(r, refs[i].file, refs[i].index, &r->chunks[i]);
  free(refs);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < total && st == STATUS_OK;) {
    int j = i + 1;
    while (j < total && strcmp(r->chunks[j].info->name, r->chunks[i].info->name) == 0) j++;
    r->first[r->n_list] = i;
    st = fold_tensor(r, &r->chunks[i], j - i, &r->list[r->n_list]);
    if (r->list[r->n_list].name != NULL) r->n_list++;
    i = j;
  }
  r->first[r->n_list] = total;
  return st;
}

/* Opens files names[0..n) of dir into a new reader; takes the names (frees them and the list,
 * whatever happens). */
static fsdpc_status_t open_named(const char *dir, char **names, int n, dcp_reader_t **out) {
  dcp_reader_t *r = calloc(1, sizeof *r);
  fsdpc_status_t st = r ? STATUS_OK : oom();
  if (r) snprintf(r->dir, sizeof r->dir, "%s", dir);
  if (st == STATUS_OK && (r->files = calloc((size_t)(n > 0 ? n : 1), sizeof(rfile_t))) == NULL)
    st = oom();
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char path[DCP_JOIN_MAX];
    r->n_files = i + 1;
    r->files[i].base = names[i]; /* owned by the file now */
    names[i] = NULL;
    st = file_join(path, sizeof path, dir, r->files[i].base);
    if (st == STATUS_OK) st = dcp_rfile_open(&r->files[i], path);
  }
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
  if (st == STATUS_OK) st = decide_checks(r);
  if (st == STATUS_OK) st = build_table(r);
  if (st == STATUS_OK) st = dcp_checker_new(&r->checker);
  if (st != STATUS_OK) {
    dcp_reader_close(r);
    return st;
  }
  *out = r;
  return STATUS_OK;
}

fsdpc_status_t dcp_reader_open(const char *dir, dcp_reader_t **out) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  *out = NULL;
  char **names = NULL;
  int n = 0;
  FSDPC_TRY(list_files(dir, &names, &n));
  return open_named(dir, names, n, out);
}

fsdpc_status_t dcp_reader_open_files(const char *dir, const char *const *files, int n,
                                     dcp_reader_t **out) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  *out = NULL;
  if (n < 1 || files == NULL) return err_set(STATUS_EINVAL, "%s: no file to open", dir);
  char **names = calloc((size_t)n, sizeof *names);
  if (names == NULL) return oom();
  for (int i = 0; i < n; i++)
    if ((names[i] = strdup(files[i])) == NULL) {
      for (int k = 0; k < i; k++) free(names[k]);
      free(names);
      return oom();
    }
  return open_named(dir, names, n, out);
}

void dcp_reader_close(dcp_reader_t *r) {
  if (r == NULL) return;
  for (int i = 0; i < r->n_list; i++) free(r->list[i].name);
  for (int i = 0; i < r->n_files; i++) dcp_rfile_close(&r->files[i]);
  free(r->files);
  free(r->list);
  free(r->chunks);
  free(r->first);
  dcp_checker_free(r->checker);
  free(r);
}

dcp_checks_t dcp_reader_checks(const dcp_reader_t *r, uint64_t *block_bytes) {
  if (r == NULL) return (dcp_checks_t){0};
  if (block_bytes) *block_bytes = r->block_bytes;
  return r->checks;
}

bool dcp_reader_save_id(const dcp_reader_t *r, uint64_t *id) {
  if (r == NULL || id == NULL) return false;
  if (r->checks != DCP_CHECKS_BLOCKS) return false;
  *id = r->files[0].it.save_id;
  return true;
}

fsdpc_status_t dcp_reader_list(dcp_reader_t *r, const dcp_tensor_t **out, int *n) {
  ARG_NONNULL(r);
  ARG_NONNULL(out);
  ARG_NONNULL(n);
  *out = r->list;
  *n = r->n_list;
  return STATUS_OK;
}

static int cmp_name_tensor(const void *name, const void *t) {
  return strcmp(name, ((const dcp_tensor_t *)t)->name);
}

int dcp_find_tensor(const dcp_reader_t *r, const char *name) {
  const dcp_tensor_t *t = r->n_list ? bsearch(name, r->list, (size_t)r->n_list,
                                              sizeof(dcp_tensor_t), cmp_name_tensor)
                                    : NULL;
  return t ? (int)(t - r->list) : -1;
}
