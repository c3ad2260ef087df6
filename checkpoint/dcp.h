/*
 * Distributed checkpoints of DTensors (docs/design.md, "Checkpoints"): every rank saves its own
 * shards, no gather; a load under any other plan reads, on each rank, only the saved bytes
 * its shards need.
 *
 * Layout of a checkpoint folder (PyTorch DCP's Hugging Face storage layout):
 *   DIR/shard-RRRRR.safetensors   one file per rank that holds a shard to save (RRRRR: the
 *                                 world rank, 5 digits); the tensor key is the plain name, the
 *                                 stored shape the local chunk's shape
 *   __metadata__ of each file:    "DCP_SHARDING_INFO": {"name": {"saved_offsets": [..]}, ...}
 *                                 (each chunk's global offset), "DCP_VERSION": "1.0",
 *                                 "format": "pt", and "FSDPC_INTEGRITY": the folder's file
 *                                 list, a 64-bit hash (XXH3) of every block of B bytes
 *                                 (default 256 KiB) of every chunk, and a hash of the header
 *                                 (names, dtypes, shapes, data and saved offsets, block hashes)
 * A reader takes every *.safetensors file directly in DIR; a tensor's global shape is the
 * largest offset + shape over its chunks. A tensor without sharding info is a whole tensor at
 * offset 0, so plain Hugging Face weight files load the same way.
 *
 * Integrity: opening a folder checks every header against its hash, that every file lists the
 * same files and exactly those present, and that each tensor's chunks tile it (no overlap, no
 * gap). Every read, whole chunk or part, reads and checks the blocks it touches. A folder whose
 * files carry no integrity record (written by another tool) is read unchecked
 * (dcp_reader_checks says so); one record missing among others is an error. Folders of earlier
 * versions, with a CRC-32 per chunk in DCP_SHARDING_INFO, are checked chunk by chunk.
 *
 *   dcp_entry_t e[] = {{"model.norm.weight", norm->value}, ...};
 *   FSDPC_TRY(dcp_save("ckpt/step-100", e, n, world_pg()));
 *   FSDPC_TRY(dcp_load("ckpt/step-100", e, n, NULL));     // any placements, any mesh
 */
#ifndef FSDPC_CHECKPOINT_DCP_H
#define FSDPC_CHECKPOINT_DCP_H

#include "dtensor/dtensor.h"
#include "mesh/pg.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define DCP_VERSION "1.0"

typedef struct dcp_entry {
  const char *name;
  dtensor_t *value;
} dcp_entry_t;

/* 256 KiB: a load under another plan reads at most two blocks more than the rows it needs
 * per chunk, and the record is 16 hex digits per block (64 KB per GB of data). */
#define DCP_BLOCK_BYTES_DEFAULT ((uint64_t)256 << 10)

typedef struct dcp_stats {
  uint64_t bytes_read;   /* tensor data read from the files by this rank: the blocks its
                          * shards touch (the bytes it needs, when the folder is unchecked) */
  uint64_t header_bytes; /* length fields and headers of the files this rank opened */
  uint64_t bytes_needed; /* this rank's shards, in the stored dtypes */
  int files;             /* files in the folder */
  bool unchecked;        /* the folder has no checksums (written by another tool) */
} dcp_stats_t;

/* The block size of the checksums of files saved from now on in this process (a multiple of
 * 64 bytes, at most 1 GiB; default DCP_BLOCK_BYTES_DEFAULT): a partial read reads and checks
 * whole blocks. Not thread-safe; call it before saving. */
fsdpc_status_t dcp_set_block_bytes(uint64_t bytes);
uint64_t dcp_block_bytes(void);

/* Saves the entries into folder dir, which must not exist: every rank writes its local
 * shards (a shard replicated over mesh dimensions is written by the replica at coordinate 0
 * only; empty shards are skipped) into one file of a temporary folder, then rank 0 commits
 * it by renaming it to dir (fsync'd). A crash before the rename leaves no dir; a failed
 * save (a full disk) removes its temporary folder. Every rank passes the same dir (compared),
 * and each name once. Every rank of an entry's mesh passes it,
 * with the same global shape and dtype (checked, every rank agreeing). Partial placements and
 * tensors without elements are refused (strided shards, being boxes, are saved like any
 * shard). Collective over pg (world_pg(), or any group that spans every rank of the entries'
 * meshes). */
fsdpc_status_t dcp_save(const char *dir, const dcp_entry_t *entries, int n, pg_t *pg);

/* The steps of dcp_save, for checkpoints of several folders committed at once:
 * dcp_prepare checks that dir does not exist and creates the temporary folder (its path into
 * tmp, size >= 4096); dcp_write writes every rank's file into an existing folder (the save's
 * id, recorded in every file, into *save_id when not NULL); dcp_commit
 * renames tmp to dir. Each is collective over pg and gives every rank the same verdict. */
fsdpc_status_t dcp_prepare(const char *dir, char *tmp, size_t size, pg_t *pg);
fsdpc_status_t dcp_write(const char *folder, const dcp_entry_t *entries, int n, pg_t *pg,
                         uint64_t *save_id);
fsdpc_status_t dcp_commit(const char *tmp, const char *dir, pg_t *pg);
/* One shard file of chunks at given global offsets, with DCP_SHARDING_INFO, DCP_VERSION,
 * format and FSDPC_INTEGRITY metadata (for tools that write checkpoints of other plans
 * offline). Every file of a folder records the folder's files and the save's id, so that a
 * reader notices a file missing, added, or taken from another save. Local. */
typedef struct dcp_box {
  const char *name;
  const fsdpc_tensor_t *value;
  int64_t offset[TENSOR_MAX_DIMS];
} dcp_box_t;
typedef struct dcp_folder {
  const char *const *files; /* the name (no folder) of every file the folder will hold */
  int n_files;
  uint64_t save_id; /* the same for every file of the folder: dcp_new_save_id() */
} dcp_folder_t;
fsdpc_status_t dcp_write_file(const char *path, const dcp_box_t *boxes, int n,
                              const dcp_folder_t *folder);
/* An id for one save: from the clock and the process, different between saves. */
uint64_t dcp_new_save_id(void);

/* The boxes of this rank's file of a save of entries: its local shards (a shard replicated over
 * mesh dimensions only at coordinate 0), none empty, at their global offsets, borrowing the
 * entries' local tensors; b has room for n. *count receives how many. Local. */
fsdpc_status_t dcp_shard_boxes(const dcp_entry_t *entries, int n, dcp_box_t *b, int *count);
/* The name of rank's file in a folder: "shard-RRRRR.safetensors". */
void dcp_shard_name(int rank, char *out, size_t size);

/* Loads every entry's local shard from folder dir, whatever plan saved it: the global shape
 * must match and the saved chunks must cover the shard; values are converted to the
 * entry's dtype between floating-point dtypes, and between integer dtypes (a float saved
 * into an integer entry, or the reverse, is refused). Reads only the saved rows that intersect this
 * rank's shards. Local (every rank reads for itself). */
fsdpc_status_t dcp_load(const char *dir, const dcp_entry_t *entries, int n, dcp_stats_t *stats);

/* A checkpoint folder kept open for several loads (its headers parsed and checked once). */
typedef struct dcp_reader dcp_reader_t;

/* How a folder's bytes are checked. */
typedef enum dcp_checks {
  DCP_CHECKS_BLOCKS, /* integrity records: headers, file list, every block */
  DCP_CHECKS_CHUNKS, /* an earlier version's CRC-32 per chunk (a part reads its whole chunk) */
  DCP_CHECKS_NONE,   /* no checksums: written by another tool */
} dcp_checks_t;

/* One saved tensor: its stored dtype, the global shape (largest offset + shape over its
 * chunks), the number of chunks and their stored bytes. */
typedef struct dcp_tensor {
  char *name;
  dtype_t dtype;          /* DTYPE_COUNT when the library cannot hold it */
  const char *dtype_name; /* as stored: "F32", "BF16", ... */
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
  int chunks;
  uint64_t bytes;
} dcp_tensor_t;

/* Opens folder dir: parses every file's header and checks the integrity records and the
 * tiling of every tensor (errors name the file and the tensor). */
fsdpc_status_t dcp_reader_open(const char *dir, dcp_reader_t **out);
/* The same for the n files of dir named by files (a Hugging Face folder's model.safetensors or
 * the files its index names), the folder's other files left out. */
fsdpc_status_t dcp_reader_open_files(const char *dir, const char *const *files, int n,
                                     dcp_reader_t **out);
void dcp_reader_close(dcp_reader_t *r);
/* The folder's checks, and (may be NULL) the block size of the first file. */
dcp_checks_t dcp_reader_checks(const dcp_reader_t *r, uint64_t *block_bytes);
/* The id of the save that wrote the folder (false when its files carry no integrity record). */
bool dcp_reader_save_id(const dcp_reader_t *r, uint64_t *id);
/* dcp_load on an open folder; stats count this call's reads. */
fsdpc_status_t dcp_reader_load(dcp_reader_t *r, const dcp_entry_t *entries, int n,
                               dcp_stats_t *stats);
/* Reads the box of tensor name at offset with dst's shape (global shape given, as for a
 * DTensor) into dst, any dtype and device. */
fsdpc_status_t dcp_reader_read_box(dcp_reader_t *r, const char *name, int ndim,
                                   const int64_t *global_shape, const int64_t *offset,
                                   fsdpc_tensor_t *dst);
/* Reads n boxes of the folder's tensors, each at its offset with its value's shape, into the
 * values' memory (any dtype and device); the saved global shapes apply. The blocks read for
 * one box are checked while the next is read: prefer this to one read_box per box. */
fsdpc_status_t dcp_reader_read_boxes(dcp_reader_t *r, const dcp_box_t *boxes, int n);
/* Reads every block of every saved chunk of tensor name and checks it: *checked counts the
 * chunks that passed, *unchecked those of a folder without checksums. The first mismatch
 * fails, naming the file, the tensor and the block. */
fsdpc_status_t dcp_reader_verify(dcp_reader_t *r, const char *name, int *checked, int *unchecked);
/* dcp_reader_verify over a whole folder, split over pg's ranks (the i-th tensor in name
 * order on rank i % size), so that the folder is read once in all. Collective: every rank
 * fails, naming the first damaged tensor, when any is; *chunks (may be NULL) receives the
 * number of chunks checked over all ranks. */
fsdpc_status_t dcp_verify(const char *dir, pg_t *pg, int64_t *chunks);

/* Every tensor of the folder, sorted by name (owned by the reader; never fails). */
fsdpc_status_t dcp_reader_list(dcp_reader_t *r, const dcp_tensor_t **out, int *n);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
