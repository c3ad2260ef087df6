/* Helpers shared by the fully_shard suites (tests/dist/test_fsdp*.c). */
#ifndef FSDPC_TESTS_FSDP_COMMON_H
#define FSDPC_TESTS_FSDP_COMMON_H

#include "fully_shard/fsdp.h"
#include "train/data.h"
#include "models/llama/llama.h"
#include "nn/optim.h"
#include "tests/harness.h"

void ok(fsdpc_status_t st);

/* Argument "cuda" or "cuda:offload": models and mesh on this rank's GPU (with offload, the
 * sharded state on the host). */
device_type_t test_device_type(void);
bool test_offload(void);
/* Argument "hsdp" or "hsdp:R": an HSDP mesh (R, W/R), R = 2 by default. */
bool hsdp_mode(void);
/* HFSDP (argument "hfsdp" beside "hsdp[:R]"): the state sharded over the replicas too. */
bool hfsdp_mode(void);
int hsdp_replicas(void);
/* The data-parallel mesh: 1-D over the world, or (R, W/R) for HSDP. Collective. */
mesh_t *dp_mesh(void);

/* A model with its parameter list and optimizer. */
typedef struct run {
  llama_t *m;
  nn_param_t **ps;
  int n;
  optim_t *opt;
} run_t;

/* A finalized module of n whole f32 parameters "p0", "p1", ... on the one-rank mesh local:
 * parameter i has ndims[i] dimensions shapes[i], its element k holding 1000 i + k. */
nn_module_t *params_module(mesh_t *local, int n, const int *ndims, const int64_t (*shapes)[3]);

void run_init(run_t *r, const llama_config_t *cfg);
void run_optim(run_t *r);

/* Counts shards (values, or gradients) differing from the chunk of the single-rank tensor by
 * more than tol relative to the whole single-rank tensor's L2 norm; prints each. */
int compare_shards(const run_t *ref, const run_t *sh, bool grads, double tol);

/* Counts the collective kinds whose calls or bytes differ from want, printing each (rank 0)
 * as "step S, WHAT group: ...". */
int check_counts(int step, const char *what, const pg_counters_t *got, const pg_counters_t *want);

/* Forward, loss scaled by 1/grad_accum, backward of one micro-batch; returns the loss. */
double fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
               int64_t micro);

/* The single-rank reference's part of micro-step `micro`: the global micro-batch of the
 * data-parallel spec `local`, taken as local->dp_size micro-batches of local->batch_size
 * samples, the shapes each rank computes (tests/README.md, "Reference shapes"); returns their
 * mean loss. The gradients then hold dp_size times the sharded run's: ref_average_grads
 * divides them once the step's micro-steps are done. */
double ref_fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *local, int64_t step,
                   int64_t micro);
void ref_average_grads(const run_t *r, int dp_size);

#endif
