#include "mesh/mesh.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

/* The world-level mesh every slice and flattening refers back to. */
typedef struct mesh_root {
  int refcount;
  int ndim;
  int shape[MESH_MAX_DIMS];
  int coord[MESH_MAX_DIMS];
  MPI_Comm comm;
  device_t device;
  pg_t *all; /* the group of every rank, every other group split from it (NULL: planned) */
} mesh_root_t;

struct mesh {
  int refs; /* mesh_free calls still to come */
  mesh_root_t *root;
  int ndim;
  int shape[MESH_MAX_DIMS];
  int coord[MESH_MAX_DIMS];
  char names[MESH_MAX_DIMS][MESH_NAME_MAX];
  unsigned root_mask[MESH_MAX_DIMS]; /* the root dimensions each dimension spans */
  pg_t *groups[MESH_MAX_DIMS];
  int *ranks;
  int nranks;
};

static void root_release(mesh_root_t *root) {
  if (root == NULL || --root->refcount > 0) return;
  pg_release(root->all);
  pg_comm_free(&root->comm);
  free(root);
}

mesh_t *mesh_retain(mesh_t *mesh) {
  if (mesh != NULL) mesh->refs++;
  return mesh;
}

void mesh_free(mesh_t *mesh) {
  if (mesh == NULL || --mesh->refs > 0) return;
  for (int i = 0; i < mesh->ndim; i++) pg_release(mesh->groups[i]);
  root_release(mesh->root);
  free(mesh->ranks);
  free(mesh);
}

/* Root coordinates of world rank r (row-major). */
static void root_unravel(const mesh_root_t *root, int r, int *coord) {
  for (int i = root->ndim - 1; i >= 0; i--) {
    coord[i] = r % root->shape[i];
    r /= root->shape[i];
  }
}

/* Row-major index of coord over the root dimensions in mask (in root order). */
static int masked_index(const mesh_root_t *root, const int *coord, unsigned mask) {
  int idx = 0;
  for (int i = 0; i < root->ndim; i++)
    if (mask & (1u << i)) idx = idx * root->shape[i] + coord[i];
  return idx;
}

/* Fills mesh->ranks: the world ranks that agree with this rank outside the mesh's root dims,
 * in row-major order of the mesh's own coordinates (a flattened dimension's index row-major
 * over its root dimensions in root order). */
static fsdpc_status_t fill_ranks(mesh_t *m) {
  m->nranks = 1;
  for (int i = 0; i < m->ndim; i++) m->nranks *= m->shape[i];
  m->ranks = malloc(sizeof(int) * (size_t)m->nranks);
  if (m->ranks == NULL) return err_set(STATUS_ENOMEM, "mesh: out of host memory");
  const mesh_root_t *root = m->root;
  for (int r = 0; r < m->nranks; r++) {
    int c[MESH_MAX_DIMS], rc = r;
    memcpy(c, root->coord, sizeof c);
    for (int k = m->ndim - 1; k >= 0; k--) { /* this dimension's index, then its root dims' */
      int idx = rc % m->shape[k];
      rc /= m->shape[k];
      for (int i = root->ndim - 1; i >= 0; i--)
        if (m->root_mask[k] & (1u << i)) {
          c[i] = idx % root->shape[i];
          idx /= root->shape[i];
        }
    }
    int w = 0;
    for (int i = 0; i < root->ndim; i++) w = w * root->shape[i] + c[i];
    m->ranks[r] = w;
  }
  return STATUS_OK;
}

static fsdpc_status_t check_names(const char *who, int ndim, const char *const *names) {
  for (int i = 0; i < ndim; i++) {
    if (names == NULL || names[i] == NULL)
      return err_set(STATUS_EINVAL, "%s: the name of mesh dimension %d is NULL", who, i);
    if (names[i][0] == '\0') return err_set(STATUS_EMESH, "mesh dimension %d has no name", i);
    if (strlen(names[i]) >= MESH_NAME_MAX)
      return err_set(STATUS_EMESH, "mesh dimension name '%s' is longer than %d characters",
                     names[i], MESH_NAME_MAX - 1);
    for (int j = 0; j < i; j++)
      if (strcmp(names[i], names[j]) == 0)
        return err_set(STATUS_EMESH, "mesh dimension name '%s' appears twice", names[i]);
  }
  return STATUS_OK;
}

/* Resolves -1 and checks that the sizes multiply to the world size. */
static fsdpc_status_t resolve_shape(int ndim, const int *shape, const char *const *names, int world,
                                    int *out) {
  int inferred = -1;
  double known = 1; /* a double cannot overflow for five int factors */
  char dims[256];
  size_t off = 0;
  dims[0] = '\0';
  for (int i = 0; i < ndim; i++) {
    if (shape[i] == -1) {
      if (inferred >= 0)
        return err_set(STATUS_EMESH, "mesh: only one dimension may be -1 ('%s' and '%s' are)",
                       names[inferred], names[i]);
      inferred = i;
    } else if (shape[i] <= 0) {
      return err_set(STATUS_EMESH, "mesh: size of '%s' must be positive or -1, got %d", names[i],
                     shape[i]);
    } else {
      known *= shape[i];
    }
    out[i] = shape[i];
    if (off < sizeof dims)
      off += (size_t)snprintf(dims + off, sizeof dims - off, "%s%s=%d", i ? " x " : "", names[i],
                              shape[i]);
  }
  if (inferred >= 0) {
    if (known > world || world % (int)known != 0)
      return err_set(STATUS_EMESH,
                     "mesh %s: world size %d is not divisible by %.0f (the product of the "
                     "other dimensions), so '%s' cannot be inferred",
                     dims, world, known, names[inferred]);
    out[inferred] = world / (int)known;
    return STATUS_OK;
  }
  if (known != world)
    return err_set(STATUS_EMESH, "mesh %s has %.0f ranks, but the world has %d", dims, known,
                   world);
  return STATUS_OK;
}

static fsdpc_status_t new_mesh(mesh_root_t *root, mesh_t **out) {
  mesh_t *m = calloc(1, sizeof *m);
  if (m == NULL) return err_set(STATUS_ENOMEM, "mesh: out of host memory");
  m->refs = 1;
  m->root = root;
  root->refcount++;
  *out = m;
  return STATUS_OK;
}

/* Builds the group of the ranks that agree with this rank outside `mask`, ordered
 * row-major over the dimensions in mask. Collective over the root. */
static fsdpc_status_t split_group(mesh_root_t *root, unsigned mask, pg_t **out) {
  unsigned others = ((1u << root->ndim) - 1) & ~mask;
  if (world_planning()) { /* this rank's group of the planned world, its size and place */
    int size = 1;
    for (int i = 0; i < root->ndim; i++)
      if (mask & (1u << i)) size *= root->shape[i];
    return pg_new_planned(size, masked_index(root, root->coord, mask), root->device, out);
  }
  if (others == 0) { /* every rank */
    *out = pg_retain(root->all);
    return STATUS_OK;
  }
  return pg_split(root->all, masked_index(root, root->coord, others),
                  masked_index(root, root->coord, mask), out);
}

fsdpc_status_t mesh_new(int ndim, const int *shape, const char *const *names,
                        device_type_t device_type, mesh_t **out) {
  if (out == NULL) return err_set(STATUS_EINVAL, "mesh_new: out is NULL");
  *out = NULL;
  if (ndim < 1 || ndim > MESH_MAX_DIMS)
    return err_set(STATUS_EMESH, "mesh: 1 to %d dimensions, got %d", MESH_MAX_DIMS, ndim);
  if (shape == NULL) return err_set(STATUS_EINVAL, "mesh_new: shape is NULL");
  if (world_pg() == NULL) return err_set(STATUS_EINVAL, "mesh_new: call world_init first");
  if (device_type != DEVICE_CPU && device_type != DEVICE_CUDA)
    return err_set(STATUS_EINVAL, "mesh_new: device type %d is neither DEVICE_CPU nor DEVICE_CUDA",
                   (int)device_type);
  if (names == NULL) return err_set(STATUS_EINVAL, "mesh_new: names is NULL");
  FSDPC_TRY(check_names("mesh_new", ndim, names));
  int sizes[MESH_MAX_DIMS];
  FSDPC_TRY(resolve_shape(ndim, shape, names, world_size(), sizes));

  device_t dev = device_cpu();
  if (device_type == DEVICE_CUDA) /* each rank a device of its own, or every rank an error */
    FSDPC_TRY(err_prefix(world_choose_device(DEVICE_WANT_CUDA, &dev, NULL, 0), "CUDA mesh"));

  mesh_root_t *root = calloc(1, sizeof *root);
  if (root == NULL) return err_set(STATUS_ENOMEM, "mesh: out of host memory");
  root->ndim = ndim;
  root->device = dev;
  memcpy(root->shape, sizes, sizeof(int) * (size_t)ndim);
  root_unravel(root, world_rank(), root->coord);
  fsdpc_status_t st = pg_mpi_status(MPI_Comm_dup(MPI_COMM_WORLD, &root->comm), "MPI_Comm_dup");
  if (st != STATUS_OK) {
    free(root);
    return st;
  }
  mesh_t *m = NULL;
  st = new_mesh(root, &m); /* takes the root's first reference */
  if (st != STATUS_OK) {
    MPI_Comm_free(&root->comm);
    free(root);
    return st;
  }
  m->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    m->shape[i] = sizes[i];
    m->coord[i] = root->coord[i];
    m->root_mask[i] = 1u << i;
    snprintf(m->names[i], MESH_NAME_MAX, "%s", names[i]);
  }
  /* the group of every rank first: the others are split from it (one NCCL communicator made
   * from scratch, the rest split from its) */
  if (!world_planning()) st = comm_agree(root->comm, pg_new_for(root->comm, dev, &root->all));
  for (int i = 0; i < ndim && st == STATUS_OK; i++) st = split_group(root, 1u << i, &m->groups[i]);
  if (st == STATUS_OK) st = fill_ranks(m);
  st = comm_agree(MPI_COMM_WORLD, st);
  if (st != STATUS_OK) {
    mesh_free(m);
    return st;
  }
  *out = m;
  return STATUS_OK;
}

fsdpc_status_t mesh_new_local(const char *name, device_type_t device_type, mesh_t **out) {
  if (out == NULL) return err_set(STATUS_EINVAL, "mesh_new_local: out is NULL");
  *out = NULL;
  FSDPC_TRY(check_names("mesh_new_local", 1, &name));
  int up = 0; /* its group is an MPI communicator of this process alone */
  if (MPI_Initialized(&up) != MPI_SUCCESS || !up || world_pg() == NULL)
    return err_set(STATUS_EINVAL, "mesh_new_local: call world_init first");
  device_t dev = device_cpu();
  if (device_type == DEVICE_CUDA) {
    dev = world_device();
    if (dev.type != DEVICE_CUDA)
      return err_set(STATUS_ENODEV, "CUDA mesh requested, but rank %d has no CUDA device",
                     world_rank());
  }
  mesh_root_t *root = calloc(1, sizeof *root);
  if (root == NULL) return err_set(STATUS_ENOMEM, "mesh: out of host memory");
  root->ndim = 1;
  root->shape[0] = 1;
  root->device = dev;
  fsdpc_status_t st = pg_mpi_status(MPI_Comm_dup(MPI_COMM_SELF, &root->comm), "MPI_Comm_dup");
  if (st != STATUS_OK) {
    free(root);
    return st;
  }
  mesh_t *m = NULL;
  if ((st = new_mesh(root, &m)) != STATUS_OK) {
    MPI_Comm_free(&root->comm);
    free(root);
    return st;
  }
  m->ndim = 1;
  m->shape[0] = 1;
  m->root_mask[0] = 1;
  snprintf(m->names[0], MESH_NAME_MAX, "%s", name);
  st = pg_new_for(root->comm, dev, &m->groups[0]);
  if (st == STATUS_OK) {
    root->all = pg_retain(m->groups[0]); /* its group of every rank: this one */
    m->nranks = 1;
    m->ranks = malloc(sizeof(int));
    if (m->ranks == NULL)
      st = err_set(STATUS_ENOMEM, "mesh: out of host memory");
    else
      m->ranks[0] = world_rank();
  }
  if (st != STATUS_OK) {
    mesh_free(m);
    return st;
  }
  *out = m;
  return STATUS_OK;
}

fsdpc_status_t mesh_local_shared(device_type_t device_type, mesh_t **out) {
  ARG_NONNULL(out);
  static mesh_t *shared[2];
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  *out = NULL;
  if (device_type != DEVICE_CPU && device_type != DEVICE_CUDA)
    return err_set(STATUS_EINVAL, "mesh_local_shared: unknown device type %d", (int)device_type);
  fsdpc_status_t st = STATUS_OK;
  pthread_mutex_lock(&lock);
  if (shared[device_type] == NULL) st = mesh_new_local("local", device_type, &shared[device_type]);
  *out = shared[device_type];
  pthread_mutex_unlock(&lock);
  return st;
}

/* Indices of the named dimensions, which must be distinct and in mesh order. */
static fsdpc_status_t lookup_dims(const mesh_t *mesh, int n, const char *const *names, int *idx) {
  if (n < 1 || n > mesh->ndim)
    return err_set(STATUS_EMESH, "mesh: %d dimension names given for a %d-D mesh", n, mesh->ndim);
  for (int k = 0; k < n; k++) {
    idx[k] = names && names[k] ? mesh_dim_index(mesh, names[k]) : -1;
    if (idx[k] < 0) {
      char buf[256];
      return err_set(STATUS_EMESH, "mesh %s has no dimension '%s'", mesh_str(mesh, buf, sizeof buf),
                     names && names[k] ? names[k] : "(null)");
    }
    if (k > 0 && idx[k] <= idx[k - 1])
      return err_set(STATUS_EMESH,
                     "mesh dimensions must be named once each, in mesh order "
                     "('%s' comes after '%s')",
                     names[k - 1], names[k]);
  }
  return STATUS_OK;
}

fsdpc_status_t mesh_slice(const mesh_t *mesh, int n, const char *const *names, mesh_t **out) {
  ARG_NONNULL(mesh);
  if (n > 0) ARG_NONNULL(names);
  ARG_NONNULL(out);
  *out = NULL;
  int idx[MESH_MAX_DIMS];
  FSDPC_TRY(lookup_dims(mesh, n, names, idx));
  mesh_t *m = NULL;
  FSDPC_TRY(new_mesh(mesh->root, &m));
  m->ndim = n;
  for (int k = 0; k < n; k++) {
    int d = idx[k];
    m->shape[k] = mesh->shape[d];
    m->coord[k] = mesh->coord[d];
    m->root_mask[k] = mesh->root_mask[d];
    memcpy(m->names[k], mesh->names[d], MESH_NAME_MAX);
    m->groups[k] = pg_retain(mesh->groups[d]);
  }
  fsdpc_status_t st = fill_ranks(m);
  if (st != STATUS_OK) {
    mesh_free(m);
    return st;
  }
  *out = m;
  return STATUS_OK;
}

bool mesh_same_root(const mesh_t *a, const mesh_t *b) {
  if (a == NULL || b == NULL) return false;
  return a->root == b->root;
}

fsdpc_status_t mesh_concat(const mesh_t *a, const mesh_t *b, mesh_t **out) {
  ARG_NONNULL(a);
  ARG_NONNULL(b);
  ARG_NONNULL(out);
  *out = NULL;
  if (a->root != b->root)
    return err_set(STATUS_EMESH, "mesh_concat: the meshes come from different mesh_new calls");
  if (a->ndim + b->ndim > MESH_MAX_DIMS)
    return err_set(STATUS_EMESH, "mesh_concat: more than %d dimensions", MESH_MAX_DIMS);
  for (int i = 0; i < a->ndim; i++)
    for (int j = 0; j < b->ndim; j++)
      if ((a->root_mask[i] & b->root_mask[j]) || strcmp(a->names[i], b->names[j]) == 0)
        return err_set(STATUS_EMESH, "mesh_concat: dimensions '%s' and '%s' overlap", a->names[i],
                       b->names[j]);
  mesh_t *m = NULL;
  FSDPC_TRY(new_mesh(a->root, &m));
  const mesh_t *src[2] = {a, b};
  for (int s = 0; s < 2; s++)
    for (int d = 0; d < src[s]->ndim; d++) {
      int k = m->ndim++;
      m->shape[k] = src[s]->shape[d];
      m->coord[k] = src[s]->coord[d];
      m->root_mask[k] = src[s]->root_mask[d];
      memcpy(m->names[k], src[s]->names[d], MESH_NAME_MAX);
      m->groups[k] = pg_retain(src[s]->groups[d]);
    }
  fsdpc_status_t st = fill_ranks(m);
  if (st != STATUS_OK) {
    mesh_free(m);
    return st;
  }
  *out = m;
  return STATUS_OK;
}

fsdpc_status_t mesh_flatten(const mesh_t *mesh, int n, const char *const *names,
                            const char *new_name, mesh_t **out) {
  ARG_NONNULL(mesh);
  if (n > 0) ARG_NONNULL(names);
  ARG_NONNULL(new_name);
  ARG_NONNULL(out);
  *out = NULL;
  int idx[MESH_MAX_DIMS];
  FSDPC_TRY(lookup_dims(mesh, n, names, idx));
  FSDPC_TRY(check_names("mesh_flatten", 1, &new_name));
  mesh_t *m = NULL;
  FSDPC_TRY(new_mesh(mesh->root, &m));
  m->ndim = 1;
  m->shape[0] = 1;
  for (int k = 0; k < n; k++) {
    m->shape[0] *= mesh->shape[idx[k]];
    m->root_mask[0] |= mesh->root_mask[idx[k]];
  }
  m->coord[0] = masked_index(m->root, m->root->coord, m->root_mask[0]);
  snprintf(m->names[0], MESH_NAME_MAX, "%s", new_name);
  fsdpc_status_t st = split_group(m->root, m->root_mask[0], &m->groups[0]);
  if (st == STATUS_OK) st = fill_ranks(m);
  if (st != STATUS_OK) {
    mesh_free(m);
    return st;
  }
  *out = m;
  return STATUS_OK;
}

int mesh_ndim(const mesh_t *mesh) {
  if (mesh == NULL) return 0;
  return mesh->ndim;
}
/* A dimension's index, or -1 (no mesh, or out of range). */
static int dim_of(const mesh_t *mesh, int dim) {
  return mesh != NULL && dim >= 0 && dim < mesh->ndim ? dim : -1;
}

int mesh_size(const mesh_t *mesh, int dim) {
  if (dim_of(mesh, dim) < 0) return 0;
  return mesh->shape[dim];
}
int mesh_numel(const mesh_t *mesh) {
  if (mesh == NULL) return 0;
  return mesh->nranks;
}
int mesh_coord(const mesh_t *mesh, int dim) {
  if (dim_of(mesh, dim) < 0) return -1;
  return mesh->coord[dim];
}
const char *mesh_dim_name(const mesh_t *mesh, int dim) {
  return dim_of(mesh, dim) < 0 ? NULL : mesh->names[dim];
}
pg_t *mesh_group(const mesh_t *mesh, int dim) {
  if (dim_of(mesh, dim) < 0) return NULL;
  return mesh->groups[dim];
}
const int *mesh_ranks(const mesh_t *mesh) {
  if (mesh == NULL) return NULL;
  return mesh->ranks;
}
device_t mesh_device(const mesh_t *mesh) {
  if (mesh == NULL) return device_cpu();
  return mesh->root->device;
}

int mesh_dim_index(const mesh_t *mesh, const char *name) {
  if (mesh == NULL || name == NULL) return -1;
  for (int i = 0; i < mesh->ndim; i++)
    if (strcmp(mesh->names[i], name) == 0) return i;
  return -1;
}

void mesh_unravel(const mesh_t *mesh, int index, int *coord) {
  if (mesh == NULL || coord == NULL) return;
  for (int i = mesh->ndim - 1; i >= 0; i--) {
    coord[i] = index % mesh->shape[i];
    index /= mesh->shape[i];
  }
}

const char *mesh_str(const mesh_t *mesh, char *buf, size_t size) {
  if (mesh == NULL || buf == NULL) return "(null)";
  size_t off = (size_t)snprintf(buf, size, "(");
  for (int i = 0; i < mesh->ndim && off < size; i++)
    off += (size_t)snprintf(buf + off, size - off, "%s%s=%d", i ? ", " : "", mesh->names[i],
                            mesh->shape[i]);
  if (off < size) snprintf(buf + off, size - off, ")");
  return buf;
}
