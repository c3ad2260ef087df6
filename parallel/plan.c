/* YAML plans (libyaml's document API) into plan_t: --set overrides, key checks with
 * did-you-mean, typed values with ranges, then resolution against the world size. */
#include "parallel/plan.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "base/file.h"
#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "parallel/llama_plan.h"

#define MAX_SETS 256

typedef struct ctx {
  plan_t *p;
  yaml_document_t doc;
  int set_base;                 /* nodes from this index on were made by --set */
  const char *set_of[MAX_SETS]; /* the --set text of node set_base + i */
  int n_set_nodes;
  char dir[PLAN_PATH_MAX]; /* the file's folder, for relative paths */
} ctx_t;

void parallel_plan_defaults(parallel_plan_t *pp) {
  memset(pp, 0, sizeof *pp);
  pp->dp_replicate = 1;
  pp->dp_shard = -1;
  pp->tp = 1;
  pp->reshard_after_forward = FSDP_RESHARD_AUTO;
  pp->param_dtype = pp->reduce_dtype = pp->output_dtype = DTYPE_COUNT;
}

void plan_defaults(plan_t *p) {
  memset(p, 0, sizeof *p);
  parallel_plan_defaults(&p->par);
  /* model: the small Llama of configs/llama-small.json */
  p->model = (llama_config_t)LLAMA_CONFIG_INIT;
  p->model.dim = 256;
  p->model.n_layers = 6;
  p->model.n_heads = 8;
  p->model.n_kv_heads = 4;
  p->model.ffn_dim = 688;
  p->model.vocab_size = 256;
  p->model.max_seq_len = 1024;
  p->model.norm_eps = 1e-5;
  p->model.tie_embeddings = false;
  p->model_seed = 0;
  p->deferred_init = true;
  p->optim = (adamw_config_t)ADAMW_CONFIG_INIT;
  p->optim.lr = 3e-4;
  p->optim.weight_decay = 0.1;
  p->optim.beta2 = 0.95;
  p->clip_grad_norm = 1.0;
  p->warmup_steps = 0;
  p->min_lr_ratio = 0.1;
  p->data_format = DATA_BYTES;
  p->seq_len = 128;
  p->batch_size = 8;
  p->grad_accum = 1;
  p->steps = 100;
  p->comm_timeout_s = WORLD_DEFAULT_TIMEOUT_S;
  p->seed = 0;
  p->ckpt_keep = 0;
  p->ckpt_block_bytes = (int64_t)1 << 20;
  p->log_interval = 10;
}

/* ---- nodes, places, errors ---- */

static yaml_node_t *node(ctx_t *c, int i) { return i ? yaml_document_get_node(&c->doc, i) : NULL; }

static void where_of(ctx_t *c, int i, plan_where_t *w) {
  if (i >= c->set_base && i - c->set_base < c->n_set_nodes) {
    snprintf(w->text, sizeof w->text, "--set %s", c->set_of[i - c->set_base]);
    return;
  }
  yaml_node_t *n = node(c, i);
  snprintf(w->text, sizeof w->text, "%s:%zu:%zu", c->p->source, n ? n->start_mark.line + 1 : 1,
           n ? n->start_mark.column + 1 : 1);
}

static status_t fail(ctx_t *c, int i, const char *path, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  plan_where_t w;
  where_of(c, i, &w);
  return err_set(STATUS_EFORMAT, "%s: %s: %s", w.text, path, msg);
}

static const char *scalar(ctx_t *c, int i) {
  yaml_node_t *n = node(c, i);
  return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

/* An absent value: no node, or a plain empty / null scalar. */
static bool is_null(ctx_t *c, int i) {
  yaml_node_t *n = node(c, i);
  if (n == NULL) return true;
  if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return false;
  const char *s = (const char *)n->data.scalar.value;
  return s[0] == 0 || strcmp(s, "~") == 0 || strcasecmp(s, "null") == 0;
}

static void join(char *out, size_t size, const char *prefix, const char *key) {
  int n = snprintf(out, size, "%s%s%s", prefix, prefix[0] ? "." : "", key);
  if (n < 0 || (size_t)n >= size) out[size - 1] = 0; /* a very long key path is cut */
}

static size_t edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b), row[64];
  if (lb >= 63 || la >= 63) return 99;
  for (size_t j = 0; j <= lb; j++) row[j] = j;
  for (size_t i = 1; i <= la; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      diag = up;
      row[j] = best;
    }
  }
  return row[lb];
}

/* Checks that i is a mapping of scalar keys from keys (NULL-terminated), without duplicates. */
static status_t check_keys(ctx_t *c, int i, const char *path, const char *const *keys) {
  yaml_node_t *n = node(c, i);
  if (n->type != YAML_MAPPING_NODE)
    return fail(c, i, path, "expected a mapping of keys (%s, ...)", keys[0]);
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = scalar(c, a->key);
    if (k == NULL) return fail(c, a->key, path, "keys must be plain names");
    char full[256];
    join(full, sizeof full, path, k);
    bool known = false;
    const char *near = NULL;
    size_t best = 3;
    for (int j = 0; keys[j]; j++) {
      if (strcmp(keys[j], k) == 0) known = true;
      size_t d = edit_distance(keys[j], k);
      if (d < best) {
        best = d;
        near = keys[j];
      }
    }
    if (!known) {
      char list[256] = "";
      for (int j = 0; keys[j]; j++) {
        strncat(list, j ? ", " : "", sizeof list - strlen(list) - 1);
        strncat(list, keys[j], sizeof list - strlen(list) - 1);
      }
      if (near) return fail(c, a->key, full, "unknown key; did you mean '%s'?", near);
      return fail(c, a->key, full, "unknown key (expected one of: %s)", list);
    }
    for (yaml_node_pair_t *b = n->data.mapping.pairs.start; b < a; b++)
      if (strcmp(scalar(c, b->key) ? scalar(c, b->key) : "", k) == 0) {
        plan_where_t w;
        where_of(c, b->key, &w);
        return fail(c, a->key, full, "duplicate key (first given at %s)", w.text);
      }
  }
  return STATUS_OK;
}

/* The value node of key in mapping i (the last one, so --set wins), or 0. */
static int find(ctx_t *c, int i, const char *key) {
  yaml_node_t *n = node(c, i);
  if (n == NULL || n->type != YAML_MAPPING_NODE) return 0;
  int v = 0;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = scalar(c, a->key);
    if (k && strcmp(k, key) == 0) v = a->value;
  }
  return v;
}

/* ---- typed values ---- */

/* The value node of key in mapping map, with its key path in path[256]; 0 when the key is
 * absent or null (the default stays). */
static int lookup(ctx_t *c, int map, const char *prefix, const char *key, char *path) {
  int v = find(c, map, key);
  if (is_null(c, v)) return 0;
  join(path, 256, prefix, key);
  return v;
}

static status_t want_scalar(ctx_t *c, int v, const char *path, const char *what, const char **s) {
  *s = scalar(c, v);
  if (*s == NULL)
    return fail(c, v, path, "expected %s, got a %s", what,
                node(c, v)->type == YAML_MAPPING_NODE ? "mapping" : "list");
  return STATUS_OK;
}

static status_t parse_int(ctx_t *c, int v, const char *path, int64_t lo, int64_t hi, int64_t *out) {
  const char *s;
  TRY(want_scalar(c, v, path, "an integer", &s));
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (end == s || *end != 0) return fail(c, v, path, "expected an integer, got '%s'", s);
  if (errno == ERANGE || x < lo || x > hi)
    return fail(c, v, path, "%s is out of range [%lld, %lld]", s, (long long)lo, (long long)hi);
  *out = x;
  return STATUS_OK;
}

static status_t get_int(ctx_t *c, int map, const char *prefix, const char *key, int64_t lo,
                        int64_t hi, int64_t *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  return parse_int(c, v, path, lo, hi, out);
}

static status_t get_size(ctx_t *c, int map, const char *prefix, const char *key, int *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  int64_t x = 0; /* set by parse_int (gcc -O3 cannot tell) */
  TRY(parse_int(c, v, path, -1, 1 << 20, &x));
  if (x == 0) return fail(c, v, path, "a mesh size must be positive, or -1 for the rest");
  *out = (int)x;
  return STATUS_OK;
}

static status_t get_float(ctx_t *c, int map, const char *prefix, const char *key, double lo,
                          double hi, bool open_lo, double *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  TRY(want_scalar(c, v, path, "a number", &s));
  char *end;
  errno = 0;
  double x = strtod(s, &end);
  if (end == s || *end != 0) return fail(c, v, path, "expected a number, got '%s'", s);
  if (errno == ERANGE || !isfinite(x) || x < lo || x > hi || (open_lo && x == lo))
    return fail(c, v, path, "%s is out of range %s%g, %g]", s, open_lo ? "(" : "[", lo, hi);
  *out = x;
  return STATUS_OK;
}

static status_t parse_bool(ctx_t *c, int v, const char *path, bool *out) {
  const char *s;
  TRY(want_scalar(c, v, path, "true or false", &s));
  if (strcasecmp(s, "true") == 0)
    *out = true;
  else if (strcasecmp(s, "false") == 0)
    *out = false;
  else
    return fail(c, v, path, "expected true or false, got '%s'", s);
  return STATUS_OK;
}

static status_t get_bool(ctx_t *c, int map, const char *prefix, const char *key, bool *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  return parse_bool(c, v, path, out);
}

static status_t get_str(ctx_t *c, int map, const char *prefix, const char *key, char *out,
                        size_t size) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  TRY(want_scalar(c, v, path, "a string", &s));
  if (strlen(s) >= size) return fail(c, v, path, "longer than %zu characters", size - 1);
  strcpy(out, s);
  return STATUS_OK;
}

/* A path: relative ones from the file are taken from the file's folder. */
static status_t get_path(ctx_t *c, int map, const char *prefix, const char *key, char *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  TRY(get_str(c, map, prefix, key, out, PLAN_PATH_MAX));
  if (v == 0 || out[0] == '/' || v >= c->set_base || c->dir[0] == 0) return STATUS_OK;
  char joined[2 * PLAN_PATH_MAX];
  snprintf(joined, sizeof joined, "%s/%s", c->dir, out);
  if (strlen(joined) >= PLAN_PATH_MAX) return fail(c, v, path, "the path is too long");
  strcpy(out, joined);
  return STATUS_OK;
}

static status_t get_dtype(ctx_t *c, int map, const char *prefix, const char *key, dtype_t *out) {
  char path[256];
  int v = lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  TRY(want_scalar(c, v, path, "a dtype", &s));
  dtype_t dt;
  if (dtype_parse(s, &dt) != STATUS_OK || !dtype_is_float(dt))
    return fail(c, v, path, "expected f32, bf16 or f16, got '%s'", s);
  *out = dt;
  return STATUS_OK;
}

/* true | false | integer N >= 2 (0 and 1 mean false and true). */
static status_t get_reshard(ctx_t *c, int map, const char *prefix, int *out) {
  char path[256];
  int v = lookup(c, map, prefix, "reshard_after_forward", path);
  if (v == 0) return STATUS_OK;
  const char *s;
  TRY(want_scalar(c, v, path, "true, false or an integer", &s));
  if (strcasecmp(s, "true") == 0 || strcasecmp(s, "false") == 0) {
    *out = strcasecmp(s, "true") == 0;
    return STATUS_OK;
  }
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (end == s || *end != 0)
    return fail(c, v, path, "expected true, false or an integer, got '%s'", s);
  if (errno == ERANGE || x < 0 || x > (1 << 20))
    return fail(c, v, path, "%s is out of range (an integer N >= 2, or true / false)", s);
  *out = (int)x;
  return STATUS_OK;
}

/* ---- sections ---- */

static status_t section(ctx_t *c, int root, const char *key, const char *const *keys, int *out) {
  *out = find(c, root, key);
  if (is_null(c, *out)) {
    *out = 0;
    return STATUS_OK;
  }
  return check_keys(c, *out, key, keys);
}

static status_t read_mesh(ctx_t *c, int root) {
  static const char *const keys[] = {"dp_replicate", "dp_shard", "tp", NULL};
  int m;
  TRY(section(c, root, "mesh", keys, &m));
  if (m == 0) {
    snprintf(c->p->par.mesh_where.text, sizeof c->p->par.mesh_where.text, "%s", c->p->source);
    return STATUS_OK;
  }
  where_of(c, m, &c->p->par.mesh_where);
  TRY(get_size(c, m, "mesh", "dp_replicate", &c->p->par.dp_replicate));
  TRY(get_size(c, m, "mesh", "dp_shard", &c->p->par.dp_shard));
  TRY(get_size(c, m, "mesh", "tp", &c->p->par.tp));
  int unknown = (c->p->par.dp_replicate < 0) + (c->p->par.dp_shard < 0) + (c->p->par.tp < 0);
  if (unknown > 1) return fail(c, m, "mesh", "at most one size may be -1");
  return STATUS_OK;
}

static status_t read_model(ctx_t *c, int root) {
  static const char *const keys[] = {"dim",      "n_layers",       "n_heads",     "n_kv_heads",
                                     "ffn_dim",  "vocab_size",     "max_seq_len", "rope_theta",
                                     "norm_eps", "tie_embeddings", "seed",        "init_from",
                                     "deferred_init", NULL};
  int m;
  TRY(section(c, root, "model", keys, &m));
  if (m == 0) return STATUS_OK;
  plan_t *p = c->p;
  uint64_t seed = p->model_seed;
  int64_t s = 0;
  TRY(get_int(c, m, "model", "seed", 0, INT64_MAX, &s));
  if (find(c, m, "seed")) seed = (uint64_t)s;
  p->model_seed = seed;
  TRY(get_bool(c, m, "model", "deferred_init", &p->deferred_init));
  TRY(get_path(c, m, "model", "init_from", p->init_from));
  if (p->init_from[0]) {
    for (int i = 0; keys[i] && strcmp(keys[i], "seed") != 0; i++)
      if (find(c, m, keys[i]))
        return fail(c, find(c, m, keys[i]), "model",
                    "%s: the architecture comes from %s/config.json "
                    "with model.init_from; remove model.%s",
                    keys[i], p->init_from, keys[i]);
    char cfg[PLAN_PATH_MAX + 16];
    snprintf(cfg, sizeof cfg, "%s/config.json", p->init_from);
    if (llama_config_from_hf(cfg, &p->model) != STATUS_OK)
      return fail(c, find(c, m, "init_from"), "model.init_from", "%s", err_detail());
    return STATUS_OK;
  }
  llama_config_t *mc = &p->model;
  const int64_t big = (int64_t)1 << 31;
  TRY(get_int(c, m, "model", "dim", 1, big, &mc->dim));
  TRY(get_int(c, m, "model", "n_layers", 1, 4096, &mc->n_layers));
  TRY(get_int(c, m, "model", "n_heads", 1, 65536, &mc->n_heads));
  TRY(get_int(c, m, "model", "n_kv_heads", 1, 65536, &mc->n_kv_heads));
  TRY(get_int(c, m, "model", "ffn_dim", 1, big, &mc->ffn_dim));
  TRY(get_int(c, m, "model", "vocab_size", 1, big, &mc->vocab_size));
  TRY(get_int(c, m, "model", "max_seq_len", 1, big, &mc->max_seq_len));
  TRY(get_float(c, m, "model", "rope_theta", 0, 1e12, true, &mc->rope.theta));
  TRY(get_float(c, m, "model", "norm_eps", 0, 1, true, &mc->norm_eps));
  TRY(get_bool(c, m, "model", "tie_embeddings", &mc->tie_embeddings));
  if (llama_config_check(mc) != STATUS_OK) return fail(c, m, "model", "%s", err_detail());
  return STATUS_OK;
}

/* mp_policy {param_dtype, reduce_dtype, output_dtype} under map into dt[0..2] (given keys). */
static status_t read_mp(ctx_t *c, int map, const char *prefix, dtype_t dt[3]) {
  static const char *const keys[] = {"param_dtype", "reduce_dtype", "output_dtype", NULL};
  char path[256];
  int v = lookup(c, map, prefix, "mp_policy", path);
  if (v == 0) return STATUS_OK;
  TRY(check_keys(c, v, path, keys));
  for (int k = 0; k < 3; k++) TRY(get_dtype(c, v, path, keys[k], &dt[k]));
  return STATUS_OK;
}

static void unit_defaults(const parallel_plan_t *pp, plan_unit_t *u) {
  u->reshard_after_forward = pp->reshard_after_forward;
  u->param_dtype = pp->param_dtype;
  u->reduce_dtype = pp->reduce_dtype;
  u->output_dtype = pp->output_dtype;
}

static status_t read_units(ctx_t *c, int fs) {
  plan_t *p = c->p;
  const char *path = "parallelize.fully_shard.units";
  int v = find(c, fs, "units");
  if (is_null(c, v)) return STATUS_OK;
  yaml_node_t *n = node(c, v);
  if (n->type != YAML_SEQUENCE_NODE) return fail(c, v, path, "expected a list of module patterns");
  p->par.n_units = 0;
  for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
    if (p->par.n_units == PLAN_MAX_UNITS)
      return fail(c, *it, path, "more than %d units", PLAN_MAX_UNITS);
    plan_unit_t *u = &p->par.units[p->par.n_units];
    char upath[256];
    snprintf(upath, sizeof upath, "%s[%d]", path, p->par.n_units);
    unit_defaults(&p->par, u);
    where_of(c, *it, &u->where);
    const char *s = scalar(c, *it);
    if (s == NULL) { /* {match: PATTERN, reshard_after_forward: ..., mp_policy: ...} */
      static const char *const keys[] = {"match", "reshard_after_forward", "mp_policy", NULL};
      TRY(check_keys(c, *it, upath, keys));
      int m = find(c, *it, "match");
      char mpath[300];
      snprintf(mpath, sizeof mpath, "%s.match", upath);
      if (is_null(c, m)) return fail(c, *it, mpath, "missing: the module pattern of this unit");
      TRY(want_scalar(c, m, mpath, "a module pattern", &s));
      TRY(get_reshard(c, *it, upath, &u->reshard_after_forward));
      dtype_t dt[3] = {u->param_dtype, u->reduce_dtype, u->output_dtype};
      TRY(read_mp(c, *it, upath, dt));
      u->param_dtype = dt[0];
      u->reduce_dtype = dt[1];
      u->output_dtype = dt[2];
    }
    if (s[0] == 0) return fail(c, *it, upath, "empty module pattern");
    if (strlen(s) >= PLAN_PATTERN_MAX)
      return fail(c, *it, upath, "pattern longer than %d characters", PLAN_PATTERN_MAX - 1);
    strcpy(u->pattern, s);
    p->par.n_units++;
  }
  return STATUS_OK;
}

static status_t read_tp_layout(ctx_t *c, int map, const char *path, const char *key,
                               tp_layout_t *out) {
  int v = find(c, map, key);
  if (is_null(c, v)) return STATUS_OK;
  const char *s = scalar(c, v);
  if (s == NULL || !tp_layout_parse(s, out))
    return fail(c, v, path, "%s: expected replicate, shard(1) or shard(-1)", key);
  return STATUS_OK;
}

/* tensor_parallel: {plan: {PATTERN: STYLE | {style: STYLE, input: L, output: L}},
 * sequence_parallel: bool} */
static status_t read_tp(ctx_t *c, int tp) {
  static const char *const keys[] = {"plan", "sequence_parallel", NULL};
  static const char *const rkeys[] = {"style", "input", "output", NULL};
  plan_t *p = c->p;
  const char *path = "parallelize.tensor_parallel";
  if (node(c, tp)->type != YAML_MAPPING_NODE)
    return fail(c, tp, path, "expected a mapping with plan and sequence_parallel");
  TRY(check_keys(c, tp, path, keys));
  where_of(c, tp, &p->par.tp_where);
  TRY(get_bool(c, tp, path, "sequence_parallel", &p->par.sequence_parallel));
  int pl = find(c, tp, "plan");
  if (is_null(c, pl)) return STATUS_OK;
  const char *ppath = "parallelize.tensor_parallel.plan";
  yaml_node_t *n = node(c, pl);
  if (n->type != YAML_MAPPING_NODE)
    return fail(c, pl, ppath, "expected a mapping of module pattern: style");
  p->par.tp_plan_given = true;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = scalar(c, a->key);
    if (p->par.n_tp_rules == PLAN_MAX_TP_RULES)
      return fail(c, a->key, ppath, "more than %d rules", PLAN_MAX_TP_RULES);
    if (k == NULL || strlen(k) >= PLAN_PATTERN_MAX)
      return fail(c, a->key, ppath, "expected module pattern: style");
    plan_tp_rule_t *r = &p->par.tp_rules[p->par.n_tp_rules];
    memset(r, 0, sizeof *r);
    char rpath[PLAN_PATTERN_MAX + 64];
    snprintf(rpath, sizeof rpath, "%s.%s", ppath, k);
    int sv = a->value;
    if (node(c, a->value)->type == YAML_MAPPING_NODE) {
      TRY(check_keys(c, a->value, rpath, rkeys));
      sv = find(c, a->value, "style");
      if (sv == 0) return fail(c, a->value, rpath, "style: missing");
      TRY(read_tp_layout(c, a->value, rpath, "input", &r->input));
      TRY(read_tp_layout(c, a->value, rpath, "output", &r->output));
    }
    const char *s = scalar(c, sv);
    if (s == NULL || !tp_style_parse(s, &r->style))
      return fail(c, sv, rpath,
                  "unknown style '%s' (colwise, rowwise, sequence_parallel, prepare_input)",
                  s ? s : "");
    strcpy(r->pattern, k);
    where_of(c, a->key, &r->where);
    p->par.n_tp_rules++;
  }
  return STATUS_OK;
}

/* sharding_strategy (FSDP1's names, as Accelerate writes them) or zero_stage (DeepSpeed's):
 * aliases of the mesh's data-parallel sizes and reshard_after_forward. A key also given that
 * says otherwise is an error naming both. */
static status_t read_strategy(ctx_t *c, int root, int fs) {
  static const struct {
    const char *name;
    int reshard;
    char mesh; /* 's': shard over all ranks, 'h': shard within a node and replicate, 'r':
                  replicate only */
  } table[] = {{"FULL_SHARD", 1, 's'},   {"SHARD_GRAD_OP", 0, 's'},
               {"HYBRID_SHARD", 1, 'h'}, {"_HYBRID_SHARD_ZERO2", 0, 'h'},
               {"NO_SHARD", 0, 'r'}};
  parallel_plan_t *pp = &c->p->par;
  const char *prefix = "parallelize.fully_shard";
  char spath[256], zpath[256];
  int s = lookup(c, fs, prefix, "sharding_strategy", spath);
  int z = lookup(c, fs, prefix, "zero_stage", zpath);
  if (s == 0 && z == 0) return STATUS_OK;
  if (s != 0 && z != 0)
    return fail(c, z, zpath, "give sharding_strategy or zero_stage, not both");
  int k = -1;
  const char *said = s ? spath : zpath;
  if (s != 0) {
    const char *name;
    TRY(want_scalar(c, s, spath, "a sharding strategy", &name));
    for (int i = 0; i < 5; i++)
      if (strcmp(name, table[i].name) == 0) k = i;
    if (k < 0)
      return fail(c, s, spath,
                  "expected FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 or "
                  "NO_SHARD, got '%s'",
                  name);
  } else {
    const char *v;
    TRY(want_scalar(c, z, zpath, "2 or 3", &v));
    if (strcmp(v, "3") == 0) k = 0;
    if (strcmp(v, "2") == 0) k = 1;
    if (k < 0)
      return fail(c, z, zpath,
                  "expected 3 (parameters, gradients and optimizer state sharded: FULL_SHARD) or "
                  "2 (parameters kept whole from forward to backward: SHARD_GRAD_OP), got '%s'",
                  v);
  }
  snprintf(pp->strategy, sizeof pp->strategy, "%s", table[k].name);
  char rpath[256], reppath[256], shardpath[256];
  int r = lookup(c, fs, prefix, "reshard_after_forward", rpath);
  if (r != 0 && pp->reshard_after_forward != table[k].reshard)
    return fail(c, r, rpath,
                "disagrees with %s = %s (which means reshard_after_forward %s): give one",
                said, table[k].name, table[k].reshard ? "true" : "false");
  pp->reshard_after_forward = table[k].reshard;
  int m = find(c, root, "mesh"); /* the sizes given explicitly (0: absent or null) */
  int rep = lookup(c, m, "mesh", "dp_replicate", reppath);
  int shard = lookup(c, m, "mesh", "dp_shard", shardpath);
  if (table[k].mesh == 's') {
    if (rep && pp->dp_replicate != 1)
      return fail(c, rep, reppath,
                  "%d disagrees with %s = %s (shards over every data-parallel rank): give one",
                  pp->dp_replicate, said, table[k].name);
  } else if (table[k].mesh == 'r') {
    if (shard && pp->dp_shard != 1 && pp->dp_shard != -1) /* -1: the rest, here none */
      return fail(c, shard, shardpath,
                  "%d disagrees with %s = %s (replicates, shards nothing): give one",
                  pp->dp_shard, said, table[k].name);
    pp->dp_shard = 1;
    if (!rep) pp->dp_replicate = pp->tp < 0 ? 1 : -1;
  } else if (!rep) { /* hybrid: shard within a node (unless sized), replicate across nodes */
    if (pp->dp_shard < 0) pp->dp_shard = PLAN_SIZE_NODE;
    pp->dp_replicate = pp->tp < 0 ? 1 : -1;
  }
  return STATUS_OK;
}

static status_t read_parallelize(ctx_t *c, int root) {
  static const char *const keys[] = {"fully_shard", "tensor_parallel", NULL};
  static const char *const fs_keys[] = {"units",   "reshard_after_forward", "mp_policy",
                                        "offload", "sharding_strategy",     "zero_stage",
                                        NULL};
  plan_t *p = c->p;
  int m;
  TRY(section(c, root, "parallelize", keys, &m));
  int fs = m ? find(c, m, "fully_shard") : 0;
  if (!is_null(c, fs)) {
    const char *path = "parallelize.fully_shard";
    TRY(check_keys(c, fs, path, fs_keys));
    where_of(c, fs, &p->par.fsdp_where);
    TRY(get_reshard(c, fs, path, &p->par.reshard_after_forward));
    dtype_t dt[3] = {p->par.param_dtype, p->par.reduce_dtype, p->par.output_dtype};
    TRY(read_mp(c, fs, path, dt));
    p->par.param_dtype = dt[0];
    p->par.reduce_dtype = dt[1];
    p->par.output_dtype = dt[2];
    TRY(get_bool(c, fs, path, "offload", &p->par.offload));
    TRY(read_strategy(c, root, fs));
    for (int i = 0; i < p->par.n_units; i++) unit_defaults(&p->par, &p->par.units[i]);
    TRY(read_units(c, fs));
  }
  int tp = m ? find(c, m, "tensor_parallel") : 0;
  if (!is_null(c, tp)) TRY(read_tp(c, tp));
  return STATUS_OK;
}

static status_t read_optim(ctx_t *c, int root) {
  static const char *const keys[] = {"lr",           "beta1",          "beta2",        "eps",
                                     "weight_decay", "clip_grad_norm", "param_groups", NULL};
  static const char *const gkeys[] = {"lr", "weight_decay", NULL};
  plan_t *p = c->p;
  int m;
  TRY(section(c, root, "optim", keys, &m));
  if (m == 0) return STATUS_OK;
  adamw_config_t *o = &p->optim;
  TRY(get_float(c, m, "optim", "lr", 0, 1e3, true, &o->lr));
  TRY(get_float(c, m, "optim", "beta1", 0, 0.999999, false, &o->beta1));
  TRY(get_float(c, m, "optim", "beta2", 0, 0.999999, false, &o->beta2));
  TRY(get_float(c, m, "optim", "eps", 0, 1, true, &o->eps));
  TRY(get_float(c, m, "optim", "weight_decay", 0, 1e3, false, &o->weight_decay));
  TRY(get_float(c, m, "optim", "clip_grad_norm", 0, 1e12, false, &p->clip_grad_norm));
  int g = find(c, m, "param_groups");
  if (is_null(c, g)) return STATUS_OK;
  yaml_node_t *n = node(c, g);
  if (n->type != YAML_MAPPING_NODE)
    return fail(c, g, "optim.param_groups",
                "expected a mapping of FQN pattern: {lr, weight_decay}");
  o->n_groups = 0;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = scalar(c, a->key);
    if (k == NULL || strlen(k) >= PLAN_PATTERN_MAX)
      return fail(c, a->key, "optim.param_groups", "expected an FQN pattern as the key");
    if (o->n_groups == ADAMW_MAX_GROUPS)
      return fail(c, a->key, "optim.param_groups", "more than %d groups", ADAMW_MAX_GROUPS);
    for (int q = 0; q < o->n_groups; q++)
      if (strcmp(p->group_patterns[q], k) == 0)
        return fail(c, a->key, "optim.param_groups", "'%s' appears twice", k);
    char path[300];
    snprintf(path, sizeof path, "optim.param_groups.%s", k);
    TRY(check_keys(c, a->value, path, gkeys));
    adamw_group_t *gr = &o->groups[o->n_groups];
    gr->lr = gr->weight_decay = -1;
    TRY(get_float(c, a->value, path, "lr", 0, 1e3, false, &gr->lr));
    TRY(get_float(c, a->value, path, "weight_decay", 0, 1e3, false, &gr->weight_decay));
    strcpy(p->group_patterns[o->n_groups], k);
    gr->pattern = p->group_patterns[o->n_groups];
    o->n_groups++;
  }
  return STATUS_OK;
}

static status_t read_rest(ctx_t *c, int root) {
  static const char *const sched_keys[] = {"warmup_steps", "min_lr_ratio", NULL};
  static const char *const data_keys[] = {"path",       "format",     "seq_len",
                                          "batch_size", "grad_accum", NULL};
  static const char *const train_keys[] = {"steps",     "seed",           "activation_checkpointing",
                                           "nonfinite", "comm_timeout_s", NULL};
  static const char *const ckpt_keys[] = {"dir",    "interval",    "keep",
                                         "load",   "verify",      "block_bytes", NULL};
  static const char *const log_keys[] = {"metrics", "interval", NULL};
  plan_t *p = c->p;
  const int64_t big = (int64_t)1 << 40;
  int m;
  TRY(section(c, root, "schedule", sched_keys, &m));
  TRY(get_int(c, m, "schedule", "warmup_steps", 0, big, &p->warmup_steps));
  TRY(get_float(c, m, "schedule", "min_lr_ratio", 0, 1, false, &p->min_lr_ratio));
  TRY(section(c, root, "data", data_keys, &m));
  if (m) where_of(c, m, &p->data_where);
  TRY(get_path(c, m, "data", "path", p->data_path));
  int f = find(c, m, "format");
  if (!is_null(c, f)) {
    const char *s;
    TRY(want_scalar(c, f, "data.format", "text or u16", &s));
    if (strcmp(s, "text") == 0)
      p->data_format = DATA_BYTES;
    else if (strcmp(s, "u16") == 0)
      p->data_format = DATA_U16;
    else
      return fail(c, f, "data.format", "expected text or u16, got '%s'", s);
  }
  TRY(get_int(c, m, "data", "seq_len", 1, (int64_t)1 << 24, &p->seq_len));
  TRY(get_int(c, m, "data", "batch_size", 1, (int64_t)1 << 24, &p->batch_size));
  TRY(get_int(c, m, "data", "grad_accum", 1, (int64_t)1 << 20, &p->grad_accum));
  TRY(section(c, root, "train", train_keys, &m));
  TRY(get_int(c, m, "train", "steps", 1, big, &p->steps));
  int64_t seed = -1;
  TRY(get_int(c, m, "train", "seed", 0, INT64_MAX, &seed));
  if (seed >= 0) p->seed = (uint64_t)seed;
  TRY(get_bool(c, m, "train", "activation_checkpointing", &p->activation_checkpointing));
  TRY(get_float(c, m, "train", "comm_timeout_s", 0, 1e9, false, &p->comm_timeout_s));
  int nf = find(c, m, "nonfinite");
  if (!is_null(c, nf)) {
    const char *s;
    TRY(want_scalar(c, nf, "train.nonfinite", "stop or skip", &s));
    if (strcmp(s, "stop") == 0 || strcmp(s, "skip") == 0)
      p->skip_nonfinite = s[1] == 'k';
    else
      return fail(c, nf, "train.nonfinite", "expected stop or skip, got '%s'", s);
  }
  TRY(section(c, root, "checkpoint", ckpt_keys, &m));
  if (m) where_of(c, m, &p->ckpt_where);
  TRY(get_path(c, m, "checkpoint", "dir", p->ckpt_dir));
  TRY(get_int(c, m, "checkpoint", "interval", 0, big, &p->ckpt_interval));
  TRY(get_int(c, m, "checkpoint", "keep", 0, 1 << 20, &p->ckpt_keep));
  int ld = find(c, m, "load");
  if (!is_null(c, ld) && scalar(c, ld) && strcmp(scalar(c, ld), "auto") == 0)
    strcpy(p->ckpt_load, "auto");
  else
    TRY(get_path(c, m, "checkpoint", "load", p->ckpt_load));
  TRY(get_bool(c, m, "checkpoint", "verify", &p->ckpt_verify));
  TRY(get_int(c, m, "checkpoint", "block_bytes", 64, (int64_t)1 << 30, &p->ckpt_block_bytes));
  if (p->ckpt_block_bytes % 64 != 0)
    return fail(c, find(c, m, "block_bytes"), "checkpoint.block_bytes",
                "expected a multiple of 64, got %lld", (long long)p->ckpt_block_bytes);
  TRY(section(c, root, "log", log_keys, &m));
  TRY(get_path(c, m, "log", "metrics", p->metrics));
  TRY(get_int(c, m, "log", "interval", 1, big, &p->log_interval));
  return STATUS_OK;
}

/* ---- --set ---- */

static int add_scalar(ctx_t *c, const char *s, const char *set) {
  int i = yaml_document_add_scalar(&c->doc, NULL, (yaml_char_t *)s, (int)strlen(s),
                                   YAML_PLAIN_SCALAR_STYLE);
  if (i && i - c->set_base < MAX_SETS) {
    c->set_of[i - c->set_base] = set;
    if (i - c->set_base + 1 > c->n_set_nodes) c->n_set_nodes = i - c->set_base + 1;
  }
  return i;
}

static status_t apply_set(ctx_t *c, int root, const char *set) {
  const char *eq = strchr(set, '=');
  if (eq == NULL || eq == set)
    return err_set(STATUS_EFORMAT, "--set %s: expected key.path=value", set);
  char key[256];
  size_t kl = (size_t)(eq - set);
  if (kl >= sizeof key) return err_set(STATUS_EFORMAT, "--set %s: key path too long", set);
  memcpy(key, set, kl);
  key[kl] = 0;
  int cur = root;
  char *save = NULL;
  for (char *part = strtok_r(key, ".", &save); part; part = strtok_r(NULL, ".", &save)) {
    bool last = save == NULL || *save == 0;
    if (node(c, cur)->type != YAML_MAPPING_NODE)
      return err_set(STATUS_EFORMAT, "--set %s: '%s' is inside a value that is not a mapping", set,
                     part);
    long index = -1; /* NAME[INDEX]: an item of the list NAME */
    char *br = strchr(part, '[');
    if (br != NULL) {
      char *end;
      index = strtol(br + 1, &end, 10);
      if (end == br + 1 || strcmp(end, "]") != 0 || index < 0 || br == part)
        return err_set(STATUS_EFORMAT, "--set %s: '%s': expected NAME[INDEX] (INDEX from 0)",
                       set, part);
      *br = 0;
    }
    int v = find(c, cur, part);
    if (index >= 0) {
      yaml_node_t *seq = v ? node(c, v) : NULL;
      if (seq == NULL || seq->type != YAML_SEQUENCE_NODE)
        return err_set(STATUS_EFORMAT, "--set %s: '%s' is not a list in the plan", set, part);
      long n = (long)(seq->data.sequence.items.top - seq->data.sequence.items.start);
      if (index >= n)
        return err_set(STATUS_EFORMAT, "--set %s: '%s' has %ld item%s (from 0)", set, part, n,
                       n == 1 ? "" : "s");
      yaml_node_item_t *item = &seq->data.sequence.items.start[index];
      if (last) { /* replace the item */
        int val = add_scalar(c, eq + 1, set);
        if (!val) return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
        *item = val;
        return STATUS_OK;
      }
      cur = *item;
      continue;
    }
    if (last) { /* replace the value given in the file, or add the key */
      int val = add_scalar(c, eq + 1, set);
      if (!val) return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
      yaml_node_t *m = node(c, cur);
      for (yaml_node_pair_t *a = m->data.mapping.pairs.start; a < m->data.mapping.pairs.top; a++)
        if (scalar(c, a->key) && strcmp(scalar(c, a->key), part) == 0) a->value = val;
      if (v != 0) return STATUS_OK;
      int k = add_scalar(c, part, set);
      if (!k || !yaml_document_append_mapping_pair(&c->doc, cur, k, val))
        return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
      return STATUS_OK;
    }
    if (v == 0 || is_null(c, v)) {
      v = yaml_document_add_mapping(&c->doc, NULL, YAML_BLOCK_MAPPING_STYLE);
      int k = add_scalar(c, part, set);
      if (v && v - c->set_base < MAX_SETS) c->set_of[v - c->set_base] = set;
      if (v && v - c->set_base + 1 > c->n_set_nodes) c->n_set_nodes = v - c->set_base + 1;
      if (!v || !k || !yaml_document_append_mapping_pair(&c->doc, cur, k, v))
        return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
    }
    cur = v;
  }
  return err_set(STATUS_EFORMAT, "--set %s: empty key path", set);
}

/* ---- load ---- */

/* Plans are small: a plan larger than this, or nested deeper, is refused before libyaml reads
 * loads it (libyaml's time grows with the square of the flow nesting depth). */
#define PLAN_MAX_BYTES ((size_t)1 << 20)
#define PLAN_MAX_DEPTH 64

/* Checks the nesting depth with libyaml's event parser, which stops at the first collection
 * too deep (its lookahead is bounded), before the document loader builds anything. */
status_t plan_yaml_check_depth(const char *path, const char *text, size_t len, int max_depth) {
  yaml_parser_t parser;
  yaml_parser_initialize(&parser);
  yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
  status_t st = STATUS_OK;
  int depth = 0;
  for (bool done = false; !done && st == STATUS_OK;) {
    yaml_event_t ev;
    if (!yaml_parser_parse(&parser, &ev)) break; /* the loader reports syntax errors */
    if (ev.type == YAML_SEQUENCE_START_EVENT || ev.type == YAML_MAPPING_START_EVENT) {
      if (++depth > max_depth)
        st = err_set(STATUS_EFORMAT, "%s:%zu:%zu: collections nested more than %d deep", path,
                     ev.start_mark.line + 1, ev.start_mark.column + 1, max_depth);
    } else if (ev.type == YAML_SEQUENCE_END_EVENT || ev.type == YAML_MAPPING_END_EVENT) {
      depth--;
    }
    done = ev.type == YAML_STREAM_END_EVENT;
    yaml_event_delete(&ev);
  }
  yaml_parser_delete(&parser);
  return st;
}

static status_t parse_file(ctx_t *c, const char *path) {
  FILE *f;
  TRY(file_open_regular(path, "cannot open the plan", &f));
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  fclose(f);
  char *text;
  TRY(file_read_text(path, PLAN_MAX_BYTES, &text));
  size_t len = strlen(text);
  status_t st = STATUS_OK;
  if (size >= 0 && (size_t)size != len)
    st = err_set(STATUS_EFORMAT, "%s:1:1: not valid YAML: the file holds a NUL byte (binary?)",
                 path);
  if (st == STATUS_OK) st = plan_yaml_check_depth(path, text, len, PLAN_MAX_DEPTH);
  if (st != STATUS_OK) {
    free(text);
    return st;
  }
  yaml_parser_t parser;
  yaml_parser_initialize(&parser);
  yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
  if (!yaml_parser_load(&parser, &c->doc)) {
    st = err_set(STATUS_EFORMAT, "%s:%zu:%zu: not valid YAML: %s%s%s", path,
                 parser.problem_mark.line + 1, parser.problem_mark.column + 1,
                 parser.problem ? parser.problem : "syntax error", parser.context ? " " : "",
                 parser.context ? parser.context : "");
    memset(&c->doc, 0, sizeof c->doc);
  }
  yaml_parser_delete(&parser);
  free(text);
  return st;
}

/* Reads the file into p: every section, or (parallel_only) mesh and parallelize alone. */
static status_t load(plan_t *p, const char *path, const char *const *sets, int n_sets,
                     bool parallel_only) {
  plan_defaults(p);
  if (strlen(path) >= PLAN_PATH_MAX) return err_set(STATUS_EINVAL, "plan path too long");
  strcpy(p->source, path);
  strcpy(p->par.source, path);
  plan_where_t *ws[] = {&p->par.mesh_where, &p->par.fsdp_where, &p->par.tp_where, &p->data_where,
                        &p->ckpt_where};
  for (int i = 0; i < 5; i++) snprintf(ws[i]->text, sizeof ws[i]->text, "%s", path);
  ctx_t *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "plan: out of host memory");
  c->p = p;
  const char *slash = strrchr(path, '/');
  if (slash) snprintf(c->dir, sizeof c->dir, "%.*s", (int)(slash - path), path);
  status_t st = parse_file(c, path);
  if (st != STATUS_OK) {
    free(c);
    return st;
  }
  int root = yaml_document_get_root_node(&c->doc) ? 1 : 0;
  if (root == 0 || is_null(c, root)) {
    st = err_set(STATUS_EFORMAT, "%s: the plan is empty (expected a mapping of sections: %s)", path,
                 parallel_only ? "mesh, parallelize"
                               : "mesh, model, parallelize, optim, schedule, data, train, "
                                 "checkpoint, log");
  } else if (node(c, root)->type != YAML_MAPPING_NODE) {
    st = fail(c, root, "(top level)", "expected a mapping of sections (mesh, %s...)",
              parallel_only ? "parallelize" : "model, ");
  }
  c->set_base = (int)(c->doc.nodes.top - c->doc.nodes.start) + 1;
  for (int i = 0; i < n_sets && st == STATUS_OK; i++) st = apply_set(c, root, sets[i]);
  static const char *const top[] = {"mesh", "model", "parallelize", "optim", "schedule",
                                    "data", "train", "checkpoint",  "log",   NULL};
  static const char *const top_parallel[] = {"mesh", "parallelize", NULL};
  if (st == STATUS_OK) st = check_keys(c, root, "", parallel_only ? top_parallel : top);
  if (st == STATUS_OK) st = read_mesh(c, root);
  if (st == STATUS_OK && !parallel_only) st = read_model(c, root);
  if (st == STATUS_OK) st = read_parallelize(c, root);
  if (st == STATUS_OK && !parallel_only) st = read_optim(c, root);
  if (st == STATUS_OK && !parallel_only) st = read_rest(c, root);
  /* fsdp-train's model is the Llama: without rules of its own, a plan splits it by the
   * built-in ones */
  if (st == STATUS_OK && !parallel_only && !p->par.tp_plan_given)
    st = llama_plan_fill_tp_rules(&p->par);
  yaml_document_delete(&c->doc);
  free(c);
  return st;
}

status_t plan_load(plan_t *p, const char *path, const char *const *sets, int n_sets) {
  return load(p, path, sets, n_sets, false);
}

status_t parallel_plan_load(parallel_plan_t *pp, const char *path, const char *const *sets,
                            int n_sets) {
  plan_t *p = malloc(sizeof *p);
  if (p == NULL) return err_set(STATUS_ENOMEM, "plan: out of host memory");
  status_t st = load(p, path, sets, n_sets, true);
  if (st == STATUS_OK) *pp = p->par;
  free(p);
  return st;
}

status_t parallel_plan_add_unit(parallel_plan_t *pp, const char *pattern) {
  if (pp->n_units == PLAN_MAX_UNITS)
    return err_set(STATUS_EINVAL, "parallel plan: more than %d units", PLAN_MAX_UNITS);
  if (pattern == NULL || pattern[0] == 0 || strlen(pattern) >= PLAN_PATTERN_MAX)
    return err_set(STATUS_EINVAL, "parallel plan: a unit pattern must have 1 to %d characters",
                   PLAN_PATTERN_MAX - 1);
  plan_unit_t *u = &pp->units[pp->n_units++];
  memset(u, 0, sizeof *u);
  strcpy(u->pattern, pattern);
  unit_defaults(pp, u);
  snprintf(u->where.text, sizeof u->where.text, "units[%d]", pp->n_units - 1);
  return STATUS_OK;
}

status_t parallel_plan_add_tp_rule(parallel_plan_t *pp, const char *pattern, tp_style_t style,
                                   tp_layout_t input, tp_layout_t output) {
  if (pp->n_tp_rules == PLAN_MAX_TP_RULES)
    return err_set(STATUS_EINVAL, "parallel plan: more than %d tensor-parallel rules",
                   PLAN_MAX_TP_RULES);
  if (pattern == NULL || pattern[0] == 0 || strlen(pattern) >= PLAN_PATTERN_MAX)
    return err_set(STATUS_EINVAL, "parallel plan: a rule pattern must have 1 to %d characters",
                   PLAN_PATTERN_MAX - 1);
  if (style < 0 || style >= TP_STYLE_COUNT || input < 0 || input >= TP_LAYOUT_COUNT ||
      output < 0 || output >= TP_LAYOUT_COUNT)
    return err_set(STATUS_EINVAL, "parallel plan: rule '%s' has an unknown style or layout",
                   pattern);
  plan_tp_rule_t *r = &pp->tp_rules[pp->n_tp_rules++];
  memset(r, 0, sizeof *r);
  strcpy(r->pattern, pattern);
  r->style = style;
  r->input = input;
  r->output = output;
  snprintf(r->where.text, sizeof r->where.text, "tensor_parallel.plan.%s", pattern);
  pp->tp_plan_given = true;
  return STATUS_OK;
}

int parallel_plan_tp_rules(const parallel_plan_t *pp, tp_rule_t *out) {
  for (int i = 0; i < pp->n_tp_rules; i++)
    out[i] = (tp_rule_t){pp->tp_rules[i].pattern, pp->tp_rules[i].style, pp->tp_rules[i].input,
                         pp->tp_rules[i].output};
  return pp->n_tp_rules;
}

/* ---- resolve ---- */

status_t parallel_plan_resolve(parallel_plan_t *pp, int world) {
  if (pp->dp_shard == PLAN_SIZE_NODE) { /* HYBRID_SHARD: the ranks of a node */
    if (world_started_size() != world)
      return err_set(STATUS_EINVAL,
                     "%s: sharding_strategy %s shards within a node, but a world of %d ranks is "
                     "not this job, whose nodes it could count: give mesh.dp_shard (the ranks "
                     "per node)",
                     pp->fsdp_where.text, pp->strategy, world);
    pp->dp_shard = world_local_size();
    if (pp->tp > 1 && pp->dp_shard % pp->tp == 0) pp->dp_shard /= pp->tp;
  }
  int *sizes[3] = {&pp->dp_replicate, &pp->dp_shard, &pp->tp};
  static const char *names[3] = {"dp_replicate", "dp_shard", "tp"};
  long long known = 1;
  int rest = -1;
  for (int i = 0; i < 3; i++) {
    if (*sizes[i] < 0)
      rest = i;
    else
      known *= *sizes[i];
  }
  if (rest >= 0) {
    if (known > world || world % known != 0)
      return err_set(STATUS_EMESH,
                     "%s: mesh: the world has %d ranks, which mesh sizes of product %lld do not "
                     "divide (mesh.%s = -1 takes the rest)",
                     pp->mesh_where.text, world, known, names[rest]);
    *sizes[rest] = (int)(world / known);
  } else if (known != world) {
    return err_set(STATUS_EMESH,
                   "%s: mesh: dp_replicate x dp_shard x tp = %d x %d x %d = %lld, but the world "
                   "has %d ranks",
                   pp->mesh_where.text, pp->dp_replicate, pp->dp_shard, pp->tp, known, world);
  }
  for (int i = -1; i < pp->n_units; i++) { /* the section's value, then the units' own */
    int N = i >= 0 ? pp->units[i].reshard_after_forward : pp->reshard_after_forward;
    if (i >= 0 && N == pp->reshard_after_forward) continue; /* inherited, or the same */
    const char *w = i >= 0 ? pp->units[i].where.text : pp->fsdp_where.text;
    char key[64] = "parallelize.fully_shard.reshard_after_forward";
    if (i >= 0)
      snprintf(key, sizeof key, "parallelize.fully_shard.units[%d].reshard_after_forward", i);
    if (N >= 2 && (N >= pp->dp_shard || pp->dp_shard % N != 0))
      return err_set(STATUS_EINVAL,
                     "%s: %s: %d %s mesh.dp_shard=%d (an integer N keeps parameters sharded "
                     "over groups of N ranks after forward: 1 < N < dp_shard, dividing it)",
                     w, key, N, N >= pp->dp_shard ? "is not below" : "does not divide",
                     pp->dp_shard);
  }
  if (pp->tp > 1 && pp->n_tp_rules == 0)
    return err_set(STATUS_EINVAL,
                   "%s: parallelize.tensor_parallel.plan: mesh.tp is %d, but no rule says which "
                   "modules to split (PATTERN: colwise | rowwise | sequence_parallel | "
                   "prepare_input)",
                   pp->tp_where.text, pp->tp);
  return STATUS_OK;
}

status_t plan_resolve(plan_t *p, int world) {
  TRY(parallel_plan_resolve(&p->par, world));
  if (p->par.tp > 1) {
    const struct {
      const char *key;
      int64_t v;
      const char *why;
    } split[] = {{"n_heads", p->model.n_heads, "whole attention heads"},
                 {"n_kv_heads", p->model.n_kv_heads, "whole key/value heads"},
                 {"ffn_dim", p->model.ffn_dim, "an equal slice of the MLP"},
                 {"vocab_size", p->model.vocab_size, "an equal slice of the vocabulary"}};
    for (size_t i = 0; i < sizeof split / sizeof split[0]; i++)
      if (split[i].v % p->par.tp != 0)
        return err_set(STATUS_EINVAL,
                       "%s: mesh.tp: %d does not divide model.%s=%lld (each tensor-parallel "
                       "rank needs %s)",
                       p->par.mesh_where.text, p->par.tp, split[i].key, (long long)split[i].v,
                       split[i].why);
    if (p->par.sequence_parallel && p->seq_len % p->par.tp != 0)
      return err_set(STATUS_EINVAL,
                     "%s: data.seq_len: %lld is not divisible by mesh.tp=%d (sequence "
                     "parallelism splits the sequence evenly)",
                     p->data_where.text, (long long)p->seq_len, p->par.tp);
  }
  if (p->data_path[0] == 0)
    return err_set(STATUS_EINVAL, "%s: data.path: missing (the token file to train on)", p->source);
  struct stat sb;
  errno = 0;
  if (stat(p->data_path, &sb) != 0 || !S_ISREG(sb.st_mode))
    return err_set(STATUS_EIO, "%s: data.path: cannot read '%s': %s", p->data_where.text,
                   p->data_path, errno ? strerror(errno) : "not a regular file");
  if (p->seq_len > p->model.max_seq_len)
    return err_set(STATUS_EINVAL, "%s: data.seq_len: %lld exceeds model.max_seq_len=%lld",
                   p->data_where.text, (long long)p->seq_len, (long long)p->model.max_seq_len);
  if (p->ckpt_interval > 0 && p->ckpt_dir[0] == 0)
    return err_set(STATUS_EINVAL, "%s: checkpoint.interval: %lld needs checkpoint.dir",
                   p->ckpt_where.text, (long long)p->ckpt_interval);
  if (strcmp(p->ckpt_load, "auto") == 0 && p->ckpt_dir[0] == 0)
    return err_set(STATUS_EINVAL,
                   "%s: checkpoint.load: auto resumes from checkpoint.dir, which is not set",
                   p->ckpt_where.text);
  if (p->ckpt_load[0] && strcmp(p->ckpt_load, "auto") != 0) {
    char state[PLAN_PATH_MAX + 32];
    snprintf(state, sizeof state, "%s/train_state.json", p->ckpt_load);
    if (access(state, R_OK) != 0)
      return err_set(STATUS_EIO,
                     "%s: checkpoint.load: '%s' is not a complete checkpoint (no "
                     "train_state.json)",
                     p->ckpt_where.text, p->ckpt_load);
  }
  return STATUS_OK;
}
