/*
 * Private to mesh/: the life of the job's NCCL communicators, apart from NCCL itself. Every
 * communicator the NCCL groups create is tracked here, and every NCCL call that can fail,
 * stay in progress or end a communicator goes through a table of functions, so that the
 * failure and teardown paths compile and are tested in every build (tests install a
 * recording table; mesh/pg_nccl.c installs NCCL's own).
 *
 *   - an NCCL call's result: in progress is polled to its end; an error aborts that
 *     communicator (its kernels end; a communicator in error is never destroyed);
 *   - a stop of the job (world_stop on this rank, a stop or the watchdog seen in any host
 *     wait) aborts every live communicator;
 *   - asynchronous errors (a peer that failed, a network error) are polled about every
 *     100 ms during every host wait, not only while a call starts: the first aborts every
 *     communicator and stops the job;
 *   - closing a communicator finalizes it (its outstanding work drains), polled within a
 *     limit and under the wait hook, then destroys it; failing that, aborts it.
 */
#ifndef FSDPC_MESH_NCCL_COMMS_H
#define FSDPC_MESH_NCCL_COMMS_H

#include <stdbool.h>

#include "core/status.h"

/* NCCL's results, as ints so that this file needs no NCCL header */
enum { NCCL_RESULT_OK = 0, NCCL_RESULT_IN_PROGRESS = 7 };

typedef struct nccl_table {
  int (*abort)(void *comm);
  int (*finalize)(void *comm);
  int (*destroy)(void *comm);
  int (*async_error)(void *comm, int *state); /* *state: the communicator's last call's */
  const char *(*error_string)(int rc);
} nccl_table_t;

typedef struct nccl_comm {
  void *comm; /* NCCL's ncclComm_t */
  const nccl_table_t *t;
  bool aborted; /* comm is gone (aborted): no call may use it */
  char name[96];
  struct nccl_comm *prev, *next; /* the live list */
} nccl_comm_t;

/* Tracks c (comm, t and name set) until nccl_comm_close. */
void nccl_comm_track(nccl_comm_t *c);

/* The result rc of an NCCL call on c: STATUS_OK; in progress, polled to its end (under the
 * wait hook: a stop or the watchdog ends the poll and aborts every communicator); an error:
 * STATUS_ENCCL naming what and NCCL's text, and c aborted. */
fsdpc_status_t nccl_comm_result(nccl_comm_t *c, int rc, const char *what);

/* Polls c until its last call has finished (nccl_comm_result of an in-progress call). */
fsdpc_status_t nccl_comm_settle(nccl_comm_t *c, const char *what);

/* Aborts c (once); every live communicator. Thread-safe. */
void nccl_comm_abort(nccl_comm_t *c);
void nccl_comm_abort_all(void);

/* The asynchronous errors of every live communicator, asked at most every 100 ms (the time
 * of the last ask is kept): the first error aborts every communicator and is returned,
 * naming the communicator. */
fsdpc_status_t nccl_comm_poll_errors(void);

/* Ends c and stops tracking it: an aborted c needs nothing; else finalize, its work polled
 * to its end for at most limit_s seconds (and under the wait hook), then destroy; an error,
 * a stop or the limit aborts it instead. Returns how it ended (STATUS_OK: finalized). */
fsdpc_status_t nccl_comm_close(nccl_comm_t *c, double limit_s);

#endif
