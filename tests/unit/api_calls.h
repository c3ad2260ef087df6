/* The table gen_api_calls.py writes: one call per public function and argument set. */
#ifndef FSDPC_TESTS_API_CALLS_H
#define FSDPC_TESTS_API_CALLS_H

typedef struct api_call {
  const char *name;
  const char *header;
  int minus_one;     /* numbers -1 (unsigned: their largest value) rather than 0 */
  int refuses;       /* returns fsdpc_status_t and takes a pointer: must not return STATUS_OK */
  int (*call)(void); /* 0 when the call returned STATUS_OK */
} api_call_t;

extern const api_call_t api_calls[];
extern const int api_call_count;

#endif
