/* The trainer's checkpoints during a run (save_impl.h). */
#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "mesh/world.h"
#include "train/save_impl.h"

fsdpc_status_t train_saver_init(train_saver_t *sv, const run_t *r) {
  memset(sv, 0, sizeof *sv);
  sv->replaced = !r->plan.ckpt_overwrite;
  sv->saved_step = -1;
  return r->plan.ckpt_async ? ckpt_async_new(&sv->async) : STATUS_OK;
}

static void put_back(train_saver_t *sv, const char *dir);

void train_saver_free(train_saver_t *sv) {
  char dir[PLAN_PATH_MAX + 32];
  snprintf(dir, sizeof dir, "%s", ckpt_async_dir(sv->async));
  /* an uncommitted save stays as step-N.tmp, which the next start removes; the folder
   * checkpoint.overwrite moved aside for it comes back */
  ckpt_async_free(sv->async);
  sv->async = NULL;
  if (world_rank() == 0 && dir[0]) put_back(sv, dir);
}

/* Before the first save under checkpoint.overwrite: the folder of its step, if any, moved aside
 * (rank 0) until the new one commits. Collective. */
static fsdpc_status_t move_aside(train_saver_t *sv, const char *dir) {
  struct stat sb;
  fsdpc_status_t st = STATUS_OK;
  sv->aside[0] = 0;
  if (!sv->replaced && world_rank() == 0 && lstat(dir, &sb) == 0) {
    snprintf(sv->aside, sizeof sv->aside, "%s.replaced-%ld", dir, (long)getpid());
    if (rename(dir, sv->aside) != 0) {
      st = err_set(STATUS_EIO, "checkpoint.overwrite: cannot move %s aside: %s", dir,
                   strerror(errno));
      sv->aside[0] = 0;
    }
  }
  return pg_agree(world_pg(), st);
}

/* A save of dir failed: the folder moved aside for it comes back. */
static void put_back(train_saver_t *sv, const char *dir) {
  if (sv->aside[0] && rename(sv->aside, dir) != 0)
    fprintf(stderr, "%s: checkpoint.overwrite: cannot put %s back as %s: %s\n", train_prog(),
            sv->aside, dir, strerror(errno));
  sv->aside[0] = 0;
}

/* After a save of step committed (rank 0): checkpoint.overwrite's newer folders removed (the
 * first time), pruning to checkpoint.keep, and the line saying so. */
static void committed(train_saver_t *sv, const run_t *r, int64_t step) {
  const fsdpc_plan_t *p = &r->plan;
  char dir[PLAN_PATH_MAX + 32];
  ckpt_step_dir(p->ckpt_dir, step, dir, sizeof dir);
  sv->last_s = device_clock_seconds() - sv->started;
  sv->saved_step = step;
  if (world_rank() != 0) {
    sv->replaced = true;
    return;
  }
  if (!sv->replaced) {
    int removed = 0;
    bool aside = sv->aside[0] != 0;
    if (aside) file_remove_tree(sv->aside);
    if (ckpt_remove_newer(p->ckpt_dir, r->start_step, step, &removed) != STATUS_OK ||
        ckpt_rollback_end(p->ckpt_dir) != STATUS_OK) /* the journal goes last */
      fprintf(stderr, "%s: checkpoint.overwrite: %s\n", train_prog(), err_detail());
    if (removed > 0 || aside)
      fprintf(stderr,
              "%s: checkpoint.overwrite: replaced the step folders after step %lld (%d "
              "removed%s)\n",
              train_prog(), (long long)r->start_step, removed + aside,
              aside ? ", one of them by this save" : "");
  }
  sv->replaced = true;
  sv->aside[0] = 0;
  printf("saved %s%s\n", dir, sv->async ? " (written in the background)" : "");
  if (ckpt_prune(p->ckpt_dir, (int)p->ckpt_keep) != STATUS_OK) { /* the run goes on */
    fprintf(stderr, "%s: warning: checkpoint.keep: %s\n", train_prog(), err_detail());
    err_clear();
  }
  fflush(stdout);
}

fsdpc_status_t train_save_finish(train_saver_t *sv, const run_t *r) {
  if (!ckpt_async_pending(sv->async)) return STATUS_OK;
  double t0 = device_clock_seconds();
  char dir[PLAN_PATH_MAX + 32];
  snprintf(dir, sizeof dir, "%s", ckpt_async_dir(sv->async));
  int64_t step = 0;
  fsdpc_status_t st = ckpt_async_commit(sv->async, world_pg(), &step);
  if (st == STATUS_OK)
    committed(sv, r, step);
  else if (world_rank() == 0)
    put_back(sv, dir);
  sv->stall_s += device_clock_seconds() - t0;
  return st;
}

fsdpc_status_t train_save(train_saver_t *sv, const run_t *r, int64_t step, const char *under,
                          bool wait) {
  const fsdpc_plan_t *p = &r->plan;
  FSDPC_TRY(train_save_finish(sv, r)); /* the previous save first */
  double t0 = device_clock_seconds();
  char dir[PLAN_PATH_MAX + 32];
  ckpt_step_dir(p->ckpt_dir, step, dir, sizeof dir);
  fsdpc_status_t st = move_aside(sv, dir);
  if (st != STATUS_OK) return st;
  sv->started = t0;
  if (sv->async)
    st = ckpt_async_start(sv->async, dir, r->save_ps, r->save_n, r->opt, step, under, world_pg());
  else
    st = ckpt_save_training(dir, r->save_ps, r->save_n, r->opt, step, under, world_pg());
  sv->stall_s += device_clock_seconds() - t0;
  if (st != STATUS_OK) {
    if (world_rank() == 0) put_back(sv, dir);
    return st;
  }
  if (!sv->async) {
    committed(sv, r, step);
    return STATUS_OK;
  }
  return wait ? train_save_finish(sv, r) : STATUS_OK;
}

void train_save_wait_staged(train_saver_t *sv) {
  if (!ckpt_async_pending(sv->async)) return; /* no save to wait for: no stall to count */
  double t0 = device_clock_seconds();
  ckpt_async_wait_staged(sv->async);
  sv->stall_s += device_clock_seconds() - t0;
}

void train_save_values(const train_saver_t *sv, double *out) {
  out[0] = ckpt_async_written(sv->async) ? 1 : 0;
  out[1] = ckpt_async_failed(sv->async) ? 1 : 0;
}

fsdpc_status_t train_save_poll(train_saver_t *sv, const run_t *r, const double *sums) {
  if (!ckpt_async_pending(sv->async)) return STATUS_OK;
  if (sums[0] < world_size() && sums[1] == 0) return STATUS_OK; /* still writing */
  return train_save_finish(sv, r);
}

fsdpc_status_t train_mark_eval_pending(const char *dir) {
  char *text = NULL, *sealed = NULL, path[PLAN_PATH_MAX + 64];
  FSDPC_TRY(ckpt_state_text(dir, &text));
  cJSON *o = text ? cJSON_Parse(text) : NULL;
  free(text);
  text = NULL;
  cJSON *under = cJSON_GetObjectItemCaseSensitive(o, "saved_under");
  fsdpc_status_t st = cJSON_IsObject(under)
                          ? STATUS_OK
                          : err_set(STATUS_EFORMAT, "%s: no saved_under to update", dir);
  if (st == STATUS_OK) {
    cJSON_DeleteItemFromObjectCaseSensitive(under, "eval_pending");
    cJSON_AddBoolToObject(under, "eval_pending", true);
    if ((text = cJSON_PrintUnformatted(o)) == NULL)
      st = err_set(STATUS_ENOMEM, "out of host memory");
  }
  if (st == STATUS_OK) st = ckpt_state_reseal(text, &sealed); /* the same save's ids */
  if (st == STATUS_OK) st = file_join(path, sizeof path, dir, "train_state.json");
  if (st == STATUS_OK) st = file_replace_text(path, sealed); /* whole or not at all */
  free(sealed);
  free(text);
  cJSON_Delete(o);
  return st;
}
