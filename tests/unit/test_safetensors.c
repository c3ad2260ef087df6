/*
 * Safetensors reader and writer: round trips of every tensor dtype with metadata, box reads,
 * files written by another implementation (the reference goldens), and malformed files, each
 * of which must be refused with an error naming the file and the problem.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/hf_weights.h"
#include "checkpoint/safetensors.h"
#include "models/llama/llama.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

static char tmp_path[256];
static const char *tmp(const char *name) {
  snprintf(tmp_path, sizeof tmp_path, "/tmp/fsdpc_st_%d_%s", (int)getpid(), name);
  return tmp_path;
}

START_TEST(round_trip_all_dtypes) {
  dtype_t dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I32, DTYPE_I64};
  const char *names[] = {"a.f32", "b.bf16", "c.f16", "d.i32", "e.i64"};
  int64_t shapes[][3] = {{3, 5, 2}, {7, 1, 1}, {4, 4, 1}, {0, 3, 1}, {2, 3, 1}};
  int ndims[] = {3, 1, 2, 2, 2};
  fsdpc_tensor_t t[5];
  test_rng_t rng = {42};
  st_writer_t *w;
  ok(st_writer_new(&w));
  for (int i = 0; i < 5; i++) {
    ok(tensor_init(&t[i], dts[i], device_cpu(), ndims[i], shapes[i]));
    for (int64_t k = 0; k < tensor_numel(&t[i]); k++)
      dtype_store(dts[i], t[i].data, (size_t)k, (double)test_rng_int(&rng, -1000, 1000) / 8);
    ok(st_writer_add(w, names[i], &t[i]));
  }
  ck_assert_int_eq(st_writer_add(w, names[0], &t[0]), STATUS_EINVAL);
  ok(st_writer_set_metadata(w, "format", "pt"));
  ok(st_writer_set_metadata(w, "note", "x\"y"));
  const char *path = tmp("rt.safetensors");
  ok(st_writer_save(w, path));
  st_writer_free(w);
  st_file_t *f;
  ok(st_open(path, &f));
  ck_assert_int_eq(st_num_tensors(f), 5);
  ck_assert_str_eq(st_metadata(f, "format"), "pt");
  ck_assert_str_eq(st_metadata(f, "note"), "x\"y");
  ck_assert_ptr_null(st_metadata(f, "absent"));
  for (int i = 0; i < 5; i++) {
    const st_info_t *info = st_find(f, names[i]);
    ck_assert_ptr_nonnull(info);
    ck_assert_int_eq(info->dtype, dts[i]);
    fsdpc_tensor_t back;
    ok(tensor_init(&back, dts[i], device_cpu(), ndims[i], shapes[i]));
    ok(st_read(f, names[i], &back));
    bool eq;
    ok(tensor_equal(&back, &t[i], &eq));
    ck_assert_msg(eq, "%s differs after a round trip", names[i]);
    tensor_free(&back);
  }
  /* a box of the f32 tensor, converted to bf16 on the way */
  int64_t off[3] = {1, 2, 1}, bshape[3] = {2, 3, 1};
  fsdpc_tensor_t box, want, wantc;
  ok(tensor_init(&box, DTYPE_BF16, device_cpu(), 3, bshape));
  ok(st_read_box(f, "a.f32", off, &box));
  ok(tensor_narrow_box(&want, &t[0], off, bshape));
  ok(tensor_clone(&wantc, &want, DTYPE_BF16, device_cpu()));
  bool eq;
  ok(tensor_equal(&box, &wantc, &eq));
  ck_assert(eq);
  int64_t far[3] = {2, 2, 1};
  ck_assert_int_eq(st_read_box(f, "a.f32", far, &box), STATUS_ESHAPE);
  /* offsets whose sum with the box's size overflows: outside, not wrapped inside */
  int64_t huge[3] = {INT64_MAX, 0, 0}, huge2[3] = {0, INT64_MAX - 1, 0};
  ck_assert_int_eq(st_read_box(f, "a.f32", huge, &box), STATUS_ESHAPE);
  ck_assert_int_eq(st_read_box(f, "a.f32", huge2, &box), STATUS_ESHAPE);
  ck_assert_int_eq(st_read(f, "nope", &box), STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "nope") != NULL);
  tensor_free(&box);
  tensor_free(&want);
  tensor_free(&wantc);
  for (int i = 0; i < 5; i++) tensor_free(&t[i]);
  st_close(f);
  remove(path);
}
END_TEST

/* Writes an 8-byte length, the header text and data_len bytes of zeros. */
static const char *raw_file(const char *header, uint64_t len_field, size_t data_len) {
  const char *path = tmp("bad.safetensors");
  FILE *fp = fopen(path, "wb");
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(len_field >> (8 * i));
  fwrite(len8, 1, 8, fp);
  fputs(header, fp);
  for (size_t i = 0; i < data_len; i++) fputc(0, fp);
  fclose(fp);
  return path;
}

static void expect_refused(const char *header, size_t data_len, const char *needle) {
  const char *path = raw_file(header, strlen(header), data_len);
  st_file_t *f = NULL;
  fsdpc_status_t st = st_open(path, &f);
  ck_assert_msg(st != STATUS_OK, "accepted: %s", header);
  ck_assert_ptr_null(f);
  ck_assert_msg(strstr(err_detail(), path) != NULL, "error does not name the file: %s",
                err_detail());
  ck_assert_msg(strstr(err_detail(), needle) != NULL, "error '%s' does not mention '%s'",
                err_detail(), needle);
  remove(path);
}

START_TEST(malformed_files_are_refused) {
  expect_refused("[1,2]", 0, "JSON object");
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
                 "truncated");
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "need");
  expect_refused("{\"a\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "Q7");
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape");
  expect_refused(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
      12, "overlapping");
  expect_refused(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}",
      16, "non-contiguous");
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "cover");
  expect_refused(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
      16, "twice");
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets");
  expect_refused("{\"__metadata__\":{\"k\":3}}", 0, "__metadata__");
  /* a header length beyond the limit, and one beyond the file */
  const char *path = raw_file("{}", (uint64_t)ST_MAX_HEADER + 1, 0);
  st_file_t *f = NULL;
  ck_assert_int_eq(st_open(path, &f), STATUS_EFORMAT);
  path = raw_file("{}", 4096, 0);
  ck_assert_int_eq(st_open(path, &f), STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "truncated") != NULL);
  path = raw_file("", 0, 3);
  ck_assert_int_eq(st_open(path, &f), STATUS_EFORMAT);
  remove(path);
  ck_assert_int_eq(st_open("/nonexistent/x.safetensors", &f), STATUS_EIO);
  /* more dimensions than tensors hold: refused by the reader, for every caller */
  expect_refused("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,2],\"data_offsets\":[0,8]}}",
                 8, "6 dimensions; at most 5");
  /* a FIFO (no writer) or a folder: refused at once, never waited on */
  char fifo[128];
  snprintf(fifo, sizeof fifo, "/tmp/fsdpc_st_%d_fifo", (int)getpid());
  ck_assert_int_eq(mkfifo(fifo, 0600), 0);
  ck_assert_int_eq(st_open(fifo, &f), STATUS_EIO);
  ck_assert_msg(strstr(err_detail(), "is a FIFO, not a regular file"), "%s", err_detail());
  remove(fifo);
  ck_assert_int_eq(st_open("/tmp", &f), STATUS_EIO);
  ck_assert_msg(strstr(err_detail(), "is a folder"), "%s", err_detail());
}
END_TEST

/* Dtypes tensors cannot hold (U8 here) are listed and readable as raw bytes. */
START_TEST(other_dtypes_read_raw) {
  const char *h = "{\"u\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]}}";
  const char *path = raw_file(h, strlen(h), 3);
  st_file_t *f;
  ok(st_open(path, &f));
  const st_info_t *u = st_find(f, "u");
  ck_assert_str_eq(u->dtype_name, "U8");
  ck_assert_int_eq(u->dtype, DTYPE_COUNT);
  unsigned char buf[3] = {9, 9, 9};
  ok(st_read_raw(f, "u", buf, 3));
  ck_assert(buf[0] == 0 && buf[2] == 0);
  ck_assert_int_eq(st_read_raw(f, "u", buf, 2), STATUS_ESHAPE);
  fsdpc_tensor_t t;
  int64_t n = 3;
  ok(tensor_init(&t, DTYPE_F32, device_cpu(), 1, &n));
  ck_assert_int_eq(st_read(f, "u", &t), STATUS_EDTYPE);
  tensor_free(&t);
  st_close(f);
  remove(path);
}
END_TEST

/* Weights by HF name: the reference init file loads; missing, unexpected and misshapen
 * tensors are refused by name. */
START_TEST(model_weights_load_and_save) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_tied_config.json", &cfg));
  llama_t *m;
  ok(llama_new(&cfg, NULL, &m));
  ok(ckpt_load_weights(llama_module(m), SOURCE_ROOT "/tests/reference/tiny_tied_init.safetensors"));
  const char *path = tmp("model.safetensors");
  ok(ckpt_save_weights(llama_module(m), path));
  st_file_t *f;
  ok(st_open(path, &f));
  ck_assert_ptr_null(st_find(f, "lm_head.weight")); /* tied: stored once */
  ck_assert_ptr_nonnull(st_find(f, "model.embed_tokens.weight"));
  st_close(f);
  llama_t *m2;
  ok(llama_new(&cfg, NULL, &m2));
  ok(ckpt_load_weights(llama_module(m2), path));
  nn_param_t *a = nn_param_find(llama_module(m), "model.layers.1.mlp.up_proj.weight");
  nn_param_t *b = nn_param_find(llama_module(m2), "model.layers.1.mlp.up_proj.weight");
  bool eq;
  ok(tensor_equal(dtensor_local(a->value), dtensor_local(b->value), &eq));
  ck_assert(eq);
  /* the untied model misses lm_head.weight in the tied file */
  llama_config_t untied = cfg;
  untied.tie_embeddings = false;
  llama_t *m3;
  ok(llama_new(&untied, NULL, &m3));
  ck_assert_int_eq(ckpt_load_weights(llama_module(m3), path), STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "lm_head.weight") != NULL);
  llama_free(m3);
  /* a model with another ffn size sees a shape mismatch */
  llama_config_t wide = cfg;
  wide.ffn_dim = 96;
  ok(llama_new(&wide, NULL, &m3));
  ck_assert_int_eq(ckpt_load_weights(llama_module(m3), path), STATUS_ESHAPE);
  ck_assert(strstr(err_detail(), "gate_proj") != NULL);
  llama_free(m3);
  /* the tied model refuses the untied file's extra lm_head.weight */
  ck_assert_int_eq(
      ckpt_load_weights(llama_module(m2), SOURCE_ROOT "/tests/reference/tiny_init.safetensors"),
      STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "unexpected") != NULL);
  remove(path);
  llama_free(m);
  llama_free(m2);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("safetensors");
  TCase *tc = tcase_create("safetensors");
  tcase_add_test(tc, round_trip_all_dtypes);
  tcase_add_test(tc, malformed_files_are_refused);
  tcase_add_test(tc, other_dtypes_read_raw);
  tcase_add_test(tc, model_weights_load_and_save);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
