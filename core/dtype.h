/*
 * Element types and scalar conversions.
 *
 * bf16 and f16 are stored as raw uint16_t bit patterns. Conversions from f32 round to
 * nearest, ties to even; NaN stays NaN (quiet), infinities stay infinite, values too large
 * for the target become infinity, f16 subnormals are produced and read exactly.
 *
 *   uint16_t h = f32_to_bf16(1.0f);       // 0x3F80
 *   float f = bf16_to_f32(h);             // 1.0f
 */
#ifndef FSDPC_BASE_DTYPE_H
#define FSDPC_BASE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum dtype {
  DTYPE_F32 = 0,
  DTYPE_BF16,
  DTYPE_F16,
  DTYPE_I32,
  DTYPE_I64,
  DTYPE_COUNT
} dtype_t;

/* Size of one element in bytes; 0 for an invalid dtype. */
size_t dtype_size(dtype_t dt);

/* Lower-case name ("f32", "bf16", ...); "invalid" for an invalid dtype. */
const char *dtype_name(dtype_t dt);

/* Parses a name as written in plans: f32/float32, bf16/bfloat16, f16/float16, i32/int32,
 * i64/int64. Returns STATUS_EDTYPE for anything else. */
fsdpc_status_t dtype_parse(const char *name, dtype_t *out);

/* 1 for f32, bf16, f16; 0 for integers. */
int dtype_is_float(dtype_t dt);

uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

/* Reads element i of a buffer of type dt as double (i64 beyond 2^53 loses precision). */
double dtype_load(dtype_t dt, const void *buf, size_t i);

/* Writes v as element i of a buffer of type dt: floats round as above, integers truncate
 * toward zero and saturate at the type's range; NaN becomes 0 for integers. */
void dtype_store(dtype_t dt, void *buf, size_t i, double v);

/* n elements of a buffer of type dt as f32 (exact for the float dtypes), and n f32 values
 * written as type dt (rounded as dtype_store does): typed loops, vectorised for bf16. */
void dtype_to_f32(dtype_t dt, const void *src, float *dst, size_t n);
void dtype_from_f32(dtype_t dt, const float *src, void *dst, size_t n);
/* x[i] = x[i] stored as type dt and loaded again, for i < n (float dtypes; f32: unchanged):
 * vectorised for bf16. */
void dtype_round_f32(dtype_t dt, float *x, size_t n);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
