#include "train/train.h"

#include <string.h>

#include "core/args_impl.h"
#include "nn/moe.h"
#include "nn/ops.h"
#include "train/ops_impl.h"

/* A batch whose every target is ignored (negative) has no mean loss: refused on the host,
 * where the targets are, before any work. */
static fsdpc_status_t some_target_kept(const fsdpc_tensor_t *tg) {
  const int64_t *t = tg->data;
  for (int64_t i = 0, n = tensor_numel(tg); i < n; i++)
    if (t[i] >= 0) return STATUS_OK;
  return err_set(STATUS_EINVAL, "every target of the batch is ignored: there is no loss to mean");
}

/* Forward and loss of the batch of (step, micro); with grad, backward of loss / grad_accum.
 * *loss: the loss tensor, on the model's device (with grad, plus the MoE blocks' weighted
 * load-balancing loss, when they have one; without, the cross-entropy alone). */
static fsdpc_status_t run_read(nn_module_t *root, device_t dev, const fsdpc_tensor_t *in_h,
                               const fsdpc_tensor_t *tg_h, const data_spec_t *spec, bool grad,
                               fsdpc_tensor_t *loss);

static fsdpc_status_t run_batch(nn_module_t *root, device_t dev, const fsdpc_data_t *d,
                                const data_spec_t *spec, int64_t step, int64_t micro, bool grad,
                                fsdpc_tensor_t *loss) {
  fsdpc_tensor_t in_h = {0}, tg_h = {0};
  memset(loss, 0, sizeof *loss);
  fsdpc_status_t st = data_batch(d, spec, step, micro, &in_h, &tg_h);
  if (st == STATUS_OK) st = run_read(root, dev, &in_h, &tg_h, spec, grad, loss);
  tensor_free(&in_h);
  tensor_free(&tg_h);
  return st;
}

/* run_batch on the batch read already (ids and targets on the host). */
static fsdpc_status_t run_read(nn_module_t *root, device_t dev, const fsdpc_tensor_t *in_h,
                               const fsdpc_tensor_t *tg_h, const data_spec_t *spec, bool grad,
                               fsdpc_tensor_t *loss) {
  fsdpc_tensor_t in = {0}, tg = {0};
  nn_ctx_t *ctx = NULL;
  nn_var_t *ids = NULL, *logits = NULL, *ce = NULL, *l = NULL, *scaled = NULL;
  nn_moe_aux_t *aux = nn_moe_aux_of(root);
  fsdpc_status_t st = STATUS_OK;
  memset(loss, 0, sizeof *loss);
  FSDPC_TRY_GOTO(st, some_target_kept(tg_h));        /* the device's mean would be NaN, unnoticed */
  FSDPC_TRY_GOTO(st, tensor_upload(&in, in_h, dev)); /* no host wait: read on this stream only */
  FSDPC_TRY_GOTO(st, tensor_upload(&tg, tg_h, dev));
  FSDPC_TRY_GOTO(st, nn_ctx_new(&ctx));
  nn_ctx_set_grad_enabled(ctx, grad);
  FSDPC_TRY_GOTO(st, nn_var_new(&in, false, &ids));
  nn_moe_aux_begin(aux, grad ? 1.0 / (double)spec->grad_accum : 0);
  FSDPC_TRY_GOTO(st, nn_call(ctx, root, ids, &logits));
  FSDPC_TRY_GOTO(st, train_check_logits(logits, spec->vocab_size));
  if (grad && aux) FSDPC_TRY_GOTO(st, nn_moe_aux_share(aux)); /* the whole batch's routing */
  FSDPC_TRY_GOTO(st, nn_cross_entropy_consume(ctx, logits, &tg, &ce, NULL));
  /* training adds the routers' balance, weighted; an evaluation's loss is the cross-entropy
   * alone (the balance depends on how the batch is split over ranks and micro-batches) */
  if (grad)
    FSDPC_TRY_GOTO(st, nn_moe_aux_add(ctx, aux, ce, &l));
  else
    l = nn_var_ref(ce);
  FSDPC_TRY_GOTO(st, tensor_ref(loss, &l->value));
  if (grad) {
    FSDPC_TRY_GOTO(st, nn_scale(ctx, l, 1.0 / (double)spec->grad_accum, &scaled));
    FSDPC_TRY_GOTO(st, nn_backward(ctx, scaled));
    nn_moe_aux_end(aux);
  }
cleanup:
  if (st != STATUS_OK) tensor_free(loss);
  nn_var_put(scaled);
  nn_var_put(l);
  nn_var_put(ce);
  nn_var_put(logits);
  nn_var_put(ids);
  nn_ctx_free(ctx);
  tensor_free(&in);
  tensor_free(&tg);
  return st;
}

fsdpc_status_t llama_loss_read(fsdpc_tensor_t *loss, double *value) {
  ARG_NONNULL(loss);
  ARG_NONNULL(value);
  *value = 0;
  if (tensor_numel(loss) != 1 || loss->dtype != DTYPE_F32) {
    tensor_free(loss);
    return err_set(STATUS_EINVAL, "llama_loss_read: expected one F32 element");
  }
  float v = 0;
  fsdpc_status_t st = device_memcpy(device_cpu(), &v, loss->device, loss->data, sizeof v);
  tensor_free(loss);
  *value = v;
  return st;
}

fsdpc_status_t llama_micro_step_async(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                      int64_t step, int64_t micro, fsdpc_tensor_t *loss) {
  ARG_NONNULL(m);
  ARG_NONNULL(d);
  ARG_NONNULL(spec);
  ARG_NONNULL(loss);
  return run_batch(llama_module(m), mesh_device(llama_local_mesh(m)), d, spec, step, micro, true,
                   loss);
}

fsdpc_status_t train_micro_step_async(nn_module_t *root, device_t dev, const fsdpc_data_t *d,
                                      const data_spec_t *spec, int64_t step, int64_t micro,
                                      fsdpc_tensor_t *loss) {
  ARG_NONNULL(root);
  ARG_NONNULL(d);
  ARG_NONNULL(spec);
  ARG_NONNULL(loss);
  return run_batch(root, dev, d, spec, step, micro, true, loss);
}

fsdpc_status_t llama_micro_step(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                int64_t step, int64_t micro, double *loss) {
  ARG_NONNULL(m);
  ARG_NONNULL(d);
  ARG_NONNULL(spec);
  ARG_NONNULL(loss);
  fsdpc_tensor_t t;
  FSDPC_TRY(
      run_batch(llama_module(m), mesh_device(llama_local_mesh(m)), d, spec, step, micro, true, &t));
  return llama_loss_read(&t, loss);
}

fsdpc_status_t llama_eval_batch(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                int64_t b, double *loss) {
  ARG_NONNULL(m);
  return train_eval_batch(llama_module(m), mesh_device(llama_local_mesh(m)), d, spec, b, loss);
}

fsdpc_status_t train_eval_batch(nn_module_t *root, device_t dev, const fsdpc_data_t *d,
                                const data_spec_t *spec, int64_t b, double *loss) {
  ARG_NONNULL(root);
  ARG_NONNULL(d);
  ARG_NONNULL(spec);
  ARG_NONNULL(loss);
  data_spec_t one = *spec;
  one.grad_accum = 1;
  fsdpc_tensor_t t;
  FSDPC_TRY(run_batch(root, dev, d, &one, b, 0, false, &t));
  return llama_loss_read(&t, loss);
}

fsdpc_status_t train_eval_batch_on(nn_module_t *root, device_t dev, const fsdpc_tensor_t *ids,
                                   const fsdpc_tensor_t *targets, double *loss) {
  ARG_NONNULL(root);
  ARG_NONNULL(ids);
  ARG_NONNULL(targets);
  ARG_NONNULL(loss);
  data_spec_t one = {.grad_accum = 1};
  fsdpc_tensor_t t;
  FSDPC_TRY(run_read(root, dev, ids, targets, &one, false, &t));
  return llama_loss_read(&t, loss);
}
