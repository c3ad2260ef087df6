#!/usr/bin/env python3
"""fsdp-train end to end.

  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT configs   every shipped plan at its world size:
                                                        loss goes down; fp32 plans match
                                                        debug.yaml step for step (1e-5)
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT errors    malformed input: documented message
                                                        from every rank, non-zero exit, fast
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT dry-run   --dry-run's estimates against a real
                                                        run's counters
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT checkpoint  saving, resuming under other plans
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT gpu       checkpoints of GPU shards (skips, 77,
                                                        without a GPU)
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

EXE, MPIRUN, ROOT, MODE = sys.argv[1:5]
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
STEPS = 10
failures = []
TEMPS = []


def mkdtemp():
    d = tempfile.mkdtemp(prefix="fsdpc-plans-")
    TEMPS.append(d)
    return d


def run(n, args, timeout=300):
    cmd = [MPIRUN] + MPI_ARGS + ["-n", str(n), EXE] + args
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p, time.time() - t


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


def configs():
    tmp = mkdtemp()
    ref = None
    for name, n, fp32 in PLANS:
        metrics = os.path.join(tmp, name + ".jsonl")
        p, _ = run(n, [os.path.join(ROOT, "configs", name + ".yaml"), "--set",
                       "train.steps=%d" % STEPS, "--metrics", metrics])
        check(p.returncode == 0, "%s on %d ranks runs" % (name, n))
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-2000:])
            continue
        m = losses(metrics)
        check(len(m) == STEPS and [r["step"] for r in m] == list(range(1, STEPS + 1)),
              "%s: one metrics line per step" % name)
        keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes", "comm_bytes"}
        check(all(keys <= set(r) for r in m), "%s: metrics carry %s" % (name, sorted(keys)))
        check(m[-1]["loss"] < m[0]["loss"] - 0.5,
              "%s: loss goes down (%.4f -> %.4f)" % (name, m[0]["loss"], m[-1]["loss"]))
        if name == "debug":
            ref = [r["loss"] for r in m]
        elif ref is not None:
            worst = max(abs(a["loss"] - b) / abs(b) for a, b in zip(m, ref))
            tol = 1e-5 if fp32 else 2e-3
            check(worst <= tol, "%s: losses match debug.yaml within %g (worst %.2e)"
                  % (name, tol, worst))


PYTORCH_PLAN = """\
# the tiny model of tests/reference, trained as make_goldens.py trains it
model:
  init_from: {model}
parallelize:
  fully_shard:
    units: ["model.layers.*"]
optim:
  lr: 3.0e-3
  beta2: 0.95
  eps: 1.0e-8
  weight_decay: 0.1
  clip_grad_norm: 1.0
  param_groups:
    "*norm*": {weight_decay: 0.0}
    "model.embed_tokens.*": {lr: 1.0e-3}
schedule:
  warmup_steps: 3
  min_lr_ratio: 0.1
data:
  path: {data}
  seq_len: 32
  batch_size: 1
train:
  steps: 10
"""


def golden_losses():
    import struct
    with open(os.path.join(ROOT, "tests", "reference", "tiny_golden.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        a, b = head["train_losses"]["data_offsets"]
        f.seek(8 + n + a)
        raw = f.read(b - a)
    return list(struct.unpack("<%df" % (len(raw) // 4), raw))


def pytorch():
    """init_from a Hugging Face folder, FSDP on 2 ranks: PyTorch's ten losses."""
    tmp = mkdtemp()
    model = os.path.join(tmp, "tiny")
    os.mkdir(model)
    ref = os.path.join(ROOT, "tests", "reference")
    os.symlink(os.path.join(ref, "tiny_config.json"), os.path.join(model, "config.json"))
    os.symlink(os.path.join(ref, "tiny_init.safetensors"), os.path.join(model, "model.safetensors"))
    plan = os.path.join(tmp, "tiny.yaml")
    with open(plan, "w") as f:
        f.write(PYTORCH_PLAN.replace("{model}", model).replace(
            "{data}", os.path.join(ROOT, "data", "corpus.txt")))
    metrics = os.path.join(tmp, "m.jsonl")
    p, _ = run(2, [plan, "--metrics", metrics])
    check(p.returncode == 0, "model.init_from plan on 2 ranks runs")
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
        return
    got = [r["loss"] for r in losses(metrics)]
    want = golden_losses()
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    check(len(got) == len(want) == 10 and worst <= 1e-5,
          "fsdp-train on 2 ranks reproduces PyTorch's ten losses (worst %.2e)" % worst)


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


def errors():
    tmp = mkdtemp()
    data = os.path.join(ROOT, "data", "corpus.txt")
    base = BASE.replace("{data}", data)
    tp_base = base.replace("dp_shard: -1", "dp_shard: 1\n  tp: 2").replace("n_kv_heads: 1",
                                                                          "n_kv_heads: 2")
    def tp_plan(rules):
        return tp_base.replace("parallelize:\n",
                               "parallelize:\n  tensor_parallel:\n    plan: {%s}\n" % rules)
    # (name, plan text or None for BASE, extra args, expected message regex)
    cases = [
        ("syntax error", "mesh: [1, 2\n", [], r"bad\d*\.yaml:\d+:\d+: not valid YAML"),
        ("wrong type", base.replace("seq_len: 16", "seq_len: abc"), [],
         r"bad\d*\.yaml:16:12: data\.seq_len: expected an integer, got 'abc'"),
        ("unknown top-level key", base + "trian:\n  steps: 3\n", [],
         r"trian: unknown key; did you mean 'train'\?"),
        ("unknown nested key", base.replace("  dim: 32", "  dimm: 32"), [],
         r"model\.dimm: unknown key; did you mean 'dim'\?"),
        ("negative mesh size", base.replace("dp_shard: -1", "dp_shard: -3"), [],
         r"mesh\.dp_shard: -3 is out of range"),
        ("zero mesh size", base.replace("dp_shard: -1", "dp_shard: 0"), [],
         r"mesh\.dp_shard: a mesh size must be positive"),
        ("mesh product differs from the world", base.replace("dp_shard: -1", "dp_shard: 3"), [],
         r"mesh: dp_replicate x dp_shard x tp = 1 x 3 x 1 = 3, but the world has 2 ranks"),
        ("integer reshard not dividing dp_shard", base.replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    reshard_after_forward: 3'),
         [], r"reshard_after_forward: 3 does not divide mesh\.dp_shard=2"),
        ("missing data file", base.replace(data, "/nonexistent/tokens.bin"), [],
         r"data\.path: cannot read '/nonexistent/tokens\.bin'"),
        ("unit pattern matching nothing", base.replace('"model.layers.*"', '"model.blocks.*"'),
         [], r"units\[0\]: 'model\.blocks\.\*' matches no module"),
        ("empty file", "", [], r"the plan is empty"),
        ("binary garbage", b"\x00\x01\xff\xfe garbage \x80\x81", [], r"not valid YAML"),
        ("huge number", base.replace("batch_size: 2", "batch_size: 99999999999999999999999"),
         [], r"data\.batch_size: 99999999999999999999999 is out of range"),
        ("duplicate key", base + "data:\n  seq_len: 8\n", [],
         r"data: duplicate key \(first given at .*bad\d*\.yaml:14:1\)"),
        ("tp not dividing the key/value heads", tp_base.replace("n_kv_heads: 2", "n_kv_heads: 1"),
         [], r"mesh\.tp: 2 does not divide model\.n_kv_heads=1"),
        ("unknown tp style", tp_plan("lm_head: diagonal"), [],
         r"tensor_parallel\.plan\.lm_head: unknown style 'diagonal'"),
        ("unknown tp layout", tp_plan("lm_head: {style: colwise, output: sideways}"), [],
         r"plan\.lm_head: output: expected replicate, shard\(1\) or shard\(-1\)"),
        ("tp pattern matching nothing", tp_plan("model.blocks.*.mlp: prepare_input"), [],
         r"tensor_parallel\.plan: tensor parallel: 'model\.blocks\.\*\.mlp' matches no module"),
        ("tp style on the wrong layer", tp_plan("model.norm: colwise"), [],
         r"tensor parallel: model\.norm is a rmsnorm; colwise applies to linear and embedding"),
        ("lm_head logits left split", tp_plan("lm_head: colwise"), [],
         r"plan\.lm_head: the loss needs whole logits"),
        ("sequence not divisible by tp", tp_base.replace("seq_len: 16", "seq_len: 15").replace(
            "parallelize:\n", "parallelize:\n  tensor_parallel:\n    sequence_parallel: true\n"),
         [], r"data\.seq_len: 15 is not divisible by mesh\.tp=2"),
        ("unknown dtype", base.replace('units: ["model.layers.*"]',
                                       'units: ["model.layers.*"]\n    mp_policy: {param_dtype: f8}'),
         [], r"mp_policy\.param_dtype: expected f32, bf16 or f16, got 'f8'"),
        ("not a boolean", base.replace("  max_seq_len: 64", "  max_seq_len: 64\n  tie_embeddings: maybe"),
         [], r"model\.tie_embeddings: expected true or false, got 'maybe'"),
        ("--set without a value", None, ["--set", "train.steps"], r"--set train\.steps: expected key\.path=value"),
        ("--set with an unknown key", None, ["--set", "train.stepz=3"],
         r"--set train\.stepz=3: train\.stepz: unknown key; did you mean 'steps'\?"),
        ("--set with a bad value", None, ["--set", "optim.lr=-1"],
         r"--set optim\.lr=-1: optim\.lr: -1 is out of range"),
        ("inconsistent model", base.replace("n_heads: 2", "n_heads: 3"), [], r"bad\d*\.yaml:\d+:\d+: model: "),
        ("top level not a mapping", "- mesh\n- model\n", [], r"expected a mapping of sections"),
        ("missing plan file", "MISSING", [], r"cannot open the plan"),
        ("unknown option", None, ["--frobnicate"], r"unknown option '--frobnicate'"),
        ("vocabulary smaller than the data", base.replace("vocab_size: 256", "vocab_size: 50"), [],
         r"token id \d+ .* is outside model\.vocab_size=50"),
        ("two sizes of -1", base.replace("dp_shard: -1", "dp_shard: -1\n  dp_replicate: -1"), [],
         r"mesh: at most one size may be -1"),
        ("sequence longer than the model's", base.replace("seq_len: 16", "seq_len: 128"), [],
         r"data\.seq_len: 128 exceeds model\.max_seq_len=64"),
        ("unknown data format", base.replace("  seq_len: 16", "  format: csv\n  seq_len: 16"), [],
         r"data\.format: expected text or u16, got 'csv'"),
        ("units not a list", base.replace('units: ["model.layers.*"]', 'units: "model.layers.*"'),
         [], r"units: expected a list of module patterns"),
        ("checkpoint.load not a checkpoint", base + "checkpoint:\n  load: /nonexistent/step-5\n", [],
         r"checkpoint\.load: '/nonexistent/step-5' is not a complete checkpoint"),
        ("checkpoint.interval without a folder", base + "checkpoint:\n  interval: 5\n", [],
         r"checkpoint\.interval: 5 needs checkpoint\.dir"),
    ]
    def one(k):
        name, text, extra, want = cases[k]
        path = os.path.join(tmp, "bad%d.yaml" % k)
        if text == "MISSING":
            path = os.path.join(tmp, "missing.yaml")
        else:
            mode = "wb" if isinstance(text, bytes) else "w"
            with open(path, mode) as f:
                f.write(text if text is not None else base)
        try:
            return run(2, [path] + extra, timeout=60)
        except subprocess.TimeoutExpired:
            return None, 60.0

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, range(len(cases))))
    for (name, _, _, want), (p, secs) in zip(cases, results):
        if p is None:
            check(False, "%s: finishes (timed out)" % name)
            continue
        lines = [l for l in p.stderr.splitlines() if re.search(want, l)]
        both = any("[rank 0]" in l for l in lines) and any("[rank 1]" in l for l in lines)
        good = p.returncode != 0 and both and secs < 30
        check(good, "%s: exit %d in %.1fs, both ranks say /%s/" % (name, p.returncode, secs, want))
        if not good:
            print(p.stderr[-1500:])
    check(len(cases) >= 20, "%d malformed inputs" % len(cases))


def dry_run():
    tmp = mkdtemp()
    for name, n, _ in PLANS:
        plan = os.path.join(ROOT, "configs", name + ".yaml")
        p, _ = run(n, [plan, "--dry-run"])
        check(p.returncode == 0, "%s: --dry-run runs" % name)
        est_comm = re.search(r"^comm_bytes (\d+)$", p.stdout, re.M)
        est_state = re.search(r"^state_bytes (\d+)$", p.stdout, re.M)
        check(bool(est_comm and est_state), "%s: --dry-run prints its estimates" % name)
        check("placements" in p.stdout and "model.layers.0.mlp.up_proj.weight" in p.stdout,
              "%s: --dry-run lists every parameter's placements and shapes" % name)
        if not (est_comm and est_state):
            continue
        metrics = os.path.join(tmp, name + ".jsonl")
        p, _ = run(n, [plan, "--set", "train.steps=2", "--metrics", metrics])
        m = losses(metrics)
        got_comm, got_state = m[-1]["comm_bytes"], m[-1]["state_bytes"]
        want_comm, want_state = int(est_comm.group(1)), int(est_state.group(1))
        check(got_comm == want_comm, "%s: communication %d B per step, estimated %d B"
              % (name, got_comm, want_comm))
        check(abs(got_state - want_state) <= 0.1 * want_state,
              "%s: memory held after a step %d B, estimated %d B (10%%)"
              % (name, got_state, want_state))


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


def checkpoints():
    tmp = mkdtemp()
    cfg = lambda name: os.path.join(ROOT, "configs", name + ".yaml")

    def train(n, name, sets, metrics=None):
        args = [cfg(name)]
        for kv in sets:
            args += ["--set", kv]
        if metrics:
            args += ["--metrics", metrics]
        p, _ = run(n, args)
        check(p.returncode == 0, "%s on %d ranks with %s runs" % (name, n, " ".join(sets)))
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-2000:])
        return p

    # 1. exact resume under the same plan: losses and saved files bit-identical
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    ma, mc = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "c.jsonl")
    train(4, "fsdp", ["train.steps=10", "checkpoint.dir=" + a, "checkpoint.interval=5"], ma)
    train(4, "fsdp", ["train.steps=5", "checkpoint.dir=" + b, "checkpoint.interval=5"])
    p = train(4, "fsdp", ["train.steps=10", "checkpoint.dir=" + b, "checkpoint.interval=5",
                          "checkpoint.load=auto"], mc)
    check("resumed from %s/step-00000005" % b in p.stdout, "load: auto finds step 5")
    la, lc = [r["loss"] for r in losses(ma)][5:], [r["loss"] for r in losses(mc)]
    check(la == lc, "resumed losses are bit-identical (%s vs %s)" % (la[:1], lc[:1]))
    same = True
    for sub in ("model", "optim"):
        for f in sorted(os.listdir(os.path.join(a, "step-00000010", sub))):
            with open(os.path.join(a, "step-00000010", sub, f), "rb") as x, \
                    open(os.path.join(b, "step-00000010", sub, f), "rb") as y:
                same = same and x.read() == y.read()
    check(same, "the step-10 checkpoints of both runs are byte-identical")
    # 2. resume under other plans: global batch 24 everywhere
    ref = os.path.join(tmp, "ref.jsonl")
    train(1, "debug", ["train.steps=10", "data.batch_size=24"], ref)
    want = [r["loss"] for r in losses(ref)][5:]
    s = os.path.join(tmp, "s")
    train(4, "fsdp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + s,
                      "checkpoint.interval=5"])
    t = os.path.join(tmp, "t")
    train(8, "hsdp-tp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + t,
                         "checkpoint.interval=5"])
    for n, name, batch, src in [(1, "debug", 24, s), (4, "hsdp", 6, s), (3, "fsdp", 8, s),
                                (8, "hsdp-int-reshard", 3, s), (2, "tp", 24, s),
                                (8, "hsdp-tp", 6, s), (4, "fsdp", 6, t), (1, "debug", 24, t)]:
        m = os.path.join(tmp, "x%d.jsonl" % len(os.listdir(tmp)))  # a new file per run
        p = train(n, name, ["train.steps=10", "data.batch_size=%d" % batch,
                            "checkpoint.load=" + os.path.join(src, "step-00000005")], m)
        got = [r["loss"] for r in losses(m)] if os.path.exists(m) else []
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, want)) if got else 1
        check(len(got) == 5 and worst <= 1e-5,
              "saved by %s, resumed by %s on %d: losses match the uninterrupted run "
              "(worst %.2e)" % ("hsdp-tp on 8 ranks" if src == t else "fsdp on 4 ranks", name, n,
                                worst))
        rd = re.search(r"read (\d+) bytes of tensor data, needing (\d+)", p.stdout)
        check(bool(rd) and rd.group(1) == rd.group(2),
              "%s on %d: rank 0 reads exactly the bytes it needs" % (name, n))
    # 3. keep: only the newest checkpoints stay
    k = os.path.join(tmp, "k")
    train(2, "fsdp-grad-accum", ["train.steps=6", "checkpoint.dir=" + k, "checkpoint.interval=2",
                                 "checkpoint.keep=2"])
    check(sorted(os.listdir(k)) == ["step-00000004", "step-00000006"],
          "checkpoint.keep=2 keeps the newest two (%s)" % sorted(os.listdir(k)))
    # 4. a run killed while saving every step: the newest complete checkpoint still loads
    kd = os.path.join(tmp, "kill")
    cmd = [MPIRUN] + MPI_ARGS + ["-n", "4", EXE, cfg("fsdp"), "--set", "train.steps=100000",
                                 "--set", "checkpoint.dir=" + kd, "--set", "checkpoint.interval=1",
                                 "--set", "checkpoint.keep=3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(os.listdir(kd) if os.path.isdir(kd) else []) < 3:
        time.sleep(0.05)
    time.sleep(0.37)
    kill_session(proc.pid)  # mpirun and every rank, mid-step or mid-save
    proc.wait()
    left = sorted(os.listdir(kd))
    complete = [d for d in left if d.startswith("step-") and not d.endswith(".tmp")
                and os.path.exists(os.path.join(kd, d, "train_state.json"))]
    check(len(complete) > 0, "a run killed mid-training left complete checkpoints (%s)" % left)
    if complete:
        newest = int(complete[-1][5:])
        p = train(4, "fsdp", ["checkpoint.dir=" + kd, "checkpoint.load=auto",
                              "train.steps=%d" % (newest + 1)])
        good = "resumed from %s/%s" % (kd, complete[-1]) in p.stdout
        check(good, "after the kill (left: %s) load: auto resumes from %s" % (left, complete[-1]))
        if not good:
            print(p.stdout[-3000:], p.stderr[-2000:])


def gpu():
    """One rank on this machine's GPU: checkpoints of CUDA shards (and of shards offloaded to
    the host) resume bit-identically."""
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "debug.yaml")
    p, _ = run(1, [cfg, "--dry-run"])
    if " on cuda" not in p.stdout:
        print("no CUDA device: skipped")
        sys.exit(77)
    for offload in ("false", "true"):
        a, b = os.path.join(tmp, "a" + offload), os.path.join(tmp, "b" + offload)
        ma, mb = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b.jsonl")
        sets = ["--set", "parallelize.fully_shard.offload=" + offload, "--set",
                "checkpoint.interval=5"]
        p1, _ = run(1, [cfg, "--set", "train.steps=10", "--set", "checkpoint.dir=" + a,
                        "--metrics", ma] + sets)
        p2, _ = run(1, [cfg, "--set", "train.steps=5", "--set", "checkpoint.dir=" + b] + sets)
        p3, _ = run(1, [cfg, "--set", "train.steps=10", "--set", "checkpoint.dir=" + b, "--set",
                        "checkpoint.load=auto", "--metrics", mb] + sets)
        ran = p1.returncode == p2.returncode == p3.returncode == 0
        check(ran, "offload=%s: train, save and resume on the GPU" % offload)
        if not ran:
            print(p1.stderr[-2000:], p2.stderr[-2000:], p3.stderr[-2000:])
            continue
        la, lb = [r["loss"] for r in losses(ma)][5:], [r["loss"] for r in losses(mb)]
        check(la == lb and len(lb) == 5,
              "offload=%s: resumed losses bit-identical (%s vs %s)" % (offload, la[:2], lb[:2]))


{"configs": lambda: (configs(), pytorch()), "errors": errors, "dry-run": dry_run,
 "checkpoint": checkpoints, "gpu": gpu}[MODE]()
for d in TEMPS:
    shutil.rmtree(d, ignore_errors=True)
print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
