/* The YAML reader of plans: places, key checks, typed values, --set, loading a file. */
#include "parallel/plan_reader_impl.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "fully_shard/fsdp.h"

/* ---- nodes, places, errors ---- */

yaml_node_t *pr_node(plan_ctx_t *c, int i) { return i ? yaml_document_get_node(&c->doc, i) : NULL; }

void pr_where_of(plan_ctx_t *c, int i, plan_where_t *w) {
  if (i >= c->set_base && i - c->set_base < c->n_set_nodes) {
    snprintf(w->text, sizeof w->text, "--set %s", c->set_of[i - c->set_base]);
    return;
  }
  yaml_node_t *n = pr_node(c, i);
  snprintf(w->text, sizeof w->text, "%s:%zu:%zu", c->source, n ? n->start_mark.line + 1 : 1,
           n ? n->start_mark.column + 1 : 1);
}

void pr_where_section(plan_ctx_t *c, int m, const char *const *keys, plan_where_t *w) {
  for (int k = 0; keys[k]; k++) {
    int v = pr_find(c, m, keys[k]);
    if (v >= c->set_base && v - c->set_base < c->n_set_nodes && c->set_of[v - c->set_base]) {
      pr_where_of(c, v, w);
      return;
    }
  }
  pr_where_of(c, m, w);
}

fsdpc_status_t pr_fail(plan_ctx_t *c, int i, const char *path, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  plan_where_t w;
  pr_where_of(c, i, &w);
  return err_set(STATUS_EFORMAT, "%s: %s: %s", w.text, path, msg);
}

const char *pr_scalar(plan_ctx_t *c, int i) {
  yaml_node_t *n = pr_node(c, i);
  return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

/* An absent value: no node, or a plain empty / null scalar. */
bool pr_is_null(plan_ctx_t *c, int i) {
  yaml_node_t *n = pr_node(c, i);
  if (n == NULL) return true;
  if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return false;
  const char *s = (const char *)n->data.scalar.value;
  return s[0] == 0 || strcmp(s, "~") == 0 || strcasecmp(s, "null") == 0;
}

void pr_join(char *out, size_t size, const char *prefix, const char *key) {
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
fsdpc_status_t pr_check_keys(plan_ctx_t *c, int i, const char *path, const char *const *keys) {
  yaml_node_t *n = pr_node(c, i);
  if (n->type != YAML_MAPPING_NODE)
    return pr_fail(c, i, path, "expected a mapping of keys (%s, ...)", keys[0]);
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = pr_scalar(c, a->key);
    if (k == NULL) return pr_fail(c, a->key, path, "keys must be plain names");
    char full[256];
    pr_join(full, sizeof full, path, k);
    bool known = false;
    const char *near = NULL;
    size_t best = 3;
    for (int j = 0; keys[j]; j++) {
      if (strcmp(keys[j], k) == 0) known = true;
      size_t d = edit_distance(keys[j], k), lk = strlen(k), lj = strlen(keys[j]);
      /* near enough to be a typo: at most a third of the longer name differs ("foo" is not
       * "moe") */
      if (d < best && 3 * d <= (lk > lj ? lk : lj) + 1) {
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
      if (near) return pr_fail(c, a->key, full, "unknown key; did you mean '%s'?", near);
      return pr_fail(c, a->key, full, "unknown key (expected one of: %s)", list);
    }
    for (yaml_node_pair_t *b = n->data.mapping.pairs.start; b < a; b++)
      if (strcmp(pr_scalar(c, b->key) ? pr_scalar(c, b->key) : "", k) == 0) {
        plan_where_t w;
        pr_where_of(c, b->key, &w);
        return pr_fail(c, a->key, full, "duplicate key (first given at %s)", w.text);
      }
  }
  return STATUS_OK;
}

/* The value node of key in mapping i (the last one, so --set wins), or 0. */
int pr_find(plan_ctx_t *c, int i, const char *key) {
  yaml_node_t *n = pr_node(c, i);
  if (n == NULL || n->type != YAML_MAPPING_NODE) return 0;
  int v = 0;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = pr_scalar(c, a->key);
    if (k && strcmp(k, key) == 0) v = a->value;
  }
  return v;
}

/* ---- typed values ---- */

/* The value node of key in mapping map, with its key path in path[256]; 0 when the key is
 * absent or null (the default stays). */
int pr_lookup(plan_ctx_t *c, int map, const char *prefix, const char *key, char *path) {
  int v = pr_find(c, map, key);
  if (pr_is_null(c, v)) return 0;
  pr_join(path, 256, prefix, key);
  return v;
}

fsdpc_status_t pr_want_scalar(plan_ctx_t *c, int v, const char *path, const char *what,
                              const char **s) {
  *s = pr_scalar(c, v);
  if (*s == NULL)
    return pr_fail(c, v, path, "expected %s, got a %s", what,
                   pr_node(c, v)->type == YAML_MAPPING_NODE ? "mapping" : "list");
  return STATUS_OK;
}

fsdpc_status_t pr_parse_int(plan_ctx_t *c, int v, const char *path, int64_t lo, int64_t hi,
                            int64_t *out) {
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "an integer", &s));
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (end == s || *end != 0) return pr_fail(c, v, path, "expected an integer, got '%s'", s);
  if (errno == ERANGE || x < lo || x > hi)
    return pr_fail(c, v, path, "%s is out of range [%lld, %lld]", s, (long long)lo, (long long)hi);
  *out = x;
  return STATUS_OK;
}

fsdpc_status_t pr_get_int(plan_ctx_t *c, int map, const char *prefix, const char *key, int64_t lo,
                          int64_t hi, int64_t *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  return pr_parse_int(c, v, path, lo, hi, out);
}

fsdpc_status_t pr_get_size(plan_ctx_t *c, int map, const char *prefix, const char *key, int *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  int64_t x = 0; /* set by parse_int (gcc -O3 cannot tell) */
  FSDPC_TRY(pr_parse_int(c, v, path, -1, 1 << 20, &x));
  if (x == 0) return pr_fail(c, v, path, "a mesh size must be positive, or -1 for the rest");
  *out = (int)x;
  return STATUS_OK;
}

fsdpc_status_t pr_get_float(plan_ctx_t *c, int map, const char *prefix, const char *key, double lo,
                            double hi, bool open_lo, double *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "a number", &s));
  char *end;
  errno = 0;
  double x = strtod(s, &end);
  if (end == s || *end != 0) return pr_fail(c, v, path, "expected a number, got '%s'", s);
  if (errno == ERANGE || !isfinite(x) || x < lo || x > hi || (open_lo && x == lo))
    return pr_fail(c, v, path, "%s is out of range %s%g, %g]", s, open_lo ? "(" : "[", lo, hi);
  *out = x;
  return STATUS_OK;
}

fsdpc_status_t pr_parse_bool(plan_ctx_t *c, int v, const char *path, bool *out) {
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "true or false", &s));
  if (strcasecmp(s, "true") == 0)
    *out = true;
  else if (strcasecmp(s, "false") == 0)
    *out = false;
  else
    return pr_fail(c, v, path, "expected true or false, got '%s'", s);
  return STATUS_OK;
}

fsdpc_status_t pr_get_bool(plan_ctx_t *c, int map, const char *prefix, const char *key, bool *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  return pr_parse_bool(c, v, path, out);
}

fsdpc_status_t pr_get_str(plan_ctx_t *c, int map, const char *prefix, const char *key, char *out,
                          size_t size) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "a string", &s));
  if (strlen(s) >= size) return pr_fail(c, v, path, "longer than %zu characters", size - 1);
  strcpy(out, s);
  return STATUS_OK;
}

/* A path: relative ones from the file are taken from the file's folder. */
fsdpc_status_t pr_get_path(plan_ctx_t *c, int map, const char *prefix, const char *key, char *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  FSDPC_TRY(pr_get_str(c, map, prefix, key, out, PLAN_PATH_MAX));
  /* "" (a template's unset variable) is no path, and not the key left out either */
  if (v != 0 && out[0] == 0)
    return pr_fail(c, v, path, "an empty path: give a path, or null to leave it unset");
  if (v == 0 || out[0] == '/' || v >= c->set_base || c->dir[0] == 0) return STATUS_OK;
  char joined[2 * PLAN_PATH_MAX];
  snprintf(joined, sizeof joined, "%s/%s", c->dir, out);
  if (strlen(joined) >= PLAN_PATH_MAX) return pr_fail(c, v, path, "the path is too long");
  strcpy(out, joined);
  return STATUS_OK;
}

fsdpc_status_t pr_get_dtype(plan_ctx_t *c, int map, const char *prefix, const char *key,
                            dtype_t *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, key, path);
  if (v == 0) return STATUS_OK;
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "a dtype", &s));
  dtype_t dt;
  if (dtype_parse(s, &dt) != STATUS_OK || !dtype_is_float(dt))
    return pr_fail(c, v, path, "expected f32, bf16 or f16, got '%s'", s);
  *out = dt;
  return STATUS_OK;
}

/* auto | true | false | integer N >= 2 (0 and 1 refused as ambiguous: PyTorch reads 1 as
 * false). auto, the default, as PyTorch's None: true for a unit, false for the root. */
fsdpc_status_t pr_get_reshard(plan_ctx_t *c, int map, const char *prefix, int *out) {
  char path[256];
  int v = pr_lookup(c, map, prefix, "reshard_after_forward", path);
  if (v == 0) return STATUS_OK;
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, v, path, "auto, true, false or an integer", &s));
  if (strcasecmp(s, "true") == 0 || strcasecmp(s, "false") == 0) {
    *out = strcasecmp(s, "true") == 0;
    return STATUS_OK;
  }
  if (strcasecmp(s, "auto") == 0) {
    *out = FSDP_RESHARD_AUTO;
    return STATUS_OK;
  }
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (end == s || *end != 0)
    return pr_fail(c, v, path, "expected auto, true, false or an integer, got '%s'", s);
  if (errno == ERANGE || x < 0 || x > (1 << 20))
    return pr_fail(c, v, path, "%s is out of range (an integer N >= 2, or true / false)", s);
  if (x < 2) /* PyTorch reads 1 as false: a reading either way would be a guess */
    return pr_fail(c, v, path,
                   "%s is ambiguous: an integer N keeps the parameters sharded over groups of N "
                   "ranks after forward (N >= 2); write false to keep them whole (as PyTorch "
                   "reads 1), true to reshard them fully",
                   s);
  *out = (int)x;
  return STATUS_OK;
}

/* ---- sections ---- */

fsdpc_status_t pr_section(plan_ctx_t *c, int root, const char *key, const char *const *keys,
                          int *out) {
  *out = pr_find(c, root, key);
  if (pr_is_null(c, *out)) {
    *out = 0;
    return STATUS_OK;
  }
  return pr_check_keys(c, *out, key, keys);
}

/* ---- --set ---- */

/* Notes node i as one that --set `set` added (its errors name the --set). */
static int note_set(plan_ctx_t *c, int i, const char *set) {
  if (i && i - c->set_base < MAX_SETS) {
    c->set_of[i - c->set_base] = set;
    if (i - c->set_base + 1 > c->n_set_nodes) c->n_set_nodes = i - c->set_base + 1;
  }
  return i;
}

static int add_scalar_styled(plan_ctx_t *c, const char *s, size_t n, yaml_scalar_style_t style,
                             const char *set) {
  return note_set(c, yaml_document_add_scalar(&c->doc, NULL, (yaml_char_t *)s, (int)n, style), set);
}

static int add_scalar(plan_ctx_t *c, const char *s, const char *set) {
  return add_scalar_styled(c, s, strlen(s), YAML_PLAIN_SCALAR_STYLE, set);
}

/* Why a YAML text is not one document: the problem, where (line and column from 1, the
 * character from 1), and whether it is a pattern read as an alias ('*norm'). */
typedef struct yaml_why {
  char text[320];
  size_t line, column, at;
  bool alias, second; /* a pattern read as an alias; a second document */
} yaml_why_t;

/* The one document of a YAML text into *doc; false, *why said, when the text is not valid
 * YAML or holds a second document (a "---" alone aside), which would be ignored. */
static bool load_one_document(const char *text, size_t len, yaml_document_t *doc, yaml_why_t *why) {
  yaml_parser_t parser;
  yaml_parser_initialize(&parser);
  yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
  bool ok = yaml_parser_load(&parser, doc), loaded = ok;
  yaml_document_t more;
  yaml_mark_t at = parser.problem_mark;
  if (ok && yaml_parser_load(&parser, &more)) {
    yaml_node_t *root = yaml_document_get_root_node(&more);
    ok = root == NULL || (root->type == YAML_SCALAR_NODE && root->data.scalar.length == 0);
    at = more.start_mark;
    yaml_document_delete(&more);
    why->second = !ok;
    if (!ok) snprintf(why->text, sizeof why->text, "a second YAML document ('---')");
  } else if (ok) { /* what follows the document is not valid */
    ok = false;
    at = parser.problem_mark;
  }
  if (!ok && parser.error != YAML_NO_ERROR) {
    const char *problem = parser.problem ? parser.problem : "syntax error";
    snprintf(why->text, sizeof why->text, "not valid YAML: %s%s%s", problem,
             parser.context ? " " : "", parser.context ? parser.context : "");
    why->alias = strstr(problem, "alias") || (parser.context && strstr(parser.context, "alias"));
  }
  why->line = at.line + 1;
  why->column = at.column + 1;
  why->at = at.index + 1;
  if (!ok && loaded) yaml_document_delete(doc);
  if (!ok) memset(doc, 0, sizeof *doc);
  yaml_parser_delete(&parser);
  return ok;
}

#define ALIAS_HINT "; a pattern that starts with '*' goes in quotes: '*norm*'"

/* Node i of document `from` copied into the plan's document, what it holds too; 0 when out of
 * memory. */
static int copy_node(plan_ctx_t *c, yaml_document_t *from, int i, const char *set) {
  yaml_node_t *n = yaml_document_get_node(from, i);
  if (n == NULL) return 0;
  if (n->type == YAML_SCALAR_NODE)
    return add_scalar_styled(c, (const char *)n->data.scalar.value, n->data.scalar.length,
                             n->data.scalar.style, set);
  if (n->type == YAML_SEQUENCE_NODE) {
    int seq = note_set(c, yaml_document_add_sequence(&c->doc, NULL, YAML_FLOW_SEQUENCE_STYLE), set);
    for (yaml_node_item_t *a = n->data.sequence.items.start; seq && a < n->data.sequence.items.top;
         a++) {
      int v = copy_node(c, from, *a, set);
      if (!v || !yaml_document_append_sequence_item(&c->doc, seq, v)) return 0;
    }
    return seq;
  }
  int map = note_set(c, yaml_document_add_mapping(&c->doc, NULL, YAML_FLOW_MAPPING_STYLE), set);
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; map && a < n->data.mapping.pairs.top;
       a++) {
    int k = copy_node(c, from, a->key, set), v = k ? copy_node(c, from, a->value, set) : 0;
    if (!v || !yaml_document_append_mapping_pair(&c->doc, map, k, v)) return 0;
  }
  return map;
}

/* A --set value in YAML's flow style ({key: value, ...}, or a list holding lists or mappings)
 * into *out, read as the plan file is read. */
static fsdpc_status_t add_flow_value(plan_ctx_t *c, const char *s, const char *set, int *out) {
  size_t n = strlen(s);
  fsdpc_status_t st = plan_yaml_check_depth("the value", s, n, PLAN_MAX_DEPTH);
  if (st != STATUS_OK) return err_prefix(st, "--set %s", set);
  yaml_document_t doc;
  yaml_why_t why = {0};
  if (!load_one_document(s, n, &doc, &why))
    return err_set(STATUS_EFORMAT, "--set %s: the value is %s (at character %zu)%s", set, why.text,
                   why.at, why.alias ? ALIAS_HINT : "");
  *out = yaml_document_get_root_node(&doc) ? copy_node(c, &doc, 1, set) : 0;
  yaml_document_delete(&doc);
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
}

/* A --set value into *out: "[a, b, ...]" a list of those scalars (each trimmed, quotes around
 * it dropped; "[]" an empty list), a mapping "{...}" or a list holding "[" or "{" read as YAML's
 * flow style, anything else one scalar. */
static fsdpc_status_t add_value(plan_ctx_t *c, const char *s, const char *set, int *out) {
  size_t n = strlen(s);
  *out = 0;
  if (s[0] == '{' || (n >= 2 && s[0] == '[' && s[n - 1] == ']' && strpbrk(s + 1, "[{") != NULL))
    return add_flow_value(c, s, set, out);
  if (n >= 2 && (s[0] == '\'' || s[0] == '"') && s[n - 1] == s[0]) {
    /* 'text', "null": the quotes go, and the value is a string (null, true, 3 quoted stay
     * text, as in the plan file) */
    *out = add_scalar_styled(
        c, s + 1, n - 2,
        s[0] == '"' ? YAML_DOUBLE_QUOTED_SCALAR_STYLE : YAML_SINGLE_QUOTED_SCALAR_STYLE, set);
    return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
  }
  if (n < 2 || s[0] != '[' || s[n - 1] != ']') {
    *out = add_scalar(c, s, set);
    return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
  }
  int seq = note_set(c, yaml_document_add_sequence(&c->doc, NULL, YAML_FLOW_SEQUENCE_STYLE), set);
  if (!seq) return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
  const char *p = s + 1, *end = s + n - 1;
  while (p < end) {
    while (p < end && (*p == ' ' || *p == '\t')) p++;
    if (p == end) break;
    char q = *p == '"' || *p == '\'' ? *p : 0;
    const char *a = q ? p + 1 : p, *b = a;
    while (b < end && (q ? *b != q : *b != ',')) b++;
    const char *stop = b;
    if (q && b == end)
      return err_set(STATUS_EFORMAT, "--set %s: a quote in the list is not closed", set);
    if (!q)
      while (stop > a && (stop[-1] == ' ' || stop[-1] == '\t')) stop--;
    p = q ? b + 1 : b;
    while (p < end && (*p == ' ' || *p == '\t')) p++;
    if (p < end && *p != ',')
      return err_set(STATUS_EFORMAT, "--set %s: expected ',' after a quoted list item", set);
    if (stop == a) return err_set(STATUS_EFORMAT, "--set %s: a list item is empty", set);
    char *item = strndup(a, (size_t)(stop - a));
    int v = item ? add_scalar(c, item, set) : 0;
    free(item);
    if (!v || !yaml_document_append_sequence_item(&c->doc, seq, v))
      return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
    if (p < end) p++; /* the comma */
  }
  *out = seq;
  return STATUS_OK;
}

/* The next part of a --set key path at *pos: up to a '.' outside quotes; a part in double or
 * single quotes ("*norm*", 'model.layers.0.*') is taken literally, dots included, then an
 * optional [INDEX]. Returns the part (in place, quotes removed), NULL at the end; *bad is set
 * for an unclosed quote. */
static char *next_part(char **pos, bool *bad) {
  char *p = *pos;
  *bad = false;
  if (p == NULL || *p == 0) return NULL;
  char *start = p, *w = p;
  if (*p == '"' || *p == '\'') {
    char q = *p++;
    while (*p && *p != q) *w++ = *p++;
    if (*p != q) {
      *bad = true;
      return NULL;
    }
    p++;
  }
  while (*p && *p != '.') *w++ = *p++;
  *pos = *p ? p + 1 : p;
  *w = 0;
  return start;
}

/* The offset of s's first byte that is no part of a UTF-8 character (an overlong form, a
 * surrogate or beyond U+10FFFF included), or -1 when s is UTF-8 throughout. */
static long bad_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  for (long i = 0; p[i];) {
    unsigned c = p[i];
    int n = c < 0x80             ? 0
            : (c & 0xe0) == 0xc0 ? 1
            : (c & 0xf0) == 0xe0 ? 2
            : (c & 0xf8) == 0xf0 ? 3
                                 : -1;
    if (n < 0 || (n == 1 && c < 0xc2) || (n == 3 && c > 0xf4)) return i;
    unsigned cp = n == 0 ? c : c & (0x3f >> n);
    for (int k = 1; k <= n; k++) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
      cp = cp << 6 | (p[i + k] & 0x3f);
    }
    if ((n == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
        (n == 3 && (cp < 0x10000 || cp > 0x10ffff)))
      return i;
    i += n + 1;
  }
  return -1;
}

fsdpc_status_t pr_apply_set(plan_ctx_t *c, int root, const char *set) {
  long at = bad_utf8(set); /* YAML's text, and a plan's, is Unicode */
  if (at >= 0)
    return err_set(STATUS_EFORMAT,
                   "--set %.*s...: not valid UTF-8 at byte %ld (0x%02x): a plan's text is UTF-8, "
                   "as YAML's",
                   (int)at, set, at + 1, (unsigned char)set[at]);
  const char *eq = strchr(set, '=');
  if (eq == NULL || eq == set)
    return err_set(STATUS_EFORMAT, "--set %s: expected key.path=value", set);
  if (eq[1] == 0) /* read as absent, it would keep the plan's value */
    return err_set(STATUS_EFORMAT,
                   "--set %s: no value after '=' (give one; null clears the key, to its default)",
                   set);
  char key[256];
  size_t kl = (size_t)(eq - set);
  if (kl >= sizeof key) return err_set(STATUS_EFORMAT, "--set %s: key path too long", set);
  memcpy(key, set, kl);
  key[kl] = 0;
  int cur = root;
  char *pos = key;
  bool bad = false, item_given = false; /* the part before was NAME[INDEX] */
  for (char *part = next_part(&pos, &bad); part; part = next_part(&pos, &bad)) {
    bool last = *pos == 0;
    if (pr_node(c, cur)->type == YAML_SCALAR_NODE && item_given) /* an item given as a string */
      return err_set(STATUS_EFORMAT,
                     "--set %s: '%s' would go inside '%s', a single value, not a mapping of keys "
                     "(an item given as a string, such as a unit's pattern, takes keys once "
                     "written as a mapping: replace it whole with NAME[INDEX]={match: PATTERN, "
                     "...})",
                     set, part, pr_scalar(c, cur));
    if (pr_node(c, cur)->type == YAML_SCALAR_NODE)
      return err_set(STATUS_EFORMAT,
                     "--set %s: '%s' would go inside the value '%s', a single value, not a "
                     "mapping of keys",
                     set, part, pr_scalar(c, cur));
    if (pr_node(c, cur)->type != YAML_MAPPING_NODE)
      return err_set(STATUS_EFORMAT, "--set %s: '%s' is inside a value that is not a mapping", set,
                     part);
    long index = -1; /* NAME[INDEX]: an item of the list NAME */
    char *br = strchr(part, '[');
    if (br != NULL) {
      char *end;
      index = strtol(br + 1, &end, 10);
      if (end == br + 1 || strcmp(end, "]") != 0 || index < 0 || br == part)
        return err_set(STATUS_EFORMAT, "--set %s: '%s': expected NAME[INDEX] (INDEX from 0)", set,
                       part);
      *br = 0;
    }
    int v = pr_find(c, cur, part);
    if (index >= 0) {
      yaml_node_t *seq = v ? pr_node(c, v) : NULL;
      if (seq == NULL || seq->type != YAML_SEQUENCE_NODE)
        return err_set(STATUS_EFORMAT, "--set %s: '%s' is not a list in the plan", set, part);
      long n = (long)(seq->data.sequence.items.top - seq->data.sequence.items.start);
      if (index >= n)
        return err_set(STATUS_EFORMAT, "--set %s: '%s' has %ld item%s (from 0)", set, part, n,
                       n == 1 ? "" : "s");
      yaml_node_item_t *item = &seq->data.sequence.items.start[index];
      item_given = true;
      if (last) { /* replace the item */
        int val;
        FSDPC_TRY(add_value(c, eq + 1, set, &val));
        *item = val;
        return STATUS_OK;
      }
      cur = *item;
      continue;
    }
    item_given = false;
    if (last) { /* replace the value given in the file, or add the key */
      int val;
      FSDPC_TRY(add_value(c, eq + 1, set, &val));
      yaml_node_t *m = pr_node(c, cur);
      for (yaml_node_pair_t *a = m->data.mapping.pairs.start; a < m->data.mapping.pairs.top; a++)
        if (pr_scalar(c, a->key) && strcmp(pr_scalar(c, a->key), part) == 0) a->value = val;
      if (v != 0) return STATUS_OK;
      int k = add_scalar(c, part, set);
      if (!k || !yaml_document_append_mapping_pair(&c->doc, cur, k, val))
        return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
      return STATUS_OK;
    }
    if (v == 0 || pr_is_null(c, v)) { /* a new mapping: for the key given null, or added */
      int had = v;
      v = note_set(c, yaml_document_add_mapping(&c->doc, NULL, YAML_BLOCK_MAPPING_STYLE), set);
      if (!v) return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
      yaml_node_t *m = pr_node(c, cur);
      for (yaml_node_pair_t *a = m->data.mapping.pairs.start; had && a < m->data.mapping.pairs.top;
           a++)
        if (a->value == had) a->value = v;
      int k = had ? 1 : add_scalar(c, part, set);
      if (!k || (!had && !yaml_document_append_mapping_pair(&c->doc, cur, k, v)))
        return err_set(STATUS_ENOMEM, "--set %s: out of memory", set);
    }
    cur = v;
  }
  if (bad) return err_set(STATUS_EFORMAT, "--set %s: a quote in the key path is not closed", set);
  return err_set(STATUS_EFORMAT, "--set %s: empty key path", set);
}

/* ---- load ---- */

/* Checks the nesting depth with libyaml's event parser, which stops at the first collection
 * too deep (its lookahead is bounded), before the document loader builds anything. */
fsdpc_status_t plan_yaml_check_depth(const char *path, const char *text, size_t len,
                                     int max_depth) {
  ARG_NONNULL(path);
  ARG_NONNULL(text);
  yaml_parser_t parser;
  yaml_parser_initialize(&parser);
  yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
  fsdpc_status_t st = STATUS_OK;
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

fsdpc_status_t pr_parse_file(plan_ctx_t *c, const char *path) {
  FILE *f;
  FSDPC_TRY(file_open_regular(path, "cannot open the plan", &f));
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  fclose(f);
  char *text;
  FSDPC_TRY(file_read_text(path, PLAN_MAX_BYTES, &text));
  size_t len = strlen(text);
  fsdpc_status_t st = STATUS_OK;
  if (size >= 0 && (size_t)size != len)
    st = err_set(STATUS_EFORMAT, "%s:1:1: not valid YAML: the file holds a NUL byte (binary?)",
                 path);
  /* a byte-order mark is read at the start only: another one would be part of a key */
  const char *bom =
      len >= 3 ? strstr(text + (memcmp(text, "\xef\xbb\xbf", 3) == 0 ? 3 : 0), "\xef\xbb\xbf")
               : NULL;
  if (st == STATUS_OK && bom != NULL) {
    size_t line = 1;
    for (const char *q = text; q < bom; q++) line += *q == '\n';
    st = err_set(STATUS_EFORMAT,
                 "%s:%zu: a byte-order mark (U+FEFF) where only the file's start may have one",
                 path, line);
  }
  if (st == STATUS_OK) st = plan_yaml_check_depth(path, text, len, PLAN_MAX_DEPTH);
  if (st != STATUS_OK) {
    free(text);
    return st;
  }
  yaml_why_t why = {0};
  if (!load_one_document(text, len, &c->doc, &why))
    st = err_set(STATUS_EFORMAT, "%s:%zu:%zu: %s%s%s", path, why.line, why.column, why.text,
                 why.second ? ": a plan is one document" : "", why.alias ? ALIAS_HINT : "");
  free(text);
  return st;
}

fsdpc_status_t pr_open(plan_ctx_t *c, const char *path, const char *const *sets, int n_sets,
                       const char *const *top, const char *sections, const char *first, int *root) {
  *root = 0;
  snprintf(c->source, sizeof c->source, "%s", path);
  const char *slash = strrchr(path, '/');
  if (slash) snprintf(c->dir, sizeof c->dir, "%.*s", (int)(slash - path), path);
  FSDPC_TRY(pr_parse_file(c, path));
  int r = yaml_document_get_root_node(&c->doc) ? 1 : 0;
  fsdpc_status_t st = STATUS_OK;
  if (r == 0 || pr_is_null(c, r))
    st = err_set(STATUS_EFORMAT, "%s: the plan is empty (expected a mapping of sections: %s)", path,
                 sections);
  else if (pr_node(c, r)->type != YAML_MAPPING_NODE)
    st = pr_fail(c, r, "(top level)", "expected a mapping of sections (mesh, %s...)", first);
  c->set_base = (int)(c->doc.nodes.top - c->doc.nodes.start) + 1;
  for (int i = 0; i < n_sets && st == STATUS_OK; i++) st = pr_apply_set(c, r, sets[i]);
  if (st == STATUS_OK) st = pr_check_keys(c, r, "", top);
  *root = r;
  return st;
}

void pr_close(plan_ctx_t *c) { yaml_document_delete(&c->doc); }
