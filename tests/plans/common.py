"""What the modes of the fsdp-train end-to-end tests share: the programs under test, running
them (under mpirun; a sanitizer's report in their output fails the mode), the checks and their
tally, temporary folders, the shipped plans and the edits of checkpoint files."""
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

EXE = MPIRUN = ROOT = MODE = TOOL = None  # set by setup
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
            # a failed job ends at once (by default mpirun waits 2 s for ranks that have exited)
            "--mca", "odls_base_sigkill_timeout", "0"]
STEPS = 10
failures = []
TEMPS = []


def setup(exe, mpirun, root, mode):
    """Names fsdp-train, mpirun, the source tree and the mode, and sets the environment the
    mode's programs run in."""
    global EXE, MPIRUN, ROOT, MODE, TOOL
    EXE, MPIRUN, ROOT, MODE = exe, mpirun, root, mode
    TOOL = os.path.join(os.path.dirname(EXE), "fsdp-ckpt")
    # The CPU modes run on the CPU on a GPU machine too (fsdp-train takes the GPUs it sees, one
    # per rank: these modes start up to 8 ranks); the gpu modes keep them.
    if not mode.startswith("gpu"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Sanitized builds: LeakSanitizer's check costs ~0.3 s of CPU per process (world_finalize
    # runs it before MPI_Finalize); the modes that run fsdp-train's ordinary paths many times
    # skip it, those of bad input and damaged files (errors, ckpt-corrupt) keep it, as do the
    # library's C suites. The damage table (ckpt-damage) runs ~110 processes: it keeps ASan and
    # UBSan, not the leak check (ckpt-corrupt and the C suites check the same error paths for
    # leaks). Every sanitizer report in a program's output fails the mode (sh below).
    if os.environ.get("FSDPC_TEST_SANITIZED") and mode in ("configs", "dry-run", "checkpoint",
                                                           "ckpt-tool", "ckpt-damage"):
        os.environ["ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0"


def finish():
    """Removes the temporary folders, prints the failures' count; the exit status."""
    for d in TEMPS:
        shutil.rmtree(d, ignore_errors=True)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


def mkdtemp():
    d = tempfile.mkdtemp(prefix="fsdpc-plans-")
    TEMPS.append(d)
    return d


SANITIZER_REPORT = re.compile(r"ERROR: (Leak|Address)Sanitizer|runtime error:")


def sh(cmd, timeout, env=None):
    """Runs cmd capturing its output; a sanitizer's report in it is a failure."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **env) if env else None)
    if SANITIZER_REPORT.search(p.stderr):
        check(False, "%s: ends without a sanitizer report" %
              " ".join(os.path.basename(c) for c in cmd))
        print(p.stderr[-3000:])
    return p


def run(n, args, timeout=300, mpi_args=()):
    cmd = [MPIRUN] + MPI_ARGS + list(mpi_args) + ["-n", str(n), EXE] + args
    t = time.time()
    p = sh(cmd, timeout)
    return p, time.time() - t


# "[rank 2]", "[ranks 0-3]", "[ranks 0,2,5-7]", "[ranks 0-3, from rank 1]" (1's, passed on)
RANKS = r"\[ranks? ([\d,\-]+)(?:, from ranks? [\d,\-]+)?\]"


def rank_set(spec):
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.update(str(k) for k in range(int(a), int(b or a) + 1))
    return out


def ranks_saying(text, pattern):
    """The ranks that the lines of text matching pattern name."""
    out = set()
    for line in text.splitlines():
        m = re.search(RANKS, line)
        if m and re.search(pattern, line):
            out |= rank_set(m.group(1))
    return out


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def losses(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# (config, world size, fp32: matches debug.yaml)
PLANS = [
    ("debug", 1, True),
    ("fsdp", 4, True),
    ("hsdp", 4, True),
    ("hsdp-int-reshard", 8, True),
    ("fsdp-grad-accum", 2, True),
    ("fsdp-bf16", 4, False),
    ("tp", 2, True),
    ("hsdp-tp", 8, True),
]


BASE = """\
mesh:
  dp_shard: -1
model:
  dim: 32
  n_layers: 2
  n_heads: 2
  n_kv_heads: 1
  ffn_dim: 64
  vocab_size: 256
  max_seq_len: 64
parallelize:
  fully_shard:
    units: ["model.layers.*"]
data:
  path: {data}
  seq_len: 16
  batch_size: 2
train:
  steps: 2
"""


def kill_session(sid):
    """SIGKILL every process of session sid (mpirun started with a new session; its ranks
    keep that session) until none is left."""
    for _ in range(100):
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(int(pid))
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def header_edit(edit):
    """raw bytes of a safetensors file -> the same file with edit applied to its header dict"""
    import struct

    def f(raw):
        (n,) = struct.unpack("<Q", raw[:8])
        h = json.loads(raw[8:8 + n])
        edit(h)
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data offsets count from the header's end
        return struct.pack("<Q", len(text)) + text + raw[8 + n:]
    return f


def edit_file(path, f):
    with open(path, "rb") as x:
        raw = x.read()
    with open(path, "wb") as x:
        x.write(f(raw))


def edit_header(path, edit):
    edit_file(path, header_edit(edit))


def edit_state(folder, f):
    path = os.path.join(folder, "train_state.json")
    with open(path) as x:
        state = json.load(x)
    f(state)
    with open(path, "w") as x:
        json.dump(state, x, indent=2)


def strip_records(folder):
    """a checkpoint as another tool would have written it: no integrity records"""
    edit_state(folder, lambda st: st.pop("integrity"))
    for sub in ("model", "optim"):
        for f in os.listdir(os.path.join(folder, sub)):
            edit_header(os.path.join(folder, sub, f),
                        lambda h: h["__metadata__"].pop("FSDPC_INTEGRITY"))


def st_read(path):
    """An independent safetensors reader: (header dict, data bytes)."""
    import struct
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def hf_folder(tmp, tag, init=None):
    """A Hugging Face folder in tmp of tests/reference's model TAG: its config and initial
    weights (those of the model init, when given)."""
    ref = os.path.join(ROOT, "tests", "reference")
    model = os.path.join(tmp, tag)
    os.mkdir(model)
    os.symlink(os.path.join(ref, tag + "_config.json"), os.path.join(model, "config.json"))
    os.symlink(os.path.join(ref, (init or tag) + "_init.safetensors"),
               os.path.join(model, "model.safetensors"))
    return model
