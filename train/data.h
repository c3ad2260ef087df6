/*
 * The token stream and the global batch order (docs/design.md, "The reference model and training
 * math").
 *
 * The token stream is one file, or the files a glob pattern matches in sorted order, one after
 * the other. A file holds the bytes of a text (vocabulary 256), or little-endian uint16 or
 * uint32 tokens (uint32 for vocabularies beyond 65,536, such as Llama 3's), or is one of
 * llm.c's token files (a 1024-byte header giving the token width and count, then the tokens).
 * The files are not loaded: each batch reads its samples from them, so a stream of any size
 * costs a rank no memory beyond its batch.
 *
 * For step s, micro-step m of grad_accum, global micro-batch G = dp_size * batch_size,
 * sample j in [0, G) starts at
 *   ((s * grad_accum + m) * G + j) * seq_len  mod  (N - seq_len);
 * its inputs are seq_len tokens from there and its targets the same shifted by one. With
 * shuffle, the global sample index g = (s * grad_accum + m) * G + j instead picks a window of
 * the stream's W = (N - 1) / seq_len windows of seq_len + 1 tokens that start every seq_len
 * tokens: epoch e = g / W visits them all, window g mod W of it being the one a permutation
 * drawn from (seed, e) puts there. Data-parallel rank d takes samples
 * [d * batch_size, (d + 1) * batch_size), so every plan trains on the same global batch, and
 * a resumed run on the same samples.
 *
 *   fsdpc_data_t *d;
 *   FSDPC_TRY(data_open("corpus.txt", DATA_BYTES, &d));
 *   data_spec_t spec = {.batch_size = 2, .seq_len = 32, .grad_accum = 1, .dp_size = 1};
 *   FSDPC_TRY(data_batch(d, &spec, step, 0, &inputs, &targets));   // I64 [2, 32] on the host
 *   data_free(d);
 */
#ifndef FSDPC_NN_DATA_H
#define FSDPC_NN_DATA_H

#include <stdbool.h>
#include <stdint.h>

#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum data_format { DATA_BYTES, DATA_U16, DATA_U32, DATA_LLMC } data_format_t;

typedef struct fsdpc_data fsdpc_data_t;

typedef struct data_spec {
  int64_t batch_size; /* per data-parallel rank */
  int64_t seq_len;
  int64_t grad_accum;
  int64_t dp_size;
  int64_t dp_rank;
  bool shuffle;  /* the windows of each epoch in an order drawn from seed (see above) */
  uint64_t seed; /* with shuffle */
  int64_t vocab_size; /* > 0: data_batch refuses a token id outside [0, vocab_size) */
} data_spec_t;

/* Opens the token file path, or every file the pattern path matches (when it has *, ? or [
 * and no file has that very name), reading only llm.c's headers; they stay open until
 * data_free. Each must be a regular file of a whole number of tokens (llm.c's: as many as its
 * header says); a raw file that starts with llm.c's header is refused (its format is llmc).
 * Errors name the file. */
fsdpc_status_t data_open(const char *path, data_format_t format, fsdpc_data_t **out);
/* Whether data_open takes path as a pattern (it has *, ? or [, and names no file). */
bool data_is_pattern(const char *path);
void data_free(fsdpc_data_t *d);

int64_t data_num_tokens(const fsdpc_data_t *d);
int data_num_files(const fsdpc_data_t *d);
/* The path of file i of the stream (0 <= i < data_num_files; NULL otherwise), owned by d. */
const char *data_file_path(const fsdpc_data_t *d, int i);
/* *max = the largest id among tokens [begin, end) of the file (-1 when the range is empty),
 * read once in 1 MiB pieces: to check against the vocabulary, each of several ranks can take
 * a part of the file. */
fsdpc_status_t data_max_token(const fsdpc_data_t *d, int64_t begin, int64_t end, int64_t *max);

/* Start of sample j of micro-step m of step s (global sample index; see above); 0 when the
 * stream cannot hold one sample (data_batch refuses it). */
int64_t data_sample_start(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                          int64_t micro, int64_t j);

/* This rank's inputs and targets for (step, micro): new I64 [batch_size, seq_len] host
 * tensors the caller frees, read from the file (an error names it when it cannot be read, or
 * has become shorter). With spec->vocab_size, every token read is checked against it: one
 * outside is refused, naming the file and its byte offset (a check of the tokens a batch
 * reads, so a stream of any size is never read whole for it). Several threads may read one
 * fsdpc_data_t at once. */
fsdpc_status_t data_batch(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                          int64_t micro, fsdpc_tensor_t *inputs, fsdpc_tensor_t *targets);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
