/*
 * cuDNN's backend API as the fused attention uses it (internal to backends/cuda/cudnn_sdpa.c and
 * backends/cuda/sdpa_graph.c; only with FSDPC_HAVE_CUDNN): the library's functions, loaded at run
 * time; a graph builder that owns its descriptors and keeps the first failure; and the attention
 * graphs themselves.
 */
#ifndef FSDPC_BASE_SDPA_GRAPH_H
#define FSDPC_BASE_SDPA_GRAPH_H

#include <cudnn_graph.h>
#include <stdbool.h>

#include "core/attention_gemm_impl.h"

/* The functions of libcudnn.so.9 (valid once cudnn_load() has returned ""). */
typedef struct cudnn_fns {
  cudnnStatus_t (*create)(cudnnHandle_t *);
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
  cudnnStatus_t (*create_desc)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t *);
  cudnnStatus_t (*destroy_desc)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*set_attr)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                            cudnnBackendAttributeType_t, int64_t, const void *);
  cudnnStatus_t (*get_attr)(cudnnBackendDescriptor_t const, cudnnBackendAttributeName_t,
                            cudnnBackendAttributeType_t, int64_t, int64_t *, void *);
  cudnnStatus_t (*finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
  const char *(*status_string)(cudnnStatus_t);
  void (*last_error)(char *, size_t);
  size_t (*version)(void);
} cudnn_fns_t;

extern cudnn_fns_t cudnn_fn;

/* Loads the library once: "" when cudnn_fn can be used, else why not. */
const char *cudnn_load(void);

/* A graph being built: every call records the first failure and then does nothing. */
#define GB_MAX_DESC 160
#define GB_MAX_OPS 48

typedef struct gb {
  cudnnBackendDescriptor_t desc[GB_MAX_DESC]; /* owned, destroyed in reverse */
  int ndesc;
  cudnnBackendDescriptor_t ops[GB_MAX_OPS];
  int nops;
  cudnnStatus_t st;
  char where[96]; /* the step that failed */
  int64_t next_uid;
} gb_t;

void gb_fail(gb_t *g, cudnnStatus_t st, const char *what);
cudnnBackendDescriptor_t gb_new(gb_t *g, cudnnBackendDescriptorType_t type, const char *what);
void gb_set(gb_t *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
            cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what);
void gb_link(gb_t *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
             cudnnBackendDescriptor_t v, const char *what);
void gb_finalize(gb_t *g, cudnnBackendDescriptor_t d, const char *what);
void gb_destroy(gb_t *g);

/* The unique ids of the graphs' real tensors (the variant pack's keys). */
enum {
  UID_Q = 1,
  UID_K,
  UID_V,
  UID_O,
  UID_LSE,
  UID_DO,
  UID_DQ,
  UID_DK,
  UID_DV,
  UID_ROWDOT,
  UID_DQACC,
  UID_SCALE,
  UID_ONE,
  UID_LOWEST,
  UID_FIRST_VIRTUAL = 100
};

/* Draws into a fresh g (memset to 0) the operations of the forward or backward attention graph
 * of a in dtype dt (bf16 or f16); g->ops then holds them, or g->st says where cuDNN refused. */
void sdpa_graph_draw(gb_t *g, const attn_shape_t *a, dtype_t dt, bool backward);

#endif
