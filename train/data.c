#include "train/data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "core/mix_impl.h"

/* One file of the stream: tokens [first, first + n) of it, at byte base of the file. */
typedef struct dfile {
  char *path;
  int width; /* bytes per token */
  off_t base;
  int64_t first, n;
  struct stat at_open; /* the file as it was opened: each read finds it the same */
} dfile_t;

/* The files are read where a batch or a check needs them (opened for that read: a stream of
 * thousands of files holds no descriptors): no rank holds more of them than a batch, and ranks
 * on one node share the operating system's page cache. */
struct fsdpc_data {
  dfile_t *files;
  int nf;
  int64_t n;
};

/* llm.c's token files: 256 little-endian int32s (magic, version, token count, zeros), then the
 * tokens. */
enum { kLlmcHeader = 1024, kLlmcMagicU16 = 20240520, kLlmcMagicU32 = 20240801 };

static int width_of(data_format_t format) {
  switch (format) {
    case DATA_BYTES: return 1;
    case DATA_U16: return 2;
    case DATA_U32: return 4;
    case DATA_LLMC: return 0; /* from each file's header */
  }
  return -1;
}

static int32_t le32(const unsigned char *b) {
  return (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                   (uint32_t)b[3] << 24);
}

/* Reads bytes [at, at + n) of f's open descriptor fd into buf; tokens [first, first + count)
 * of the stream name them in errors (count 0: the header). */
static fsdpc_status_t read_bytes(const dfile_t *f, int fd, off_t at, size_t n, unsigned char *buf,
                                 int64_t first, int64_t count) {
  for (size_t got = 0; got < n;) {
    ssize_t r = pread(fd, buf + got, n - got, at + (off_t)got);
    if (r < 0 && errno == EINTR) continue;
    const char *why = r < 0 ? strerror(errno) : "the file is shorter than when it was opened";
    if (r <= 0 && count == 0)
      return err_set(STATUS_EIO, "data file %s: cannot read its header: %s", f->path, why);
    if (r <= 0)
      return err_set(STATUS_EIO, "data file %s: cannot read tokens %lld-%lld: %s", f->path,
                     (long long)first, (long long)(first + count - 1), why);
    got += (size_t)r;
  }
  return STATUS_OK;
}

/* Opens path as the stream's file f of the given width (0: from its llm.c header); f->first is
 * set by the caller. */
static fsdpc_status_t file_open(dfile_t *f, const char *path, int width) {
  memset(f, 0, sizeof *f);
  FILE *fp;
  FSDPC_TRY(file_open_regular(path, "data file", &fp));
  fsdpc_status_t st = STATUS_OK;
  struct stat sb;
  if ((f->path = strdup(path)) == NULL)
    st = err_set(STATUS_ENOMEM, "data file %s: out of host memory", path);
  else if (fstat(fileno(fp), &sb) != 0)
    st = err_set(STATUS_EIO, "data file %s: %s", path, strerror(errno));
  if (st == STATUS_OK) f->at_open = sb;
  if (st == STATUS_OK && width == 0) { /* llm.c's header */
    unsigned char h[12];
    int64_t count = 0;
    if (sb.st_size < kLlmcHeader)
      st = err_set(STATUS_EFORMAT,
                   "data file %s: %lld bytes cannot hold llm.c's header of %d bytes (is it a "
                   "file of raw tokens? see data.format)",
                   path, (long long)sb.st_size, kLlmcHeader);
    else if ((st = read_bytes(f, fileno(fp), 0, sizeof h, h, 0, 0)) == STATUS_OK) {
      int32_t magic = le32(h), version = le32(h + 4);
      count = le32(h + 8);
      if (magic == kLlmcMagicU16 && version == 1)
        width = 2;
      else if (magic == kLlmcMagicU32 && version == 7)
        width = 4;
      else
        st = err_set(STATUS_EFORMAT,
                     "data file %s: not an llm.c token file (magic %d, version %d; expected "
                     "%d and 1 for uint16 tokens, or %d and 7 for uint32)",
                     path, (int)magic, (int)version, kLlmcMagicU16, kLlmcMagicU32);
    }
    if (st == STATUS_OK && (count < 0 || sb.st_size != kLlmcHeader + count * width))
      st = err_set(STATUS_EFORMAT,
                   "data file %s: its header says %lld tokens of %d bytes, but %lld bytes "
                   "follow the header",
                   path, (long long)count, width, (long long)(sb.st_size - kLlmcHeader));
    f->base = kLlmcHeader;
  } else if (st == STATUS_OK && sb.st_size % width != 0) {
    st = err_set(STATUS_EFORMAT, "data file %s: %lld bytes is not a whole number of uint%d tokens",
                 path, (long long)sb.st_size, 8 * width);
  } else if (st == STATUS_OK && sb.st_size >= kLlmcHeader) { /* raw tokens: not llm.c's file */
    unsigned char h[8];
    if ((st = read_bytes(f, fileno(fp), 0, sizeof h, h, 0, 0)) == STATUS_OK &&
        ((le32(h) == kLlmcMagicU16 && le32(h + 4) == 1) ||
         (le32(h) == kLlmcMagicU32 && le32(h + 4) == 7)))
      st = err_set(STATUS_EFORMAT,
                   "data file %s: starts with llm.c's header (magic %d): its tokens would be "
                   "read with the header's bytes; give data.format: llmc",
                   path, (int)le32(h));
  }
  fclose(fp);
  if (st != STATUS_OK) {
    free(f->path);
    f->path = NULL;
    return st;
  }
  f->width = width;
  f->n = (sb.st_size - f->base) / width;
  return STATUS_OK;
}

/* Glob's error callback: a folder it cannot read is not an error here (no match is). */
static int glob_skip(const char *path, int err) {
  (void)path, (void)err;
  return 0;
}

bool data_is_pattern(const char *path) {
  if (path == NULL) return false;
  struct stat sb; /* a file of that very name is itself, whatever its name holds */
  return strpbrk(path, "*?[") != NULL && stat(path, &sb) != 0;
}

fsdpc_status_t data_open(const char *path, data_format_t format, fsdpc_data_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(path);
  *out = NULL;
  int width = width_of(format);
  if (width < 0)
    return err_set(STATUS_EINVAL, "data file %s: unknown format %d", path, (int)format);
  glob_t g = {0};
  const char *one[1] = {path};
  char *const *paths = (char *const *)one;
  size_t n = 1;
  if (data_is_pattern(path)) { /* its matches in sorted order */
    int rc = glob(path, 0, glob_skip, &g);
    if (rc != 0) {
      globfree(&g);
      return err_set(rc == GLOB_NOSPACE ? STATUS_ENOMEM : STATUS_EIO, "data files %s: %s", path,
                     rc == GLOB_NOMATCH   ? "the pattern matches no file"
                     : rc == GLOB_NOSPACE ? "out of host memory"
                                          : "cannot list the folders it names");
    }
    paths = g.gl_pathv;
    n = g.gl_pathc;
  }
  fsdpc_data_t *d = calloc(1, sizeof *d);
  fsdpc_status_t st = STATUS_OK;
  if (d == NULL || (d->files = calloc(n, sizeof *d->files)) == NULL)
    st = err_set(STATUS_ENOMEM, "data file %s: out of host memory", path);
  for (size_t i = 0; i < n && st == STATUS_OK; i++) {
    st = file_open(&d->files[i], paths[i], width);
    if (st != STATUS_OK) break;
    d->files[i].first = d->n;
    d->n += d->files[i].n;
    d->nf++;
  }
  globfree(&g);
  if (st != STATUS_OK) {
    data_free(d);
    return st;
  }
  *out = d;
  return STATUS_OK;
}

void data_free(fsdpc_data_t *d) {
  if (d == NULL) return;
  for (int i = 0; i < d->nf; i++) free(d->files[i].path);
  free(d->files);
  free(d);
}

int64_t data_num_tokens(const fsdpc_data_t *d) {
  if (d == NULL) return 0;
  return d->n;
}

int data_num_files(const fsdpc_data_t *d) {
  if (d == NULL) return 0;
  return d->nf;
}

const char *data_file_path(const fsdpc_data_t *d, int i) {
  if (d == NULL || i < 0 || i >= d->nf) return NULL;
  return d->files[i].path;
}

/* The file holding token i (0 <= i < d->n): the last whose first token is at or before i. */
static const dfile_t *file_of(const fsdpc_data_t *d, int64_t i) {
  int lo = 0, hi = d->nf - 1;
  while (lo < hi) {
    int mid = lo + (hi - lo + 1) / 2;
    if (d->files[mid].first <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return &d->files[lo];
}

/* Token i of buf, little-endian of width w. */
static inline int64_t token_at(const unsigned char *buf, int w, int64_t i) {
  const unsigned char *b = buf + i * w;
  switch (w) {
    case 1: return b[0];
    case 2: return b[0] | (int64_t)b[1] << 8;
    default: return b[0] | (int64_t)b[1] << 8 | (int64_t)b[2] << 16 | (int64_t)b[3] << 24;
  }
}

/* The largest of the k tokens of width w in buf (-1 for none); a loop per width, so that each
 * vectorises. */
static int64_t max_of(const unsigned char *buf, int w, int64_t k) {
  if (k == 0) return -1;
  if (w == 1) {
    unsigned char m = 0;
    for (int64_t i = 0; i < k; i++) m = buf[i] > m ? buf[i] : m;
    return m;
  }
  if (w == 2) {
    uint16_t m = 0;
    for (int64_t i = 0; i < k; i++) {
      uint16_t v = (uint16_t)(buf[2 * i] | buf[2 * i + 1] << 8);
      m = v > m ? v : m;
    }
    return m;
  }
  uint32_t m = 0;
  for (int64_t i = 0; i < k; i++) {
    uint32_t v = buf[4 * i] | (uint32_t)buf[4 * i + 1] << 8 | (uint32_t)buf[4 * i + 2] << 16 |
                 (uint32_t)buf[4 * i + 3] << 24;
    m = v > m ? v : m;
  }
  return m;
}

/* Visits tokens [i0, i0 + count) of the stream in pieces of at most cap bytes, each within one
 * file: fn(ctx, buf, width, k, offset of the piece in the range). */
typedef void piece_fn(void *ctx, const unsigned char *buf, int w, int64_t k, int64_t at);

static fsdpc_status_t visit(const fsdpc_data_t *d, int64_t i0, int64_t count, unsigned char *buf,
                            size_t cap, piece_fn *fn, void *ctx) {
  fsdpc_status_t st = STATUS_OK;
  for (int64_t done = 0; done < count && st == STATUS_OK;) { /* one file at a time */
    const dfile_t *f = file_of(d, i0 + done);
    int64_t end = f->first + f->n < i0 + count ? f->first + f->n : i0 + count;
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return err_set(STATUS_EIO, "data file %s: cannot open it again: %s", f->path,
                     strerror(errno));
    struct stat sb; /* another file at its path, or this one written since: other samples */
    const struct stat *was = &f->at_open;
    if (fstat(fd, &sb) == 0 &&
        (sb.st_dev != was->st_dev || sb.st_ino != was->st_ino || sb.st_size != was->st_size ||
         sb.st_mtim.tv_sec != was->st_mtim.tv_sec || sb.st_mtim.tv_nsec != was->st_mtim.tv_nsec)) {
      close(fd);
      return err_set(STATUS_EIO,
                     "data file %s: changed since the run opened it (%s): its samples would not "
                     "be the run's",
                     f->path,
                     sb.st_dev != was->st_dev || sb.st_ino != was->st_ino
                         ? "another file at its path"
                     : sb.st_size < was->st_size ? "the file is shorter than when it was opened"
                                                 : "written to since");
    }
    for (int64_t per = (int64_t)cap / f->width; i0 + done < end && st == STATUS_OK;) {
      int64_t i = i0 + done, k = end - i < per ? end - i : per;
      st = read_bytes(f, fd, f->base + (off_t)((i - f->first) * f->width), (size_t)(k * f->width),
                      buf, i, k);
      if (st == STATUS_OK) fn(ctx, buf, f->width, k, done);
      done += k;
    }
    close(fd);
  }
  return st;
}

static void decode_piece(void *ctx, const unsigned char *buf, int w, int64_t k, int64_t at) {
  int64_t *out = (int64_t *)ctx + at;
  for (int64_t i = 0; i < k; i++) out[i] = token_at(buf, w, i);
}

static void max_piece(void *ctx, const unsigned char *buf, int w, int64_t k, int64_t at) {
  (void)at;
  int64_t *m = ctx, v = max_of(buf, w, k);
  *m = v > *m ? v : *m;
}

/* Reads tokens [i0, i0 + count) into out. */
static fsdpc_status_t read_tokens(const fsdpc_data_t *d, int64_t i0, int64_t count, int64_t *out) {
  unsigned char buf[1 << 14];
  return visit(d, i0, count, buf, sizeof buf, decode_piece, out);
}

fsdpc_status_t data_max_token(const fsdpc_data_t *d, int64_t begin, int64_t end, int64_t *max) {
  ARG_NONNULL(d);
  ARG_NONNULL(max);
  *max = -1;
  if (begin < 0 || end > d->n || begin > end)
    return err_set(STATUS_EINVAL, "data: tokens [%lld, %lld) outside [0, %lld)", (long long)begin,
                   (long long)end, (long long)d->n);
  enum { kChunk = 1 << 20 }; /* bytes read at a time */
  unsigned char *buf = malloc(kChunk);
  if (buf == NULL) return err_set(STATUS_ENOMEM, "data: out of host memory");
  int64_t m = -1;
  fsdpc_status_t st = visit(d, begin, end - begin, buf, kChunk, max_piece, &m);
  free(buf);
  if (st == STATUS_OK) *max = m;
  return st;
}

/* x's place in a permutation of [0, n) chosen by key: four Feistel rounds on the smallest
 * domain of 4^h >= n elements (a bijection of it), repeated until the value falls in [0, n)
 * (which keeps it a bijection of [0, n); the domain is under 4 n, so under four tries are
 * expected). */
static int64_t permute(int64_t x, int64_t n, uint64_t key) {
  int h = 1;
  while (h < 31 && ((int64_t)1 << (2 * h)) < n) h++;
  uint64_t mask = ((uint64_t)1 << h) - 1, v = (uint64_t)x;
  do {
    uint64_t l = v >> h, r = v & mask;
    for (uint64_t round = 0; round < 4; round++) {
      uint64_t t = l ^ (splitmix64(key ^ (round << 60) ^ r) & mask);
      l = r;
      r = t;
    }
    v = l << h | r;
  } while (v >= (uint64_t)n);
  return (int64_t)v;
}

int64_t data_sample_start(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                          int64_t micro, int64_t j) {
  if (d == NULL || spec == NULL) return 0;
  int64_t G = spec->dp_size * spec->batch_size;
  /* in 128 bits, so that long runs cannot overflow the product */
  __int128 g = (__int128)(step * spec->grad_accum + micro) * G + j;
  if (d->n < spec->seq_len + 2) return 0; /* no whole sample: data_batch says so */
  if (spec->shuffle) { /* windows of seq_len + 1 tokens every seq_len, each epoch in its order */
    int64_t windows = (d->n - 1) / spec->seq_len, epoch = (int64_t)(g / windows);
    uint64_t key = splitmix64(spec->seed ^ splitmix64((uint64_t)epoch));
    return permute((int64_t)(g % windows), windows, key) * spec->seq_len;
  }
  int64_t span = d->n - spec->seq_len; /* the starts 0 .. n - seq_len - 1: the last reads the
                                          stream's last token */
  return (int64_t)(g * spec->seq_len % span);
}

/* Tokens [i0, i0 + n) of the stream, read into row, against the vocabulary. */
static fsdpc_status_t check_ids(const fsdpc_data_t *d, int64_t i0, const int64_t *row, int64_t n,
                                int64_t vocab) {
  for (int64_t k = 0; k < n; k++) {
    if (row[k] >= 0 && row[k] < vocab) continue;
    const dfile_t *f = file_of(d, i0 + k);
    return err_set(STATUS_EINVAL,
                   "data file %s: the token at byte offset %lld has id %lld, outside the "
                   "vocabulary of %lld",
                   f->path, (long long)(f->base + (i0 + k - f->first) * f->width),
                   (long long)row[k], (long long)vocab);
  }
  return STATUS_OK;
}

fsdpc_status_t data_batch(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                          int64_t micro, fsdpc_tensor_t *inputs, fsdpc_tensor_t *targets) {
  ARG_NONNULL(d);
  ARG_NONNULL(spec);
  ARG_NONNULL(inputs);
  ARG_NONNULL(targets);
  if (spec->batch_size < 1 || spec->seq_len < 1 || spec->grad_accum < 1 || spec->dp_size < 1 ||
      spec->dp_rank < 0 || spec->dp_rank >= spec->dp_size)
    return err_set(STATUS_EINVAL,
                   "data: batch_size, seq_len, grad_accum, dp_size must be "
                   "positive and 0 <= dp_rank < dp_size");
  if (micro < 0 || micro >= spec->grad_accum || step < 0)
    return err_set(STATUS_EINVAL, "data: micro-step %lld outside [0, %lld)", (long long)micro,
                   (long long)spec->grad_accum);
  if (d->n < spec->seq_len + 2)
    return err_set(STATUS_EINVAL,
                   "data: %lld tokens cannot hold a sample of seq_len %lld plus "
                   "its targets",
                   (long long)d->n, (long long)spec->seq_len);
  int64_t L = spec->seq_len, shape[2] = {spec->batch_size, L};
  int64_t *row = malloc(sizeof(int64_t) * (size_t)(L + 1));
  if (row == NULL) return err_set(STATUS_ENOMEM, "data: out of host memory");
  fsdpc_status_t st = tensor_init(inputs, DTYPE_I64, device_cpu(), 2, shape);
  if (st == STATUS_OK &&
      (st = tensor_init(targets, DTYPE_I64, device_cpu(), 2, shape)) != STATUS_OK)
    tensor_free(inputs);
  for (int64_t b = 0; b < spec->batch_size && st == STATUS_OK; b++) {
    int64_t s = data_sample_start(d, spec, step, micro, spec->dp_rank * spec->batch_size + b);
    st = read_tokens(d, s, L + 1, row);
    if (st == STATUS_OK && spec->vocab_size > 0) st = check_ids(d, s, row, L + 1, spec->vocab_size);
    if (st != STATUS_OK) {
      tensor_free(inputs);
      tensor_free(targets);
      break;
    }
    memcpy((int64_t *)inputs->data + b * L, row, sizeof(int64_t) * (size_t)L);
    memcpy((int64_t *)targets->data + b * L, row + 1, sizeof(int64_t) * (size_t)L);
  }
  free(row);
  return st;
}
