/*
 * Status codes shared by the whole library.
 *
 * Every fallible function returns a fsdpc_status_t: 0 (STATUS_OK) on success, a negative code
 * on failure. The code says what kind of failure it was; the detail text (err_detail())
 * says which object and which values, e.g. "shape [7,15] cannot be viewed as [16,15]".
 *
 *   fsdpc_status_t st = tensor_init(&t, DTYPE_F32, device_cpu(), 2, shape);
 *   if (st != STATUS_OK)
 *     fprintf(stderr, "%s: %s\n", status_str(st), err_detail());
 *
 * The detail text is thread-local and belongs to the last failure on this thread.
 */
#ifndef FSDPC_BASE_STATUS_H
#define FSDPC_BASE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* X-macro table: name, value, message. */
#define STATUS_TABLE(X)                           \
  X(OK, 0, "ok")                                  \
  X(EINVAL, -1, "invalid argument")               \
  X(ENOMEM, -2, "out of memory")                  \
  X(ENODEV, -3, "device not available")           \
  X(ESHAPE, -4, "shape mismatch")                 \
  X(EDTYPE, -5, "unsupported dtype")              \
  X(EMPI, -6, "MPI error")                        \
  X(ECUDA, -7, "CUDA error")                      \
  X(ENCCL, -8, "NCCL error")                      \
  X(ECUBLAS, -9, "cuBLAS error")                  \
  X(EIO, -10, "I/O error")                        \
  X(EFORMAT, -11, "malformed input")              \
  X(EMESH, -12, "invalid device mesh")            \
  X(EPLACEMENT, -13, "invalid placement")         \
  X(EUNSUPPORTED, -14, "operation not supported") \
  X(EINTERNAL, -15, "internal error")             \
  X(ETIMEOUT, -16, "timed out")

typedef enum fsdpc_status {
#define STATUS_ENUM_(name, value, msg) STATUS_##name = (value),
  STATUS_TABLE(STATUS_ENUM_)
#undef STATUS_ENUM_
} fsdpc_status_t;

/* Static text for a status code; never NULL. */
const char *status_str(fsdpc_status_t st);

/* The library's version, "MAJOR.MINOR.PATCH" (what every program's --version prints). */
const char *fsdpc_version(void);

/* Detail text of the last error recorded on this thread ("" if none). Valid until the next
 * err_set() on this thread. */
const char *err_detail(void);

/* Records a formatted detail text and returns st, so that failures read
 *   return err_set(STATUS_ESHAPE, "shape %s ...", ...); */
fsdpc_status_t err_set(fsdpc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Puts a formatted prefix and ": " before the current detail text and returns st, so that
 * a caller adds where a failure happened:
 *   if (st != STATUS_OK) return err_prefix(st, "AdamW step of %s", fqn); */
fsdpc_status_t err_prefix(fsdpc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears the detail text. */
void err_clear(void);

/* Propagate a failing status: evaluates expr once, returns it from the caller on failure. */
#define FSDPC_TRY(expr)                       \
  do {                                        \
    fsdpc_status_t try_st_ = (expr);          \
    if (try_st_ != STATUS_OK) return try_st_; \
  } while (0)

/* Same, but jumps to `cleanup` with `st` set, for functions that must release resources. */
#define FSDPC_TRY_GOTO(st, expr)         \
  do {                                   \
    (st) = (expr);                       \
    if ((st) != STATUS_OK) goto cleanup; \
  } while (0)

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
