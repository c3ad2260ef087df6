/*
 * Private to checkpoint/: an open checkpoint folder. dcp_rfile.c opens one shard file (its
 * sharding info and integrity record, checked), dcp_folder.c the folder (its file list, the
 * table of every tensor's chunks, checked to tile it), dcp_read.c reads from it block by block.
 */
#ifndef FSDPC_CHECKPOINT_DCP_READER_H
#define FSDPC_CHECKPOINT_DCP_READER_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "checkpoint/dcp.h"
#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/safetensors.h"

#define DCP_PATH_MAX 4096
#define DCP_JOIN_MAX (DCP_PATH_MAX + 320) /* a folder path plus a file name */

typedef struct rfile {
  st_file_t *f;
  char *base;            /* the file's name in the folder */
  cJSON *sharding;       /* DCP_SHARDING_INFO, or NULL */
  cJSON **entries;       /* its entries, sorted by name */
  int n_entries;
  int64_t (*offs)[TENSOR_MAX_DIMS]; /* per tensor in data order: saved_offsets */
  bool *has_offs;
  bool *has_crc; /* a legacy "crc32" of the whole chunk */
  uint32_t *crc;
  bool has_integrity;
  dcp_integrity_t it;
  uint64_t *first_block; /* per tensor in data order: its first hash in it.hashes */
} rfile_t;

typedef struct chunk {
  int file;
  const st_info_t *info;
  int64_t off[TENSOR_MAX_DIMS];
  uint64_t block;       /* bytes per checked block; 0: not checked */
  const uint64_t *hash; /* XXH3-64 of each block; NULL for a CRC-32 chunk (one block) */
  uint32_t crc;
} chunk_t;

struct dcp_reader {
  char dir[DCP_PATH_MAX];
  rfile_t *files;
  int n_files;
  dcp_checks_t checks;
  uint64_t block_bytes;
  dcp_tensor_t *list; /* sorted by name */
  int n_list;
  chunk_t *chunks; /* tensor i's: chunks[first[i] .. first[i + 1]) */
  int *first;
  dcp_checker_t *checker; /* hashes the blocks a read has just brought in */
};

static inline fsdpc_status_t oom(void) {
  return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
}

/* Opens shard file path into rf (its name in the folder already in rf->base): the header, the
 * sharding info and the integrity record, each checked. rf is closed with dcp_rfile_close,
 * also on failure. */
fsdpc_status_t dcp_rfile_open(rfile_t *rf, const char *path);
void dcp_rfile_close(rfile_t *rf);

/* The entries of a save or a load, checked (who: the function, for messages): each with a
 * name that is not empty and a value; for a load (save false), no Partial placement, whose
 * local terms would each receive the whole value. */
fsdpc_status_t dcp_check_entries(const dcp_entry_t *entries, int n, bool save, const char *who);

/* Tensor name of r as a tensor of nd dims, global shape gshape and dtype's kind (float or
 * integer) takes it: present, of that rank and shape, stored as a dtype of the same kind. Its
 * index in the reader's table into *index (may be NULL). */
fsdpc_status_t dcp_reader_check_tensor(const dcp_reader_t *r, const char *name, int nd,
                                       const int64_t *gshape, dtype_t dtype, int *index);

/* Tensor name's index in the reader's table, or -1. */
int dcp_find_tensor(const dcp_reader_t *r, const char *name);

#endif
