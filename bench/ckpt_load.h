/*
 * The parts of bench-ckpt-load (ckpt_load.c: the one-rank run and its runs in new processes;
 * ckpt_load_sharded.c: the run under mpirun -n W) shared through ckpt_load_util.c: the
 * checkpoint's copy without checksums, the plain reads of its files, the model and optimizer a
 * resume fills, and the paired statistics of the timings. Benchmark code: a failure prints the
 * error and exits.
 */
#ifndef FSDPC_BENCH_CKPT_LOAD_H
#define FSDPC_BENCH_CKPT_LOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "bench/bench_util.h"
#include "mesh/mesh.h"
#include "nn/optim.h"

/* The plain reads' piece: each read(2) asks for this many bytes. */
#define CKB_PLAIN_PIECE ((size_t)8 << 20)

/* What each file of a tree gets: a read in pieces of size bytes into buf, each piece in the same
 * place (the destination stays in the CPU's caches); with at, the files laid end to end from
 * buf + *at on instead, each byte in its own place of memory of size bytes, as a load puts
 * them (*at advances), in pieces of CKB_PLAIN_PIECE; with hash, each piece hashed (what the block
 * checks add to a read); with drop, its pages dropped from the page cache (the next read comes
 * from storage). */
typedef struct walk {
  char *buf;
  size_t size;
  bool hash, drop;
  uint64_t *at;
} ckb_walk_t;

/* Does to every regular file under dir (two levels) what w says; returns the bytes read. */
uint64_t ckb_walk_tree(const char *dir, const ckb_walk_t *w);

/* Reads every file under dir in pieces of size bytes into buf (each piece in the same place). */
uint64_t ckb_read_tree(const char *dir, char *buf, size_t size);

/* Reads every file under dir into mem (size bytes), end to end. */
uint64_t ckb_read_tree_into(const char *dir, char *mem, size_t size);

/* Reads this rank's own files of checkpoint dir (model/ and optim/ shard-RRRRR): in pieces of
 * size bytes into buf, or with at, end to end from buf + *at (size: buf's bytes); the bytes. */
uint64_t ckb_read_own(const char *dir, char *buf, size_t size, uint64_t *at);

/* size bytes from the host allocator (as a load's large tensors get them), touched; free with
 * device_free(device_cpu(), p, size). */
char *ckb_memory_in_use(size_t size);

/* A copy of checkpoint dir (model/, optim/, train_state.json) at to whose files carry no
 * checksums: the same bytes, as another tool would write them. */
void ckb_copy_unchecked_checkpoint(const char *dir, const char *to);

/* Reads the first quarter of the rows of every tensor of dir's model and optimizer state, as
 * a rank of a 4-way plan would, into memory allocated and touched before: returns the bytes
 * read, the seconds the opens and reads took in *secs. */
uint64_t ckb_read_quarters(const char *dir, double *secs);

typedef struct built {
  llama_t *m;
  nn_param_t **ps;
  int n;
  optim_t *opt;
} ckb_built_t;

/* The model and its AdamW state; with a mesh, fully_shard per layer and root over it (as
 * fsdp-train's FSDP plans), before a deferred model gets memory. */
void ckb_build(ckb_built_t *b, const llama_config_t *cfg, bool deferred, mesh_t *mesh);
void ckb_unbuild(ckb_built_t *b);

/* Frees the eagerly built optimizer's zero-filled moments (the state before deferred
 * initialisation, in which the load then overwrote them). */
void ckb_zero_moments(ckb_built_t *b);

/* The median of the paired ratios a[i] / b[i] (each pair run back to back, so machine noise
 * mostly cancels), written with their quartiles; the text lasts until four more calls. */
const char *ckb_paired_ratio(const double *a, const double *b, int n);

/* The checked-over-unchecked cost in percent: the median of the paired ratios, with their
 * quartiles and the fastest runs' ratio; the text lasts until four more calls. */
const char *ckb_paired_cost(const double *checked, const double *unchecked, int n);

/* Seconds since t0 on the slowest rank (collective). */
double ckb_slowest(double t0);

/* Every rank waits for every other (collective). */
void ckb_barrier(void);

/* Prints where this rank's loads hash their blocks, and why. */
void ckb_print_hashing(void);

/* The run under mpirun -n W, W > 1 (collective; see ckpt_load_sharded.c). */
void ckb_sharded(const llama_config_t *cfg, int reps);

#endif
