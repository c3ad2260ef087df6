/*
 * The optimizer: the LR schedule, AdamW against the formula computed by hand (parameter groups
 * included), gradient clipping, and clipping folded into AdamW bit for bit.
 */
#include <math.h>
#include <string.h>

#include "nn/autograd.h"
#include "nn/optim.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

START_TEST(lr_schedule_values) {
  lr_schedule_t s = {.warmup_steps = 3, .total_steps = 10, .min_ratio = 0.1};
  ck_assert_double_eq_tol(lr_schedule_factor(&s, 0), 1.0 / 3, 1e-15);
  ck_assert_double_eq_tol(lr_schedule_factor(&s, 2), 1.0, 1e-15);
  ck_assert_double_eq_tol(lr_schedule_factor(&s, 3), 1.0, 1e-15);
  ck_assert_double_eq_tol(lr_schedule_factor(&s, 10), 0.1, 1e-15);
  double mid = 0.1 + 0.9 * 0.5 * (1 + cos(M_PI * 4.0 / 7.0));
  ck_assert_double_eq_tol(lr_schedule_factor(&s, 7), mid, 1e-15);
}
END_TEST

START_TEST(adamw_matches_formula_and_groups) {
  mesh_t *mesh = test_local_mesh();
  nn_module_t *m;
  ok(nn_module_new("", NULL, NULL, &m));
  int64_t n3 = 3;
  nn_param_t *w, *nw;
  ok(nn_module_add_param(m, "weight", test_replicated(mesh, 1, &n3, 1.0), true, &w));
  ok(nn_module_add_param(m, "norm", test_replicated(mesh, 1, &n3, 1.0), true, &nw));
  ok(nn_module_finalize(m));
  nn_param_t *ps[] = {w, nw};
  adamw_config_t cfg = ADAMW_CONFIG_INIT;
  cfg.lr = 0.1;
  cfg.weight_decay = 0.5;
  cfg.groups[cfg.n_groups++] = (adamw_group_t){"*norm*", 0.01, 0.0};
  optim_t *o;
  /* a group's NaN or infinite value is refused, not read as "the default" or taken */
  adamw_config_t bad_cfg = cfg;
  bad_cfg.groups[0].lr = NAN;
  ck_assert_int_eq(optim_new(ps, 2, &bad_cfg, &o), STATUS_EINVAL);
  bad_cfg.groups[0].lr = 0.01;
  bad_cfg.groups[0].weight_decay = INFINITY;
  ck_assert_int_eq(optim_new(ps, 2, &bad_cfg, &o), STATUS_EINVAL);
  bad_cfg = cfg;
  bad_cfg.lr = INFINITY;
  ck_assert_int_eq(optim_new(ps, 2, &bad_cfg, &o), STATUS_EINVAL);
  ok(optim_new(ps, 2, &cfg, &o));
  double lr, wd;
  optim_param_hparams(o, 1, &lr, &wd);
  ck_assert(lr == 0.01 && wd == 0.0);
  for (int bad = -1; bad <= 2; bad += 3) { /* no such parameter: NaN, not another's memory */
    optim_param_hparams(o, bad == -1 ? -100000000 : bad, &lr, &wd);
    ck_assert(isnan(lr) && isnan(wd));
  }
  float gvals[3] = {0.5f, -2.0f, 0.0f};
  double p_ref[3] = {1, 1, 1}, m_ref[3] = {0}, v_ref[3] = {0};
  for (int step = 1; step <= 3; step++) {
    for (int k = 0; k < 2; k++) {
      fsdpc_tensor_t g;
      ok(tensor_init(&g, DTYPE_F32, device_cpu(), 1, &n3));
      memcpy(g.data, gvals, sizeof gvals);
      nn_param_zero_grad(ps[k]);
      ok(nn_param_accumulate_grad(ps[k], &g));
    }
    ok(optim_step(o, 0.5)); /* schedule factor */
    double a = 0.1 * 0.5;
    for (int i = 0; i < 3; i++) {
      p_ref[i] *= 1 - a * 0.5;
      m_ref[i] = 0.9 * m_ref[i] + 0.1 * gvals[i];
      v_ref[i] = 0.999 * v_ref[i] + 0.001 * gvals[i] * gvals[i];
      double mh = m_ref[i] / (1 - pow(0.9, step)), vh = v_ref[i] / (1 - pow(0.999, step));
      p_ref[i] -= a * mh / (sqrt(vh) + 1e-8);
    }
  }
  const float *pv = dtensor_local(w->value)->data;
  for (int i = 0; i < 3; i++) ck_assert_double_eq_tol(pv[i], p_ref[i], 2e-6);
  ck_assert_int_eq(optim_steps(o), 3);
  /* clipping: grads (0.5, -2, 0) twice -> norm sqrt(2 * 4.25) */
  double norm;
  ok(clip_grad_norm(ps, 2, 1.0, NULL, &norm));
  ck_assert_double_eq_tol(norm, sqrt(8.5), 1e-6);
  double after;
  ok(clip_grad_norm(ps, 2, 100.0, NULL, &after));
  ck_assert_double_eq_tol(after, 1.0, 1e-5);
  /* a NULL list or parameter is refused by name, not dereferenced */
  float coef;
  ck_assert(clip_grad_norm(NULL, 1, 1.0, NULL, &norm) == STATUS_EINVAL &&
            strstr(err_detail(), "1 parameters given without their list"));
  ck_assert(clip_grad_norm((nn_param_t *[]){ps[0], NULL}, 2, 1.0, NULL, &norm) == STATUS_EINVAL &&
            strstr(err_detail(), "parameter 1 is NULL"));
  ck_assert(clip_grad_coef(NULL, 1, 1.0, NULL, &norm, &coef) == STATUS_EINVAL);
  optim_free(o);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* Clipping folded into AdamW (clip_grad_coef + optim_step_scaled) gives the parameters and
 * moments of clip_grad_norm + optim_step bit for bit, for an F32 and a BF16 parameter, with
 * and without clipping taking effect. */
static dtensor_t *filled(mesh_t *mesh, dtype_t dt, int64_t n, uint32_t seed) {
  fsdpc_tensor_t t;
  ok(tensor_init(&t, dt, device_cpu(), 1, &n));
  for (int64_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    dtype_store(dt, t.data, (size_t)i, ((double)(seed >> 8) / 16777216.0 - 0.5) * 3);
  }
  dtensor_t *d;
  placement_t rep = placement_replicate();
  ok(dtensor_from_local(&t, mesh, &rep, 1, &n, &d));
  tensor_free(&t);
  return d;
}

START_TEST(clipping_folded_into_adamw_is_bit_identical) {
  mesh_t *mesh = test_local_mesh();
  const dtype_t dts[2] = {DTYPE_F32, DTYPE_BF16};
  const int64_t n = 1001;
  nn_module_t *m[2];
  nn_param_t *ps[2][2];
  optim_t *o[2];
  adamw_config_t cfg = ADAMW_CONFIG_INIT;
  cfg.lr = 0.01;
  cfg.weight_decay = 0.1;
  for (int run = 0; run < 2; run++) {
    ok(nn_module_new("", NULL, NULL, &m[run]));
    for (int k = 0; k < 2; k++)
      ok(nn_module_add_param(m[run], k ? "b" : "a", filled(mesh, dts[k], n, 7u + (unsigned)k), true,
                             &ps[run][k]));
    ok(nn_module_finalize(m[run]));
    ok(optim_new(ps[run], 2, &cfg, &o[run]));
  }
  const double max_norm[3] = {5.0, 1e9, 0.25}; /* clipped, not clipped, clipped hard */
  for (int step = 0; step < 3; step++) {
    for (int run = 0; run < 2; run++)
      for (int k = 0; k < 2; k++) {
        dtensor_t *g = filled(mesh, dts[k], n, 100u * (unsigned)step + (unsigned)k);
        fsdpc_tensor_t copy;
        ok(tensor_clone(&copy, dtensor_local(g), dts[k], device_cpu()));
        nn_param_zero_grad(ps[run][k]);
        ok(nn_param_accumulate_grad(ps[run][k], &copy)); /* released by it */
        dtensor_free(g);
      }
    double na, nb;
    float coef;
    ok(clip_grad_norm(ps[0], 2, max_norm[step], NULL, &na));
    ok(optim_step(o[0], 0.5));
    ok(clip_grad_coef(ps[1], 2, max_norm[step], NULL, &nb, &coef));
    ck_assert(na == nb && (step == 1 ? coef == 1.0f : coef < 1.0f));
    ok(optim_step_scaled(o[1], 0.5, coef));
  }
  for (int k = 0; k < 2; k++) {
    const fsdpc_tensor_t *a = dtensor_local(ps[0][k]->value), *b = dtensor_local(ps[1][k]->value);
    ck_assert_msg(memcmp(a->data, b->data, tensor_nbytes(a)) == 0, "parameter %d differs", k);
    dtensor_t *ma, *va, *mb, *vb;
    ok(optim_state(o[0], k, &ma, &va));
    ok(optim_state(o[1], k, &mb, &vb));
    ck_assert(memcmp(dtensor_local(ma)->data, dtensor_local(mb)->data, 4 * n) == 0);
    ck_assert(memcmp(dtensor_local(va)->data, dtensor_local(vb)->data, 4 * n) == 0);
    dtensor_free(ma);
    dtensor_free(va);
    dtensor_free(mb);
    dtensor_free(vb);
  }
  ck_assert_int_eq(optim_step_scaled(o[1], 0.5, 0.0f), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "gradient scale 0 is not a positive number") != NULL);
  for (int run = 0; run < 2; run++) {
    optim_free(o[run]);
    nn_module_free(m[run]);
  }
  mesh_free(mesh);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("optim");
  TCase *tc = tcase_create("optim");
  tcase_add_test(tc, lr_schedule_values);
  tcase_add_test(tc, adamw_matches_formula_and_groups);
  tcase_add_test(tc, clipping_folded_into_adamw_is_bit_identical);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
