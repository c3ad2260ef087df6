/* The CUDA entry points when the library is built without CUDA: no backend and no kernels, so
 * device_check() refuses every CUDA device. */
#include "core/backend_impl.h"
#include "core/kernels_impl.h"

const backend_t *cuda_backend(void) { return NULL; }
const kernel_ops_t *cuda_kernels(void) { return NULL; }

void kernel_attention_set_fused(bool on) { (void)on; }
const char *kernel_attention_fused_off(void) { return "built without CUDA"; }
int64_t kernel_attention_fused_runs(void) { return 0; }
const char *kernel_attention_fused_note(void) { return "built without CUDA"; }

void kernel_matmul_set_lt(bool on) { (void)on; }
const char *kernel_matmul_lt_off(void) { return "built without CUDA"; }
int64_t kernel_matmul_lt_runs(void) { return 0; }
const char *kernel_matmul_lt_note(void) { return "built without CUDA"; }

void kernel_matmul_set_grouped(bool on) { (void)on; }
const char *kernel_matmul_grouped_off(void) { return "built without CUDA"; }
int64_t kernel_matmul_grouped_runs(void) { return 0; }
const char *kernel_matmul_grouped_note(void) { return "built without CUDA"; }
