/* libFuzzer harness: the YAML plan parser (plan_load, then plan_resolve on 8 ranks). Any input
 * must give a plan or an error, never a crash, a leak or a hang. */
#include "train/plan.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char path[64];
  int fd = fuzz_file(data, size, path, sizeof path);
  fsdpc_plan_t p;
  if (plan_load(&p, path, NULL, 0) == STATUS_OK) (void)plan_resolve(&p, 8);
  close(fd);
  return 0;
}
