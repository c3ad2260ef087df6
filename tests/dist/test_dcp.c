/*
 * Distributed checkpoints: tensors saved under one plan load under another (world-1
 * replicate, 1-D shard on either dimension, 2-D HSDP, (S(0), S(1)) and the strided
 * (SS(0), S(0)) of FSDP over tensor parallelism) exactly equal to
 * distributing the original directly, from the files as saved and from a copy without
 * checksums; replicas are written once; each rank reads exactly the checksum blocks its
 * shards touch (without checksums: the bytes from the first its box needs to the last); a
 * damaged block fails exactly the loads that touch it, small blocks or large chunks hashed
 * while the next bytes are read; bad folders and mismatches give errors naming the tensor.
 */
#include <cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/dcp.h"
#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/safetensors.h"
#include "tests/harness.h"

#define NT 5
static const int64_t shapes[NT][2] = {{16, 15}, {7, 15}, {3, 0}, {1, 8}, {10, 6}};
static const char *names[NT] = {"a.weight", "b.weight", "c.bias", "d.row", "e.half"};

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

static int ndim_of(int i) { return shapes[i][1] ? 2 : 1; }

/* The global value of tensor i: i * 1000 + its flat index (exact in f32 and bf16 here). */
static void full_of(int i, fsdpc_tensor_t *t) {
  ok(tensor_init(t, DTYPE_F32, device_cpu(), ndim_of(i), shapes[i]));
  for (int64_t k = 0; k < tensor_numel(t); k++)
    ((float *)t->data)[k] = (float)(i == 4 ? k % 200 : i * 1000 + k);
}

/* Distributes every tensor with placements pl (ndim-1 tensors shard dim 0 where 2-D ones
 * would shard dim 1). */
static void make(mesh_t *mesh, const placement_t *pl, bool zero, dcp_entry_t *e, dtensor_t **d) {
  for (int i = 0; i < NT; i++) {
    fsdpc_tensor_t full;
    full_of(i, &full);
    if (i == 4) { /* stored as bf16 */
      fsdpc_tensor_t h;
      ok(tensor_clone(&h, &full, DTYPE_BF16, device_cpu()));
      tensor_free(&full);
      full = h;
    }
    if (zero) ok(tensor_fill(&full, 0));
    placement_t p[2] = {pl[0], pl[1]};
    for (int k = 0; k < mesh_ndim(mesh); k++)
      if (p[k].kind == PLACEMENT_SHARD && p[k].dim >= ndim_of(i)) p[k] = placement_shard(0);
    ok(dtensor_distribute(&full, mesh, p, DTENSOR_ALL_RANKS, &d[i]));
    tensor_free(&full);
    e[i] = (dcp_entry_t){names[i], d[i]};
  }
}

static void free_all(dtensor_t **d) {
  for (int i = 0; i < NT; i++) dtensor_free(d[i]);
}

static char root[256];

static void make_root(void) {
  if (world_rank() == 0) {
    snprintf(root, sizeof root, "/tmp/fsdpc-dcp-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(root));
  }
  MPI_Bcast(root, sizeof root, MPI_CHAR, 0, MPI_COMM_WORLD);
}

static void remove_root(void) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
  }
}


/* Flips the bits mask of byte pos of tensor name's data in rank 0's file of folder dir. */
static void flip_data_byte(const char *dir, const char *name, uint64_t pos, int mask) {
  char path[500];
  snprintf(path, sizeof path, "%s/shard-00000.safetensors", dir);
  st_file_t *f;
  ok(st_open(path, &f));
  long at = (long)(st_header_bytes(f) + st_find(f, name)->begin + pos);
  st_close(f);
  FILE *fp = fopen(path, "r+b");
  ck_assert_ptr_nonnull(fp);
  ck_assert_int_eq(fseek(fp, at, SEEK_SET), 0);
  int c = fgetc(fp);
  ck_assert_int_eq(fseek(fp, at, SEEK_SET), 0);
  fputc(c ^ mask, fp);
  fclose(fp);
}

/* Whether the last bytes bytes of tensor name in rank 0's file of folder dir read as cached
 * (st_read_cached); with drop, after the file's pages were dropped from the page cache (written
 * back first), so that the next reads come from storage. The file is opened before the drop:
 * reading its header afterwards could bring the data's first pages back (readahead). Rank 0
 * alone, before others read. */
static bool pages_cached(const char *dir, const char *name, size_t bytes, bool drop) {
  char path[500];
  snprintf(path, sizeof path, "%s/shard-00000.safetensors", dir);
  st_file_t *f;
  ok(st_open(path, &f));
  const st_info_t *t = st_find(f, name);
  uint64_t size = t->end - t->begin;
  ck_assert_uint_ge(size, bytes);
  char *buf = malloc(bytes);
  ck_assert_ptr_nonnull(buf);
  bool cached = true;
  /* pages just written or read may sit in a CPU's list for a moment, where the drop skips
   * them: tried again, for up to 2 s */
  for (int tries = 0; tries < (drop ? 100 : 1) && cached; tries++) {
    if (drop) {
      if (tries) usleep(20000);
      int fd = open(path, O_RDONLY);
      ck_assert_int_ge(fd, 0);
      ck_assert_int_eq(fdatasync(fd), 0);
      ck_assert_int_eq(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
      close(fd);
    }
    cached = st_read_cached(f, name, size - bytes, buf, bytes, 64) == bytes;
  }
  free(buf);
  st_close(f);
  return cached;
}

/* Block size of the checksums in these tests: small, so that chunks span many blocks. */
#define BLOCK 64

/* The bytes a load of entries e reads from folder dir, worked out from the files' own
 * headers: for every saved chunk that meets a rank's box, the whole chunk when the box covers
 * it, else the blocks of block bytes from the one holding the box's first byte in the chunk to
 * the one holding its last (block 1 for files without checksums: the bytes from the first to
 * the last). */
static uint64_t touched_bytes(const char *dir, const dcp_entry_t *e, int n, uint64_t block) {
  uint64_t total = 0;
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (strstr(de->d_name, ".safetensors") == NULL) continue;
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    st_file_t *f;
    ok(st_open(path, &f));
    cJSON *info = cJSON_Parse(st_metadata(f, "DCP_SHARDING_INFO"));
    for (int i = 0; i < n; i++) {
      const st_info_t *t = st_find(f, e[i].name);
      if (t == NULL) continue;
      const cJSON *offs =
          cJSON_GetObjectItem(cJSON_GetObjectItem(info, e[i].name), "saved_offsets");
      const fsdpc_tensor_t *local = dtensor_local(e[i].value);
      int64_t want[2], lo[2], hi[2], vol = 1, whole = 1;
      dtensor_offset(e[i].value, want);
      for (int k = 0; k < t->ndim; k++) {
        int64_t s0 = (int64_t)cJSON_GetArrayItem(offs, k)->valuedouble;
        lo[k] = s0 > want[k] ? s0 : want[k];
        hi[k] = s0 + t->shape[k] < want[k] + local->shape[k] ? s0 + t->shape[k]
                                                             : want[k] + local->shape[k];
        vol *= hi[k] > lo[k] ? hi[k] - lo[k] : 0;
        whole *= t->shape[k];
        lo[k] -= s0; /* inside the chunk */
        hi[k] -= s0;
      }
      uint64_t size = t->end - t->begin;
      if (vol == 0) continue;
      if (vol == whole) {
        total += size;
        continue;
      }
      int64_t cols = t->ndim == 2 ? t->shape[1] : 1;
      uint64_t first = (uint64_t)(lo[0] * cols + (t->ndim == 2 ? lo[1] : 0)) * t->elem_size;
      uint64_t last = (uint64_t)((hi[0] - 1) * cols + (t->ndim == 2 ? hi[1] : 1)) * t->elem_size;
      uint64_t a = first / block * block, b = (last + block - 1) / block * block;
      total += (b < size ? b : size) - a;
    }
    cJSON_Delete(info);
    st_close(f);
  }
  closedir(d);
  return total;
}

/* Copies the shard files of folder from into a new folder to without their integrity records,
 * as another tool would write them. */
static void copy_without_records(const char *from, const char *to) {
  ck_assert_int_eq(mkdir(to, 0755), 0);
  DIR *d = opendir(from);
  ck_assert_ptr_nonnull(d);
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (strstr(de->d_name, ".safetensors") == NULL) continue;
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/%s", from, de->d_name);
    snprintf(b, sizeof b, "%s/%s", to, de->d_name);
    st_file_t *f;
    st_writer_t *w;
    ok(st_open(a, &f));
    ok(st_writer_new(&w));
    const char *keys[] = {"DCP_SHARDING_INFO", "DCP_VERSION", "format"};
    for (int k = 0; k < 3; k++)
      if (st_metadata(f, keys[k])) ok(st_writer_set_metadata(w, keys[k], st_metadata(f, keys[k])));
    for (int i = 0; i < st_num_tensors(f); i++) {
      const st_info_t *t = st_tensor(f, i);
      ok(st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape));
    }
    ok(st_writer_begin(w, b));
    for (int i = 0; i < st_num_tensors(f); i++) {
      const st_info_t *t = st_tensor(f, i);
      fsdpc_tensor_t x;
      ok(tensor_init(&x, t->dtype, device_cpu(), t->ndim, t->shape));
      ok(st_read(f, t->name, &x));
      ok(st_writer_write(w, t->name, &x));
      tensor_free(&x);
    }
    ok(st_writer_finish(w));
    st_writer_free(w);
    st_close(f);
  }
  closedir(d);
}

typedef struct plan {
  const char *name;
  int mesh; /* 0: world 1-D, 1: 2-D (2, W/2), 2: this rank alone */
  placement_t pl[2];
} plan_t;

START_TEST(save_under_one_plan_load_under_another) {
  int W = world_size();
  make_root();
  ok(dcp_set_block_bytes(BLOCK));
  mesh_t *meshes[3] = {NULL, NULL, NULL};
  const char *n1[] = {"w"}, *n2[] = {"r", "s"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &meshes[0]));
  bool two_d = W >= 4 && W % 2 == 0;
  if (two_d) ok(mesh_new(2, (int[]){2, W / 2}, n2, DEVICE_CPU, &meshes[1]));
  ok(mesh_new_local("one", DEVICE_CPU, &meshes[2]));
  plan_t plans[] = {
      {"S0", 0, {placement_shard(0), placement_replicate()}},
      {"S1", 0, {placement_shard(1), placement_replicate()}},
      {"R", 0, {placement_replicate(), placement_replicate()}},
      {"local", 2, {placement_replicate(), placement_replicate()}},
      {"R_S0", 1, {placement_replicate(), placement_shard(0)}},
      {"S0_S1", 1, {placement_shard(0), placement_shard(1)}},
      {"SS0_S0", 1, {placement_strided_shard(0, W / 2), placement_shard(0)}}, /* FSDP over TP */
  };
  int np = (int)(sizeof plans / sizeof plans[0]), bad = 0, pairs = 0;
  for (int a = 0; a < np; a++) {
    if (plans[a].mesh == 1 && !two_d) continue;
    if (plans[a].mesh == 2) continue; /* every rank would save the whole tensor */
    char dir[400];
    snprintf(dir, sizeof dir, "%s/%s", root, plans[a].name);
    dcp_entry_t e[NT];
    dtensor_t *d[NT];
    make(meshes[plans[a].mesh], plans[a].pl, false, e, d);
    ok(dcp_save(dir, e, NT, world_pg()));
    free_all(d);
    /* replicas written once: the files hold every element exactly once */
    if (world_rank() == 0) {
      int64_t stored[NT] = {0};
      for (int r = 0; r < W; r++) {
        char path[500];
        snprintf(path, sizeof path, "%s/shard-%05d.safetensors", dir, r);
        st_file_t *f;
        if (access(path, F_OK) != 0) continue;
        ok(st_open(path, &f));
        ck_assert_str_eq(st_metadata(f, "DCP_VERSION"), DCP_VERSION);
        ck_assert_str_eq(st_metadata(f, "format"), "pt");
        for (int i = 0; i < NT; i++) {
          const st_info_t *t = st_find(f, names[i]);
          int64_t n = 1;
          for (int k = 0; t && k < t->ndim; k++) n *= t->shape[k];
          if (t) stored[i] += n;
        }
        st_close(f);
      }
      for (int i = 0; i < NT; i++)
        if (stored[i] != shapes[i][0] * (shapes[i][1] ? shapes[i][1] : 1)) {
          bad++;
          printf("%s: %s stored %lld elements\n", plans[a].name, names[i], (long long)stored[i]);
        }
    }
    char plain[420]; /* the same files without their integrity records */
    snprintf(plain, sizeof plain, "%s.plain", dir);
    if (world_rank() == 0) copy_without_records(dir, plain);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int b = 0; b < np; b++) {
      if (plans[b].mesh == 1 && !two_d) continue;
      dtensor_t *got[NT], *want[NT];
      dcp_entry_t eg[NT], ew[NT];
      make(meshes[plans[b].mesh], plans[b].pl, true, eg, got);
      make(meshes[plans[b].mesh], plans[b].pl, false, ew, want);
      dcp_stats_t s;
      ok(dcp_load(dir, eg, NT, &s));
      for (int i = 0; i < NT; i++) {
        bool eq = false;
        ok(tensor_equal(dtensor_local(got[i]), dtensor_local(want[i]), &eq));
        if (!eq) {
          bad++;
          printf("saved %s, loaded %s: %s differs\n", plans[a].name, plans[b].name, names[i]);
        }
      }
      uint64_t touched = touched_bytes(dir, eg, NT, BLOCK);
      if (s.bytes_read != touched || s.bytes_needed > touched || s.unchecked) {
        bad++;
        printf("saved %s, loaded %s: read %llu bytes, the blocks touched hold %llu, needed %llu\n",
               plans[a].name, plans[b].name, (unsigned long long)s.bytes_read,
               (unsigned long long)touched, (unsigned long long)s.bytes_needed);
      }
      free_all(got);
      make(meshes[plans[b].mesh], plans[b].pl, true, eg, got);
      ok(dcp_load(plain, eg, NT, &s)); /* the same bytes without checksums */
      for (int i = 0; i < NT; i++) {
        bool eq = false;
        ok(tensor_equal(dtensor_local(got[i]), dtensor_local(want[i]), &eq));
        if (!eq) {
          bad++;
          printf("saved %s without checksums, loaded %s: %s differs\n", plans[a].name,
                 plans[b].name, names[i]);
        }
      }
      touched = touched_bytes(plain, eg, NT, 1);
      if (s.bytes_read != touched || s.bytes_needed > touched || !s.unchecked) {
        bad++;
        printf("saved %s without checksums, loaded %s: read %llu bytes, the boxes span %llu\n",
               plans[a].name, plans[b].name, (unsigned long long)s.bytes_read,
               (unsigned long long)touched);
      }
      free_all(got);
      free_all(want);
      pairs++;
    }
  }
  if (world_rank() == 0) printf("%d save/load plan pairs checked on %d ranks\n", pairs, W);
  expect_all(bad == 0, "%d checkpoint mismatches", bad);
  for (int k = 0; k < 3; k++) mesh_free(meshes[k]);
  ok(dcp_set_block_bytes(DCP_BLOCK_BYTES_DEFAULT));
  remove_root();
}
END_TEST

/* One flipped byte in a replicated tensor saved whole (one chunk, rank 0's file): a load that
 * shards its rows fails on exactly the ranks whose rows touch the damaged block, naming the
 * block; the others load correct values; dcp_verify fails on every rank. */
START_TEST(partial_reads_check_the_blocks_they_touch) {
  int W = world_size();
  make_root();
  ok(dcp_set_block_bytes(BLOCK));
  mesh_t *mesh;
  const char *n1[] = {"w"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &mesh));
  placement_t rep[2] = {placement_replicate(), placement_replicate()};
  placement_t s0[2] = {placement_shard(0), placement_replicate()};
  dcp_entry_t e[NT], eg[NT], ew[NT];
  dtensor_t *d[NT], *got[NT], *want[NT];
  make(mesh, rep, false, e, d);
  char dir[400];
  snprintf(dir, sizeof dir, "%s/whole", root);
  ok(dcp_save(dir, e, NT, world_pg()));
  free_all(d);
  const uint64_t pos = 200; /* a.weight's byte 200: row 3 of 16 rows of 60 bytes, block 4 */
  if (world_rank() == 0) flip_data_byte(dir, "a.weight", pos, 0x10);
  MPI_Barrier(MPI_COMM_WORLD);
  make(mesh, s0, true, eg, got);
  make(mesh, s0, false, ew, want);
  int64_t off[2];
  dtensor_offset(got[0], off);
  int64_t rows = dtensor_local(got[0])->shape[0], row_bytes = 15 * 4;
  uint64_t a = (uint64_t)(off[0] * row_bytes) / BLOCK, b = (uint64_t)((off[0] + rows) * row_bytes);
  bool touches = rows > 0 && pos / BLOCK >= a && pos / BLOCK < (b + BLOCK - 1) / BLOCK;
  fsdpc_status_t st = dcp_load(dir, eg, 1, NULL);
  int bad = 0;
  if (touches && (st != STATUS_EFORMAT ||
                  !strstr(err_detail(), "tensor 'a.weight': checksum mismatch in block 4 of 15"))) {
    bad++;
    printf("rank %d: rows %lld+%lld touch the damage; load: %s\n", world_rank(),
           (long long)off[0], (long long)rows, st ? err_detail() : "ok");
  }
  bool eq = false;
  if (!touches) ok(tensor_equal(dtensor_local(got[0]), dtensor_local(want[0]), &eq));
  if (!touches && (st != STATUS_OK || !eq)) {
    bad++;
    printf("rank %d: rows %lld+%lld miss the damage; load %s, values %s\n", world_rank(),
           (long long)off[0], (long long)rows, st ? err_detail() : "ok", eq ? "equal" : "differ");
  }
  st = dcp_verify(dir, world_pg(), NULL);
  if (st == STATUS_OK) bad++;
  expect_all(bad == 0, "%d wrong outcomes of loading a damaged block", bad);
  free_all(got);
  free_all(want);
  mesh_free(mesh);
  ok(dcp_set_block_bytes(DCP_BLOCK_BYTES_DEFAULT));
  remove_root();
}
END_TEST

/* The checker on its own: jobs of 256 KiB (handed to the helper thread when there is a second
 * CPU), the first mismatch named, the verdict reset by each wait. */
START_TEST(checker_names_the_first_bad_block) {
  enum { JOBS = 24, PER = 4 };
  const size_t B = (size_t)64 << 10;
  char *data = malloc(JOBS * PER * B);
  uint64_t expect[JOBS * PER];
  ck_assert_ptr_nonnull(data);
  for (size_t k = 0; k < JOBS * PER * B; k++) data[k] = (char)(k * 2654435761u >> 13);
  for (int b = 0; b < JOBS * PER; b++) expect[b] = dcp_block_hash(data + (size_t)b * B, B);
  dcp_checker_t *c;
  ok(dcp_checker_new(&c));
  const void *who = NULL;
  uint64_t block = 0;
  for (int round = 0; round < 3; round++) {
    int bad_a = round == 0 ? 41 : -1, bad_b = round == 0 ? 70 : -1;
    if (bad_a >= 0) data[(size_t)bad_a * B + 5] ^= 1;
    if (bad_b >= 0) data[(size_t)bad_b * B + B - 1] ^= 1;
    for (int j = 0; j < JOBS; j++)
      dcp_checker_push(c, data + (size_t)j * PER * B, PER * B, B, expect, (uint64_t)j * PER,
                       &expect[j]);
    bool all = dcp_checker_wait(c, &who, &block);
    if (round == 0) {
      ck_assert_msg(!all, "two damaged blocks went unnoticed");
      ck_assert_ptr_eq(who, &expect[bad_a / PER]);
      ck_assert_int_eq(block, bad_a);
      data[(size_t)bad_a * B + 5] ^= 1; /* repaired for the next rounds */
      data[(size_t)bad_b * B + B - 1] ^= 1;
    } else {
      ck_assert_msg(all, "round %d: intact blocks reported (block %llu)", round,
                    (unsigned long long)block);
    }
  }
  dcp_checker_free(c);
  free(data);
}
END_TEST

/* A tensor of 128 blocks of 64 KiB, two of them damaged: every load that touches one fails
 * naming the first it touches (the blocks are hashed while the next ones are read), the others
 * load exact values; from the page cache (read in small pieces) and from storage (pieces as
 * large as a read job). */
START_TEST(large_chunks_are_checked_while_read) {
  int W = world_size();
  make_root();
  const uint64_t B = (uint64_t)64 << 10;
  ok(dcp_set_block_bytes(B));
  mesh_t *mesh;
  const char *n1[] = {"w"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &mesh));
  const int64_t shape[2] = {2048, 1024}; /* 8 MiB of f32 */
  fsdpc_tensor_t full;
  ok(tensor_init(&full, DTYPE_F32, device_cpu(), 2, shape));
  for (int64_t k = 0; k < tensor_numel(&full); k++) ((float *)full.data)[k] = (float)(k % 9973);
  placement_t rep = placement_replicate(), s0 = placement_shard(0);
  dtensor_t *d;
  ok(dtensor_distribute(&full, mesh, &rep, DTENSOR_ALL_RANKS, &d));
  char dir[400];
  snprintf(dir, sizeof dir, "%s/large", root);
  ok(dcp_save(dir, &(dcp_entry_t){"big", d}, 1, world_pg()));
  dtensor_free(d);
  const uint64_t damaged[2] = {77, 100};
  if (world_rank() == 0)
    for (int k = 0; k < 2; k++) flip_data_byte(dir, "big", damaged[k] * B + 1000 * (uint64_t)k, 0x40);
  MPI_Barrier(MPI_COMM_WORLD);
  int bad = 0;
  for (int pass = 0; pass < 4; pass++) { /* both layouts, warm, then from storage */
    int layout = pass % 2;
    /* the reads must be the ones each pass is for: pieces from the cache, then from storage */
    if ((pass == 0 || pass == 2) && world_rank() == 0 &&
        pages_cached(dir, "big", (size_t)B * 4, pass == 2) != (pass == 0)) {
      bad++;
      printf("pass %d: the shard's pages are %s\n", pass, pass ? "still cached" : "not cached");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    fsdpc_tensor_t zero;
    ok(tensor_init(&zero, DTYPE_F32, device_cpu(), 2, shape));
    ok(tensor_fill(&zero, 0));
    ok(dtensor_distribute(&zero, mesh, layout ? &s0 : &rep, DTENSOR_ALL_RANKS, &d));
    tensor_free(&zero);
    int64_t off[2];
    dtensor_offset(d, off);
    const fsdpc_tensor_t *local = dtensor_local(d);
    uint64_t row = (uint64_t)shape[1] * 4, lo = (uint64_t)off[0] * row / B;
    uint64_t hi = ((uint64_t)(off[0] + local->shape[0]) * row + B - 1) / B;
    int64_t first = -1; /* the first damaged block the rank's rows touch */
    for (int k = 1; k >= 0; k--)
      if (local->shape[0] > 0 && damaged[k] >= lo && damaged[k] < hi) first = (int64_t)damaged[k];
    fsdpc_status_t st = dcp_load(dir, &(dcp_entry_t){"big", d}, 1, NULL);
    char want[96];
    snprintf(want, sizeof want, "tensor 'big': checksum mismatch in block %lld of 128",
             (long long)first + 1);
    if (first >= 0 && (st != STATUS_EFORMAT || !strstr(err_detail(), want))) {
      bad++;
      printf("rank %d, pass %d: expected \"%s\", got %s\n", world_rank(), pass, want,
             st ? err_detail() : "success");
    }
    if (first < 0) {
      fsdpc_tensor_t box = {0};
      bool eq = false;
      ok(tensor_narrow(&box, &full, 0, off[0], local->shape[0]));
      if (st == STATUS_OK) ok(tensor_equal(local, &box, &eq));
      tensor_free(&box);
      if (!eq) {
        bad++;
        printf("rank %d, pass %d: rows %lld+%lld miss the damage; load %s, values %s\n",
               world_rank(), pass, (long long)off[0], (long long)local->shape[0],
               st ? err_detail() : "ok", eq ? "equal" : "differ");
      }
    }
    dtensor_free(d);
  }
  /* several boxes in one call (a resharding tool's read): rows 5..304 and 1700..2047 miss the
   * damage and load exact values; with rows 1220..1269 (block 78 inside) between them the call fails */
  dcp_reader_t *r;
  ok(dcp_reader_open(dir, &r));
  const int64_t rows[3][2] = {{5, 300}, {1220, 50}, {1700, 348}};
  fsdpc_tensor_t part[3];
  dcp_box_t boxes[3];
  for (int k = 0; k < 3; k++) {
    ok(tensor_init(&part[k], DTYPE_F32, device_cpu(), 2, (int64_t[]){rows[k][1], shape[1]}));
    boxes[k] = (dcp_box_t){.name = "big", .value = &part[k], .offset = {rows[k][0], 0}};
  }
  dcp_box_t clean[2] = {boxes[0], boxes[2]};
  fsdpc_status_t st = dcp_reader_read_boxes(r, clean, 2);
  for (int k = 0; k < 3; k += 2) {
    fsdpc_tensor_t want = {0};
    bool eq = false;
    ok(tensor_narrow(&want, &full, 0, rows[k][0], rows[k][1]));
    if (st == STATUS_OK) ok(tensor_equal(&part[k], &want, &eq));
    tensor_free(&want);
    if (!eq) {
      bad++;
      printf("rank %d: boxes of rows %lld+%lld: %s\n", world_rank(), (long long)rows[k][0],
             (long long)rows[k][1], st ? err_detail() : "values differ");
    }
  }
  st = dcp_reader_read_boxes(r, boxes, 3);
  if (st != STATUS_EFORMAT || !strstr(err_detail(), "checksum mismatch in block 78 of 128")) {
    bad++;
    printf("rank %d: three boxes, one damaged: %s\n", world_rank(), st ? err_detail() : "loaded");
  }
  for (int k = 0; k < 3; k++) tensor_free(&part[k]);
  dcp_reader_close(r);
  int64_t chunks = 0;
  st = dcp_verify(dir, world_pg(), &chunks);
  if (st != STATUS_EFORMAT || !strstr(err_detail(), "checksum mismatch in block 78 of 128")) {
    bad++;
    printf("rank %d: verify: %s\n", world_rank(), st ? err_detail() : "passed");
  }
  expect_all(bad == 0, "%d wrong outcomes of loading a large damaged chunk", bad);
  tensor_free(&full);
  mesh_free(mesh);
  ok(dcp_set_block_bytes(DCP_BLOCK_BYTES_DEFAULT));
  remove_root();
}
END_TEST

START_TEST(errors_name_the_tensor) {
  int W = world_size();
  make_root();
  mesh_t *mesh;
  const char *n1[] = {"w"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &mesh));
  placement_t pl[2] = {placement_shard(0), placement_replicate()};
  dcp_entry_t e[NT];
  dtensor_t *d[NT];
  make(mesh, pl, false, e, d);
  char dir[400], stale[420];
  snprintf(dir, sizeof dir, "%s/ckpt", root);
  snprintf(stale, sizeof stale, "%s.tmp", dir);
  /* a folder of the temporary's name that is not a save's (no mark): refused on every rank,
   * left as it was */
  if (world_rank() == 0) {
    ck_assert_int_eq(mkdir(stale, 0755), 0);
    FILE *f = fopen(strcat(strcpy((char[440]){0}, stale), "/shard-00000.safetensors"), "w");
    fputs("partial", f);
    fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  fsdpc_status_t st = dcp_save(dir, e, NT, world_pg());
  ck_assert_msg(st != STATUS_OK && strstr(err_detail(), "is not what a stopped save left"), "%s",
                st ? err_detail() : "ok");
  ck_assert_int_eq(access(strcat(strcpy((char[440]){0}, stale), "/shard-00000.safetensors"), F_OK),
                   0);
  /* a save that died before its commit left its temporary folder, marked: replaced */
  if (world_rank() == 0) {
    FILE *f = fopen(strcat(strcpy((char[440]){0}, stale), "/.fsdpc-partial"), "w");
    fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  st = dcp_load(stale, e, NT, NULL);
  ck_assert_int_ne(st, STATUS_OK); /* the partial file is not a checkpoint */
  ok(dcp_save(dir, e, NT, world_pg()));
  ck_assert_int_ne(access(stale, F_OK), 0);
  ck_assert_int_ne(access(strcat(strcpy((char[440]){0}, dir), "/.fsdpc-partial"), F_OK), 0);
  /* saving over an existing checkpoint is refused on every rank */
  st = dcp_save(dir, e, NT, world_pg());
  ck_assert_int_ne(st, STATUS_OK);
  ck_assert_msg(strstr(err_detail(), "already exists") || strstr(err_detail(), "another rank"),
                "%s", err_detail());
  /* ranks naming different folders (one rank beside the others): refused on every rank,
   * nothing written; an entry named twice likewise */
  if (W > 1) {
    char other[420];
    snprintf(other, sizeof other, "%s/ckpt-%d", root, world_rank() == W - 1 ? 1 : 0);
    st = dcp_save(other, e, NT, world_pg());
    ck_assert_msg(
        st == STATUS_EINVAL && strstr(err_detail(), "the ranks of the save name different folders"),
        "%s", st ? err_detail() : "ok");
    ck_assert_int_ne(access(other, F_OK), 0);
  }
  dcp_entry_t twice[2] = {e[0], e[0]};
  char dup[420];
  snprintf(dup, sizeof dup, "%s/dup", root);
  st = dcp_save(dup, twice, 2, world_pg());
  ck_assert_msg(st == STATUS_EINVAL && strstr(err_detail(), "two entries are named"), "%s",
                st ? err_detail() : "ok");
  ck_assert_int_ne(access(dup, F_OK), 0);
  /* a tensor the checkpoint lacks */
  dcp_entry_t missing = {"z.weight", d[0]};
  ck_assert_int_eq(dcp_load(dir, &missing, 1, NULL), STATUS_EFORMAT);
  ck_assert_msg(strstr(err_detail(), "missing tensor 'z.weight'"), "%s", err_detail());
  /* a shape that differs from the saved one */
  dcp_entry_t wrong = {"b.weight", d[0]}; /* (16,15) into the (7,15) one */
  ck_assert_int_eq(dcp_load(dir, &wrong, 1, NULL), STATUS_ESHAPE);
  ck_assert_msg(strstr(err_detail(), "'b.weight' was saved with shape [7,15]"), "%s", err_detail());
  /* no such folder */
  ck_assert_int_ne(dcp_load("/nonexistent/ckpt", e, NT, NULL), STATUS_OK);
  ck_assert_msg(strstr(err_detail(), "/nonexistent/ckpt"), "%s", err_detail());
  free_all(d);
  mesh_free(mesh);
  remove_root();
}
END_TEST

/* A save that fails on some rank (its file cannot grow: the error a full disk gives) fails on
 * every rank and leaves neither the checkpoint nor its temporary folder behind. */
START_TEST(failed_save_removes_its_temporary_folder) {
  int W = world_size();
  make_root();
  mesh_t *mesh;
  const char *n1[] = {"w"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &mesh));
  placement_t pl[2] = {placement_shard(0), placement_replicate()};
  dcp_entry_t e[NT];
  dtensor_t *d[NT];
  make(mesh, pl, false, e, d);
  char dir[400], tmp[420];
  snprintf(dir, sizeof dir, "%s/full", root);
  snprintf(tmp, sizeof tmp, "%s.tmp", dir);
  struct rlimit old, small;
  ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
  small = old;
  small.rlim_cur = world_rank() == W - 1 ? 64 : old.rlim_cur; /* the last rank's disk is full */
  signal(SIGXFSZ, SIG_IGN);
  ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &small), 0);
  fsdpc_status_t st = dcp_save(dir, e, NT, world_pg());
  ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
  ck_assert_msg(st != STATUS_OK, "a save that cannot write its files fails on every rank");
  MPI_Barrier(MPI_COMM_WORLD);
  ck_assert_msg(access(dir, F_OK) != 0 && access(tmp, F_OK) != 0,
                "the failed save left %s or %s", dir, tmp);
  free_all(d);
  mesh_free(mesh);
  remove_root();
}
END_TEST

/* A file whose blocks would be too many to record (a large shard under a small block size)
 * records a larger block size of its own, doubled until they fit, and loads exactly: 125 MB
 * of f32 in 64-byte blocks would record 2,000,000 hashes and more. One rank (the test holds
 * the tensor twice). */
START_TEST(a_large_shard_records_a_larger_block_size) {
  if (world_size() != 1) return;
  make_root();
  ok(dcp_set_block_bytes(64));
  int W = 1;
  mesh_t *mesh;
  const char *n1[] = {"w"};
  ok(mesh_new(1, &W, n1, DEVICE_CPU, &mesh));
  const int64_t shape[2] = {31251, 1024}; /* 128,004,096 bytes: 2,000,064 blocks of 64 */
  fsdpc_tensor_t full;
  ok(tensor_init(&full, DTYPE_F32, device_cpu(), 2, shape));
  for (int64_t k = 0; k < tensor_numel(&full); k++) ((float *)full.data)[k] = (float)(k % 8191);
  placement_t rep = placement_replicate();
  dtensor_t *d;
  ok(dtensor_distribute(&full, mesh, &rep, DTENSOR_ALL_RANKS, &d));
  char dir[400], path[500];
  snprintf(dir, sizeof dir, "%s/wide", root);
  ok(dcp_save(dir, &(dcp_entry_t){"big", d}, 1, world_pg()));
  snprintf(path, sizeof path, "%s/shard-00000.safetensors", dir);
  st_file_t *f;
  ok(st_open(path, &f));
  cJSON *rec = cJSON_Parse(st_metadata(f, "FSDPC_INTEGRITY"));
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(rec, "block_bytes");
  ck_assert_msg(cJSON_IsNumber(b) && b->valuedouble == 128,
                "the file records blocks of %g bytes, not 128",
                cJSON_IsNumber(b) ? b->valuedouble : -1);
  cJSON_Delete(rec);
  st_close(f);
  ok(tensor_fill((fsdpc_tensor_t *)dtensor_local(d), 0));
  ok(dcp_load(dir, &(dcp_entry_t){"big", d}, 1, NULL));
  bool eq = false;
  ok(tensor_equal(dtensor_local(d), &full, &eq));
  ck_assert_msg(eq, "the large shard loads its values");
  dtensor_free(d);
  tensor_free(&full);
  mesh_free(mesh);
  ok(dcp_set_block_bytes(DCP_BLOCK_BYTES_DEFAULT));
  remove_root();
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("dcp");
  TCase *tc = tcase_create("dcp");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, save_under_one_plan_load_under_another);
  tcase_add_test(tc, partial_reads_check_the_blocks_they_touch);
  tcase_add_test(tc, checker_names_the_first_bad_block);
  tcase_add_test(tc, large_chunks_are_checked_while_read);
  tcase_add_test(tc, errors_name_the_tensor);
  tcase_add_test(tc, failed_save_removes_its_temporary_folder);
  tcase_add_test(tc, a_large_shard_records_a_larger_block_size);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
