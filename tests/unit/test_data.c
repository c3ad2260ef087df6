/*
 * The token stream and the data order: the global batch split over data-parallel ranks, the
 * formats (raw tokens of three widths, llm.c's files), several files by pattern, range checks,
 * and files read where a batch needs them (a file far larger than what the test may take in
 * memory).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* A new file of this process named by tag (its path into path), open for writing. */
static FILE *new_file(char *path, size_t size, const char *tag) {
  snprintf(path, size, "/tmp/fsdpc_test_%d_%s", (int)getpid(), tag);
  FILE *fp = fopen(path, "wb");
  ck_assert_ptr_nonnull(fp);
  return fp;
}

/* The n tokens v(i) = base + step * i, little-endian of width w. */
static void put_tokens(FILE *fp, int w, int n, unsigned base, unsigned step) {
  for (int i = 0; i < n; i++) {
    unsigned v = base + step * (unsigned)i;
    for (int b = 0; b < w; b++) fputc((int)((v >> (8 * b)) & 0xff), fp);
  }
}

/* A file of the n tokens v(i) = base + step * i, little-endian of width w; its path in path. */
static void write_tokens(char *path, size_t size, const char *tag, int w, int n, unsigned base,
                         unsigned step) {
  FILE *fp = new_file(path, size, tag);
  put_tokens(fp, w, n, base, step);
  fclose(fp);
}

static long max_rss_kib(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

/* The order of samples, the split over data-parallel ranks and uint16 tokens. */
START_TEST(data_order_and_dp_split) {
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  int64_t N = data_num_tokens(d);
  data_spec_t g = {.batch_size = 4, .seq_len = 16, .grad_accum = 2, .dp_size = 1, .dp_rank = 0};
  ck_assert_int_eq(data_sample_start(d, &g, 3, 1, 2), ((3 * 2 + 1) * 4 + 2) * 16 % (N - 16));
  fsdpc_tensor_t gi, gt;
  ok(data_batch(d, &g, 3, 1, &gi, &gt));
  const int64_t *all = gi.data, *allt = gt.data;
  for (int r = 0; r < 2; r++) { /* two dp ranks of batch 2 see the same global batch */
    data_spec_t s = {.batch_size = 2, .seq_len = 16, .grad_accum = 2, .dp_size = 2, .dp_rank = r};
    fsdpc_tensor_t in, tg;
    ok(data_batch(d, &s, 3, 1, &in, &tg));
    ck_assert_int_eq(memcmp(in.data, all + r * 2 * 16, 2 * 16 * sizeof(int64_t)), 0);
    const int64_t *a = in.data, *t = tg.data;
    for (int k = 0; k + 1 < 16; k++) ck_assert_int_eq(t[k], a[k + 1]); /* shifted by one */
    ck_assert_int_eq(memcmp(tg.data, allt + r * 2 * 16, 2 * 16 * sizeof(int64_t)), 0);
    tensor_free(&in);
    tensor_free(&tg);
  }
  /* in order, every window of a stream of k whole ones is read, the last one (which holds the
   * stream's last token) included */
  data_free(d);
  char wpath[256];
  write_tokens(wpath, sizeof wpath, "windows-in-order.txt", 1, 1 + 5 * 7, 0, 1);
  ok(data_open(wpath, DATA_BYTES, &d));
  data_spec_t w = {.batch_size = 1, .seq_len = 5, .grad_accum = 1, .dp_size = 1};
  for (int64_t step = 0; step < 7; step++)
    ck_assert_int_eq(data_sample_start(d, &w, step, 0, 0), 5 * step);
  data_free(d);
  remove(wpath);
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t bad = g;
  bad.dp_rank = 1;
  ck_assert_int_eq(data_batch(d, &bad, 0, 0, &gi, &gt), STATUS_EINVAL);
  tensor_free(&gi);
  tensor_free(&gt);
  data_free(d);
  ck_assert_int_eq(data_open("/nonexistent/tokens.bin", DATA_U16, &d), STATUS_EIO);
  /* uint16 tokens, little-endian */
  char path[256];
  write_tokens(path, sizeof path, "tokens.bin", 2, 40, 1000, 517);
  ok(data_open(path, DATA_U16, &d));
  ck_assert_int_eq(data_num_tokens(d), 40);
  int64_t top;
  ok(data_max_token(d, 0, 40, &top));
  ck_assert_int_eq(top, 1000 + 517 * 39);
  data_spec_t u = {.batch_size = 1, .seq_len = 4, .grad_accum = 1, .dp_size = 1};
  ok(data_batch(d, &u, 2, 0, &gi, &gt)); /* starts at 2 * 4 = 8 */
  ck_assert_int_eq(((int64_t *)gi.data)[0], 1000 + 517 * 8);
  ck_assert_int_eq(((int64_t *)gt.data)[3], 1000 + 517 * 12);
  tensor_free(&gi);
  tensor_free(&gt);
  data_free(d);
  FILE *fp = fopen(path, "ab");
  fputc(1, fp); /* an odd byte count is not a uint16 file */
  fclose(fp);
  ck_assert_int_eq(data_open(path, DATA_U16, &d), STATUS_EFORMAT);
  remove(path);
}
END_TEST

/* uint32 tokens (ids past 65,535, as a Llama 3 vocabulary has), the largest id of a range, and
 * the vocabulary check of a batch. */
START_TEST(u32_tokens_and_ranges) {
  char path[256];
  write_tokens(path, sizeof path, "tokens.u32", 4, 40, 70000u, 100003u);
  fsdpc_data_t *d;
  ok(data_open(path, DATA_U32, &d));
  ck_assert_int_eq(data_num_tokens(d), 40);
  int64_t top;
  ok(data_max_token(d, 0, 40, &top));
  ck_assert_int_eq(top, 70000 + 100003 * 39);
  ok(data_max_token(d, 3, 10, &top));
  ck_assert_int_eq(top, 70000 + 100003 * 9);
  ok(data_max_token(d, 5, 5, &top));
  ck_assert_int_eq(top, -1);
  ck_assert_int_eq(data_max_token(d, 0, 41, &top), STATUS_EINVAL);
  ck_assert_int_eq(data_max_token(d, -1, 3, &top), STATUS_EINVAL);
  fsdpc_tensor_t in, tg;
  data_spec_t u = {.batch_size = 2, .seq_len = 4, .grad_accum = 1, .dp_size = 1};
  ok(data_batch(d, &u, 1, 0, &in, &tg)); /* samples at 8 and 12 */
  for (int b = 0; b < 2; b++)
    for (int t = 0; t < 4; t++) {
      ck_assert_int_eq(((int64_t *)in.data)[b * 4 + t], 70000 + 100003 * (8 + 4 * b + t));
      ck_assert_int_eq(((int64_t *)tg.data)[b * 4 + t], 70000 + 100003 * (9 + 4 * b + t));
    }
  tensor_free(&in);
  tensor_free(&tg);
  /* with a vocabulary, each token a batch reads is checked: the first outside it is named by
   * file and byte offset (token 9 of step 1's samples at 8 and 12: offset 36) */
  u.vocab_size = 70000 + 100003 * 9;
  ck_assert_int_eq(data_batch(d, &u, 1, 0, &in, &tg), STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(), "tokens.u32: the token at byte offset 36 has id 970027, "
                                     "outside the vocabulary of 970027") != NULL,
                "%s", err_detail());
  u.vocab_size = 70000 + 100003 * 17; /* step 1 reads tokens 8-16: all below it */
  ok(data_batch(d, &u, 1, 0, &in, &tg));
  tensor_free(&in);
  tensor_free(&tg);
  data_free(d);
  FILE *fp = fopen(path, "ab");
  fputc(1, fp);
  fputc(2, fp); /* 162 bytes: a whole number of uint16 tokens, not of uint32 ones */
  fclose(fp);
  ck_assert_int_eq(data_open(path, DATA_U32, &d), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), "162 bytes is not a whole number of uint32 tokens") != NULL,
                "%s", err_detail());
  ok(data_open(path, DATA_U16, &d));
  ck_assert_int_eq(data_num_tokens(d), 81);
  data_free(d);
  remove(path);
}
END_TEST

/* An llm.c token file of n tokens v(i) = base + step * i: magic, version and count in its
 * 1024-byte header (count_shift added to the count: a header that lies), then the tokens. */
static void write_llmc(char *path, size_t size, const char *tag, int w, int n, unsigned base,
                       unsigned step, int count_shift) {
  FILE *fp = new_file(path, size, tag);
  int32_t h[256] = {w == 2 ? 20240520 : 20240801, w == 2 ? 1 : 7, n + count_shift};
  for (int i = 0; i < 256; i++) put_tokens(fp, 4, 1, (unsigned)h[i], 0);
  put_tokens(fp, w, n, base, step);
  fclose(fp);
}

/* A glob pattern's files in sorted order make one stream, whatever their widths (llm.c's files
 * of uint16 and uint32 tokens); a sample across two files reads both; refusals name the file. */
START_TEST(several_files_and_llmc_headers) {
  char a[256], b[256], c[256], pattern[256];
  write_llmc(a, sizeof a, "shard_0.bin", 2, 10, 100, 1, 0);     /* 100 .. 109 */
  write_llmc(b, sizeof b, "shard_1.bin", 4, 6, 70000, 1000, 0); /* 70000 .. 75000 */
  write_llmc(c, sizeof c, "shard_2.bin", 2, 0, 0, 0, 0);        /* empty */
  snprintf(pattern, sizeof pattern, "/tmp/fsdpc_test_%d_shard_*.bin", (int)getpid());
  fsdpc_data_t *d;
  ok(data_open(pattern, DATA_LLMC, &d));
  ck_assert_int_eq(data_num_files(d), 3);
  ck_assert_int_eq(data_num_tokens(d), 16);
  int64_t top;
  ok(data_max_token(d, 0, 10, &top));
  ck_assert_int_eq(top, 109);
  ok(data_max_token(d, 5, 16, &top));
  ck_assert_int_eq(top, 75000);
  fsdpc_tensor_t in, tg;
  data_spec_t u = {.batch_size = 1, .seq_len = 4, .grad_accum = 1, .dp_size = 1};
  ok(data_batch(d, &u, 2, 0, &in, &tg)); /* tokens 8 .. 12: two of a, three of b */
  const int64_t want[5] = {108, 109, 70000, 71000, 72000};
  for (int t = 0; t < 4; t++) {
    ck_assert_int_eq(((int64_t *)in.data)[t], want[t]);
    ck_assert_int_eq(((int64_t *)tg.data)[t], want[t + 1]);
  }
  tensor_free(&in);
  tensor_free(&tg);
  data_free(d);

  /* refusals: each names the file */
  /* read raw, its header would be tokens: refused, naming the format that reads it */
  ck_assert_int_eq(data_open(a, DATA_U16, &d), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), "starts with llm.c's header (magic 20240520)") != NULL &&
                    strstr(err_detail(), "data.format: llmc") != NULL,
                "%s", err_detail());
  write_llmc(c, sizeof c, "shard_2.bin", 2, 5, 0, 0, 1); /* says 6 tokens, holds 5 */
  ck_assert_int_eq(data_open(pattern, DATA_LLMC, &d), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), c) && strstr(err_detail(), "header says 6 tokens of 2 bytes"),
                "%s", err_detail());
  write_tokens(c, sizeof c, "shard_2.bin", 2, 600, 1, 1); /* raw tokens, no header */
  ck_assert_int_eq(data_open(pattern, DATA_LLMC, &d), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), "not an llm.c token file") != NULL, "%s", err_detail());
  write_tokens(c, sizeof c, "shard_2.bin", 1, 100, 1, 1); /* shorter than a header */
  ck_assert_int_eq(data_open(pattern, DATA_LLMC, &d), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), "cannot hold llm.c's header") != NULL, "%s", err_detail());
  remove(c);
  snprintf(c, sizeof c, "/tmp/fsdpc_test_%d_shard_2.bin", (int)getpid());
  ck_assert_int_eq(mkdir(c, 0700), 0); /* a folder among the matches */
  ck_assert_int_eq(data_open(pattern, DATA_LLMC, &d), STATUS_EIO);
  ck_assert_msg(strstr(err_detail(), "is a folder") != NULL, "%s", err_detail());
  rmdir(c);
  remove(a);
  remove(b);
  ck_assert_int_eq(data_open(pattern, DATA_LLMC, &d), STATUS_EIO);
  ck_assert_msg(strstr(err_detail(), "the pattern matches no file") != NULL, "%s", err_detail());
}
END_TEST

/* data.shuffle: every epoch visits each window once, in an order fixed by the seed and the
 * epoch; the data-parallel ranks split the same global batch; starts stay whole windows. */
START_TEST(shuffled_epochs) {
  char path[256];
  write_tokens(path, sizeof path, "shuffle.u16", 2, 1 + 7 * 8, 0, 1); /* 8 windows of 7 + 1 */
  fsdpc_data_t *d;
  ok(data_open(path, DATA_U16, &d));
  data_spec_t g = {.batch_size = 4, .seq_len = 7, .grad_accum = 1, .dp_size = 1};
  g.shuffle = true;
  g.seed = 5;
  int64_t first[8], orders_differ = 0;
  for (int64_t e = 0; e < 3; e++) { /* three epochs of two steps of four */
    int seen[8] = {0};
    for (int64_t k = 0; k < 8; k++) {
      int64_t s = data_sample_start(d, &g, (8 * e + k) / 4, 0, k % 4);
      ck_assert_int_eq(s % 7, 0);
      ck_assert(s >= 0 && s / 7 < 8);
      seen[s / 7]++;
      if (e == 0) first[k] = s;
      orders_differ += e > 0 && s != first[k];
    }
    for (int w = 0; w < 8; w++) ck_assert_int_eq(seen[w], 1);
  }
  ck_assert(orders_differ > 0); /* the epochs are in different orders */
  int same = 0, unshuffled = 0;
  data_spec_t other = g;
  other.seed = 6;
  for (int64_t k = 0; k < 8; k++) {
    same += data_sample_start(d, &other, k / 4, 0, k % 4) == first[k];
    unshuffled += first[k] == 7 * k;
  }
  ck_assert(same < 8 && unshuffled < 8);
  /* two data-parallel ranks of batch 2 read the global batch of four */
  fsdpc_tensor_t all_in, all_tg;
  ok(data_batch(d, &g, 1, 0, &all_in, &all_tg));
  for (int r = 0; r < 2; r++) {
    data_spec_t s = g;
    s.batch_size = 2, s.dp_size = 2, s.dp_rank = r;
    fsdpc_tensor_t in, tg;
    ok(data_batch(d, &s, 1, 0, &in, &tg));
    ck_assert_int_eq(memcmp(in.data, (int64_t *)all_in.data + r * 14, 14 * sizeof(int64_t)), 0);
    ck_assert_int_eq(memcmp(tg.data, (int64_t *)all_tg.data + r * 14, 14 * sizeof(int64_t)), 0);
    tensor_free(&in);
    tensor_free(&tg);
  }
  for (int k = 0; k < 4; k++) /* the tokens are their positions: a window from its start */
    for (int t = 0; t < 7; t++) {
      int64_t s = data_sample_start(d, &g, 1, 0, k);
      ck_assert_int_eq(((int64_t *)all_in.data)[k * 7 + t], s + t);
      ck_assert_int_eq(((int64_t *)all_tg.data)[k * 7 + t], s + t + 1);
    }
  tensor_free(&all_in);
  tensor_free(&all_tg);
  data_free(d);
  remove(path);
  /* a stream too short for one sample: no start (and no division by zero), refused batches */
  write_tokens(path, sizeof path, "short.txt", 1, 8, 0, 1);
  ok(data_open(path, DATA_BYTES, &d));
  for (int k = 0; k < 2; k++) {
    data_spec_t s = g;
    s.shuffle = k == 1;
    ck_assert_int_eq(data_sample_start(d, &s, 3, 0, 1), 0);
    ck_assert_int_eq(data_batch(d, &s, 3, 0, &all_in, &all_tg), STATUS_EINVAL);
  }
  data_free(d);
  remove(path);
  /* one window, and more: each epoch is a permutation of them all */
  const int sizes[] = {1, 3, 17, 1000, 4097};
  for (int i = 0; i < 5; i++) {
    int n = sizes[i];
    write_tokens(path, sizeof path, "windows.txt", 1, 1 + 5 * n, 0, 1);
    ok(data_open(path, DATA_BYTES, &d));
    data_spec_t one = {.batch_size = 1, .seq_len = 5, .grad_accum = 1, .dp_size = 1};
    one.shuffle = true;
    one.seed = 11;
    int *seen = calloc((size_t)n, sizeof *seen);
    for (int64_t step = n; step < 2 * n; step++) { /* the second epoch */
      int64_t s = data_sample_start(d, &one, step, 0, 0);
      ck_assert(s % 5 == 0 && s >= 0 && s / 5 < n);
      seen[s / 5]++;
    }
    for (int w = 0; w < n; w++) ck_assert_int_eq(seen[w], 1);
    free(seen);
    data_free(d);
    remove(path);
  }
}
END_TEST

/* A 6 GiB token file (sparse: it takes no disk) is opened and read without being loaded: a
 * batch at its far end reads what was written there, and the process grows by far less than
 * the file. A file that shrinks under an open reader gives an error naming it. */
START_TEST(files_are_read_where_needed) {
  char path[256];
  FILE *fp = new_file(path, sizeof path, "big.u16");
  const int64_t bytes = (int64_t)6 << 30, n = bytes / 2;
  ck_assert_int_eq(ftruncate(fileno(fp), (off_t)bytes), 0);
  data_spec_t u = {.batch_size = 1, .seq_len = 4, .grad_accum = 1, .dp_size = 1};
  int64_t step = (n - 5 - 1) / 4, at = step * 4; /* the last sample start before the wrap */
  unsigned char tail[10];
  for (int i = 0; i < 5; i++) tail[2 * i] = (unsigned char)(201 + i), tail[2 * i + 1] = 0x9c;
  ck_assert_int_eq(pwrite(fileno(fp), tail, sizeof tail, (off_t)(at * 2)), (ssize_t)sizeof tail);
  fclose(fp);

  long before = max_rss_kib();
  fsdpc_data_t *d;
  ok(data_open(path, DATA_U16, &d));
  ck_assert_int_eq(data_num_tokens(d), n);
  ck_assert_int_eq(data_sample_start(d, &u, step, 0, 0), at);
  fsdpc_tensor_t in, tg;
  ok(data_batch(d, &u, step, 0, &in, &tg));
  for (int t = 0; t < 4; t++) {
    ck_assert_int_eq(((int64_t *)in.data)[t], 0x9c00 + 201 + t);
    ck_assert_int_eq(((int64_t *)tg.data)[t], 0x9c00 + 202 + t);
  }
  tensor_free(&in);
  tensor_free(&tg);
  int64_t top;
  ok(data_max_token(d, n - (1 << 20), n, &top));
  ck_assert_int_eq(top, 0x9c00 + 205);
  long grew = max_rss_kib() - before;
  ck_assert_msg(grew < 64 * 1024, "reading a 6 GiB file grew the process by %ld KiB", grew);

  ck_assert_int_eq(truncate(path, (off_t)(at * 2)), 0); /* the sample's tokens are gone */
  ck_assert_int_eq(data_batch(d, &u, step, 0, &in, &tg), STATUS_EIO);
  ck_assert_msg(strstr(err_detail(), path) != NULL &&
                    strstr(err_detail(), "shorter than when it was opened") != NULL,
                "%s", err_detail());
  data_free(d);
  remove(path);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("data");
  TCase *tc = tcase_create("data");
  tcase_add_test(tc, data_order_and_dp_split);
  tcase_add_test(tc, u32_tokens_and_ranges);
  tcase_add_test(tc, several_files_and_llmc_headers);
  tcase_add_test(tc, shuffled_epochs);
  tcase_add_test(tc, files_are_read_where_needed);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
