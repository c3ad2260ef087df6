#include "core/dtype.h"

#include <math.h>
#include <string.h>

size_t dtype_size(dtype_t dt) {
  switch (dt) {
    case DTYPE_F32:
    case DTYPE_I32: return 4;
    case DTYPE_BF16:
    case DTYPE_F16: return 2;
    case DTYPE_I64: return 8;
    default: return 0;
  }
}

const char *dtype_name(dtype_t dt) {
  static const char *const names[DTYPE_COUNT] = {
      [DTYPE_F32] = "f32", [DTYPE_BF16] = "bf16", [DTYPE_F16] = "f16",
      [DTYPE_I32] = "i32", [DTYPE_I64] = "i64",
  };
  if ((unsigned)dt >= DTYPE_COUNT) return "invalid";
  return names[dt];
}

fsdpc_status_t dtype_parse(const char *name, dtype_t *out) {
  static const struct {
    const char *name;
    dtype_t dt;
  } aliases[] = {
      {"f32", DTYPE_F32},     {"float32", DTYPE_F32},   {"fp32", DTYPE_F32},
      {"bf16", DTYPE_BF16},   {"bfloat16", DTYPE_BF16}, {"f16", DTYPE_F16},
      {"float16", DTYPE_F16}, {"fp16", DTYPE_F16},      {"i32", DTYPE_I32},
      {"int32", DTYPE_I32},   {"i64", DTYPE_I64},       {"int64", DTYPE_I64},
  };
  if (name == NULL || out == NULL) return err_set(STATUS_EINVAL, "dtype_parse: NULL argument");
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++) {
    if (strcmp(name, aliases[i].name) == 0) {
      *out = aliases[i].dt;
      return STATUS_OK;
    }
  }
  return err_set(STATUS_EDTYPE, "unknown dtype '%s' (expected f32, bf16, f16, i32 or i64)", name);
}

int dtype_is_float(dtype_t dt) { return dt == DTYPE_F32 || dt == DTYPE_BF16 || dt == DTYPE_F16; }

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Written without branches, so that loops over it vectorise. */
static inline uint16_t bf16_of_bits(uint32_t u) {
  uint32_t nan = (u >> 16) | 0x0040u; /* NaN: keep sign and top payload, force quiet */
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* to nearest even; overflow: inf */
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

uint16_t f32_to_bf16(float f) { return bf16_of_bits(f32_bits(f)); }

float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;

  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65536: inf */

  int32_t exp = (int32_t)(abs >> 23) - 127 + 15;
  uint32_t mant = abs & 0x7fffffu;
  if (exp <= 0) {
    /* f16 subnormal (or zero): value = mant16 * 2^-24. */
    if (exp < -10) return sign; /* below half the smallest subnormal: rounds to zero */
    mant |= 0x800000u;          /* implicit leading one */
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = 1u << (shift - 1);
    uint32_t rest = mant & ((1u << shift) - 1);
    uint32_t q = mant >> shift;
    if (rest > half || (rest == half && (q & 1u))) q++;
    return (uint16_t)(sign | q); /* q may carry into the smallest normal: still correct */
  }
  uint32_t q = ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (q & 1u))) q++; /* carry may reach inf: correct */
  return (uint16_t)(sign | q);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    float v = ldexpf((float)mant, -24);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

double dtype_load(dtype_t dt, const void *buf, size_t i) {
  if (buf == NULL) return 0.0;
  switch (dt) {
    case DTYPE_F32: return ((const float *)buf)[i];
    case DTYPE_BF16: return bf16_to_f32(((const uint16_t *)buf)[i]);
    case DTYPE_F16: return f16_to_f32(((const uint16_t *)buf)[i]);
    case DTYPE_I32: return ((const int32_t *)buf)[i];
    case DTYPE_I64: return (double)((const int64_t *)buf)[i];
    default: return 0.0;
  }
}

static int64_t saturate(double v, double lo, double hi) {
  if (isnan(v)) return 0;
  if (v <= lo) return (int64_t)lo;
  if (v >= hi) return (int64_t)hi;
  return (int64_t)v;
}

void dtype_store(dtype_t dt, void *buf, size_t i, double v) {
  if (buf == NULL) return;
  switch (dt) {
    case DTYPE_F32: ((float *)buf)[i] = (float)v; break;
    case DTYPE_BF16: ((uint16_t *)buf)[i] = f32_to_bf16((float)v); break;
    case DTYPE_F16: ((uint16_t *)buf)[i] = f32_to_f16((float)v); break;
    case DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)saturate(v, -2147483648.0, 2147483647.0); break;
    case DTYPE_I64:
      /* 2^63 is not representable in int64; the largest double below it is. */
      ((int64_t *)buf)[i] = saturate(v, -9223372036854775808.0, 9223372036854774784.0);
      break;
    default: break;
  }
}

void dtype_to_f32(dtype_t dt, const void *src, float *dst, size_t n) {
  if (src == NULL || dst == NULL) return;
  switch (dt) {
    case DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case DTYPE_BF16: {
      const uint16_t *h = src;
#pragma omp simd
      for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16);
      break;
    }
    case DTYPE_F16: {
      const uint16_t *h = src;
      for (size_t i = 0; i < n; i++) dst[i] = f16_to_f32(h[i]);
      break;
    }
    default:
      for (size_t i = 0; i < n; i++) dst[i] = (float)dtype_load(dt, src, i);
  }
}

void dtype_from_f32(dtype_t dt, const float *src, void *dst, size_t n) {
  if (src == NULL || dst == NULL) return;
  switch (dt) {
    case DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case DTYPE_BF16: {
      uint16_t *h = dst;
#pragma omp simd
      for (size_t i = 0; i < n; i++) h[i] = bf16_of_bits(f32_bits(src[i]));
      break;
    }
    case DTYPE_F16: {
      uint16_t *h = dst;
      for (size_t i = 0; i < n; i++) h[i] = f32_to_f16(src[i]);
      break;
    }
    default:
      for (size_t i = 0; i < n; i++) dtype_store(dt, dst, i, src[i]);
  }
}

void dtype_round_f32(dtype_t dt, float *x, size_t n) {
  switch (dt) {
    case DTYPE_BF16:
#pragma omp simd
      for (size_t i = 0; i < n; i++) x[i] = bits_f32((uint32_t)bf16_of_bits(f32_bits(x[i])) << 16);
      break;
    case DTYPE_F16:
      for (size_t i = 0; i < n; i++) x[i] = f16_to_f32(f32_to_f16(x[i]));
      break;
    default: break;
  }
}
