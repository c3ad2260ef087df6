/* bench-ckpt-load under mpirun -n W (W > 1): a W-way FSDP checkpoint and each rank's resume of
 * it (see ckpt_load.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "bench/ckpt_load.h"
#include "checkpoint/train_ckpt.h"

/* With W > 1 ranks: a W-way FSDP checkpoint (fully_shard per layer and root, saved by the W
 * ranks), each rank's resume (deferred build, shard, memory for its shards, load its own
 * chunks) from it and from a copy without checksums, against each rank reading its own files
 * from the page cache; the slowest rank's times, medians over the repetitions. */
void ckb_sharded(const llama_config_t *cfg, int reps) {
  int W = world_size();
  mesh_t *mesh;
  const char *names[] = {"dp_shard"};
  BENCH_TRY(mesh_new(1, &W, names, DEVICE_CPU, &mesh));
  char tmp[] = "/tmp/fsdpc-ckpt-load-XXXXXX", dir[256] = {0}, plain[300];
  if (world_rank() == 0) {
    if (mkdtemp(tmp) == NULL) {
      perror("mkdtemp");
      bench_leave(1);
    }
    snprintf(dir, sizeof dir, "%s/step-00000001", tmp);
  }
  char *all = malloc(sizeof dir * (size_t)W);
  if (all == NULL) bench_leave(1);
  BENCH_TRY(pg_host_all_gather(world_pg(), dir, all, (int)sizeof dir, PG_HOST_BYTE));
  memcpy(dir, all, sizeof dir); /* rank 0's */
  free(all);
  snprintf(plain, sizeof plain, "%s.unchecked", dir);
  ckb_built_t b;
  ckb_build(&b, cfg, false, mesh);
  ckb_zero_moments(&b);
  BENCH_TRY(ckpt_save_training(dir, b.ps, b.n, b.opt, 1, NULL, world_pg()));
  ckb_unbuild(&b);
  if (world_rank() == 0) ckb_copy_unchecked_checkpoint(dir, plain);
  ckb_barrier();
  char *buf = malloc(CKB_PLAIN_PIECE);
  if (buf == NULL) bench_leave(1);
  uint64_t own = ckb_read_own(dir, buf, CKB_PLAIN_PIECE, NULL), total = 0, at;
  char *mem = ckb_memory_in_use(own);
  double t_read[64], t_into[64], t_load[64], t_plain[64];
  size_t fresh = 0; /* blocks rank 0's last checked resume took from the system */
  for (int r = 0; r < reps; r++) {
    ckb_barrier();
    double t0 = device_clock_seconds();
    ckb_read_own(dir, buf, CKB_PLAIN_PIECE, NULL);
    t_read[r] = ckb_slowest(t0);
    ckb_barrier();
    at = 0;
    t0 = device_clock_seconds();
    ckb_read_own(dir, mem, own, &at);
    t_into[r] = ckb_slowest(t0);
    for (int j = 0; j < 2; j++) { /* checked and unchecked back to back, alternating first */
      int k = (j + r) % 2;
      ckb_read_own(k ? dir : plain, buf, CKB_PLAIN_PIECE, NULL);
      ckb_barrier();
      size_t os0 = mem_os_allocs(device_cpu());
      t0 = device_clock_seconds();
      ckb_build(&b, cfg, true, mesh);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_load : t_plain)[r] = ckb_slowest(t0);
      if (k) fresh = mem_os_allocs(device_cpu()) - os0;
      ckb_unbuild(&b);
    }
  }
  BENCH_TRY(pg_host_all_reduce(world_pg(), &own, &total, 1, PG_HOST_I64, REDUCE_SUM));
  double tr = bench_median(t_read, reps), ti = bench_median(t_into, reps),
         tl = bench_median(t_load, reps);
  if (world_rank() == 0) {
    printf(
        "checkpoint %s: %lld parameters, %d ranks (FSDP: fully_shard per layer and root), "
        "%.1f MB in their files, %.1f MB per rank\n",
        dir, (long long)llama_num_params(cfg), W, (double)total / 1e6, (double)total / 1e6 / W);
    printf(
        "each rank reading its own files (page cache), the slowest rank: %.3f s into "
        "memory of their size (memory in use, each byte in its own place, as a load puts "
        "it); %.3f s in %zu MiB pieces into one buffer (which stays in the CPU's caches)\n",
        ti, tr, CKB_PLAIN_PIECE >> 20);
    printf(
        "resume, deferred (build, shard, memory for the shards, load), repeated in these "
        "processes (rank 0's took %zu blocks of 64 KiB or more from the system, the rest "
        "the blocks an earlier load freed; a new process takes them all, see the one-rank "
        "run), the slowest rank: %.3f s: %s of the read into memory (%.2fx the read into "
        "one buffer)\n",
        fresh, tl, ckb_paired_ratio(t_load, t_into, reps), tl / tr);
    ckb_print_hashing();
    printf("block checks: %.3f s checked, %.3f s from the same files without checksums: %s\n", tl,
           bench_median(t_plain, reps), ckb_paired_cost(t_load, t_plain, reps));
    printf("(times: medians of %d interleaved repetitions of the slowest rank's)\n", reps);
  }
  device_free(device_cpu(), mem, own);
  free(buf);
  ckb_barrier();
  if (world_rank() == 0) {
    file_remove_tree(plain);
    file_remove_tree(dir);
    rmdir(tmp);
  }
  mesh_free(mesh);
}
