/*
 * Integrity records of checkpoint shard files (internal to checkpoint/).
 *
 * Every shard file written by dcp_save / dcp_write_file carries, in its __metadata__, the key
 * FSDPC_INTEGRITY: a JSON object
 *   {"version": 1, "hash": "xxh3-64", "block_bytes": B,
 *    "files": ["shard-00000.safetensors", ...],     every file of the folder
 *    "save": "<16 hex digits>",                     the same in every file of one save
 *    "blocks": "<16 hex digits per block>",         each tensor's data in blocks of B bytes
 *                                                   (the last one shorter), tensors in data
 *                                                   order
 *    "header": "<16 hex digits>"}                   the hash of the file's canonical header
 * The canonical header is a text built from the parsed values (not the header's bytes, so
 * JSON spacing does not matter): the version, B, the file list, then per tensor in data
 * order its name, stored dtype, shape, data offsets and saved_offsets, then the block hashes
 * (and the save's id).
 * Changing any value a load depends on changes it.
 */
#ifndef FSDPC_CHECKPOINT_DCP_INTEGRITY_H
#define FSDPC_CHECKPOINT_DCP_INTEGRITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

#define DCP_INTEGRITY_KEY "FSDPC_INTEGRITY"
#define DCP_INTEGRITY_VERSION 1
#define DCP_BLOCK_BYTES_MIN ((uint64_t)64) /* block sizes are multiples of it */
#define DCP_BLOCK_BYTES_MAX ((uint64_t)1 << 30)

/* One tensor of a file as its header declares it. */
typedef struct dcp_hdr_tensor {
  const char *name;
  const char *dtype_name; /* as stored: "F32", ... */
  int ndim;
  const int64_t *shape;
  uint64_t begin, end;    /* data offsets */
  const int64_t *offsets; /* saved_offsets (ndim of them); NULL when the file has none */
} dcp_hdr_tensor_t;

typedef struct dcp_integrity {
  uint64_t block_bytes;
  char **files; /* names (no folder) */
  int n_files;
  uint64_t save_id;
  uint64_t *hashes; /* every tensor's blocks, tensors in data order */
  uint64_t n_hashes;
  uint64_t header;
} dcp_integrity_t;

/* The blocks that hold bytes bytes: ceil(bytes / block). */
uint64_t dcp_blocks_of(uint64_t bytes, uint64_t block);
/* 16 lowercase hex digits at s (as the records write them) into *out; false otherwise. */
bool dcp_parse_hex64(const char *s, uint64_t *out);
/* The hash of one block's bytes. */
uint64_t dcp_block_hash(const void *data, size_t bytes);
/* Checks bytes bytes at data, blocks of block bytes (the last one shorter) whose hashes
 * should be expect[first], expect[first + 1], ...: the index of the first block that does
 * not match, or UINT64_MAX when all do. */
uint64_t dcp_first_bad_block(const void *data, size_t bytes, size_t block,
                             const uint64_t *expect, uint64_t first);
/* The hash of the canonical header of n tensors (in data order) with its block size, files
 * and block hashes. */
fsdpc_status_t dcp_integrity_header_hash(const dcp_integrity_t *it, const dcp_hdr_tensor_t *t,
                                         int n, uint64_t *out);
/* The metadata value of it (caller frees). */
fsdpc_status_t dcp_integrity_format(const dcp_integrity_t *it, char **out);
/* Parses a metadata value of file path into out (freed with dcp_integrity_free, also on
 * failure). The block hashes are checked against nothing here: see dcp_integrity_header_hash. */
fsdpc_status_t dcp_integrity_parse(const char *path, const char *text, dcp_integrity_t *out);
void dcp_integrity_free(dcp_integrity_t *it);

/* Compares blocks with their recorded hashes: on a helper thread when the rank has a CPU to
 * spare (dcp_checker_spare_cpu; the caller reads on meanwhile), else at once on the caller.
 * Pushed bytes must stay in place until dcp_checker_wait returns. */
typedef struct dcp_checker dcp_checker_t;
/* Whether a helper thread would find a CPU the node's ranks leave free: this thread is bound to
 * more than one CPU but not to all of the node's (the launcher gave them to this rank), or it may
 * run on all of them and they outnumber the ranks on the node (world_local_size). */
bool dcp_checker_spare_cpu(void);
fsdpc_status_t dcp_checker_new(dcp_checker_t **out);
/* Whether the blocks are hashed on the helper thread (else at once, by dcp_checker_push). */
bool dcp_checker_threaded(const dcp_checker_t *c);
/* Queues bytes bytes at data: blocks of block bytes (the last one shorter) whose hashes should
 * be expect[first], expect[first + 1], ...; who names their owner in the verdict. */
void dcp_checker_push(dcp_checker_t *c, const void *data, size_t bytes, size_t block,
                      const uint64_t *expect, uint64_t first, const void *who);
/* Waits for every queued block: true when all matched since the last wait, else false with
 * the first mismatch found (its owner and block index). */
bool dcp_checker_wait(dcp_checker_t *c, const void **who, uint64_t *block);
void dcp_checker_free(dcp_checker_t *c);

#endif
