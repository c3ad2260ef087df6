/*
 * cuDNN's fused flash attention for the CUDA backend (private to backends/cuda/): causal,
 * grouped-query, bf16 and f16, head dims that are multiples of 8 up to 256, on the layouts of
 * core/attention_gemm_impl.h (q and out [B, T, H, Dh], k and v [B, T, Hkv, Dh], lse [B, H, T] F32,
 * the log-sum-exp of the scaled scores, the same quantity the batched-GEMM plan writes, so either
 * path's backward takes either path's forward).
 *
 * libcudnn.so.9 is loaded on the first call. The graphs are the ones cuDNN's fused attention
 * engines take (backends/cuda/cudnn_sdpa.c draws them); an execution plan is built once per device,
 * shape, dtype and direction and kept, and so is a refusal (also one at launch: a plan cuDNN
 * built but will not enqueue is dropped). A call that cuDNN cannot run returns STATUS_OK with
 * *ran false, and the caller runs the batched-GEMM plan; the reason is kept for
 * kernel_attention_fused_note(). FSDPC_CUDNN_ATTENTION=0 in the environment, or
 * kernel_attention_set_fused(false), turns the fused path off.
 *
 * Determinism: the forward gives the same bits on every run (activation-checkpointing
 * recomputation included); the backward adds dQ's shares with atomics, so its dQ may differ in
 * the last bits between runs. The batched-GEMM plan is deterministic.
 */
#ifndef FSDPC_BASE_CUDNN_SDPA_H
#define FSDPC_BASE_CUDNN_SDPA_H

#include <stdbool.h>

#include "core/attention_gemm_impl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* stream is the cudaStream_t every operand is ordered on; dev is the current device. */
fsdpc_status_t cudnn_sdpa_forward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                  void *out, float *lse, const void *q, const void *k,
                                  const void *v, bool *ran);

fsdpc_status_t cudnn_sdpa_backward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                   void *dq, void *dk, void *dv, const void *dout, const void *q,
                                   const void *k, const void *v, const void *out, const float *lse,
                                   bool *ran);

/* Draws the forward or backward graph of s and has cuDNN finalize it and its heuristics
 * descriptor without a device (no handle, no plan): STATUS_OK when cuDNN takes every
 * descriptor; STATUS_ENODEV when libcudnn.so.9 cannot be used; otherwise STATUS_EUNSUPPORTED
 * naming the step and cuDNN's message. For tests on machines without a GPU. */
fsdpc_status_t cudnn_sdpa_check_graph(const attn_shape_t *s, dtype_t dt, bool backward);

#ifdef __cplusplus
}
#endif

#endif
