/*
 * A mixture of experts' routing of one token, forward and backward, shared by the CPU and CUDA
 * twins of kernel_moe_route (core/kernels.h) so that both choose the same experts: the scores in
 * f64 rounded once to f32, the choice by comparisons of f32 keys. (The devices' f64 exp may
 * differ in its last bit, rounding a score apart in rare cases; CUDA contracts the backward's
 * sums into fused multiply-adds.)
 */
#ifndef FSDPC_CORE_MOE_ROUTE_IMPL_H
#define FSDPC_CORE_MOE_ROUTE_IMPL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

/* The most experts a token takes. */
#define MOE_MAX_TOP_K 64

/* Up to this many experts, the host keeps a row's exponentials rather than computing them twice. */
#define MOE_KEEP_EXPS 512

typedef struct moe_route_args {
  int64_t E;
  int k;
  bool norm, sigmoid;
  double scale;
} moe_route_args_t;

/* A token's logits z (E) into its scores pr (the softmax, or each logit's sigmoid), its k
 * experts e (the largest scores plus bias when not NULL, from the largest, ties to the lower
 * expert: kept in order in one pass) and their weights w (scale times the score, over the
 * chosen scores' sum when norm). With NaN scores the choice is not defined, but its k experts
 * stay distinct and in [0, E). */
static inline MOE_HD void moe_route_row(const moe_route_args_t *a, const float *z,
                                        const float *bias, float *pr, int64_t *e, float *w) {
  int64_t E = a->E;
  int k = a->k;
  if (a->sigmoid) {
    for (int64_t i = 0; i < E; i++) pr[i] = (float)(1.0 / (1.0 + exp(-(double)z[i])));
  } else {
    float mx = z[0];
    for (int64_t i = 1; i < E; i++) mx = z[i] > mx ? z[i] : mx;
    double s = 0;
#ifndef __CUDA_ARCH__
    if (E <= MOE_KEEP_EXPS) { /* on the host each exp once (the same values: exp is a function) */
      double ex[MOE_KEEP_EXPS];
      for (int64_t i = 0; i < E; i++) s += ex[i] = exp((double)z[i] - mx);
      for (int64_t i = 0; i < E; i++) pr[i] = (float)(ex[i] / s);
    } else
#endif
    {
      for (int64_t i = 0; i < E; i++) s += exp((double)z[i] - mx);
      for (int64_t i = 0; i < E; i++) pr[i] = (float)(exp((double)z[i] - mx) / s);
    }
  }
  float key[MOE_MAX_TOP_K];
  int n = 0;
  for (int64_t i = 0; i < E; i++) {
    float ki = bias ? pr[i] + bias[i] : pr[i];
    if (n == k && !(ki > key[k - 1])) continue; /* an equal key keeps the lower expert */
    int at = n < k ? n++ : k - 1;
    for (; at > 0 && ki > key[at - 1]; at--) {
      key[at] = key[at - 1];
      e[at] = e[at - 1];
    }
    key[at] = ki;
    e[at] = i;
  }
  double chosen = 0;
  for (int j = 0; j < k; j++) chosen += pr[e[j]];
  for (int j = 0; j < k; j++) w[j] = (float)(a->scale * (a->norm ? pr[e[j]] / chosen : pr[e[j]]));
}

/* Its backward: the token's dz (E, written) from dw (k) through the weights w, the scores pr
 * and the experts e (in [0, E)); with g (E) not NULL, plus the gradient of a loss whose
 * derivative by the score of expert i is g[i], through the softmax. */
static inline MOE_HD void moe_route_row_backward(const moe_route_args_t *a, const float *pr,
                                                 const int64_t *e, const float *dw, const float *w,
                                                 const float *g, float *dz) {
  int64_t E = a->E;
  int k = a->k;
  double c = a->scale, sum = 0, dot = 0, dp[MOE_MAX_TOP_K], pdp = 0;
  for (int j = 0; j < k; j++) {
    sum += pr[e[j]];
    dot += (double)dw[j] * w[j];
  }
  for (int j = 0; j < k; j++) {
    dp[j] = a->norm ? c / sum * ((double)dw[j] - dot / c) : c * dw[j];
    pdp += dp[j] * pr[e[j]];
  }
  if (a->sigmoid) {
    for (int64_t i = 0; i < E; i++) dz[i] = 0;
    for (int j = 0; j < k; j++) {
      double s = pr[e[j]];
      dz[e[j]] = (float)(dp[j] * s * (1 - s));
    }
  } else {
    for (int64_t i = 0; i < E; i++) dz[i] = (float)(-pr[i] * pdp);
    for (int j = 0; j < k; j++) dz[e[j]] += (float)(pr[e[j]] * dp[j]);
  }
  if (g == NULL) return;
  double gp = 0;
  for (int64_t i = 0; i < E; i++) gp += (double)g[i] * pr[i];
  for (int64_t i = 0; i < E; i++) dz[i] += (float)(pr[i] * ((double)g[i] - gp));
}

#endif
