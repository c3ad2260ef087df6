#include <math.h>
#include <string.h>

#include "core/dtype.h"
#include "tests/harness.h"

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

START_TEST(f32_to_bf16_known_patterns) {
  ck_assert_uint_eq(f32_to_bf16(1.0f), 0x3F80);
  ck_assert_uint_eq(f32_to_bf16(-2.0f), 0xC000);
  ck_assert_uint_eq(f32_to_bf16(0.0f), 0x0000);
  ck_assert_uint_eq(f32_to_bf16(-0.0f), 0x8000);
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x3F808000)), 0x3F80); /* tie, even below */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x3F818000)), 0x3F82); /* tie, even above */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x3F808001)), 0x3F81); /* just above the tie */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x3F807FFF)), 0x3F80); /* just below the tie */
  ck_assert_uint_eq(f32_to_bf16(INFINITY), 0x7F80);
  ck_assert_uint_eq(f32_to_bf16(-INFINITY), 0xFF80);
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x7F7FFFFF)), 0x7F80); /* FLT_MAX rounds to inf */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x00010000)), 0x0001); /* subnormal, exact */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x00008000)), 0x0000); /* subnormal tie to even 0 */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x00018000)), 0x0002); /* subnormal tie to even 2 */
  ck_assert_uint_eq(f32_to_bf16(from_bits(0x7FC00000)), 0x7FC0); /* quiet NaN */
  uint16_t snan = f32_to_bf16(from_bits(0x7F800001));            /* payload below bf16 */
  ck_assert_msg((snan & 0x7F80) == 0x7F80 && (snan & 0x7F) != 0, "sNaN became %04x", snan);
  ck_assert_uint_eq(f32_to_bf16(from_bits(0xFFC00000)) & 0x8000, 0x8000); /* sign kept */
}
END_TEST

START_TEST(bf16_to_f32_known_patterns) {
  ck_assert(bf16_to_f32(0x3F80) == 1.0f);
  ck_assert(bf16_to_f32(0xC000) == -2.0f);
  ck_assert(isinf(bf16_to_f32(0x7F80)) && bf16_to_f32(0x7F80) > 0);
  ck_assert(isnan(bf16_to_f32(0x7FC0)));
  ck_assert(bf16_to_f32(0x0001) == from_bits(0x00010000));
}
END_TEST

START_TEST(f32_to_f16_known_patterns) {
  ck_assert_uint_eq(f32_to_f16(1.0f), 0x3C00);
  ck_assert_uint_eq(f32_to_f16(-2.0f), 0xC000);
  ck_assert_uint_eq(f32_to_f16(-0.0f), 0x8000);
  ck_assert_uint_eq(f32_to_f16(65504.0f), 0x7BFF);
  ck_assert_uint_eq(f32_to_f16(65519.0f), 0x7BFF); /* below the tie with 65536 */
  ck_assert_uint_eq(f32_to_f16(65520.0f), 0x7C00); /* the tie rounds to even: inf */
  ck_assert_uint_eq(f32_to_f16(1e10f), 0x7C00);
  ck_assert_uint_eq(f32_to_f16(-INFINITY), 0xFC00);
  ck_assert_uint_eq(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);     /* tie, even below */
  ck_assert_uint_eq(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02); /* tie, even above */
  ck_assert_uint_eq(f32_to_f16(0x1p-14f), 0x0400);            /* smallest normal */
  ck_assert_uint_eq(f32_to_f16(1023 * 0x1p-24f), 0x03FF);     /* largest subnormal */
  ck_assert_uint_eq(f32_to_f16(0x1p-24f), 0x0001);            /* smallest subnormal */
  ck_assert_uint_eq(f32_to_f16(0x1p-25f), 0x0000);            /* tie: even is zero */
  ck_assert_uint_eq(f32_to_f16(3 * 0x1p-25f), 0x0002);        /* tie: even is two */
  ck_assert_uint_eq(f32_to_f16(0.75f * 0x1p-24f), 0x0001);    /* above the tie */
  ck_assert_uint_eq(f32_to_f16(0x1p-26f), 0x0000);
  ck_assert_uint_eq(f32_to_f16(-0x1p-24f), 0x8001);
  ck_assert_uint_eq(f32_to_f16(1023.5f * 0x1p-24f), 0x0400); /* rounds into the normals */
  uint16_t n = f32_to_f16(NAN);
  ck_assert_msg((n & 0x7C00) == 0x7C00 && (n & 0x3FF) != 0, "NaN became %04x", n);
  n = f32_to_f16(from_bits(0x7F800001)); /* payload too small for f16: still a NaN */
  ck_assert_msg((n & 0x7C00) == 0x7C00 && (n & 0x3FF) != 0, "sNaN became %04x", n);
}
END_TEST

START_TEST(f16_to_f32_known_patterns) {
  ck_assert(f16_to_f32(0x3C00) == 1.0f);
  ck_assert(f16_to_f32(0x7BFF) == 65504.0f);
  ck_assert(f16_to_f32(0x0001) == 0x1p-24f);
  ck_assert(f16_to_f32(0x8001) == -0x1p-24f);
  ck_assert(f16_to_f32(0x03FF) == 1023 * 0x1p-24f);
  ck_assert(isinf(f16_to_f32(0x7C00)));
  ck_assert(isnan(f16_to_f32(0x7E00)));
  ck_assert(signbit(f16_to_f32(0x8000)));
}
END_TEST

START_TEST(half_round_trip_exhaustive) {
  for (uint32_t h = 0; h < 65536; h++) {
    /* compared first, asserted on a mismatch: each passing ck_assert costs a record written
     * to Check's log, which dominates loops this long */
    float f = f16_to_f32((uint16_t)h);
    if (isnan(f)) continue;
    if (f32_to_f16(f) != h)
      ck_abort_msg("f16 %04x -> %a -> %04x", h, (double)f, f32_to_f16(f));
    float g = bf16_to_f32((uint16_t)h);
    if (isnan(g)) continue;
    if (f32_to_bf16(g) != h) ck_abort_msg("bf16 %04x did not round trip", h);
  }
}
END_TEST

#ifdef __FLT16_MAX__
/* The compiler's own _Float16 conversion (IEEE round to nearest even) as an independent
 * reference over random bit patterns. */
START_TEST(f32_to_f16_matches_compiler) {
  test_rng_t rng = {42};
  for (int i = 0; i < 2000000; i++) {
    uint32_t u = (uint32_t)test_rng_next(&rng);
    float f = from_bits(u);
    if (isnan(f)) continue;
    _Float16 ref = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &ref, sizeof bits);
    if (f32_to_f16(f) != bits) /* asserted on a mismatch only, as above */
      ck_abort_msg("%08x: got %04x, want %04x", u, f32_to_f16(f), bits);
  }
}
END_TEST
#endif

START_TEST(dtype_store_saturates_integers) {
  int32_t i32[3];
  dtype_store(DTYPE_I32, i32, 0, 3e10);
  dtype_store(DTYPE_I32, i32, 1, -3e10);
  dtype_store(DTYPE_I32, i32, 2, -7.9);
  ck_assert_int_eq(i32[0], INT32_MAX);
  ck_assert_int_eq(i32[1], INT32_MIN);
  ck_assert_int_eq(i32[2], -7);
  int64_t i64[2];
  dtype_store(DTYPE_I64, i64, 0, NAN);
  dtype_store(DTYPE_I64, i64, 1, 1e300);
  ck_assert_int_eq(i64[0], 0);
  ck_assert(i64[1] > INT64_MAX - 2048);
}
END_TEST

START_TEST(dtype_parse_names) {
  dtype_t dt;
  ck_assert_int_eq(dtype_parse("bfloat16", &dt), STATUS_OK);
  ck_assert_int_eq(dt, DTYPE_BF16);
  ck_assert_int_eq(dtype_parse("fp32", &dt), STATUS_OK);
  ck_assert_int_eq(dt, DTYPE_F32);
  ck_assert_int_eq(dtype_parse("float8", &dt), STATUS_EDTYPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "float8"));
  ck_assert_uint_eq(dtype_size(DTYPE_I64), 8);
  ck_assert_uint_eq(dtype_size(DTYPE_BF16), 2);
  ck_assert_str_eq(dtype_name(DTYPE_F16), "f16");
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("dtype");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, f32_to_bf16_known_patterns);
  tcase_add_test(tc, bf16_to_f32_known_patterns);
  tcase_add_test(tc, f32_to_f16_known_patterns);
  tcase_add_test(tc, f16_to_f32_known_patterns);
  tcase_add_test(tc, half_round_trip_exhaustive);
#ifdef __FLT16_MAX__
  tcase_add_test(tc, f32_to_f16_matches_compiler);
#endif
  tcase_add_test(tc, dtype_store_saturates_integers);
  tcase_add_test(tc, dtype_parse_names);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
