/*
 * The YAML reader behind plan_load and parallel_plan_load (libyaml's document API): places
 * for errors ("file:line:col: key.path: message", or "--set key=value"), key checks with
 * did-you-mean, typed values with ranges, --set overrides. Shared by parallel/parallel_plan.c
 * (mesh and parallelize) and train/plan.c (the job's other sections). Not installed.
 */
#ifndef FSDPC_PARALLEL_PLAN_READER_H
#define FSDPC_PARALLEL_PLAN_READER_H

#include <yaml.h>

#include "parallel/parallel_plan.h"

#define MAX_SETS 256

typedef struct plan_ctx {
  parallel_plan_t *par;         /* the mesh and parallelize sections go here */
  void *job;                    /* the reader of the other sections' own (train/plan.c) */
  char source[PLAN_PATH_MAX];   /* the file, as errors name it */
  yaml_document_t doc;
  int set_base;                 /* nodes from this index on were made by --set */
  const char *set_of[MAX_SETS]; /* the --set text of node set_base + i */
  int n_set_nodes;
  char dir[PLAN_PATH_MAX]; /* the file's folder, for relative paths */
} plan_ctx_t;

/* Plans are small: a plan larger than this, or nested deeper, is refused before libyaml
 * loads it (libyaml's time grows with the square of the flow nesting depth). */
#define PLAN_MAX_BYTES ((size_t)1 << 20)
#define PLAN_MAX_DEPTH 64

yaml_node_t *pr_node(plan_ctx_t *c, int i);
void pr_where_of(plan_ctx_t *c, int i, plan_where_t *w);
/* Where a section's later checks point: the first of keys whose value came from --set
 * ("--set mesh.tp=3"), else the section itself. */
void pr_where_section(plan_ctx_t *c, int m, const char *const *keys, plan_where_t *w);
fsdpc_status_t pr_fail(plan_ctx_t *c, int i, const char *path, const char *fmt, ...);
const char *pr_scalar(plan_ctx_t *c, int i);
bool pr_is_null(plan_ctx_t *c, int i);
void pr_join(char *out, size_t size, const char *prefix, const char *key);
fsdpc_status_t pr_check_keys(plan_ctx_t *c, int i, const char *path, const char *const *keys);
int pr_find(plan_ctx_t *c, int i, const char *key);
int pr_lookup(plan_ctx_t *c, int map, const char *prefix, const char *key, char *path);
fsdpc_status_t pr_want_scalar(plan_ctx_t *c, int v, const char *path, const char *what,
                              const char **s);
fsdpc_status_t pr_parse_int(plan_ctx_t *c, int v, const char *path, int64_t lo, int64_t hi,
                            int64_t *out);
fsdpc_status_t pr_get_int(plan_ctx_t *c, int map, const char *prefix, const char *key, int64_t lo,
                          int64_t hi, int64_t *out);
fsdpc_status_t pr_get_size(plan_ctx_t *c, int map, const char *prefix, const char *key, int *out);
fsdpc_status_t pr_get_float(plan_ctx_t *c, int map, const char *prefix, const char *key, double lo,
                            double hi, bool open_lo, double *out);
fsdpc_status_t pr_parse_bool(plan_ctx_t *c, int v, const char *path, bool *out);
fsdpc_status_t pr_get_bool(plan_ctx_t *c, int map, const char *prefix, const char *key, bool *out);
fsdpc_status_t pr_get_str(plan_ctx_t *c, int map, const char *prefix, const char *key, char *out,
                          size_t size);
fsdpc_status_t pr_get_path(plan_ctx_t *c, int map, const char *prefix, const char *key, char *out);
fsdpc_status_t pr_get_dtype(plan_ctx_t *c, int map, const char *prefix, const char *key,
                            dtype_t *out);
fsdpc_status_t pr_get_reshard(plan_ctx_t *c, int map, const char *prefix, int *out);
fsdpc_status_t pr_section(plan_ctx_t *c, int root, const char *key, const char *const *keys,
                          int *out);
fsdpc_status_t pr_apply_set(plan_ctx_t *c, int root, const char *set);
fsdpc_status_t pr_parse_file(plan_ctx_t *c, const char *path);
/* Reads path into c (source and folder set), applies the --set texts, and checks that the
 * top level is a mapping whose keys are among top (NULL-terminated): sections, the list an
 * empty file's error names, first, what a non-mapping's error names after "mesh, ". *root:
 * the top node. pr_close frees what it read, whatever it returned. */
fsdpc_status_t pr_open(plan_ctx_t *c, const char *path, const char *const *sets, int n_sets,
                       const char *const *top, const char *sections, const char *first, int *root);
void pr_close(plan_ctx_t *c);

/* parallel_plan.c: the mesh and parallelize sections into c->p->par. */
fsdpc_status_t pp_read_mesh(plan_ctx_t *c, int root);
fsdpc_status_t pp_read_parallelize(plan_ctx_t *c, int root);

#endif
