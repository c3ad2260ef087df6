/*
 * fsdp-plan convert: an Accelerate config (YAML) or a DeepSpeed config (JSON) as a plan.
 *
 *   fsdp-plan convert CONFIG.yaml|CONFIG.json [-o PLAN.yaml]
 *
 * Writes the plan keys the config's settings stand for, each with a comment naming the key it
 * came from, and lists at the end, as comments, every setting with no equivalent and why. The
 * model and the data path are the user's to add (a config of these tools names neither).
 * Mapping: FULL_SHARD = ZeRO-3 = reshard_after_forward true; SHARD_GRAD_OP = ZeRO-2 = false;
 * ZeRO's module-by-module gathering = one unit per decoder layer; SIZE_BASED_WRAP =
 * min_unit_params;
 * HYBRID_SHARD = shard within a node, replicate across; DeepSpeed's hpZ partition size N =
 * an integer reshard_after_forward N; mixed precision bf16/fp16 = mp_policy param_dtype
 * bf16/f16 with f32 reductions; micro-batch, accumulation, clipping, AdamW and the
 * warmup-cosine schedule map to data, optim and schedule.
 */
#include <cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <yaml.h>

#include "core/file.h"
#include "core/status.h"
#include "parallel/parallel_plan.h"
#include "tools/plan_convert.h"

/* ---- input: YAML through libyaml, as a cJSON tree with every scalar a string ---- */

/* Values a YAML document may expand to: aliases repeat a node wherever they stand, and a few
 * levels of them expand a small file into billions of values. */
enum { YAML_VALUES_MAX = 100000 };
/* the budget left when a key is a list or a mapping (below what any count reaches) */
#define KEY_NOT_SCALAR (-100L * YAML_VALUES_MAX)

static cJSON *yaml_to_json(yaml_document_t *d, yaml_node_t *n, int depth, long *budget) {
  if (n == NULL || depth > 64 || --*budget < 0) return NULL;
  if (n->type == YAML_SCALAR_NODE) { /* a plain null (~, null, empty) as YAML reads it */
    const char *v = (const char *)n->data.scalar.value;
    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        (!v[0] || strcmp(v, "~") == 0 || strcmp(v, "null") == 0 || strcmp(v, "Null") == 0 ||
         strcmp(v, "NULL") == 0))
      return cJSON_CreateNull();
    return cJSON_CreateString(v);
  }
  if (n->type == YAML_SEQUENCE_NODE) {
    cJSON *a = cJSON_CreateArray();
    for (yaml_node_item_t *i = n->data.sequence.items.start;
         a && *budget >= 0 && i < n->data.sequence.items.top; i++)
      cJSON_AddItemToArray(a, yaml_to_json(d, yaml_document_get_node(d, *i), depth + 1, budget));
    return a;
  }
  cJSON *o = cJSON_CreateObject();
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start;
       o && *budget >= 0 && p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *k = yaml_document_get_node(d, p->key);
    if (k == NULL || k->type != YAML_SCALAR_NODE) { /* a list or mapping as a key: no setting */
      cJSON_Delete(o);
      *budget = KEY_NOT_SCALAR;
      return NULL;
    }
    cJSON_AddItemToObject(o, (const char *)k->data.scalar.value,
                          yaml_to_json(d, yaml_document_get_node(d, p->value), depth + 1, budget));
  }
  return o;
}

/* A key given twice in one mapping: the last value is taken, as DeepSpeed (Python's json) and
 * Accelerate (PyYAML) read it; each is said on stderr. */
static void keep_last(cJSON *o, const char *path, const char *at) {
  for (cJSON *it = o ? o->child : NULL; it != NULL;) {
    cJSON *next = it->next;
    char where[256];
    snprintf(where, sizeof where, "%s%s%s", at, at[0] ? "." : "", it->string ? it->string : "");
    if (cJSON_IsObject(it)) keep_last(it, path, where);
    bool later = false;
    for (cJSON *j = next; j != NULL && it->string && !later; j = j->next)
      later = j->string && strcmp(j->string, it->string) == 0;
    if (later) {
      fprintf(stderr,
              "fsdp-plan: warning: %s: %s is given more than once; the last value is taken (as "
              "DeepSpeed and Accelerate read it)\n",
              path, where);
      cJSON_Delete(cJSON_DetachItemViaPointer(o, it));
    }
    it = next;
  }
}

/* A YAML document of settings as JSON (one document, a mapping, aliases bounded). */
static fsdpc_status_t parse_yaml(const char *path, const char *text, cJSON **out) {
  fsdpc_status_t st = plan_yaml_check_depth(path, text, strlen(text), 64);
  if (st != STATUS_OK) return st;
  yaml_parser_t p;
  yaml_document_t d;
  yaml_parser_initialize(&p);
  yaml_parser_set_input_string(&p, (const unsigned char *)text, strlen(text));
  if (!yaml_parser_load(&p, &d)) {
    st = err_set(STATUS_EFORMAT, "%s:%zu: not valid YAML: %s", path, p.problem_mark.line + 1,
                 p.problem ? p.problem : "?");
  } else {
    yaml_node_t *root = yaml_document_get_root_node(&d);
    long budget = YAML_VALUES_MAX;
    *out = root && root->type == YAML_MAPPING_NODE ? yaml_to_json(&d, root, 0, &budget) : NULL;
    if (budget <= KEY_NOT_SCALAR / 2)
      st = err_set(STATUS_EFORMAT, "%s: a key that is a list or a mapping (settings are named)",
                   path);
    else if (budget < 0)
      st =
          err_set(STATUS_EFORMAT, "%s: expands to more than %d values (aliases repeating aliases?)",
                  path, YAML_VALUES_MAX);
    else if (*out == NULL)
      st = err_set(STATUS_EFORMAT, "%s: not a mapping of settings", path);
    yaml_document_t second;
    if (st == STATUS_OK && yaml_parser_load(&p, &second)) { /* a second document: refused */
      if (yaml_document_get_root_node(&second) != NULL)
        st = err_set(STATUS_EFORMAT, "%s: holds more than one YAML document", path);
      yaml_document_delete(&second);
    }
    yaml_document_delete(&d);
  }
  yaml_parser_delete(&p);
  return st;
}

static fsdpc_status_t read_config(const char *path, cJSON **out) {
  *out = NULL;
  FILE *f;
  FSDPC_TRY(file_open_regular(path, "cannot open the config", &f));
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  fclose(f);
  char *text;
  FSDPC_TRY(file_read_text(path, (size_t)1 << 20, &text));
  if (size >= 0 && (size_t)size != strlen(text)) {
    size_t at = strlen(text);
    free(text);
    return err_set(STATUS_EFORMAT, "%s: holds a NUL byte at offset %zu (a binary file?)", path, at);
  }
  const char *s = text;
  while (isspace((unsigned char)*s)) s++;
  fsdpc_status_t st = STATUS_OK;
  if (*s == '{') {
    const char *end = NULL;
    *out = cJSON_ParseWithOpts(text, &end, true); /* nothing but spaces after the object */
    if (*out == NULL) {
      cJSON *first = cJSON_Parse(text); /* whether the first object alone is whole */
      st = err_set(STATUS_EFORMAT, "%s: not valid JSON at byte %ld%s", path,
                   end ? (long)(end - text) : 0L, first ? " (more after the object)" : "");
      cJSON_Delete(first);
    }
  } else {
    st = parse_yaml(path, text, out);
  }
  free(text);
  if (st == STATUS_OK && !cJSON_IsObject(*out))
    st = err_set(STATUS_EFORMAT, "%s: not an object of settings", path);
  if (st != STATUS_OK) {
    cJSON_Delete(*out);
    *out = NULL;
    return st;
  }
  keep_last(*out, path, "");
  return STATUS_OK;
}

/* An Accelerate config whose deepspeed_config names a deepspeed_config_file: that file's
 * settings read into deepspeed_config, as Accelerate reads them (a relative path from the
 * config's folder, else from the working directory), the key kept (the translation reads the
 * file's absent keys as DeepSpeed's defaults); its path into file ("" when none). */
static fsdpc_status_t read_deepspeed_file(const char *path, cJSON *c, char *file, size_t n) {
  cJSON *ds = cJSON_GetObjectItemCaseSensitive(c, "deepspeed_config");
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(ds, "deepspeed_config_file");
  file[0] = 0;
  if (cJSON_IsNull(name) || (cJSON_IsString(name) && name->valuestring[0] == 0)) {
    /* null or "" (a template's): no file, as Accelerate reads it */
    cJSON_DeleteItemFromObjectCaseSensitive(ds, "deepspeed_config_file");
    return STATUS_OK;
  }
  if (name == NULL) return STATUS_OK;
  if (!cJSON_IsString(name))
    return err_set(STATUS_EINVAL, "%s: deepspeed_config.deepspeed_config_file must be a path",
                   path);
  const char *slash = strrchr(path, '/');
  if (name->valuestring[0] != '/' && slash != NULL)
    snprintf(file, n, "%.*s/%s", (int)(slash - path), path, name->valuestring);
  if (file[0] == 0 || access(file, F_OK) != 0) snprintf(file, n, "%s", name->valuestring);
  /* Accelerate refuses its own settings beside the file (they would be ignored) */
  static const char *const ignored[] = {
      "gradient_accumulation_steps", "gradient_clipping",     "zero_stage",
      "offload_optimizer_device",    "offload_param_device",  "offload_param_nvme_path",
      "offload_optimizer_nvme_path", "zero3_save_16bit_model"};
  char given[512] = "";
  for (size_t k = 0; k < sizeof ignored / sizeof ignored[0]; k++) /* (null: not given) */
    if (!cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(ds, ignored[k])) &&
        cJSON_GetObjectItemCaseSensitive(ds, ignored[k]))
      snprintf(given + strlen(given), sizeof given - strlen(given), "%sdeepspeed_config.%s",
               given[0] ? ", " : "", ignored[k]);
  const cJSON *mp = cJSON_GetObjectItemCaseSensitive(c, "mixed_precision");
  if (mp != NULL && !cJSON_IsNull(mp))
    snprintf(given + strlen(given), sizeof given - strlen(given), "%smixed_precision",
             given[0] ? ", " : "");
  if (given[0])
    return err_set(STATUS_EINVAL,
                   "%s: %s beside deepspeed_config.deepspeed_config_file: Accelerate refuses "
                   "them there (the DeepSpeed config file gives them); remove them",
                   path, given);
  cJSON *inner = NULL;
  fsdpc_status_t st = read_config(file, &inner);
  if (st != STATUS_OK) return err_prefix(st, "%s: deepspeed_config.deepspeed_config_file", path);
  if (cJSON_GetObjectItemCaseSensitive(inner, "zero_optimization") == NULL) {
    cJSON_Delete(inner);
    return err_set(STATUS_EINVAL,
                   "%s: its deepspeed_config_file %s has no zero_optimization section: "
                   "Accelerate refuses such a file (give zero_optimization.stage)",
                   path, file);
  }
  for (cJSON *it = inner->child; it != NULL;) {
    cJSON *next = it->next;
    if (cJSON_GetObjectItemCaseSensitive(ds, it->string) == NULL)
      cJSON_AddItemToObject(ds, it->string, cJSON_DetachItemViaPointer(inner, it));
    else
      fprintf(stderr,
              "fsdp-plan: warning: %s: %s is set both in the config and in %s; the config's value "
              "is taken\n",
              path, it->string, file);
    it = next;
  }
  cJSON_Delete(inner);
  return STATUS_OK;
}

static void write_plan(FILE *f, const out_t *o, const char *path, const char *kind,
                       const char *ds_file, const cJSON *c) {
  char b[64];
  bool data = false; /* a data: section is written: only its path is the user's to add */
  for (int i = 0; i < o->n_keys && !data; i++) data = strcmp(o->keys[i].section, "data") == 0;
  fprintf(f, "# fsdp-plan convert %s\n# from %s%s%s. Add a model: section and %s", path, kind,
          ds_file[0] ? " with its DeepSpeed config " : "", ds_file,
          data ? "data.path (to the data: section below)" : "a data: section");
  const char *np = plan_text_of(cJSON_GetObjectItemCaseSensitive(c, "num_processes"), b, sizeof b);
  if (np) fprintf(f, "; launch with mpirun -n %s (num_processes)", np);
  fputs(".\n", f);
  static const char *const order[] = {"mesh",
                                      "parallelize.fully_shard",
                                      "parallelize.fully_shard.mp_policy",
                                      "optim",
                                      "schedule",
                                      "data",
                                      "train",
                                      NULL};
  char open[3][40] = {"", "", ""}; /* the section names written so far, by depth */
  for (int s = 0; order[s]; s++) {
    bool any = false;
    for (int i = 0; i < o->n_keys && !any; i++) any = strcmp(o->keys[i].section, order[s]) == 0;
    if (!any) continue;
    char sec[64];
    snprintf(sec, sizeof sec, "%s", order[s]);
    int depth = 0;
    bool same = true; /* the path so far matches what is open */
    for (char *part = strtok(sec, "."); part && depth < 3; part = strtok(NULL, "."), depth++) {
      if (same && strcmp(open[depth], part) == 0) continue;
      same = false;
      fprintf(f, "%*s%s:\n", 2 * depth, "", part);
      snprintf(open[depth], sizeof open[depth], "%s", part);
      for (int d = depth + 1; d < 3; d++) open[d][0] = '\0';
    }
    for (int i = 0; i < o->n_keys; i++) {
      const entry_t *e = &o->keys[i];
      if (strcmp(e->section, order[s]) != 0) continue;
      bool seen = false; /* the first of a repeated key wins */
      for (int j = 0; j < i && !seen; j++)
        seen = strcmp(o->keys[j].section, e->section) == 0 && strcmp(o->keys[j].key, e->key) == 0;
      if (!seen) fprintf(f, "%*s%s: %s  # %s\n", 2 * depth, "", e->key, e->value, e->from);
    }
  }
  if (o->n_left > 0) {
    fputs("\n# Not translated:\n", f);
    for (int i = 0; i < o->n_left; i++) fprintf(f, "#   %s: %s\n", o->left[i].key, o->left[i].from);
  }
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-plan convert CONFIG.yaml|CONFIG.json [-o|--output PLAN.yaml]\n"
          "       fsdp-plan --help | --version\n"
          "  an Accelerate config (YAML) or a DeepSpeed config (JSON) as plan keys, each\n"
          "  commented with its source, and the settings with no equivalent listed\n");
}

/* The arguments of fsdp-plan convert CONFIG [-o OUT]: 0 (go on), else the exit status (help,
 * version, or a usage error, said). */
static int parse_args(int argc, char **argv, const char **in, const char **outp) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return -1;
    }
    if (strcmp(argv[i], "--version") == 0) {
      printf("fsdp-plan (fsdpc) %s\n", fsdpc_version());
      return -1;
    }
  }
  if (argc < 2 || strcmp(argv[1], "convert") != 0) {
    fprintf(stderr, "fsdp-plan: %s\n",
            argc < 2 ? "no command given" : "unknown command (the command is convert)");
    usage(stderr);
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    bool eq = strncmp(argv[i], "--output=", 9) == 0;
    if (strcmp(argv[i], "-o") == 0 || strcmp(argv[i], "--output") == 0 || eq) {
      const char *opt = eq ? "--output" : argv[i];
      if ((!eq && i + 1 == argc) || (eq && argv[i][9] == 0)) {
        fprintf(stderr, "fsdp-plan: %s needs a file name\n", opt);
        return 2;
      }
      const char *v = eq ? argv[i] + 9 : argv[i + 1];
      if (*outp != NULL) {
        fprintf(stderr, "fsdp-plan: %s given twice ('%s' and '%s'; -o and --output are one)\n", opt,
                *outp, v);
        return 2;
      }
      *outp = v;
      i += !eq;
    } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
      fprintf(stderr, "fsdp-plan: unknown option '%s' (--help)\n", argv[i]);
      return 2;
    } else if (*in == NULL) {
      *in = argv[i];
    } else {
      fprintf(stderr, "fsdp-plan: more than one config ('%s' and '%s')\n", *in, argv[i]);
      return 2;
    }
  }
  if (*in == NULL) {
    fprintf(stderr, "fsdp-plan: convert needs a config file\n");
    return 2;
  }
  return 0;
}

/* The plan written to outp (through a temporary file and a rename) or to stdout. */
static fsdpc_status_t write_out(const char *outp, const out_t *o, const char *in, const char *kind,
                                const char *ds_file, const cJSON *c) {
  char tmp[4096];
  FILE *f = stdout;
  if (outp) FSDPC_TRY(file_create_temp(outp, tmp, sizeof tmp, &f));
  write_plan(f, o, in, kind, ds_file, c);
  bool bad = ferror(f) != 0;
  if (outp && (fclose(f) != 0 || bad || rename(tmp, outp) != 0)) {
    fsdpc_status_t st = err_set(STATUS_EIO, "cannot write '%s': %s", outp, strerror(errno));
    remove(tmp);
    return st;
  }
  if (!outp && (fflush(f) != 0 || bad))
    return err_set(STATUS_EIO, "cannot write the plan: %s", strerror(errno));
  return STATUS_OK;
}

int main(int argc, char **argv) {
  const char *in = NULL, *outp = NULL;
  int rc = parse_args(argc, argv, &in, &outp);
  if (rc != 0) return rc < 0 ? 0 : rc;
  cJSON *c = NULL;
  out_t *o = calloc(1, sizeof *o);
  char kind[160], ds_file[4200] = "";
  fsdpc_status_t st = o ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK) st = read_config(in, &c);
  if (st == STATUS_OK) st = read_deepspeed_file(in, c, ds_file, sizeof ds_file);
  if (st == STATUS_OK && outp) { /* before anything is written: no input is the output */
    file_inputs_t *inputs = NULL;
    st = file_inputs_new(&inputs);
    if (st == STATUS_OK) st = file_inputs_add(inputs, in, "the config being converted");
    if (st == STATUS_OK && ds_file[0])
      st = file_inputs_add(inputs, ds_file, "its deepspeed_config_file");
    if (st == STATUS_OK) st = file_check_output(outp, "-o", inputs);
    static const char *const plan[] = {"# fsdp-plan convert ", NULL}; /* write_plan's start */
    if (st == STATUS_OK) st = file_check_replaces(outp, "-o", "a plan fsdp-plan wrote", plan);
    file_inputs_free(inputs);
  }
  if (st == STATUS_OK) st = plan_convert(c, in, o, kind, sizeof kind);
  if (st == STATUS_OK && o->n_bad > 0) { /* values its own tool refuses: nothing written */
    fprintf(stderr, "fsdp-plan: %s (%s): %d setting%s %s not valid there; nothing was written\n",
            in, kind, o->n_bad, o->n_bad == 1 ? "" : "s", o->n_bad == 1 ? "is" : "are");
    for (int i = 0; i < o->n_bad; i++) fprintf(stderr, "  %s: %s\n", o->bad[i].key, o->bad[i].from);
    cJSON_Delete(c);
    free(o);
    return 1;
  }
  if (st == STATUS_OK) st = write_out(outp, o, in, kind, ds_file, c);
  cJSON_Delete(c);
  free(o);
  if (st != STATUS_OK) {
    fprintf(stderr, "fsdp-plan: %s\n", err_detail());
    return 1;
  }
  return 0;
}
