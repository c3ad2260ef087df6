/* fsdp-plan convert's translation: Accelerate and DeepSpeed settings as plan keys, and the
 * settings with no equivalent, with the reason. */
#include "tools/plan_convert.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

const char *plan_text_of(const cJSON *it, char *buf, size_t n) {
  if (it == NULL || cJSON_IsNull(it)) return NULL;
  if (cJSON_IsString(it)) return it->valuestring;
  if (cJSON_IsBool(it)) return cJSON_IsTrue(it) ? "true" : "false";
  if (cJSON_IsNumber(it)) {
    snprintf(buf, n, "%.15g", it->valuedouble);
    return buf;
  }
  return "(a structure)";
}

/* True as Accelerate's str_to_bool reads it (and PyYAML's booleans). */
static bool truthy(const char *v) {
  static const char *const yes[] = {"true", "1", "yes", "y", "t", "on"};
  for (size_t i = 0; v && i < sizeof yes / sizeof yes[0]; i++)
    if (strcasecmp(v, yes[i]) == 0) return true;
  return false;
}

/* ---- output: plan keys by section, and the settings left out ---- */

static void put(out_t *o, const char *section, const char *key, const char *value, const char *from,
                ...) {
  if (o->n_keys == MAX_KEYS) return;
  entry_t *e = &o->keys[o->n_keys++];
  snprintf(e->section, sizeof e->section, "%s", section);
  snprintf(e->key, sizeof e->key, "%s", key);
  snprintf(e->value, sizeof e->value, "%s", value);
  va_list ap;
  va_start(ap, from);
  vsnprintf(e->from, sizeof e->from, from, ap);
  va_end(ap);
}

/* Drops what earlier settings put into section.key (a later setting that overrides them). */
static void unput(out_t *o, const char *section, const char *key) {
  int k = 0;
  for (int i = 0; i < o->n_keys; i++)
    if (strcmp(o->keys[i].section, section) != 0 || strcmp(o->keys[i].key, key) != 0)
      o->keys[k++] = o->keys[i];
  o->n_keys = k;
}

/* setting and why it is listed, into list (of *n entries). */
static void listed(entry_t *list, int *n, const char *setting, const char *why, va_list ap) {
  if (*n == MAX_KEYS) return;
  entry_t *e = &list[(*n)++];
  snprintf(e->key, sizeof e->key, "%s", setting);
  vsnprintf(e->from, sizeof e->from, why, ap);
}

/* A setting with no equivalent here: listed in the plan's comments, with the reason. */
static void leave(out_t *o, const char *setting, const char *why, ...) {
  va_list ap;
  va_start(ap, why);
  listed(o->left, &o->n_left, setting, why, ap);
  va_end(ap);
}

/* A setting whose value DeepSpeed or Accelerate would refuse: the conversion fails, naming it,
 * rather than write a plan of the rest. */
static void invalid(out_t *o, const char *setting, const char *why, ...) {
  va_list ap;
  va_start(ap, why);
  listed(o->bad, &o->n_bad, setting, why, ap);
  va_end(ap);
}

static bool is_auto(const char *v) { return v && strcmp(v, "auto") == 0; }

/* What a number setting may be: a count of at least one (a batch), of at least zero (steps),
 * a finite number of at least zero (a rate), above zero, or a ratio in [0, 1]. */
typedef enum num_kind { NUM_COUNT, NUM_STEPS, NUM_NONNEG, NUM_POS, NUM_RATIO } num_kind_t;

/* Whether x is a number of that kind; its description into *what. */
static bool num_fits(double x, num_kind_t kind, const char **what) {
  static const char *const whats[] = {
      "a whole number of at least 1", "a whole number of at least 0",
      "a finite number of at least 0", "a finite number above 0", "a ratio from 0 to 1"};
  *what = whats[kind];
  if (!isfinite(x)) return false;
  switch (kind) {
    case NUM_COUNT: return x >= 1 && x <= 1e15 && x == floor(x);
    case NUM_STEPS: return x >= 0 && x <= 1e15 && x == floor(x);
    case NUM_NONNEG: return x >= 0;
    case NUM_POS: return x > 0;
    default: return x >= 0 && x <= 1;
  }
}

/* A number setting into section.key; "auto" (filled in by the HF Trainer) is left out, and one
 * that is not of its kind (which DeepSpeed or Accelerate would refuse) fails the conversion. */
static void number(out_t *o, const cJSON *src, const char *name, const char *shown,
                   const char *section, const char *key, num_kind_t kind) {
  char b[64];
  const char *v = plan_text_of(cJSON_GetObjectItemCaseSensitive(src, name), b, sizeof b);
  if (v == NULL) return;
  if (is_auto(v)) {
    leave(o, shown, "'auto': taken from the training script there; give %s.%s here", section, key);
    return;
  }
  char *end;
  double x = strtod(v, &end);
  const char *what;
  if (*end != '\0' || end == v) {
    invalid(o, shown, "'%s' is not a number", v);
    return;
  }
  if (!num_fits(x, kind, &what)) {
    invalid(o, shown, "'%s' is not %s", v, what);
    return;
  }
  put(o, section, key, v, "%s", shown);
}

static void precision(out_t *o, const char *v, const char *from) {
  if (v == NULL || strcasecmp(v, "no") == 0 || strcasecmp(v, "fp32") == 0) return;
  const char *dt = strcasecmp(v, "bf16") == 0 ? "bf16" : strcasecmp(v, "fp16") == 0 ? "f16" : NULL;
  if (dt == NULL) {
    leave(o, from, "'%s' has no equivalent (bf16, fp16 or no)", v);
    return;
  }
  put(o, "parallelize.fully_shard.mp_policy", "param_dtype", dt, "%s: %s", from, v);
  put(o, "parallelize.fully_shard.mp_policy", "reduce_dtype", "f32",
      "%s: %s (gradients reduced in f32)", from, v);
  if (strcmp(dt, "f16") == 0)
    leave(o, "fp16 loss scaling",
          "none here (a dynamic loss scaler there): small f16 gradients may underflow; bf16 "
          "needs none");
}

/* An offload to the host named `name` (its comment name + suffix): the sharded parameters,
 * gradients and optimizer state when the parameters go there (params_too), else listed: the
 * optimizer's state cannot go alone. */
static void host_offload(out_t *o, const char *name, const char *suffix, bool params_too) {
  if (params_too)
    put(o, "parallelize.fully_shard", "offload", "true", "%s%s", name, suffix);
  else
    leave(o, name,
          "device cpu for the optimizer alone: offload here moves the sharded parameters, "
          "gradients and optimizer state together (parallelize.fully_shard.offload: true)");
}

/* A number setting, or DeepSpeed's default for it when it is not given (def: the default's text,
 * why: where it comes from). */
static void number_or(out_t *o, const cJSON *src, const char *name, const char *shown,
                      const char *section, const char *key, num_kind_t kind, const char *def,
                      const char *why) {
  if (cJSON_GetObjectItemCaseSensitive(src, name) != NULL)
    number(o, src, name, shown, section, key, kind);
  else
    put(o, section, key, def, "%s not given: %s", shown, why);
}

/* ---- DeepSpeed: a ds_config.json, or Accelerate's deepspeed_config section ---- */

/* The units DeepSpeed's ZeRO implies: it gathers parameters submodule by submodule as they run,
 * never the whole model, so one unit per decoder layer (the built-in Llama's). */
static void layer_units(out_t *o, const char *from) {
  put(o, "parallelize.fully_shard", "units", "[\"model.layers.*\"]",
      "%s: DeepSpeed gathers parameters module by module as they run; one unit per decoder "
      "layer keeps one layer gathered at a time",
      from);
}

static void zero(out_t *o, const char *stage, const char *from, long hpz) {
  if (stage == NULL) return;
  if (hpz > 1 && strcmp(stage, "3") == 0) {
    char n[24];
    snprintf(n, sizeof n, "%ld", hpz);
    put(o, "parallelize.fully_shard", "reshard_after_forward", n,
        "%s 3 with zero_hpz_partition_size %ld: parameters re-gathered within groups of %ld "
        "ranks for the backward",
        from, hpz, hpz);
    layer_units(o, from);
  } else if (strcmp(stage, "3") == 0 || strcmp(stage, "2") == 0) {
    put(o, "parallelize.fully_shard", "zero_stage", stage, "%s %s", from, stage);
    layer_units(o, from);
  } else if (strcmp(stage, "0") == 0) {
    put(o, "parallelize.fully_shard", "sharding_strategy", "NO_SHARD", "%s 0 (data parallel)",
        from);
  } else if (strcmp(stage, "1") == 0) {
    put(o, "parallelize.fully_shard", "zero_stage", "2",
        "%s 1 shards the optimizer state only; the nearest plan also shards the gradients "
        "(ZeRO-2), parameters kept gathered from forward to backward",
        from);
    layer_units(o, from);
  } else {
    invalid(o, from, "stage '%s' is not a ZeRO stage (0, 1, 2 or 3)", stage);
  }
}

/* v as a number of ranks (a whole number from 1 to 10^6) into *out; false when it is not one. */
static bool whole_ranks(const char *v, long *out) {
  char *end;
  double x = strtod(v, &end);
  if (end == v || *end != '\0' || !(x >= 1 && x <= 1e6) || x != (double)(long)x) return false;
  *out = (long)x;
  return true;
}

/* DeepSpeed's zero_optimization: the stage (hpZ partitions as HSDP), offload, and the knobs
 * that have no equivalent. */
static void ds_zero(out_t *o, const cJSON *c, const char *prefix) {
  char b[64], name[96];
  const cJSON *z = cJSON_GetObjectItemCaseSensitive(c, "zero_optimization");
  long hpz = 0;
  const char *hv =
      plan_text_of(cJSON_GetObjectItemCaseSensitive(z, "zero_hpz_partition_size"), b, sizeof b);
  snprintf(name, sizeof name, "%szero_optimization.zero_hpz_partition_size", prefix);
  if (hv && !whole_ranks(hv, &hpz)) invalid(o, name, "'%s' is not a whole number of ranks", hv);
  char sb[64];
  snprintf(name, sizeof name, "%szero_optimization.stage", prefix);
  const char *stage = plan_text_of(cJSON_GetObjectItemCaseSensitive(z, "stage"), sb, sizeof sb);
  zero(o, stage, name, hpz);
  bool three = stage && strcmp(stage, "3") == 0; /* what applies at stage 3 only */
  if (hv && hpz > 0 && !three) {
    snprintf(name, sizeof name, "%szero_optimization.zero_hpz_partition_size", prefix);
    leave(o, name, "%s: hpZ applies at ZeRO stage 3 only (DeepSpeed ignores it at stage %s)", hv,
          stage ? stage : "0");
  }
  snprintf(name, sizeof name, "%szero_stage", prefix);
  char zb[64];
  const char *zs = plan_text_of(cJSON_GetObjectItemCaseSensitive(c, "zero_stage"), zb, sizeof zb);
  zero(o, zs, name, 0);
  /* the default stage, not the plan's: Accelerate's for its own section, DeepSpeed's for a
   * DeepSpeed file (one an Accelerate config names too) */
  bool accelerate = *prefix && !cJSON_GetObjectItemCaseSensitive(c, "deepspeed_config_file");
  if (stage == NULL && zs == NULL)
    zero(o, accelerate ? "2" : "0",
         accelerate ? "deepspeed_config.zero_stage not given: Accelerate's default"
                    : "zero_optimization.stage not given: DeepSpeed's default",
         0);
  for (const cJSON *it = z ? z->child : NULL; it; it = it->next) {
    if (strcmp(it->string, "stage") == 0 || strcmp(it->string, "zero_hpz_partition_size") == 0)
      continue;
    snprintf(name, sizeof name, "%szero_optimization.%s", prefix, it->string);
    if (strcmp(it->string, "offload_param") == 0 && !three) {
      leave(o, name,
            "parameters are offloaded at ZeRO stage 3 only (DeepSpeed ignores it at stage %s)",
            stage ? stage : "0");
    } else if (strcmp(it->string, "offload_optimizer") == 0 ||
               strcmp(it->string, "offload_param") == 0) {
      const char *dev = plan_text_of(cJSON_GetObjectItemCaseSensitive(it, "device"), b, sizeof b);
      const cJSON *other = cJSON_GetObjectItemCaseSensitive(
          z, strcmp(it->string, "offload_param") == 0 ? "offload_optimizer" : "offload_param");
      char ob[64];
      const char *odev =
          plan_text_of(cJSON_GetObjectItemCaseSensitive(other, "device"), ob, sizeof ob);
      bool both = odev && strcmp(odev, "cpu") == 0;
      if (dev && strcmp(dev, "cpu") == 0)
        host_offload(o, name,
                     ".device cpu (CUDA: sharded parameters, gradients and optimizer on the host)",
                     both || strcmp(it->string, "offload_param") == 0);
      else if (dev && strcmp(dev, "none") != 0)
        leave(o, name, "device '%s': only the host (cpu) is an offload target", dev);
    } else if (strcmp(it->string, "cpu_offload") == 0 ||
               strcmp(it->string, "cpu_offload_param") == 0) { /* the deprecated forms */
      bool param = strcmp(it->string, "cpu_offload_param") == 0;
      const cJSON *other =
          cJSON_GetObjectItemCaseSensitive(z, param ? "cpu_offload" : "cpu_offload_param");
      char ob[64];
      if (truthy(plan_text_of(it, b, sizeof b)))
        host_offload(o, name, " (CUDA: sharded parameters, gradients and optimizer on the host)",
                     param || truthy(plan_text_of(other, ob, sizeof ob)));
    } else if (strcmp(it->string, "mics_shard_size") == 0) {
      long m = 0;
      const char *v = plan_text_of(it, b, sizeof b);
      if (v && whole_ranks(v, &m) && m > 1 && !three) {
        leave(o, name, "MiCS applies at ZeRO stage 3 only (DeepSpeed ignores it at stage %s)",
              stage ? stage : "0");
      } else if (v && whole_ranks(v, &m) && m > 1) { /* HSDP: sharded as ZeRO-3 within */
        unput(o, "parallelize.fully_shard", "zero_stage");
        put(o, "parallelize.fully_shard", "sharding_strategy", "HYBRID_SHARD",
            "%s with stage 3: ZeRO-3 within groups of %ld ranks, replicated across them", name, m);
        put(o, "mesh", "dp_shard", v, "%s: parameters sharded within groups of %ld ranks", name, m);
        put(o, "mesh", "dp_replicate", "-1", "%s: and replicated across the groups (HSDP)", name);
      } else if (v && strcmp(v, "-1") != 0) {
        invalid(o, name, "'%s' is not a number of ranks above 1", v);
      }
    } else if (strcmp(it->string, "zero_quantized_weights") == 0 ||
               strcmp(it->string, "zero_quantized_gradients") == 0 ||
               strcmp(it->string, "zero_quantized_nontrainable_weights") == 0) {
      if (truthy(plan_text_of(it, b, sizeof b)))
        leave(o, name,
              "int8 communication (ZeRO++): the collectives here carry the compute and reduce "
              "dtypes (mp_policy)");
    } else if (strcmp(it->string, "stage3_param_persistence_threshold") == 0) {
      leave(o, name,
            "parameters below it kept whole there: here every parameter of a unit is sharded "
            "(units choose what is gathered together)");
    } else if (strcmp(it->string, "stage3_gather_16bit_weights_on_model_save") == 0 ||
               strcmp(it->string, "gather_16bit_weights_on_model_save") == 0) {
      leave(o, name,
            "a save format: checkpoints here are sharded; fsdp-ckpt export-hf --dtype bf16 "
            "writes whole 16-bit weights");
    } else {
      leave(o, name, "a bucket or overlap knob: communication here is one collective per unit");
    }
  }
}

/* The top-level offload devices, the tensor-parallel size and the batch and clipping numbers. */
static void ds_sizes(out_t *o, const cJSON *c, const char *prefix) {
  char b[64], name[96];
  char pb[64];
  const char *pdev =
      plan_text_of(cJSON_GetObjectItemCaseSensitive(c, "offload_param_device"), pb, sizeof pb);
  bool param_cpu = pdev && strcmp(pdev, "cpu") == 0;
  for (int k = 0; k < 2; k++) {
    const char *key = k ? "offload_param_device" : "offload_optimizer_device";
    const char *dev = plan_text_of(cJSON_GetObjectItemCaseSensitive(c, key), b, sizeof b);
    snprintf(name, sizeof name, "%s%s", prefix, key);
    if (dev && strcmp(dev, "cpu") == 0)
      host_offload(o, name, " cpu", k == 1 || param_cpu);
    else if (dev && strcmp(dev, "none") != 0)
      leave(o, name, "device '%s': only the host (cpu) is an offload target", dev);
  }
  const cJSON *tpc = cJSON_GetObjectItemCaseSensitive(c, "tensor_parallel");
  const char *tps = plan_text_of(cJSON_GetObjectItemCaseSensitive(tpc, "autotp_size"), b, sizeof b);
  long tp = 0;
  snprintf(name, sizeof name, "%stensor_parallel.autotp_size", prefix);
  if (tps && !whole_ranks(tps, &tp))
    invalid(o, name, "'%s' is not a whole number of ranks", tps);
  else if (tps)
    put(o, "mesh", "tp", tps,
        "%s: the built-in Llama's tensor-parallel plan over %s ranks (the data-parallel sizes "
        "take the rest)",
        name, tps);
  snprintf(name, sizeof name, "%strain_micro_batch_size_per_gpu", prefix);
  number(o, c, "train_micro_batch_size_per_gpu", name, "data", "batch_size", NUM_COUNT);
  snprintf(name, sizeof name, "%sgradient_accumulation_steps", prefix);
  number(o, c, "gradient_accumulation_steps", name, "data", "grad_accum", NUM_COUNT);
  snprintf(name, sizeof name, "%sgradient_clipping", prefix);
  /* Accelerate's own section: the training script clips; a DeepSpeed file it names is
   * DeepSpeed's, which does not clip without the key */
  if (*prefix && !cJSON_GetObjectItemCaseSensitive(c, "deepspeed_config_file"))
    number(o, c, "gradient_clipping", name, "optim", "clip_grad_norm", NUM_NONNEG);
  else
    number_or(o, c, "gradient_clipping", name, "optim", "clip_grad_norm", NUM_NONNEG, "0",
              "DeepSpeed does not clip");
  snprintf(name, sizeof name, "%strain_batch_size", prefix);
  number(o, c, "train_batch_size", name, "data", "global_batch_size", NUM_COUNT);
  const cJSON *tb = cJSON_GetObjectItemCaseSensitive(c, "train_batch_size");
  const cJSON *mb = cJSON_GetObjectItemCaseSensitive(c, "train_micro_batch_size_per_gpu");
  const cJSON *ga = cJSON_GetObjectItemCaseSensitive(c, "gradient_accumulation_steps");
  double per = cJSON_IsNumber(mb) ? mb->valuedouble * (cJSON_IsNumber(ga) ? ga->valuedouble : 1)
                                  : 0; /* one data-parallel rank's samples a step */
  if (cJSON_IsNumber(tb) && per >= 1 && tb->valuedouble >= 1 && fmod(tb->valuedouble, per) != 0)
    invalid(o, name,
            "%g is not a whole number of data-parallel ranks' %g samples (micro-batch x "
            "gradient_accumulation_steps): DeepSpeed refuses it",
            tb->valuedouble, per);
  if (cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(c, "train_batch_size")) &&
      !cJSON_GetObjectItemCaseSensitive(c, "train_micro_batch_size_per_gpu"))
    leave(o, name,
          "without train_micro_batch_size_per_gpu, DeepSpeed derives the micro-batch from the "
          "world size (train_batch_size / (ranks x gradient_accumulation_steps)); give "
          "data.batch_size so: data.global_batch_size then gives data.grad_accum");
}

/* bf16 (or its older name bfloat16) and fp16: {"enabled": true | false | "auto"}; both
 * enabled is refused, as DeepSpeed refuses it. */
static fsdpc_status_t ds_precision(out_t *o, const cJSON *c, const char *prefix) {
  char b[64], name[96];
  bool on[2] = {false, false};
  for (int k = 0; k < 3; k++) { /* bf16, bfloat16, fp16 */
    const char *which = k == 2 ? "fp16" : k ? "bfloat16" : "bf16";
    const cJSON *section = cJSON_GetObjectItemCaseSensitive(c, which);
    if (section == NULL) continue;
    const char *v = plan_text_of(cJSON_GetObjectItemCaseSensitive(section, "enabled"), b, sizeof b);
    snprintf(name, sizeof name, "%s%s.enabled", prefix, which);
    if (is_auto(v) && *prefix && cJSON_GetObjectItemCaseSensitive(c, "deepspeed_config_file"))
      leave(o, name,
            "'auto': Accelerate fills it from accelerate launch --mixed_precision (the config "
            "cannot set mixed_precision beside the file); give "
            "parallelize.fully_shard.mp_policy.param_dtype: %s here if the run uses %s",
            k == 2 ? "f16" : "bf16", k == 2 ? "fp16" : "bf16");
    else if (is_auto(v) && *prefix) /* Accelerate fills it from its mixed_precision */
      leave(o, name, "'auto': follows mixed_precision, translated above");
    else if (is_auto(v))
      leave(o, name,
            "'auto': the Hugging Face Trainer fills it from its --%s flag; give "
            "parallelize.fully_shard.mp_policy.param_dtype: %s here if the run uses %s",
            k == 2 ? "fp16" : "bf16", k == 2 ? "f16" : "bf16", k == 2 ? "fp16" : "bf16");
    else if (truthy(v) && !on[k == 2])
      precision(o, k == 2 ? "fp16" : "bf16", name);
    on[k == 2] = on[k == 2] || truthy(v);
    for (const cJSON *it = cJSON_IsObject(section) ? section->child : NULL; it; it = it->next) {
      if (strcmp(it->string, "enabled") == 0) continue; /* fp16's loss scaler's knobs, ... */
      snprintf(name, sizeof name, "%s%s.%s", prefix, which, it->string);
      leave(o, name, "no equivalent here (no loss scaler: bf16 needs none)");
    }
  }
  if (on[0] && on[1])
    return err_set(STATUS_EINVAL,
                   "%sbf16 and %sfp16 are both enabled: DeepSpeed refuses that; enable one", prefix,
                   prefix);
  return STATUS_OK;
}

/* The optimizer (AdamW or Adam) and the scheduler (WarmupLR, WarmupCosineLR), with DeepSpeed's
 * defaults for what they leave out (a DeepSpeed file: prefix ""; Accelerate's section takes the
 * training script's). */
static void ds_optim_schedule(out_t *o, const cJSON *c, const char *prefix) {
  char b[64];
  const cJSON *opt = cJSON_GetObjectItemCaseSensitive(c, "optimizer");
  if (opt) {
    const char *type = plan_text_of(cJSON_GetObjectItemCaseSensitive(opt, "type"), b, sizeof b);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(opt, "params");
    if (type && strcasecmp(type, "AdamW") != 0 && strcasecmp(type, "Adam") != 0) {
      leave(o, "optimizer.type", "'%s': the optimizer here is AdamW", type);
    } else {
      /* DeepSpeed's Adam and AdamW: its fused Adam in AdamW mode, lr 1e-3, betas (0.9, 0.999),
       * eps 1e-8, weight_decay 0 */
      number_or(o, p, "lr", "optimizer.params.lr", "optim", "lr", NUM_NONNEG, "0.001",
                "DeepSpeed's 1e-3");
      number(o, p, "eps", "optimizer.params.eps", "optim", "eps", NUM_POS);
      number_or(o, p, "weight_decay", "optimizer.params.weight_decay", "optim", "weight_decay",
                NUM_NONNEG, "0", "DeepSpeed's 0");
      const cJSON *betas = cJSON_GetObjectItemCaseSensitive(p, "betas");
      if (cJSON_GetArraySize(betas) == 2) {
        cJSON *b1 = cJSON_GetArrayItem(betas, 0), *b2 = cJSON_GetArrayItem(betas, 1);
        char v[64];
        if (cJSON_IsNumber(b1) && cJSON_IsNumber(b2) &&
            !(b1->valuedouble >= 0 && b1->valuedouble < 1 && b2->valuedouble >= 0 &&
              b2->valuedouble < 1)) {
          invalid(o, "optimizer.params.betas", "[%g, %g]: each must lie in [0, 1)", b1->valuedouble,
                  b2->valuedouble);
        } else if (cJSON_IsNumber(b1) && cJSON_IsNumber(b2)) {
          snprintf(v, sizeof v, "%.15g", b1->valuedouble);
          put(o, "optim", "beta1", v, "optimizer.params.betas[0]");
          snprintf(v, sizeof v, "%.15g", b2->valuedouble);
          put(o, "optim", "beta2", v, "optimizer.params.betas[1]");
        } else {
          leave(o, "optimizer.params.betas", "not two numbers ('auto'?): give optim.beta1/beta2");
        }
      } else if (cJSON_IsString(betas) && is_auto(betas->valuestring)) {
        leave(o, "optimizer.params.betas",
              "'auto': taken from the training script there; give optim.beta1 and optim.beta2 "
              "here");
      } else if (betas != NULL) {
        invalid(o, "optimizer.params.betas", "not a pair of numbers");
      } else {
        put(o, "optim", "beta1", "0.9",
            "optimizer.params.betas not given: DeepSpeed's (0.9, 0.999)");
        put(o, "optim", "beta2", "0.999",
            "optimizer.params.betas not given: DeepSpeed's (0.9, 0.999)");
      }
      const char *mode =
          plan_text_of(cJSON_GetObjectItemCaseSensitive(p, "adam_w_mode"), b, sizeof b);
      if (mode && !truthy(mode))
        leave(o, "optimizer.params.adam_w_mode",
              "false: Adam with L2 regularisation there; the optimizer here is AdamW "
              "(decoupled weight decay)");
      if (cJSON_GetObjectItemCaseSensitive(p, "torch_adam"))
        leave(o, "optimizer.params.torch_adam", "an implementation choice: AdamW here is fused");
      static const char *const read[] = {
          "lr", "eps", "weight_decay", "betas", "adam_w_mode", "torch_adam", NULL};
      for (const cJSON *it = cJSON_IsObject(p) ? p->child : NULL; it; it = it->next) {
        bool known = false;
        for (int k = 0; read[k] && !known; k++) known = strcmp(it->string, read[k]) == 0;
        char name[160];
        snprintf(name, sizeof name, "optimizer.params.%s", it->string);
        if (!known)
          leave(o, name, "no equivalent here: AdamW here takes lr, betas, eps and weight_decay");
      }
    }
  } else if (!*prefix) {
    leave(o, "optimizer",
          "not in the config: the training script's; this plan's optim section applies");
  }
  const cJSON *sch = cJSON_GetObjectItemCaseSensitive(c, "scheduler");
  if (sch) {
    const char *type = plan_text_of(cJSON_GetObjectItemCaseSensitive(sch, "type"), b, sizeof b);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(sch, "params");
    bool known = type && (strcmp(type, "WarmupCosineLR") == 0 || strcmp(type, "WarmupLR") == 0);
    if (known) /* both warm up over 1000 steps by default, log-shaped */
      number_or(o, p, "warmup_num_steps", "scheduler.params.warmup_num_steps", "schedule",
                "warmup_steps", NUM_STEPS, "1000", "DeepSpeed's 1000");
    const char *wt = plan_text_of(cJSON_GetObjectItemCaseSensitive(p, "warmup_type"), b, sizeof b);
    if (known && (wt == NULL || strcmp(wt, "linear") != 0))
      leave(o, "scheduler.params.warmup_type",
            "'%s': the warmup here is linear (DeepSpeed's default is log)", wt ? wt : "log");
    if (type && strcmp(type, "WarmupCosineLR") == 0) {
      number(o, p, "total_num_steps", "scheduler.params.total_num_steps", "train", "steps",
             NUM_COUNT);
      if (cJSON_GetObjectItemCaseSensitive(p, "total_num_steps") == NULL)
        leave(o, "scheduler.params.total_num_steps",
              "not given (DeepSpeed requires it for WarmupCosineLR): give train.steps, the "
              "steps the cosine decays over");
      number_or(o, p, "cos_min_ratio", "scheduler.params.cos_min_ratio", "schedule", "min_lr_ratio",
                NUM_RATIO, "0.0001", "DeepSpeed's 1e-4");
      if (cJSON_GetObjectItemCaseSensitive(p, "warmup_min_ratio"))
        leave(o, "scheduler.params.warmup_min_ratio",
              "the warmup here starts from lr / warmup_steps");
    } else if (type && strcmp(type, "WarmupLR") == 0) {
      put(o, "schedule", "min_lr_ratio", "1.0",
          "scheduler.type WarmupLR: the rate stays at its peak after the warmup (no decay)");
      /* the rate rises to warmup_max_lr, whatever the optimizer's lr */
      unput(o, "optim", "lr");
      number_or(o, p, "warmup_max_lr", "scheduler.params.warmup_max_lr", "optim", "lr", NUM_NONNEG,
                "0.001", "DeepSpeed's 1e-3, the peak WarmupLR rises to");
      if (cJSON_GetObjectItemCaseSensitive(p, "warmup_min_lr"))
        leave(o, "scheduler.params.warmup_min_lr", "the warmup here starts from lr / warmup_steps");
    } else {
      leave(o, "scheduler.type", "'%s': the schedule here is linear warmup then cosine decay",
            type ? type : "?");
    }
    static const char *const sread[] = {
        "warmup_num_steps", "warmup_type",   "total_num_steps", "cos_min_ratio",
        "warmup_min_ratio", "warmup_max_lr", "warmup_min_lr",   NULL};
    for (const cJSON *it = known && cJSON_IsObject(p) ? p->child : NULL; it; it = it->next) {
      bool read = false;
      for (int k = 0; sread[k] && !read; k++) read = strcmp(it->string, sread[k]) == 0;
      char name[160];
      snprintf(name, sizeof name, "scheduler.params.%s", it->string);
      if (!read) leave(o, name, "no equivalent here (the schedule: linear warmup, cosine decay)");
    }
  } else if (!*prefix) {
    leave(o, "scheduler",
          "not in the config: the training script's (DeepSpeed alone keeps the rate constant); "
          "this plan's schedule applies (schedule.warmup_steps, schedule.min_lr_ratio)");
  }
}

/* What the translation leaves out, named. */
static void ds_leftovers(out_t *o, const cJSON *c, const char *prefix) {
  char b[64], name[96];
  static const char *const done[] = {"zero_optimization",
                                     "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps",
                                     "gradient_clipping",
                                     "bf16",
                                     "bfloat16",
                                     "fp16",
                                     "optimizer",
                                     "scheduler",
                                     "train_batch_size",
                                     "zero_stage",
                                     "offload_optimizer_device",
                                     "offload_param_device",
                                     "zero3_init_flag",
                                     "tensor_parallel",
                                     "deepspeed_config_file",
                                     NULL};
  for (const cJSON *it = c->child; it; it = it->next) {
    bool known = false;
    for (int k = 0; done[k] && !known; k++) known = strcmp(it->string, done[k]) == 0;
    if (strcmp(it->string, "zero3_init_flag") == 0 && truthy(plan_text_of(it, b, sizeof b)))
      leave(o, "zero3_init_flag", "already the default: model.deferred_init builds shards only");
    if (strcmp(it->string, "zero3_save_16bit_model") == 0) {
      snprintf(name, sizeof name, "%szero3_save_16bit_model", prefix);
      leave(o, name,
            "a save format: checkpoints here are sharded; fsdp-ckpt export-hf --dtype bf16 "
            "writes whole 16-bit weights");
      continue;
    }
    if (!known && *prefix == '\0')
      leave(o, it->string, "no equivalent here (logging, tuning or an engine feature)");
    else if (!known)
      leave(o, it->string, "no equivalent in a plan");
  }
}

static fsdpc_status_t deepspeed(out_t *o, const cJSON *c, const char *prefix) {
  ds_zero(o, c, prefix);
  ds_sizes(o, c, prefix);
  FSDPC_TRY(ds_precision(o, c, prefix));
  ds_optim_schedule(o, c, prefix);
  ds_leftovers(o, c, prefix);
  return STATUS_OK;
}

/* ---- Accelerate ---- */

static const char *strategy_name(const char *v) {
  static const char *const by_number[] = {NULL,       "FULL_SHARD",   "SHARD_GRAD_OP",
                                          "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"};
  if (v == NULL) return NULL;
  if (v[0] >= '1' && v[0] <= '5' && v[1] == '\0') return by_number[v[0] - '0'];
  if (strcasecmp(v, "HYBRID_SHARD_ZERO2") == 0) return "_HYBRID_SHARD_ZERO2";
  static const char *const names[] = {"FULL_SHARD",   "SHARD_GRAD_OP",       "NO_SHARD",
                                      "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", NULL};
  for (int i = 0; names[i]; i++)
    if (strcasecmp(v, names[i]) == 0) return names[i]; /* Accelerate upper-cases it */
  return NULL;
}

/* The unit pattern of a decoder layer class of the built-in family (transformers' names), or
 * NULL. */
static const char *layer_pattern(const char *cls) {
  static const char *const model_layers[] = {"LlamaDecoderLayer",
                                             "Qwen2DecoderLayer",
                                             "Qwen3DecoderLayer",
                                             "Qwen3MoeDecoderLayer",
                                             "Qwen2MoeDecoderLayer",
                                             "MixtralDecoderLayer",
                                             NULL};
  for (int i = 0; model_layers[i]; i++)
    if (strcmp(cls, model_layers[i]) == 0) return "model.layers.*";
  return strcmp(cls, "GPT2Block") == 0 ? "transformer.h.*" : NULL;
}

/* fsdp_transformer_layer_cls_to_wrap: a class name, a comma-separated list of them, or a YAML
 * list. The built-in family's decoder layers become their unit patterns; any other class is
 * listed. */
static void wrap_classes(out_t *o, const cJSON *cls, const char *from) {
  char names[512] = "", b[160];
  if (cJSON_IsArray(cls)) {
    for (const cJSON *it = cls->child; it; it = it->next) {
      const char *v = plan_text_of(it, b, sizeof b);
      snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", names[0] ? "," : "",
               v && cJSON_IsString(it) ? v : "?");
    }
  } else {
    const char *v = plan_text_of(cls, b, sizeof b);
    snprintf(names, sizeof names, "%s", v && cJSON_IsString(cls) ? v : "");
  }
  const char *patterns[2] = {NULL, NULL}; /* model.layers.*, transformer.h.*: each once */
  char classes[512] = "";
  int unknown = 0;
  for (char *save = NULL, *name = strtok_r(names, ", ", &save); name;
       name = strtok_r(NULL, ", ", &save)) {
    const char *pat = layer_pattern(name);
    if (pat == NULL) {
      unknown++;
      leave(o, "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
            "'%s': units are FQN patterns here; the built-in models' layers are "
            "\"model.layers.*\" (Llama, Qwen, Mixtral) and \"transformer.h.*\" (GPT-2)",
            name);
      continue;
    }
    patterns[strcmp(pat, "model.layers.*") == 0 ? 0 : 1] = pat;
    snprintf(classes + strlen(classes), sizeof classes - strlen(classes), "%s%s",
             classes[0] ? ", " : "", name);
  }
  char units[64];
  if (patterns[0] && patterns[1])
    snprintf(units, sizeof units, "[\"%s\", \"%s\"]", patterns[0], patterns[1]);
  else if (patterns[0] || patterns[1])
    snprintf(units, sizeof units, "[\"%s\"]", patterns[0] ? patterns[0] : patterns[1]);
  if (patterns[0] || patterns[1])
    put(o, "parallelize.fully_shard", "units", units, "%s with %s: one unit per decoder layer%s",
        from, classes,
        patterns[0] && patterns[1] ? " (one pattern per model: keep your model's)" : "");
  else if (unknown > 0)
    leave(o, from,
          "no class named is a built-in model's layer: the plan has no units, so the whole "
          "model would be gathered at once; set parallelize.fully_shard.units");
  else if (!cJSON_IsArray(cls) && names[0] == 0)
    put(o, "parallelize.fully_shard", "units", "[\"model.layers.*\"]",
        "%s without fsdp_transformer_layer_cls_to_wrap: Accelerate wraps the model's "
        "_no_split_modules, its decoder layers (GPT-2's: \"transformer.h.*\")",
        from);
}

/* fsdp_auto_wrap_policy v (with the settings it reads) as fully_shard units. */
static void wrap_policy(out_t *o, const cJSON *f, const char *v, const char *from) {
  char b[160];
  if (v && strcmp(v, "TRANSFORMER_BASED_WRAP") == 0) {
    wrap_classes(o, cJSON_GetObjectItemCaseSensitive(f, "fsdp_transformer_layer_cls_to_wrap"),
                 from);
  } else if (v && strcmp(v, "NO_WRAP") == 0) {
    put(o, "parallelize.fully_shard", "units", "[]",
        "%s: the root unit only: the whole model is gathered at once, so a rank's peak "
        "holds all of it unsharded",
        from);
  } else if (v && strcmp(v, "SIZE_BASED_WRAP") == 0) {
    const char *n =
        plan_text_of(cJSON_GetObjectItemCaseSensitive(f, "fsdp_min_num_params"), b, sizeof b);
    char *end = NULL;
    double x = n ? strtod(n, &end) : 1e8; /* Accelerate's default */
    char num[32];
    if (n && (end == n || *end != '\0' || !(x >= 1) || x > 1e15)) {
      invalid(o, "fsdp_config.fsdp_min_num_params", "'%s' is not a number of parameters", n);
    } else {
      snprintf(num, sizeof num, "%.0f", x);
      put(o, "parallelize.fully_shard", "min_unit_params", num,
          "%s%s: a module becomes a unit when the parameters under it that no inner unit "
          "took number at least %s (the dry run's -v lists the units)",
          from, n ? " with fsdp_min_num_params" : " (fsdp_min_num_params' default)", num);
    }
  } else {
    leave(o, from, "'%s': units are FQN patterns (\"model.layers.*\")", v ? v : "");
  }
}

/* fsdp_sharding_strategy (FSDP1's) and fsdp_reshard_after_forward (FSDP2's, which replaces
 * it) given both: they must mean the same, as fsdp-train requires of the plan keys. */
static void strategy_and_reshard(out_t *o, const cJSON *f) {
  char sb[64], rb[64];
  const char *s = strategy_name(
      plan_text_of(cJSON_GetObjectItemCaseSensitive(f, "fsdp_sharding_strategy"), sb, sizeof sb));
  const char *r = plan_text_of(cJSON_GetObjectItemCaseSensitive(f, "fsdp_reshard_after_forward"),
                               rb, sizeof rb);
  if (s == NULL || r == NULL || strategy_name(r) != NULL || strcmp(s, "NO_SHARD") == 0) return;
  bool implied = strcmp(s, "FULL_SHARD") == 0 || strcmp(s, "HYBRID_SHARD") == 0;
  if (truthy(r) != implied)
    invalid(o, "fsdp_config.fsdp_reshard_after_forward",
            "'%s' disagrees with fsdp_config.fsdp_sharding_strategy %s (which means "
            "reshard_after_forward %s): FSDP2's fsdp_reshard_after_forward replaces "
            "fsdp_sharding_strategy; give one",
            r, s, implied ? "true" : "false");
}

static void accelerate_fsdp(out_t *o, const cJSON *f) {
  char b[160], vb[32];
  strategy_and_reshard(o, f);
  const char *ver =
      plan_text_of(cJSON_GetObjectItemCaseSensitive(f, "fsdp_version"), vb, sizeof vb);
  const cJSON *raf = cJSON_GetObjectItemCaseSensitive(f, "fsdp_reshard_after_forward");
  char rb[64];
  const char *rv = plan_text_of(raf, rb, sizeof rb);
  static const char *const bools[] = {"true", "false", "True", "False", NULL};
  bool is_bool = cJSON_IsBool(raf);
  for (int k = 0; rv && bools[k] && !is_bool; k++) is_bool = strcmp(rv, bools[k]) == 0;
  if (ver && strcmp(ver, "2") == 0 && rv && !is_bool) { /* FSDP2's: a bool */
    invalid(o, "fsdp_config.fsdp_reshard_after_forward",
            "'%s' under fsdp_version 2, which takes true or false (Accelerate refuses others; an "
            "integer group size is parallelize.fully_shard.reshard_after_forward here)",
            rv);
    return;
  }
  for (const cJSON *it = f ? f->child : NULL; it; it = it->next) {
    const char *k = it->string, *v = plan_text_of(it, b, sizeof b);
    char from[120];
    snprintf(from, sizeof from, "fsdp_config.%s", k);
    if (strcmp(k, "fsdp_sharding_strategy") == 0 ||
        (strcmp(k, "fsdp_reshard_after_forward") == 0 && strategy_name(v))) {
      const char *s = strategy_name(v);
      if (s)
        put(o, "parallelize.fully_shard", "sharding_strategy", s, "%s: %s", from, v);
      else if (v != NULL) /* (null: not set) */
        invalid(o, from, "'%s' is not a sharding strategy", v);
    } else if (strcmp(k, "fsdp_reshard_after_forward") == 0) {
      put(o, "parallelize.fully_shard", "reshard_after_forward", truthy(v) ? "true" : "false",
          "%s: %s", from, v);
    } else if (strcmp(k, "fsdp_auto_wrap_policy") == 0) {
      wrap_policy(o, f, v, from);
    } else if (strcmp(k, "fsdp_transformer_layer_cls_to_wrap") == 0 ||
               strcmp(k, "fsdp_min_num_params") == 0) {
      /* read with the wrap policy */
    } else if (strcmp(k, "fsdp_offload_params") == 0) {
      if (truthy(v))
        put(o, "parallelize.fully_shard", "offload", "true",
            "%s (CUDA: sharded parameters, gradients and optimizer on the host)", from);
    } else if (strcmp(k, "fsdp_activation_checkpointing") == 0) {
      if (truthy(v)) put(o, "train", "activation_checkpointing", "true", "%s", from);
    } else if (strcmp(k, "fsdp_cpu_ram_efficient_loading") == 0) {
      leave(o, from, "already the default: model.deferred_init builds only each rank's shards");
    } else if (strcmp(k, "fsdp_state_dict_type") == 0) {
      leave(o, from,
            "checkpoints are always sharded (PyTorch DCP layout); fsdp-ckpt export-hf "
            "writes a full copy");
    } else if (strcmp(k, "fsdp_version") == 0) {
      leave(o, from, "fully_shard here is FSDP2 (per-parameter sharding, DTensor placements)");
    } else if (strcmp(k, "fsdp_backward_prefetch") == 0 ||
               strcmp(k, "fsdp_forward_prefetch") == 0) {
      leave(o, from, "prefetching is on: the next unit is gathered while one computes");
    } else {
      leave(o, from, "no equivalent here");
    }
  }
}

static const char *const LAUNCHER_KEYS[] = {"compute_environment",
                                            "machine_rank",
                                            "main_training_function",
                                            "num_machines",
                                            "num_processes",
                                            "rdzv_backend",
                                            "same_network",
                                            "main_process_ip",
                                            "main_process_port",
                                            "gpu_ids",
                                            "use_cpu",
                                            "debug",
                                            "enable_cpu_affinity",
                                            "tpu_env",
                                            "tpu_use_cluster",
                                            "tpu_use_sudo",
                                            "downcast_bf16",
                                            NULL};

/* The settings that hold settings must be mappings: one given as a scalar or a list would
 * otherwise be read as absent. prefix names where c is ("deepspeed_config." or ""). */
static fsdpc_status_t check_sections(const cJSON *c, const char *path, const char *prefix) {
  static const char *const sections[] = {
      "fsdp_config", "deepspeed_config", "zero_optimization", "bf16",
      "fp16",        "optimizer",        "scheduler",         NULL};
  static const char *const inner[] = {"offload_optimizer", "offload_param", "params", NULL};
  for (int i = 0; sections[i]; i++) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(c, sections[i]);
    if (s == NULL || cJSON_IsNull(s)) continue;
    if (!cJSON_IsObject(s))
      return err_set(STATUS_EFORMAT, "%s: %s%s: expected a mapping of settings", path, prefix,
                     sections[i]);
    for (int k = 0; inner[k]; k++) {
      const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, inner[k]);
      if (t != NULL && !cJSON_IsNull(t) && !cJSON_IsObject(t))
        return err_set(STATUS_EFORMAT, "%s: %s%s.%s: expected a mapping of settings", path, prefix,
                       sections[i], inner[k]);
    }
    if (strcmp(sections[i], "deepspeed_config") == 0)
      FSDPC_TRY(check_sections(s, path, "deepspeed_config."));
  }
  return STATUS_OK;
}

fsdpc_status_t plan_convert(const cJSON *c, const char *path, out_t *o, char *kind, size_t n) {
  char b[160];
  FSDPC_TRY(check_sections(c, path, ""));
  const char *dt =
      plan_text_of(cJSON_GetObjectItemCaseSensitive(c, "distributed_type"), b, sizeof b);
  if (dt == NULL) {
    if (!cJSON_GetObjectItemCaseSensitive(c, "zero_optimization") &&
        !cJSON_GetObjectItemCaseSensitive(c, "train_micro_batch_size_per_gpu") &&
        !cJSON_GetObjectItemCaseSensitive(c, "train_batch_size"))
      return err_set(STATUS_EFORMAT,
                     "%s: neither an Accelerate config (no distributed_type) nor a DeepSpeed "
                     "config (no zero_optimization or batch size)",
                     path);
    snprintf(kind, n, "a DeepSpeed config");
    return deepspeed(o, c, "");
  }
  snprintf(kind, n, "an Accelerate config (distributed_type: %s)", dt);
  if (strcmp(dt, "FSDP") == 0) {
    accelerate_fsdp(o, cJSON_GetObjectItemCaseSensitive(c, "fsdp_config"));
  } else if (strcmp(dt, "DEEPSPEED") == 0) {
    FSDPC_TRY(
        deepspeed(o, cJSON_GetObjectItemCaseSensitive(c, "deepspeed_config"), "deepspeed_config."));
  } else if (strcmp(dt, "MULTI_GPU") == 0 || strcmp(dt, "MULTI_CPU") == 0 ||
             strcmp(dt, "NO") == 0) {
    put(o, "parallelize.fully_shard", "sharding_strategy", "NO_SHARD",
        "distributed_type: %s (replicated, gradients all-reduced)", dt);
  } else {
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: distributed_type '%s' has no equivalent (FSDP, "
                   "DEEPSPEED, MULTI_GPU, MULTI_CPU or NO)",
                   path, dt);
  }
  char pb[64];
  precision(o, plan_text_of(cJSON_GetObjectItemCaseSensitive(c, "mixed_precision"), pb, sizeof pb),
            "mixed_precision");
  number(o, c, "gradient_accumulation_steps", "gradient_accumulation_steps", "data", "grad_accum",
         NUM_COUNT);
  for (const cJSON *it = c->child; it; it = it->next) {
    const char *k = it->string;
    bool launcher = false;
    for (int i = 0; LAUNCHER_KEYS[i] && !launcher; i++) launcher = strcmp(k, LAUNCHER_KEYS[i]) == 0;
    if (strcmp(k, "distributed_type") == 0 || strcmp(k, "mixed_precision") == 0 ||
        strcmp(k, "fsdp_config") == 0 || strcmp(k, "deepspeed_config") == 0 ||
        strcmp(k, "gradient_accumulation_steps") == 0 || strcmp(k, "num_processes") == 0)
      continue; /* translated, or in the header (num_processes) */
    if (launcher && strcmp(k, "num_machines") == 0) {
      char nb[64];
      const char *nm = plan_text_of(it, nb, sizeof nb);
      leave(o, k,
            "'%s': a launcher setting (mpirun or srun places the ranks here); HYBRID_SHARD "
            "shards within a node: plan it from one process with --world N --ranks-per-node M",
            nm ? nm : "");
    } else if (launcher) {
      leave(o, k, "a launcher setting (mpirun or srun places the ranks here)");
    } else {
      leave(o, k, "no equivalent here");
    }
  }
  return STATUS_OK;
}
