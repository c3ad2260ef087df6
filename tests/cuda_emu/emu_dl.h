/*
 * The CUDA emulator's dynamic loading: the CUDA backend loads cuBLAS, cuBLASLt and cuDNN with
 * dlopen at run time; in the emulator's build its sources call these instead, which give the
 * emulated cuBLAS and cuBLASLt (cublas.cpp) and report every other library (cuDNN) absent, as
 * on a machine without it. Included before each of them.
 */
#ifndef FSDPC_TESTS_CUDA_EMU_DL_H
#define FSDPC_TESTS_CUDA_EMU_DL_H

#include <dlfcn.h>

#ifdef __cplusplus
extern "C" {
#endif
void *emu_dlopen(const char *name, int flags);
void *emu_dlsym(void *lib, const char *symbol);
char *emu_dlerror(void);
#ifdef __cplusplus
}
#endif

#define dlopen emu_dlopen
#define dlsym emu_dlsym
#define dlerror emu_dlerror

#endif
