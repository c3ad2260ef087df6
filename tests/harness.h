/*
 * Runs a Check suite on every rank of an MPI job (or alone, as a world of one).
 *
 * Check runs in CK_NOFORK mode (forking after MPI_Init is not allowed), so a test that
 * fails an assertion on one rank only must not leave the others waiting in a collective:
 * multi-rank tests count their failures locally and assert on the agreed result
 * (expect_all), so all ranks fail together. The exit code is 0 only when every rank passed;
 * 77 (skip) when the suite asked for it on every rank.
 */
#ifndef FSDPC_TESTS_HARNESS_H
#define FSDPC_TESTS_HARNESS_H

#include <check.h>
#include <mpi.h> /* the tests use MPI directly to coordinate their ranks */
#include <stdbool.h>

#include "core/tensor.h"
#include "dtensor/dtensor.h"
#include "mesh/mesh.h"
#include "mesh/world.h"

/* Initialises the world, runs the suite, combines the ranks' verdicts, finalises. */
int harness_main(int argc, char **argv, Suite *(*make_suite)(void));

/* 1 when ok holds on every rank of the world. Collective. */
int all_ranks(int ok);

/* Asserts that ok holds on every rank (collective; every rank fails together). */
#define expect_all(ok, ...) ck_assert_msg(all_ranks(ok), __VA_ARGS__)

/* Asks harness_main to exit 77 (skip) once the suite has run. */
void harness_skip(const char *why);

/* Deterministic random numbers, identical on every rank for the same seed. */
typedef struct test_rng {
  unsigned long long s;
} test_rng_t;
unsigned long long test_rng_next(test_rng_t *r);
/* Uniform in [lo, hi]. */
int test_rng_int(test_rng_t *r, int lo, int hi);

/* Uniform in [-1, 1). */
double test_rng_uniform(test_rng_t *r);

/* Fills a float tensor (any device) with uniform values in [-scale, scale). */
void test_fill_uniform(fsdpc_tensor_t *t, test_rng_t *r, double scale);

/* ||a - ref||_2 / ||ref||_2 over two float tensors of the same shape (any devices);
 * fails the test when the comparison itself cannot run. */
double test_rel_l2(const fsdpc_tensor_t *a, const fsdpc_tensor_t *ref);

/* A mesh of this process alone, on the CPU (caller frees). */
mesh_t *test_local_mesh(void);

/* An F32 DTensor of shape[0..ndim), every element fill, replicated on mesh (caller frees). */
dtensor_t *test_replicated(mesh_t *mesh, int ndim, const int64_t *shape, double fill);

/* The process's arguments after MPI's, for suites that take a mode ("cuda"). */
int test_argc(void);
char **test_argv(void);

#endif
