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
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT ckpt-tool fsdp-ckpt inspect, export-hf (read by an
                                                        independent parser), import-hf
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT ckpt-corrupt damaged checkpoints given to
                                                           fsdp-train: named errors; hostile
                                                           headers, non-finite steps, load:
                                                           auto, the watchdog, verify
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT ckpt-damage  the damage table: every damage x
                                                           resume on 1 and 3 ranks and every
                                                           fsdp-ckpt command that reads it
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT gpu       checkpoints of GPU shards (skips, 77,
                                                        without a GPU)
  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT operations  final saves, signals, the time limit,
                                                          the folder lock, refusals before the
                                                          first step, links and outputs
"""
import glob
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

EXE, MPIRUN, ROOT, MODE = sys.argv[1:5]
TOOL = os.path.join(os.path.dirname(EXE), "fsdp-ckpt")
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
            # a failed job ends at once (by default mpirun waits 2 s for ranks that have exited)
            "--mca", "odls_base_sigkill_timeout", "0"]
STEPS = 10
failures = []
TEMPS = []
# Sanitized builds: LeakSanitizer's check costs ~0.3 s of CPU per process (world_finalize
# runs it before MPI_Finalize); the modes that run fsdp-train's ordinary paths many times skip
# it, those of bad input and damaged files (errors, ckpt-corrupt) keep it, as do the library's
# C suites. The damage table (ckpt-damage) runs ~110 processes: it keeps ASan and UBSan, not
# the leak check (ckpt-corrupt and the C suites check the same error paths for leaks). Every
# sanitizer report in a program's output fails the mode (sh below).
# The CPU modes run on the CPU on a GPU machine too (fsdp-train takes the GPUs it sees, one per
# rank: these modes start up to 8 ranks); the gpu modes keep them.
if not MODE.startswith("gpu"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
if os.environ.get("FSDPC_TEST_SANITIZED") and MODE in ("configs", "dry-run", "checkpoint",
                                                       "ckpt-tool", "ckpt-damage"):
    os.environ["ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0"


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


RANKS = r"\[ranks? ([\d,\-]+)\]"  # "[rank 2]", "[ranks 0-3]", "[ranks 0,2,5-7]"


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


def configs():
    tmp = mkdtemp()
    ref = None
    for name, n, fp32 in PLANS:
        metrics = os.path.join(tmp, name + ".jsonl")
        eager = os.path.join(tmp, name + "-eager.jsonl")
        yaml = os.path.join(ROOT, "configs", name + ".yaml")
        p, _ = run(n, [yaml, "--set", "train.steps=%d" % STEPS, "--metrics", metrics])
        check(p.returncode == 0, "%s on %d ranks runs" % (name, n))
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-2000:])
            continue
        # the default builds the model deferred; the eager build must train bit-identically
        # (three steps: the initial weights, then two optimizer steps on them)
        q, _ = run(n, [yaml, "--set", "train.steps=3", "--set",
                       "model.deferred_init=false", "--metrics", eager])
        check(q.returncode == 0 and [r["loss"] for r in losses(eager)] ==
              [r["loss"] for r in losses(metrics)][:3],
              "%s: deferred and eager initialisation give bit-identical losses" % name)
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
    # per-unit mixed precision, both directions, on 4 ranks: the units compute in the dtypes
    # the plan gives them (--dry-run's units), the losses stay within bf16 noise of the f32
    # run and differ from it (the overrides take effect)
    with open(os.path.join(ROOT, "configs", "fsdp.yaml")) as f:
        text = f.read().replace("../data/", os.path.join(ROOT, "data") + "/")
    units = 'units: ["model.layers.*"]'
    mixed = [
        ("bf16, lm_head f32", units.replace(']', ', {match: lm_head, mp_policy: {param_dtype: '
                                                 'f32}}]') +
         "\n    mp_policy: {param_dtype: bf16, reduce_dtype: f32}",
         {"model.layers.0": "bf16", "model.layers.1": "bf16", "lm_head": "f32", "(root)": "bf16"}),
        ("f32, model.layers.1 bf16", 'units: [{match: "model.layers.1", mp_policy: '
                                     '{param_dtype: bf16}}, "model.layers.*"]',
         {"model.layers.0": "f32", "model.layers.1": "bf16", "(root)": "f32"})]
    for k, (what, rule, want) in enumerate(mixed):
        plan = os.path.join(tmp, "mixed-%d.yaml" % k)
        with open(plan, "w") as f:
            f.write(text.replace(units, rule))
        p, _ = run(4, [plan, "--dry-run"])
        got = dict(re.findall(r"^  (\S+) +compute (\w+) ", p.stdout, re.M))
        check(p.returncode == 0 and got == want,
              "%s: the units compute in %s (--dry-run: %s)" % (what, want, got))
        metrics = os.path.join(tmp, "mixed-%d.jsonl" % k)
        p, _ = run(4, [plan, "--set", "train.steps=%d" % STEPS, "--metrics", metrics])
        m = [r["loss"] for r in losses(metrics)] if p.returncode == 0 else []
        worst = max(abs(a - b) / abs(b) for a, b in zip(m, ref)) if m and ref else 1
        check(len(m) == STEPS and 0 < worst <= 2e-3,
              "%s: trains on 4 ranks, losses within 2e-3 of debug.yaml's and not equal (worst "
              "%.2e)" % (what, worst))
        if p.returncode != 0:
            print(p.stderr[-2000:])
    # sharding_strategy / zero_stage (Accelerate's and DeepSpeed's words): the mesh and
    # reshard_after_forward they stand for, training as one rank does
    # (sanitized builds: the two 2-D meshes; the others differ only in what the parser sets)
    fsdp_yaml = os.path.join(ROOT, "configs", "fsdp.yaml")
    strategies = [
        ("sharding_strategy=FULL_SHARD", "1 x dp_shard=4", "true"),
        ("sharding_strategy=SHARD_GRAD_OP", "1 x dp_shard=4", "false"),
        ("zero_stage=3", "1 x dp_shard=4", "true"),
        ("sharding_strategy=NO_SHARD", "4 x dp_shard=1", "false"),
        ("sharding_strategy=HYBRID_SHARD", "1 x dp_shard=4", "true"),  # one node
        ("sharding_strategy=_HYBRID_SHARD_ZERO2 mesh.dp_shard=2", "2 x dp_shard=2", "false")]
    if os.environ.get("FSDPC_TEST_SANITIZED"):
        strategies = [x for x in strategies if not x[1].startswith("1 x")]
    for strategy, mesh, reshard in strategies:
        sets = ["--set", "train.steps=%d" % STEPS]
        for kv in strategy.split():
            sets += ["--set", kv if kv.startswith("mesh.") else "parallelize.fully_shard." + kv]
        metrics = os.path.join(tmp, "strategy.jsonl")
        p, _ = run(4, [fsdp_yaml, "--metrics", metrics] + sets)
        m = [r["loss"] for r in losses(metrics)] if p.returncode == 0 else []
        worst = max(abs(a - b) / abs(b) for a, b in zip(m, ref)) if m and ref else 1
        check(len(m) == STEPS and worst <= 1e-5 and
              "mesh dp_replicate=%s" % mesh in p.stdout and
              "reshard_after_forward %s;" % reshard in p.stdout,
              "%s on 4 ranks: mesh dp_replicate=%s, reshard_after_forward %s, the single-rank "
              "losses within 1e-5 (worst %.2e)" % (strategy, mesh, reshard, worst))
        if p.returncode != 0:
            print(p.stderr[-1500:])
    # the host-staged process groups (FSDPC_PG), in their lazy test mode, on the 2x2x2 mesh:
    # the header says so, and the losses are the MPI backend's bit for bit
    hsdp_tp = os.path.join(ROOT, "configs", "hsdp-tp.yaml")
    runs = []
    for pg in ("native", "staged-lazy"):
        metrics = os.path.join(tmp, "pg-%s.jsonl" % pg)
        p, _ = run(8, [hsdp_tp, "--metrics", metrics, "--set", "train.steps=%d" % STEPS],
                   mpi_args=("-x", "FSDPC_PG=" + pg))
        runs.append(([r["loss"] for r in losses(metrics)] if p.returncode == 0 else [],
                     "process groups: host-staged, lazy test mode" in p.stdout))
    check(len(runs[0][0]) == STEPS and runs[1][0] == runs[0][0] and runs[1][1] and not runs[0][1],
          "FSDPC_PG=staged-lazy on hsdp-tp (8 ranks): said in the header, the native losses bit "
          "for bit")
    # --set reaches list items: NAME[INDEX], replaced whole or entered
    plan = os.path.join(tmp, "mixed-0.yaml")
    for sets, want in [
            (["parallelize.fully_shard.units[1].mp_policy.param_dtype=f16"],
             {"model.layers.0": "bf16", "model.layers.1": "bf16", "lm_head": "f16",
              "(root)": "bf16"}),
            (["parallelize.fully_shard.units[0]=model.layers.1"],
             {"model.layers.1": "bf16", "lm_head": "f32", "(root)": "bf16"})]:
        p, _ = run(1, [plan, "--dry-run", "--set", "mesh.dp_shard=1"] +
                   [x for kv in sets for x in ("--set", kv)])
        got = dict(re.findall(r"^  (\S+) +compute (\w+) ", p.stdout, re.M))
        check(p.returncode == 0 and got == want, "--set %s: units %s" % (" ".join(sets), got))
    for kv, want in [("parallelize.fully_shard.units[2]=x", r"'units' has 2 items \(from 0\)"),
                     ("model[0]=1", r"'model' is not a list in the plan"),
                     ("parallelize.fully_shard.units[x]=1", r"expected NAME\[INDEX\]")]:
        p, _ = run(1, [plan, "--dry-run", "--set", "mesh.dp_shard=1", "--set", kv])
        check(p.returncode != 0 and re.search(want, p.stderr) is not None,
              "--set %s is refused: /%s/" % (kv, want))


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


def golden_losses(tag):
    import struct
    with open(os.path.join(ROOT, "tests", "reference", tag + "_golden.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        a, b = head["train_losses"]["data_offsets"]
        f.seek(8 + n + a)
        raw = f.read(b - a)
    return list(struct.unpack("<%df" % (len(raw) // 4), raw))


def pytorch():
    """init_from a Hugging Face folder, FSDP on 2 ranks: PyTorch's ten losses, for the
    transformers 4 config, transformers 5's rope_parameters (theta 5e5) and llama3 scaling."""
    ref = os.path.join(ROOT, "tests", "reference")
    variants = [("tiny", "tiny"), ("tiny_v5", "tiny_v5"), ("tiny_llama3_v5", "tiny_llama3")]
    for config, tag in variants:
        tmp = mkdtemp()
        model = os.path.join(tmp, config)
        os.mkdir(model)
        os.symlink(os.path.join(ref, config + "_config.json"), os.path.join(model, "config.json"))
        os.symlink(os.path.join(ref, "tiny_init.safetensors"),
                   os.path.join(model, "model.safetensors"))
        plan = os.path.join(tmp, "tiny.yaml")
        with open(plan, "w") as f:
            f.write(PYTORCH_PLAN.replace("{model}", model).replace(
                "{data}", os.path.join(ROOT, "data", "corpus.txt")))
        metrics = os.path.join(tmp, "m.jsonl")
        p, _ = run(2, [plan, "--metrics", metrics])
        check(p.returncode == 0, "model.init_from plan on 2 ranks runs (%s)" % config)
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-2000:])
            continue
        got = [r["loss"] for r in losses(metrics)]
        if config == "tiny":
            eager = os.path.join(tmp, "eager.jsonl")
            q, _ = run(2, [plan, "--metrics", eager, "--set", "model.deferred_init=false"])
            check(q.returncode == 0 and [r["loss"] for r in losses(eager)] == got,
                  "model.init_from: deferred and eager initialisation give bit-identical losses")
        want = golden_losses(tag)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        # within 2e-6 (measured ~1.3e-7): the three models' losses differ by >= 1.7e-5
        check(len(got) == len(want) == 10 and worst <= 2e-6,
              "fsdp-train on 2 ranks reproduces PyTorch's ten losses from %s_config.json "
              "within 2e-6 (worst %.2e)" % (config, worst))


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


def metrics_of(plan, metrics, extra):
    """fsdp-train of plan on 2 ranks: its metrics rows and stdout, or None (said) on failure."""
    p, _ = run(2, [plan, "--metrics", metrics] + extra)
    if p.returncode != 0:
        print(p.stdout[-1500:], p.stderr[-1500:])
        return None, p.stdout
    return losses(metrics), p.stdout


def evaluation():
    """eval.path: the loss on held-out tokens is the same under every plan, leaves training
    bit-identical, and with frozen weights equals the mean of the training losses of the same
    batches."""
    tmp = mkdtemp()
    data = os.path.join(ROOT, "data", "corpus.txt")
    base = BASE.replace("{data}", data).replace("n_kv_heads: 1", "n_kv_heads: 2").replace(
        "steps: 2", "steps: 7") + "eval:\n  path: %s\n  interval: 3\n  batches: 4\n" % data

    plan = os.path.join(tmp, "eval.yaml")
    with open(plan, "w") as f:
        f.write(base)

    def train(name, extra):
        rows, out = metrics_of(plan, os.path.join(tmp, name + ".jsonl"), extra)
        if rows is None:
            return None, None, ""
        return ([r["loss"] for r in rows], [(r["step"], r["eval_loss"]) for r in rows
                                             if "eval_loss" in r], out)
    ck = os.path.join(tmp, "ck")
    fsdp, ev, out = train("fsdp", ["--set", "checkpoint.dir=" + ck, "--set",
                                   "checkpoint.interval=7"])
    check(ev is not None and [k for k, _ in ev] == [3, 6, 7] and
          len(re.findall(r"eval after step \d+: loss \d\.\d{6} \(perplexity", out)) == 3,
          "eval.interval 3 over 7 steps evaluates after steps 3, 6 and 7 (%s)" % ev)
    # a checkpoint evaluated: resumed with nothing left to train
    p, _ = run(2, [plan, "--set", "checkpoint.load=" + os.path.join(ck, "step-00000007")])
    want = "eval after step 7: loss %.6f" % ev[-1][1] if ev else "?"
    check(p.returncode == 0 and "nothing to train" in p.stdout and want in p.stdout,
          "a checkpoint resumed with nothing to train is evaluated: '%s'" % want)
    plain, _, _ = train("plain", ["--set", "eval.path=null", "--set", "eval.interval=0"])
    check(fsdp is not None and fsdp == plain,
          "training losses with evaluation are bit-identical to those without")
    worst = 0.0
    for name, extra in [("hsdp", ["--set", "mesh.dp_shard=1", "--set", "mesh.dp_replicate=2"]),
                        ("tp", ["--set", "mesh.dp_shard=1", "--set", "mesh.tp=2", "--set",
                                "data.batch_size=4"]),  # the tp ranks share one batch
                        ("zero2", ["--set", "parallelize.fully_shard.reshard_after_forward=false"]),
                        ("ac", ["--set", "train.activation_checkpointing=true"])]:
        _, other, _ = train(name, extra)
        if other is None or ev is None or len(other) != len(ev):
            worst = float("inf")
            continue
        worst = max([worst] + [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(other, ev)])
    check(worst <= 1e-5, "HSDP, TP, reshard_after_forward false and activation checkpointing "
          "give FSDP's evaluation losses within 1e-5 (worst %.2e)" % worst)
    # eval.batch_size: two batches of twice the samples are the same samples as four of the
    # training size (the data order is by sample), so the same mean; training is unchanged
    wide, we, out = train("wide", ["--set", "eval.batch_size=4", "--set", "eval.batches=2"])
    close = we is not None and ev is not None and len(we) == len(ev) and all(
        abs(a[1] - b[1]) <= 1e-6 * abs(b[1]) for a, b in zip(we, ev))
    check(close and wide == fsdp and "2 global batches of 4 x 2 samples" in out,
          "eval.batch_size 4 over 2 batches gives the evaluation of 4 batches of 2 (%s, %s)"
          % (we, ev))
    # with weights that cannot move, evaluation of the training file's first four batches is
    # the mean of the first four training losses
    frozen, fe, _ = train("frozen", ["--set", "optim.lr=1e-30", "--set", "train.steps=4",
                                     "--set", "eval.interval=0"])
    want = sum(frozen) / 4 if frozen else float("nan")
    got = fe[-1][1] if fe else float("nan")
    check(fe is not None and len(fe) == 1 and abs(got - want) <= 1e-6 * abs(want),
          "frozen weights: the evaluation loss %.7f is the mean of the training losses %.7f" %
          (got, want))


def shuffling():
    """data.shuffle: plans agree on the shuffled order, the seed changes it, a resumed run
    continues it bit for bit."""
    tmp = mkdtemp()
    data = os.path.join(ROOT, "data", "corpus.txt")
    base = BASE.replace("{data}", data).replace("n_kv_heads: 1", "n_kv_heads: 2").replace(
        "steps: 2", "steps: 6").replace("  batch_size: 2", "  batch_size: 2\n  shuffle: true")
    plan = os.path.join(tmp, "shuffle.yaml")
    with open(plan, "w") as f:
        f.write(base)

    def train(name, extra):
        rows, _ = metrics_of(plan, os.path.join(tmp, name + ".jsonl"), extra)
        return None if rows is None else [r["loss"] for r in rows]
    fsdp = train("fsdp", [])
    plain = train("plain", ["--set", "data.shuffle=false"])
    seed = train("seed", ["--set", "train.seed=1"])
    check(fsdp is not None and plain is not None and seed is not None and fsdp != plain and
          fsdp != seed, "data.shuffle trains on another order than the plain one, and "
          "train.seed changes it")
    worst = 0.0
    for name, extra in [("hsdp", ["--set", "mesh.dp_shard=1", "--set", "mesh.dp_replicate=2"]),
                        ("tp", ["--set", "mesh.dp_shard=1", "--set", "mesh.tp=2", "--set",
                                "data.batch_size=4"])]:
        other = train(name, extra)
        worst = max(worst, float("inf") if other is None or fsdp is None or
                    len(other) != len(fsdp) else
                    max(abs(a - b) / abs(b) for a, b in zip(other, fsdp)))
    check(worst <= 1e-5, "HSDP and TP train FSDP's shuffled losses within 1e-5 (worst %.2e)"
          % worst)
    ck = os.path.join(tmp, "ck")
    saved = train("saved", ["--set", "checkpoint.dir=" + ck, "--set", "checkpoint.interval=3"])
    rest = train("rest", ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000003")])
    check(saved == fsdp and rest is not None and rest[-3:] == fsdp[3:],
          "a shuffled run resumed after step 3 trains steps 4-6 bit-identically")


def errors():
    tmp = mkdtemp()
    data = os.path.join(ROOT, "data", "corpus.txt")
    base = BASE.replace("{data}", data)
    tp_base = base.replace("dp_shard: -1", "dp_shard: 1\n  tp: 2").replace("n_kv_heads: 1",
                                                                          "n_kv_heads: 2")
    def tp_plan(rules):
        return tp_base.replace("parallelize:\n",
                               "parallelize:\n  tensor_parallel:\n    plan: {%s}\n" % rules)
    odd = os.path.join(tmp, "odd.bin")
    with open(odd, "wb") as f:
        f.write(b"\x01\x02\x03")
    with open(data, "rb") as f:
        corpus = f.read()
    llmc_as_text = os.path.join(tmp, "llmc.bin")  # an llm.c token file under format: text
    with open(llmc_as_text, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, 600, *([0] * 253)) + bytes(1200))
    # (name, plan text or None for BASE, extra args, expected message regex)
    cases = [
        ("--set with an empty value", None, ["--set", "data.seq_len="],
         r"--set data\.seq_len=: no value after '='"),
        ("an llm.c token file read as text", base.replace(data, llmc_as_text), [],
         r"llmc\.bin: starts with llm\.c's header \(magic 20240520\).*data\.format: llmc"),
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
         [], r"fully_shard\.reshard_after_forward: 3 is not below mesh\.dp_shard=2"),
        ("a unit's integer reshard not dividing dp_shard", base.replace(
            'units: ["model.layers.*"]',
            'units: [{match: "model.layers.*", reshard_after_forward: 3}]'),
         [], r"fully_shard\.units\[0\]\.reshard_after_forward: 3 is not below "
             r"mesh\.dp_shard=2"),
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
         r"tensor parallel: model\.norm: colwise applies to linear and embedding layers, not a "
         r"rmsnorm"),
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
        ("missing plan file", "MISSING", [], r"cannot open the plan .*missing\.yaml: No such file"),
        ("unknown option", None, ["--frobnicate"], r"unknown option '--frobnicate'"),
        ("-v without --dry-run", None, ["-v"], r"-v goes with --dry-run"),
        ("eval.interval without eval.path", base + "eval:\n  interval: 5\n", [],
         r"eval\.interval: 5 needs eval\.path"),
        ("missing eval file", base + "eval:\n  path: /nonexistent/val.bin\n", [],
         r"eval\.path: cannot read '/nonexistent/val\.bin'"),
        ("no eval batches", base + "eval:\n  path: %s\n  batches: 0\n" % data, [],
         r"eval\.batches: 0 is out of range"),
        ("two sizes of -1", base.replace("dp_shard: -1", "dp_shard: -1\n  dp_replicate: -1"), [],
         r"mesh: at most one size may be -1"),
        ("sequence longer than the model's", base.replace("seq_len: 16", "seq_len: 128"), [],
         r"data\.seq_len: 128 exceeds model\.max_seq_len=64"),
        ("unknown data format", base.replace("  seq_len: 16", "  format: csv\n  seq_len: 16"), [],
         r"data\.format: expected text, u16, u32 or llmc, got 'csv'"),
        ("units not a list", base.replace('units: ["model.layers.*"]', 'units: "model.layers.*"'),
         [], r"units: expected a list of module patterns"),
        ("checkpoint.load not a checkpoint", base + "checkpoint:\n  load: /nonexistent/step-5\n", [],
         r"checkpoint\.load: '/nonexistent/step-5' is not a complete checkpoint"),
        ("checkpoint.interval without a folder", base + "checkpoint:\n  interval: 5\n", [],
         r"checkpoint\.interval: 5 needs checkpoint\.dir"),
        # hostile input ends at once: no blocking open, no quadratic parse
        ("plan path is a FIFO", "FIFO", [], r"cannot open the plan .*fifo\.yaml: is a FIFO, not a "
         r"regular file"),
        ("data path is a FIFO", base.replace(data, os.path.join(tmp, "fifo.yaml")), [],
         r"data\.path: cannot read '.*fifo\.yaml': not a regular file"),
        ("data path is a folder", base.replace(data, tmp), [], r"is a folder|not a regular file"),
        ("flow lists nested 400,000 deep", "mesh: " + "[" * 400000 + "]" * 400000 + "\n", [],
         r"bad\d*\.yaml:1:\d+: collections nested more than 64 deep"),
        ("block lists nested 400,000 deep", "mesh:\n  " + "- " * 400000 + "x\n", [],
         r"bad\d*\.yaml:2:\d+: collections nested more than 64 deep"),
        ("a 2 MB plan", base + "#" + "x" * 2000000 + "\n", [],
         r"bad\d*\.yaml: \d+ bytes, more than the 1048576 this file may have"),
        ("param group matching nothing", base + "optim:\n  param_groups:\n    \"model.nope.*\": "
         "{lr: 0.1}\n", [], r"optim\.param_groups: 'model\.nope\.\*' matches no parameter"),
        ("param group given twice", base + "optim:\n  param_groups:\n    \"*norm*\": {lr: 0.1}\n"
         "    \"*norm*\": {lr: 0.2}\n", [], r"optim\.param_groups: '\*norm\*' appears twice"),
        ("unknown sharding_strategy", None, ["--set", "parallelize.fully_shard.sharding_strategy="
                                                      "FULLY"],
         r"sharding_strategy: expected FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, "
         r"_HYBRID_SHARD_ZERO2 or NO_SHARD, got 'FULLY'"),
        ("zero_stage 1", None, ["--set", "parallelize.fully_shard.zero_stage=1"],
         r"zero_stage: expected 3 \(.*FULL_SHARD\) or 2 \(.*SHARD_GRAD_OP\), got '1'"),
        ("sharding_strategy and zero_stage", None,
         ["--set", "parallelize.fully_shard.zero_stage=3", "--set",
          "parallelize.fully_shard.sharding_strategy=FULL_SHARD"],
         r"give sharding_strategy or zero_stage, not both"),
        ("sharding_strategy against reshard_after_forward", None,
         ["--set", "parallelize.fully_shard.sharding_strategy=SHARD_GRAD_OP", "--set",
          "parallelize.fully_shard.reshard_after_forward=true"],
         r"reshard_after_forward: disagrees with parallelize\.fully_shard\.sharding_strategy = "
         r"SHARD_GRAD_OP \(which means reshard_after_forward false\): give one"),
        ("sharding_strategy against the mesh", None,
         ["--set", "parallelize.fully_shard.sharding_strategy=NO_SHARD", "--set",
          "mesh.dp_shard=2"],
         r"mesh\.dp_shard: 2 disagrees with parallelize\.fully_shard\.sharding_strategy = "
         r"NO_SHARD"),
        ("unknown train.nonfinite", base.replace("  steps: 2", "  steps: 2\n  nonfinite: ignore"), [],
         r"train\.nonfinite: expected stop or skip, got 'ignore'"),
        ("train.deterministic not a boolean", None, ["--set", "train.deterministic=yes"],
         r"--set train\.deterministic=yes: train\.deterministic: expected true or false, got 'yes'"),
        ("unknown train.device", None, ["--set", "train.device=gpu"],
         r"--set train\.device=gpu: train\.device: expected auto, cpu or cuda, got 'gpu'"),
        # the CPU modes hide the devices (CUDA_VISIBLE_DEVICES above)
        ("train.device cuda without a device", None, ["--set", "train.device=cuda"],
         r"train\.device: cuda: (this rank sees no CUDA device .*|the library was built without "
         r"CUDA): ask for the CPU \(cpu\), or for auto"),
        # a value given by --set is named as given, not by a line of the file
        ("--set mesh size against the world", None, ["--set", "mesh.dp_shard=3"],
         r"--set mesh\.dp_shard=3: mesh: dp_replicate x dp_shard x tp = 1 x 3 x 1 = 3, but the "
         r"world has 2 ranks"),
        ("--set data.path missing", None, ["--set", "data.path=/nonexistent/t.bin"],
         r"--set data\.path=/nonexistent/t\.bin: data\.path: cannot read"),
        ("--set reshard_after_forward not dividing", None,
         ["--set", "parallelize.fully_shard.reshard_after_forward=3"],
         r"--set parallelize\.fully_shard\.reshard_after_forward=3: parallelize\.fully_shard\."
         r"reshard_after_forward: 3 is not below mesh\.dp_shard=2"),
        ("--set seq_len too long", None, ["--set", "data.seq_len=128"],
         r"--set data\.seq_len=128: data\.seq_len: 128 exceeds model\.max_seq_len=64"),
        ("--set key path with an open quote", None, ["--set", 'optim.param_groups."*norm*.lr=1'],
         r"a quote in the key path is not closed"),
        # model.init_from with architecture keys: all of them named at once
        ("init_from with model keys", base.replace("  dim: 32", "  init_from: %s\n  dim: 32" % tmp),
         [], r"model: the architecture comes from .*/config\.json with model\.init_from; remove "
             r"model\.dim, model\.n_layers, model\.n_heads, model\.n_kv_heads, model\.ffn_dim, "
             r"model\.vocab_size, model\.max_seq_len$"),
        # data.global_batch_size states batch_size x data-parallel ranks x grad_accum
        ("global batch not a multiple", None, ["--set", "data.global_batch_size=6"],
         r"data\.global_batch_size: 6 is not a multiple of data\.batch_size 2 x 2 data-parallel "
         r"ranks = 4 samples a micro-batch"),
        ("global batch against grad_accum", None,
         ["--set", "data.global_batch_size=8", "--set", "data.grad_accum=3"],
         r"data\.global_batch_size: 8 is not data\.batch_size 2 x 2 data-parallel ranks x "
         r"data\.grad_accum 3 = 12"),
        # --dry-run refuses what the run would
        ("--dry-run, u16 tokens in an odd-sized file",
         base.replace(data, odd).replace("  seq_len: 16", "  format: u16\n  seq_len: 16"),
         ["--dry-run"], r"data file .*odd\.bin: 3 bytes is not a whole number of uint16 tokens"),
    ]
    os.mkfifo(os.path.join(tmp, "fifo.yaml"))
    def one(k):
        name, text, extra, want = cases[k]
        path = os.path.join(tmp, "bad%d.yaml" % k)
        if text == "MISSING":
            path = os.path.join(tmp, "missing.yaml")
        elif text == "FIFO":
            path = os.path.join(tmp, "fifo.yaml")
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
        # the same error on both ranks: printed once, naming both
        once = len([l for l in p.stderr.splitlines() if re.search(want, l)]) == 1
        both = ranks_saying(p.stderr, want) == {"0", "1"}
        good = p.returncode != 0 and both and once and secs < 30
        check(good, "%s: exit %d in %.1fs, said once for both ranks /%s/"
              % (name, p.returncode, secs, want))
        if not good:
            print(p.stderr[-1500:])
    check(len(cases) >= 20, "%d malformed inputs" % len(cases))
    # token ids are checked where each batch reads them, naming the file and the byte offset;
    # the start-up reads only sizes and headers. The corpus as uint16 tokens with an id past
    # the vocabulary: at token 100 only rank 1's batch of the second step reads it (samples of
    # 17 tokens from 96 and 112); at the end of the file, the two steps never read it.
    for name, at, fmt, vocab, step_lines, want in (
            ("a text file beyond a vocabulary of 50", None, "text", 50, 0,
             r"data file \S+corpus\.txt: the token at byte offset \d+ has id \d+, outside the "
             r"vocabulary of 50"),
            ("an id of 300 read by rank 1 in step 2", 100, "u16", 256, 1,
             r"data file \S+bad\.u16: the token at byte offset 200 has id 300, outside the "
             r"vocabulary of 256"),
            ("an id of 300 that no step reads", len(corpus), "u16", 256, 2, None),
            ("eval tokens: an id of 300 in the first batch", 5, "eval", 256, 1,
             r"data file \S+bad\.u16: the token at byte offset 10 has id 300, outside the "
             r"vocabulary of 256")):
        path, text = data, base.replace("vocab_size: 256", "vocab_size: %d" % vocab)
        if at is not None:
            path = os.path.join(tmp, "bad.u16")
            tokens = list(corpus[:at]) + [300] + list(corpus[at:])
            with open(path, "wb") as f:
                f.write(struct.pack("<%dH" % len(tokens), *tokens))
        if fmt == "u16":
            text = text.replace(data, path).replace("  seq_len: 16", "  format: u16\n  seq_len: 16")
        elif fmt == "eval":
            text += "eval:\n  path: %s\n  format: u16\n" % path
        plan = os.path.join(tmp, "vocab.yaml")
        with open(plan, "w") as f:
            f.write(text + "log:\n  interval: 1\n")
        p, secs = run(2, [plan], timeout=60)
        lines = len(re.findall(r"^step\s+\d+/", p.stdout, re.M))
        if want is None:
            check(p.returncode == 0 and lines == step_lines,
                  "%s: trains (the start reads no token)" % name)
            continue
        said = ranks_saying(p.stderr, want)
        check(p.returncode != 0 and said == {"0", "1"} and lines == step_lines and secs < 30,
              "%s: stopped after %d step line(s), every rank naming the file and offset /%s/" %
              (name, step_lines, want[:50]))
        if said != {"0", "1"}:
            print(p.stderr[-1500:])
    # the same tokens as text, uint16, uint32 and llm.c's files (three shards by a pattern,
    # uint16 and uint32 ones mixed) train the same model
    got = {}
    for fmt, width in (("text", 0), ("u16", 2), ("u32", 4), ("llmc", 0)):
        path = data
        if width:
            path = os.path.join(tmp, "corpus." + fmt)
            with open(path, "wb") as f:
                f.write(struct.pack("<%d%s" % (len(corpus), "H" if width == 2 else "I"), *corpus))
        if fmt == "llmc":
            path = os.path.join(tmp, "shard_*.bin")
            cut = [0, 40, 100, len(corpus)]  # the two steps read tokens 0-128: all three
            for k in range(3):
                part = corpus[cut[k]:cut[k + 1]]
                magic, version, code = (20240801, 7, "I") if k == 1 else (20240520, 1, "H")
                with open(os.path.join(tmp, "shard_%d.bin" % k), "wb") as f:
                    f.write(struct.pack("<256i", magic, version, len(part), *([0] * 253)))
                    f.write(struct.pack("<%d%s" % (len(part), code), *part))
        plan = os.path.join(tmp, "format-%s.yaml" % fmt)
        with open(plan, "w") as f:
            f.write(base.replace(data, path).replace("  seq_len: 16",
                                                     "  format: %s\n  seq_len: 16" % fmt))
        metrics = os.path.join(tmp, "format-%s.jsonl" % fmt)
        p, _ = run(2, [plan, "--metrics", metrics])
        got[fmt] = [r["loss"] for r in losses(metrics)] if p.returncode == 0 else p.stderr[-500:]
    check(len(got["text"]) == 2 and got["text"] == got["u16"] == got["u32"] == got["llmc"],
          "data.format text, u16, u32 and llmc (three files by a pattern) of the same tokens "
          "give bit-identical losses (%s)" % got)
    # one rank fails alone mid-run (its samples are cut from the token file): the other is
    # stopped at once instead of waiting in the step's collectives until the watchdog, and
    # both name the file
    big = os.path.join(tmp, "big.txt")
    with open(big, "wb") as f:
        f.write(corpus * 64)  # no wrap-around for 150,000 steps
    plan = os.path.join(tmp, "shrink.yaml")
    with open(plan, "w") as f:
        f.write(base.replace(data, big).replace("steps: 2", "steps: 1000000") +
                "log:\n  interval: 1\n")
    cmd = [MPIRUN] + MPI_ARGS + ["-n", "2", EXE, plan]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    import threading
    steps = []

    def read_steps():
        for line in proc.stdout:
            m = re.match(r"step\s+(\d+)/", line)
            if m:
                steps.append(int(m.group(1)))
    threading.Thread(target=read_steps, daemon=True).start()
    t = time.time()
    while not steps and time.time() - t < 120:
        time.sleep(0.05)
    # step s (from 0) reads tokens 64 s .. 64 s + 32 on rank 0 and 64 s + 32 .. 64 s + 64 on
    # rank 1 (batch 2 x 16 per rank): at 64 s + 40 bytes, rank 1 alone fails at step s
    fail = (steps[-1] if steps else 0) + 3000
    os.truncate(big, 64 * fail + 40)
    t = time.time()
    try:
        err = proc.stderr.read() if proc.wait(timeout=120) is not None else ""
        secs = time.time() - t
    except subprocess.TimeoutExpired:
        err, secs = "", None
    kill_session(proc.pid)
    said = ranks_saying(err, r"data file .*big\.txt: cannot read tokens \d+-\d+: the file is "
                             r"shorter than when it was opened")
    check(secs is not None and secs < 60 and proc.returncode != 0 and said == {"0", "1"},
          "a token file cut mid-run fails one rank: the job ends in %s s (the watchdog: 600 s), "
          "both ranks name the file (%s)" % ("%.1f" % secs if secs else "never", sorted(said)))
    if said != {"0", "1"}:
        print(err[-1500:])
    # every program: --help and --version answer at once; a wrong flag or value is an error
    build = os.path.join(os.path.dirname(EXE), "..")
    tool = lambda name: os.path.join(build, "tools", name)
    bench = lambda name: os.path.join(build, "bench", name)
    version = r"\(fsdpc\) \d+\.\d+\.\d+"
    for argv, ok, want in [
            ([EXE, "--version"], True, version), ([EXE, "--help"], True, r"usage: fsdp-train"),
            ([EXE, "--stpes", "5"], False, r"unknown option '--stpes'"),
            ([TOOL, "--version"], True, version), ([TOOL, "--help"], True, r"usage: fsdp-ckpt"),
            ([tool("fsdp-demo"), "--help"], True, r"usage: mpirun -n 4 fsdp-demo"),
            ([tool("fsdp-demo"), "--version"], True, version),
            ([tool("fsdp-demo"), "extra"], False, r"unknown argument 'extra'"),
            ([bench("bench-train-tiny"), "--help"], True, r"usage: bench-train-tiny .*\n.*loss "
             r"curve(.|\n)*--steps N"),
            ([bench("bench-train-tiny"), "--version"], True, version),
            ([bench("bench-train-tiny"), "--steps", "abc"], False,
             r"--steps: expected an integer from 1 to \d+, got 'abc'"),
            ([bench("bench-train-tiny"), "--stpes", "5"], False, r"unknown option '--stpes'"),
            ([bench("bench-train-tiny"), "--lr", "-1"], False, r"--lr: expected a positive number"),
            ([bench("bench-fsdp-step"), "--reshard", "banana"], False,
             r"--reshard: expected auto, true, false or an integer N, got 'banana'"),
            ([bench("bench-fsdp-step"), "--help"], True, r"--reshard auto\|true\|false\|N"),
            ([bench("bench-ac-memory"), "--batch"], False, r"--batch needs a value"),
            ([bench("bench-ckpt-load"), "--reps", "0"], False,
             r"--reps: expected an integer from 1 to 64, got '0'"),
            ([bench("bench-ckpt-load"), "stray"], False, r"unexpected argument 'stray'"),
            ([tool("fsdp-plan"), "--help"], True, r"usage: fsdp-plan convert"),
            ([tool("fsdp-plan"), "--version"], True, version),
            ([tool("fsdp-plan"), "convert", "a.yaml", "--to", "x"], False,
             r"unknown option '--to'"),
            ([tool("fsdp-plot"), "--help"], True, r"usage: fsdp-plot METRICS.jsonl\.\.\. -o"),
            ([tool("fsdp-plot"), "--version"], True, version),
            ([tool("fsdp-plot"), "--bins", "3"], False, r"unknown option '--bins'"),
            ([tool("fsdp-plot"), "m.jsonl"], False, r"no -o OUT.svg given"),
            ([EXE, os.path.join(ROOT, "configs", "debug.yaml"), "--plot", "x.svg"], False,
             r"--plot draws the metrics file: give --metrics PATH or log.metrics")]:
        p = sh(argv, timeout=60)
        out = p.stdout + p.stderr
        good = (p.returncode == 0) == ok and re.search(want, out) is not None
        check(good, "%s: exit %d, says /%s/" % (" ".join([os.path.basename(argv[0])] + argv[1:]),
                                                 p.returncode, want))
        if not good:
            print(out[-1000:])
    # started by torchrun or a plain srun, each process would be alone: refused, saying how
    debug = os.path.join(ROOT, "configs", "debug.yaml")
    for env, want in [({"WORLD_SIZE": "4", "RANK": "2"},
                       r"WORLD_SIZE=4 says 4 processes were started, but this one's MPI world "
                       r"has 1 rank \(torchrun.*launch with mpirun -n 4"),
                      ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"},
                       r"SLURM_STEP_NUM_TASKS=2 .*\(srun without an MPI plugin\?\).*"
                       r"srun --mpi=pmix -n 2"),
                      ({"WORLD_SIZE": "1"}, None)]:
        p = sh([EXE, debug, "--set", "train.steps=1"], timeout=60, env=env)
        good = p.returncode == 0 if want is None else (
            p.returncode != 0 and re.search(want, p.stderr) is not None and "step" not in p.stdout)
        check(good, "fsdp-train alone with %s: %s (exit %d)" % (
            env, "trains" if want is None else "refused, /%s/" % want, p.returncode))
        if not good:
            print(p.stdout[-500:], p.stderr[-1000:])
    # more kernel threads than the CPUs the process may run on: trains, warning that steps slow
    for threads in ["2", "1"]:
        p = sh(["taskset", "-c", "0", EXE, debug, "--set", "train.steps=1"], timeout=60,
               env={"OMP_NUM_THREADS": threads})
        warned = re.search(r"warning: 2 kernel threads \(OMP_NUM_THREADS\) but rank 0 may run "
                           r"on 1 CPU", p.stdout) is not None
        check(p.returncode == 0 and warned == (threads == "2"),
              "OMP_NUM_THREADS=%s on one CPU: trains, %s (exit %d)" % (
                  threads, "warns" if threads == "2" else "no warning", p.returncode))


def plots():
    """fsdp-plot and fsdp-train --plot: the SVG parses, has a panel per metric with a line per
    run through every step (a gap where a loss is null), a legend naming the files; rendered
    to PNG where rsvg-convert is installed; bad files are refused naming file and line."""
    import xml.etree.ElementTree as ET
    tmp = mkdtemp()
    plot = os.path.join(os.path.dirname(EXE), "fsdp-plot")
    debug = os.path.join(ROOT, "configs", "debug.yaml")
    a, b = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b & c.jsonl")
    p, _ = run(1, [debug, "--set", "train.steps=12", "--metrics", a, "--plot",
                   os.path.join(tmp, "a.svg")])
    q, _ = run(1, [debug, "--set", "train.steps=8", "--set", "optim.lr=1e-3", "--metrics", b])
    check(p.returncode == 0 and q.returncode == 0 and "plot: " in p.stdout,
          "fsdp-train --plot writes the picture at the end")
    with open(b) as f:  # a step whose loss is null (non-finite) leaves a gap
        rows = [json.loads(l) for l in f]
    rows[3]["loss"] = None
    rows[5]["eval_loss"] = rows[5]["loss"] - 0.5  # two evaluations, one below the run's losses
    rows[7]["eval_loss"] = rows[7]["loss"]
    with open(b, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    out = os.path.join(tmp, "runs.svg")
    r = sh([plot, a, b, "-o", out], timeout=60)
    ns = "{http://www.w3.org/2000/svg}"

    def lines(svg):
        root = ET.parse(svg).getroot()
        panels = {g.get("id"): g for g in root.iter(ns + "g") if g.get("class") == "panel"}
        runs = {k: [[len(pl.get("points").split()) for pl in g.iter(ns + "polyline")
                     if pl.get("class") == "run%d" % i] for i in range(2)]
                for k, g in panels.items()}
        legend = [t.text for g in root.iter(ns + "g") if g.get("class") == "legend"
                  for t in g.iter(ns + "text")]
        return root, runs, legend

    ok = r.returncode == 0 and os.path.exists(out) and not glob.glob(out + ".tmp*")
    check(ok, "fsdp-plot of two runs writes an SVG (exit %d)" % r.returncode)
    if ok:
        root, runs, legend = lines(out)
        want = {"loss": [[12], [3, 4]], "lr": [[12], [8]], "grad_norm": [[12], [8]],
                "tokens_per_s": [[12], [8]]}
        check(root.tag == ns + "svg" and runs == want,
              "the SVG parses: four panels, run 1 through 12 steps, run 2 through 8 with a gap "
              "at the null loss (%s)" % runs)
        check(legend == [a + " (12 steps)", b + " (8 steps)"],
              "the legend names each run's file (escaped): %s" % legend)
        first, last = [list(map(float, pt.split(",")))
                       for pt in next(pl for g in root.iter(ns + "g") if g.get("id") == "loss"
                                      for pl in g.iter(ns + "polyline")).get("points").split()
                       [::11]]
        check(last[1] > first[1], "the falling loss is drawn falling (y %.1f -> %.1f)"
              % (first[1], last[1]))
        dots = [(float(c.get("cx")), float(c.get("cy"))) for g in root.iter(ns + "g")
                if g.get("id") == "loss" for c in g.iter(ns + "circle")
                if c.get("class") == "eval1"]
        ys = [float(pt.split(",")[1]) for g in root.iter(ns + "g") if g.get("id") == "loss"
              for pl in g.iter(ns + "polyline") if pl.get("class") == "run1"
              for pt in pl.get("points").split()]
        check(len(dots) == 2 and dots[0][0] < dots[1][0] and dots[0][1] > max(ys) and
              [c for g in root.iter(ns + "g") if g.get("id") != "loss"
               for c in g.iter(ns + "circle")] == [],
              "evaluations are dots in the loss panel alone, inside its range (%s)" % dots)
    single = os.path.join(tmp, "a.svg")
    if os.path.exists(single):
        _, runs, legend = lines(single)
        check(runs["loss"] == [[12], []] and len(legend) == 1,
              "fsdp-train --plot draws its own metrics file (%s)" % runs["loss"])
    rsvg = shutil.which("rsvg-convert")
    if rsvg and ok:
        png = os.path.join(tmp, "runs.png")
        c = sh([rsvg, out, "-o", png], timeout=60)
        with open(png, "rb") as f:
            head = f.read(8)
        check(c.returncode == 0 and head == b"\x89PNG\r\n\x1a\n",
              "rsvg-convert renders the SVG to PNG")
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"step": 1, "loss": 2.0}\nnot json\n')
    empty = os.path.join(tmp, "empty.jsonl")
    open(empty, "w").close()
    nostep = os.path.join(tmp, "nostep.jsonl")
    with open(nostep, "w") as f:
        f.write('{"loss": 2.0}\n')
    twice = os.path.join(tmp, "twice.jsonl")
    with open(twice, "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0} {"step": 3, "loss": 0.5}\n')
    nul = os.path.join(tmp, "nul.jsonl")
    with open(nul, "wb") as f:
        f.write(b'{"step": 1, "loss": 2.0}\n\0{"step": 2, "loss": 1.0}\n')
    huge_step = os.path.join(tmp, "huge-step.jsonl")
    with open(huge_step, "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 1e400, "loss": 1.0}\n')
    for args, want in [([a, os.path.join(tmp, "missing.jsonl")], r"missing\.jsonl"),
                       ([bad], r"bad\.jsonl:2: not a JSON object"),
                       ([empty], r"empty\.jsonl: no steps in it"),
                       ([nostep], r"nostep\.jsonl:1: no finite number 'step'"),
                       ([twice], r"twice\.jsonl:2: not a JSON object \(one a line\)"),
                       ([nul], r"nul\.jsonl:2: holds a NUL byte"),
                       ([huge_step], r"huge-step\.jsonl:2: no finite number 'step'")]:
        e = sh([plot] + args + ["-o", os.path.join(tmp, "x.svg")], timeout=60)
        check(e.returncode != 0 and re.search(want, e.stderr) is not None and
              not os.path.exists(os.path.join(tmp, "x.svg")),
              "fsdp-plot refuses it: /%s/ (exit %d)" % (want, e.returncode))
    # any finite values, steps and names: a valid SVG, finite coordinates, done at once
    import xml.etree.ElementTree as ET
    odd = os.path.join(tmp, "odd\x01name\xff.jsonl".encode("utf-8", "surrogateescape").decode(
        "utf-8", "surrogateescape"))
    cases = {"close values": '{"step": 1, "loss": 1e17}\n{"step": 2, "loss": 1e17}\n'
                             '{"step": 3, "loss": 100000000000000032}\n',
             "steps at the ends of double": '{"step": -1e308, "loss": 1}\n'
                                            '{"step": 1e308, "loss": 2}\n',
             "one point at a huge step": '{"step": 1e300, "loss": -1e308, "lr": 1e-320}\n',
             "a name of control bytes and invalid UTF-8": '{"step": 1, "loss": 2}\n'}
    for name, text in cases.items():
        path = odd if "name" in name else os.path.join(tmp, "case.jsonl")
        with open(path.encode("utf-8", "surrogateescape"), "w") as f:
            f.write(text)
        svg = os.path.join(tmp, "case.svg")
        t = time.time()
        e = sh([plot, path.encode("utf-8", "surrogateescape"), "-o", svg], timeout=30)
        size = os.path.getsize(svg) if os.path.exists(svg) else 0
        try:
            root = ET.parse(svg).getroot()
            nums = [float(x) for el in root.iter() for k, v in el.attrib.items()
                    if k in ("x", "y", "x1", "y1", "x2", "y2", "cx", "cy")
                    for x in [v]] + [float(c) for el in root.iter() if el.get("points")
                                     for p in el.get("points").split() for c in p.split(",")]
            finite = all(math.isfinite(x) for x in nums)
        except (ET.ParseError, ValueError) as exc:
            finite = False
            print(exc)
        check(e.returncode == 0 and finite and size < 200000 and time.time() - t < 10,
              "fsdp-plot of %s: a valid SVG with finite coordinates, %d bytes, %.1f s" %
              (name, size, time.time() - t))


CONVERT_MODEL = "model:" + BASE.split("model:")[1].split("parallelize:")[0]  # BASE's model

# each example config of tests/convert and the plan written by hand that it stands for
CONVERTED = [
    ("accelerate-fsdp.yaml", 4, """\
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    reshard_after_forward: true
    mp_policy: {param_dtype: bf16, reduce_dtype: f32}
""", ["sharding_strategy: FULL_SHARD", "fsdp_sync_module_states: no equivalent"]),
    ("accelerate-fsdp2-zero2.yaml", 4, """\
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    reshard_after_forward: false
""", ["reshard_after_forward: false", "fsdp_version: fully_shard here is FSDP2"]),
    ("deepspeed-zero3.json", 4, """\
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    reshard_after_forward: true
optim: {lr: 0.002, beta1: 0.9, beta2: 0.95, eps: 1.0e-8, weight_decay: 0.05,
        clip_grad_norm: 0.5}
schedule: {warmup_steps: 2, min_lr_ratio: 0.2}
data: {batch_size: 2, grad_accum: 2}
train: {steps: 8}
""", ["zero_stage: 3", "stage3_prefetch_bucket_size: a bucket or overlap knob"]),
    ("deepspeed-zero3-hpz.json", 4, """\
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    reshard_after_forward: 2
""", ["reshard_after_forward: 2", "train_micro_batch_size_per_gpu: 'auto'",
      "offload_optimizer: device 'nvme'"]),
    ("accelerate-size-based.yaml", 4, """\
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    reshard_after_forward: true
""", ["min_unit_params: 9000", "sharding_strategy: FULL_SHARD"]),
]

# a 7B-shaped Llama (Llama 2's sizes) for the dry runs of converted plans
LLAMA_7B = ["--set", "model.dim=4096", "--set", "model.n_layers=32", "--set", "model.n_heads=32",
            "--set", "model.n_kv_heads=32", "--set", "model.ffn_dim=11008", "--set",
            "model.vocab_size=32000", "--set", "model.max_seq_len=4096"]


def converts():
    """fsdp-plan convert: each example Accelerate and DeepSpeed config, with a model added,
    trains exactly as the plan written by hand for it (losses and per-step communication
    bytes equal), and its output lists what it left out."""
    tmp = mkdtemp()
    tool = os.path.join(os.path.dirname(EXE), "fsdp-plan")
    sets = ["--set", "data.path=" + os.path.join(ROOT, "data", "corpus.txt"),
            "--set", "data.seq_len=16"]
    for name, n, hand, said in CONVERTED:
        src = os.path.join(ROOT, "tests", "convert", name)
        out = os.path.join(tmp, name + ".plan.yaml")
        p = sh([tool, "convert", src, "-o", out], timeout=60)
        text = open(out).read() if p.returncode == 0 else ""
        check(p.returncode == 0 and all(w in text for w in said),
              "fsdp-plan convert %s: exit %d, writes %s" % (name, p.returncode, said))
        if p.returncode != 0:
            print(p.stderr[-1000:])
            continue
        with open(out, "a") as f:
            f.write(CONVERT_MODEL)
        mine = os.path.join(tmp, name + ".hand.yaml")
        with open(mine, "w") as f:
            f.write(CONVERT_MODEL + hand)
        got = {}
        for tag, plan in (("converted", out), ("hand", mine)):
            own = text if tag == "converted" else hand
            extra = [] if "train:" in own else ["--set", "train.steps=4"]
            if not re.search(r"batch_size: \d", own):
                extra += ["--set", "data.batch_size=2"]
            metrics = os.path.join(tmp, "%s.%s.jsonl" % (name, tag))
            q, _ = run(n, [plan, "--metrics", metrics] + sets + extra)
            got[tag] = [(r["loss"], r["comm_bytes"]) for r in losses(metrics)] \
                if q.returncode == 0 else None
            if q.returncode != 0:
                print(q.stdout[-1000:], q.stderr[-1500:])
        check(got["converted"] and got["converted"] == got["hand"],
              "%s converted trains as the hand-written plan on %d ranks: %d steps, equal losses "
              "and communication bytes" % (name, n, len(got["converted"] or [])))
        # on a 7B-shaped model (planned for n ranks from one process), the converted plan's
        # peak is the per-layer plan's, within 5%; a sized unit's threshold scales with it
        seven = LLAMA_7B + ["--set", "data.seq_len=512", "--set", "data.batch_size=1"]
        if "min_unit_params" in text:
            seven += ["--set", "parallelize.fully_shard.min_unit_params=150000000"]
        peaks = {}
        for tag, plan in (("converted", out), ("hand", mine)):
            q, _ = run(1, [plan, "--dry-run", "--world", str(n)] + sets + seven)
            m = re.search(r"^peak_bytes (\d+)$", q.stdout, re.M)
            peaks[tag] = int(m.group(1)) if m else None
            if m is None:
                print(q.stderr[-800:])
        check(None not in peaks.values() and
              abs(peaks["converted"] - peaks["hand"]) <= 0.05 * peaks["hand"],
              "%s converted, on a 7B-shaped Llama at %d ranks: a dry-run peak of %.2f GiB, the "
              "per-layer plan's %.2f GiB" % (name, n, (peaks["converted"] or 0) / 2**30,
                                              (peaks["hand"] or 0) / 2**30))
    # hostile and mistyped configs: a deep nesting refused at once, a section given as a
    # scalar or a list named instead of read as absent
    deep = os.path.join(tmp, "deep.yaml")
    with open(deep, "w") as f:
        f.write("a: " + "[" * 400000 + "]" * 400000 + "\n")
    typed = {"ds-scalar.json": '{"zero_optimization": 3, "train_micro_batch_size_per_gpu": 2}',
             "ds-offload.json": '{"zero_optimization": {"stage": 3, "offload_param": "cpu"}}',
             "acc-list.yaml": "distributed_type: FSDP\nfsdp_config: [FULL_SHARD]\n",
             "acc-ds.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  bf16: true\n"}
    for name, text in typed.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    t0 = time.time()
    e = sh([tool, "convert", deep], timeout=60)
    check(e.returncode != 0 and "collections nested more than 64 deep" in e.stderr and
          time.time() - t0 < 10, "fsdp-plan convert of 400000 nested lists: refused in %.1f s"
          % (time.time() - t0))
    for args, want in [(["convert", os.path.join(tmp, "ds-scalar.json")],
                        r"zero_optimization: expected a mapping of settings"),
                       (["convert", os.path.join(tmp, "ds-offload.json")],
                        r"zero_optimization\.offload_param: expected a mapping of settings"),
                       (["convert", os.path.join(tmp, "acc-list.yaml")],
                        r"fsdp_config: expected a mapping of settings"),
                       (["convert", os.path.join(tmp, "acc-ds.yaml")],
                        r"deepspeed_config\.bf16: expected a mapping of settings"),
                       (["convert", os.path.join(ROOT, "configs", "debug.yaml")],
                        r"neither an Accelerate config .* nor a DeepSpeed config"),
                       (["convert", os.path.join(tmp, "none.json")], r"none\.json"),
                       (["convert"], r"convert needs a config file"),
                       (["merge", "x"], r"unknown command")]:
        e = sh([tool] + args, timeout=60)
        check(e.returncode != 0 and re.search(want, e.stderr) is not None,
              "fsdp-plan %s: refused, /%s/" % (" ".join(os.path.basename(a) for a in args), want))
    converts_read_as_their_tools_do(tmp, tool)


def converts_read_as_their_tools_do(tmp, tool):
    """Settings converted as DeepSpeed and Accelerate mean them, or listed with the right
    reason; files read as strictly as those tools read them."""
    ds = os.path.join(tmp, "ds-file.json")
    with open(ds, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}')
    bomb = "distributed_type: FSDP\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        "a%d: &a%d [%s]\n" % (i, i, ", ".join(["*a%d" % (i - 1)] * 10)) for i in range(1, 8))
    # (name, file, text, regexes the plan (stdout) must hold, regexes it must not, stderr's)
    cases = [
        ("bf16 'auto' in a DeepSpeed config", "auto.json",
         '{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "auto"}}',
         [r"#   bf16\.enabled: 'auto': the Hugging Face Trainer fills it"],
         [r"^\s+param_dtype:"], []),
        ("an Accelerate config naming a deepspeed_config_file", "acc-dsfile.yaml",
         "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n"
         "  deepspeed_config_file: ds-file.json\n",
         [r"zero_stage: 3", r"batch_size: 2", r"with its DeepSpeed config \S*ds-file\.json"],
         [], []),
        ("tensor_parallel.autotp_size", "autotp.json",
         '{"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}',
         [r"^  tp: 2  # tensor_parallel\.autotp_size"], [r"autotp_size: no equivalent"], []),
        ("Accelerate's gradient_accumulation_steps", "acc-accum.yaml",
         "distributed_type: FSDP\ngradient_accumulation_steps: 4\n",
         [r"grad_accum: 4  # gradient_accumulation_steps"], [r"no equivalent"], []),
        ("layer classes as a list", "acc-classes.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
         "  fsdp_transformer_layer_cls_to_wrap: [LlamaDecoderLayer, Embedding]\n",
         [r'units: \["model\.layers\.\*"\]', r"'Embedding': units are FQN patterns"],
         [r"a structure"], []),
        ("layer classes as a comma list", "acc-comma.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
         "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,GPT2Block\n",
         [r'units: \["model\.layers\.\*"\]', r"'GPT2Block': units are FQN patterns"], [], []),
        ("NO_WRAP", "acc-nowrap.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n",
         [r"units: \[\]  # .*the whole model is gathered at once"], [], []),
        ("ZeRO-1", "zero1.json", '{"train_micro_batch_size_per_gpu": 2, '
                                 '"zero_optimization": {"stage": 1}}',
         [r"zero_stage: 2  # zero_optimization\.stage 1 shards the optimizer state only",
          r'units: \["model\.layers\.\*"\]'], [], []),
        ("optimizer-only offload", "offload-opt.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"offload_optimizer": {"device": "cpu"}}}',
         [r"offload_optimizer: device cpu for the optimizer alone"], [r"^\s+offload: true"], []),
        ("WarmupLR", "warmuplr.json", '{"train_micro_batch_size_per_gpu": 2, "scheduler": '
                                      '{"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}',
         [r"min_lr_ratio: 1\.0  # scheduler\.type WarmupLR", r"warmup_steps: 5"],
         [r"linear warmup then cosine decay"], []),
        ("stage3_gather_16bit_weights_on_model_save", "gather16.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"stage3_gather_16bit_weights_on_model_save": true}}',
         [r"stage3_gather_16bit_weights_on_model_save: a save format.*export-hf"],
         [r"bucket or overlap"], []),
        ("a key given twice", "twice.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "stage": 3}}',
         [r"zero_stage: 3"], [r"zero_stage: 2"],
         [r"zero_optimization\.stage is given more than once; the last value is taken"]),
        ("betas that are not numbers", "betas.json",
         '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": '
         '{"lr": 0.001, "betas": "0.9"}}}',
         [r"optimizer\.params\.betas: not a pair of numbers"], [], []),
        ("a fractional hpZ size", "hpz.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"zero_hpz_partition_size": 2.5}}',
         [r"zero_hpz_partition_size: '2\.5' is not a whole number of ranks"],
         [r"reshard_after_forward: 2"], []),
        ("a header that says what to add", "header.json",
         '{"train_micro_batch_size_per_gpu": 2}',
         [r"Add a model: section and data\.path"], [r"Add your model: and data: sections"], []),
    ]
    for name, fname, text, want, not_want, err_want in cases:
        path = os.path.join(tmp, fname)
        with open(path, "w") as f:
            f.write(text)
        e = sh([tool, "convert", path], timeout=60)
        good = (e.returncode == 0 and all(re.search(w, e.stdout, re.M) for w in want) and
                not any(re.search(w, e.stdout, re.M) for w in not_want) and
                all(re.search(w, e.stderr) for w in err_want))
        check(good, "fsdp-plan convert, %s: as its tool means it" % name)
        if not good:
            print(e.stdout[-1500:], e.stderr[-500:])
    for name, fname, data, want in (
            ("a second JSON object after the first", "two.json",
             b'{"zero_optimization": {"stage": 3}} {"x": 1}', r"more after the object"),
            ("trailing text", "trail.json", b'{"zero_optimization": {"stage": 3}} garbage',
             r"not valid JSON at byte \d+"),
            ("a NUL byte", "nul.json", b'{"zero_optimization": {"stage": 3}}\0{"x": 1}',
             r"holds a NUL byte at offset 35"),
            ("aliases expanding to 10^8 values", "bomb.yaml", bomb.encode(),
             r"expands to more than 100000 values")):
        path = os.path.join(tmp, fname)
        with open(path, "wb") as f:
            f.write(data)
        t = time.time()
        e = sh([tool, "convert", path], timeout=60)
        check(e.returncode != 0 and re.search(want, e.stderr) and time.time() - t < 10,
              "fsdp-plan convert, %s: refused /%s/" % (name, want))


def dry_run():
    """--dry-run against real steps: communication bytes exactly, the state within 10%, the
    peak of a step (peak_mem_bytes, the largest of three steps) within 15% with and without
    activation checkpointing; -v's unit table adds up; a model far larger than the machine's
    memory would allow per process is estimated without allocating it."""
    import resource
    tmp = mkdtemp()
    worst = 0.0
    for name, n, _ in PLANS:
        plan = os.path.join(ROOT, "configs", name + ".yaml")
        for ac in ("false", "true"):
            sets = ["--set", "train.activation_checkpointing=" + ac]
            p, _ = run(n, [plan, "--dry-run", "-v"] + sets)
            check(p.returncode == 0, "%s (checkpointing %s): --dry-run -v runs" % (name, ac))
            est_comm = re.search(r"^comm_bytes (\d+)$", p.stdout, re.M)
            est_state = re.search(r"^state_bytes (\d+)$", p.stdout, re.M)
            est_peak = re.search(r"^peak_bytes (\d+)$", p.stdout, re.M)
            ok = bool(est_comm and est_state and est_peak)
            check(ok, "%s: --dry-run prints its estimates" % name)
            if ac == "false":
                check("placements" in p.stdout and
                      "model.layers.0.mlp.up_proj.weight" in p.stdout,
                      "%s: --dry-run lists every parameter's placements and shapes" % name)
                # the unit table: a row per unit, the root last, columns adding up to the total
                rows = re.findall(r"^  (\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", p.stdout, re.M)
                units = [r for r in rows if r[0] != "total"]
                total = [r for r in rows if r[0] == "total"]
                sums = [sum(int(r[k]) for r in units) for k in range(1, 5)]
                check(len(units) == 3 and units[-1][0] == "(root)" and len(total) == 1 and
                      sums == [int(x) for x in total[0][1:]] and sums[0] == 21 and
                      int(total[0][3]) * 4 == int(est_state.group(1)),
                      "%s: -v lists the units (%s), their columns add up to the total and the "
                      "sharded bytes to a quarter of state_bytes" % (name, [r[0] for r in units]))
            if not ok:
                continue
            metrics = os.path.join(tmp, "%s-%s.jsonl" % (name, ac))
            p, _ = run(n, [plan, "--set", "train.steps=3", "--metrics", metrics] + sets)
            m = losses(metrics)
            if not m:
                check(False, "%s: the real run writes metrics" % name)
                continue
            peak = max(r["peak_mem_bytes"] for r in m)
            want_peak = int(est_peak.group(1))
            worst = max(worst, abs(want_peak - peak) / peak)
            check(abs(want_peak - peak) <= 0.15 * peak,
                  "%s, activation checkpointing %s: a step's peak %d B, estimated %d B (%+.1f%%)"
                  % (name, ac, peak, want_peak, 100.0 * (want_peak - peak) / peak))
            if ac == "true":
                continue
            got_comm, got_state = m[-1]["comm_bytes"], m[-1]["state_bytes"]
            want_comm, want_state = int(est_comm.group(1)), int(est_state.group(1))
            check(got_comm == want_comm, "%s: communication %d B per step, estimated %d B"
                  % (name, got_comm, want_comm))
            check(abs(got_state - want_state) <= 0.1 * want_state,
                  "%s: memory held after a step %d B, estimated %d B (10%%)"
                  % (name, got_state, want_state))
    print("dry-run peak estimates: worst error %.1f%% over %d runs" % (100 * worst, 2 * len(PLANS)))
    # --world N from one process prints the memory and communication figures of a dry run
    # under mpirun -n N (the placements too)
    figures = re.compile(r"^(state_bytes|largest_unit_bytes|peak_bytes|comm_bytes|"
                         r"communication per step.*|memory per rank.*|  a step peaks.*|"
                         r"  model\.\S+ .*|  lm_head\S* .*)$", re.M)
    compared = [("fsdp", 2), ("fsdp", 4), ("fsdp", 8), ("hsdp-tp", 8)]
    if not os.environ.get("FSDPC_TEST_SANITIZED"):  # the same planning code, other plans
        compared += [("hsdp", 4), ("fsdp-bf16", 4), ("tp", 2), ("hsdp-int-reshard", 8)]
    for name, n in compared:
        plan = os.path.join(ROOT, "configs", name + ".yaml")
        real, _ = run(n, [plan, "--dry-run"])
        planned, _ = run(1, [plan, "--dry-run", "--world", str(n)])
        a, b = figures.findall(real.stdout), figures.findall(planned.stdout)
        check(real.returncode == 0 and planned.returncode == 0 and len(a) > 10 and a == b and
              "planned from one process (--world %d" % n in planned.stdout,
              "%s: --dry-run --world %d from one process gives the figures of mpirun -n %d "
              "(%d lines)" % (name, n, n, len(a)))
    t = time.time()
    p, _ = run(1, [os.path.join(ROOT, "configs", "fsdp.yaml"), "--dry-run", "--world", "1024",
                   "--ranks-per-node", "8", "--set", "mesh.dp_replicate=128", "--set",
                   "mesh.dp_shard=8"], timeout=120)
    check(p.returncode == 0 and re.search(r"^comm_bytes \d+$", p.stdout, re.M) and
          "world 1024 ranks" in p.stdout and time.time() - t < 60,
          "--dry-run --world 1024 (HSDP 128 x 8) runs from one process")
    for args, want in ((["--world", "4"], r"--world plans a job without running it: it goes "
                                          r"with --dry-run"),
                       (["--dry-run", "--ranks-per-node", "2"], r"--ranks-per-node goes with "
                                                                r"--world"),
                       (["--dry-run", "--world", "0"], r"--world: expected a number of ranks")):
        p, _ = run(1, [os.path.join(ROOT, "configs", "fsdp.yaml")] + args)
        check(p.returncode != 0 and re.search(want, p.stderr), "%s: refused /%s/" %
              (" ".join(args), want))
    p, _ = run(2, [os.path.join(ROOT, "configs", "fsdp.yaml"), "--dry-run", "--world", "8"])
    check(p.returncode != 0 and ranks_saying(p.stderr, r"a planning world is planned from one "
                                             r"process; 2 were started") == {"0", "1"},
          "--world under mpirun -n 2 is refused on both ranks")
    # a 520M-parameter model (2 GB in f32) on one rank: the dry run builds it meta
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    p, _ = run(1, [os.path.join(ROOT, "configs", "llama-520m.yaml"), "--dry-run"])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child
    est_state = re.search(r"^state_bytes (\d+)$", p.stdout, re.M)
    model = int(est_state.group(1)) // 4 if est_state else 0  # the f32 parameters' bytes
    check(p.returncode == 0 and model > 2e9 and rss * 1024 < model / 4,
          "--dry-run of llama-520m on one rank: %d MB of parameters, at most %d MB resident "
          "(children so far %d MB)" % (model // 1000000, rss * 1024 // 1000000,
                                       before * 1024 // 1000000))


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
    # 1b. the metrics file of a resumed run: lines up to the checkpoint's step kept, the rest
    # rewritten; a run with nothing to train leaves it as it is; a write error stops the run
    with open(ma) as f:
        before = f.read()
    p = train(4, "fsdp", ["train.steps=10", "checkpoint.load=" + os.path.join(a, "step-00000010")],
              ma)
    with open(ma) as f:
        check(f.read() == before and "nothing to train" in p.stdout,
              "a run with nothing to train leaves the metrics file as it is")
    with open(ma, "a") as f:
        f.write(before.splitlines()[-1] + "\n")  # a line past the end, as a longer run leaves
    train(4, "fsdp", ["train.steps=10", "checkpoint.load=" + os.path.join(a, "step-00000005")],
          ma)
    m = losses(ma)
    check([r["step"] for r in m] == list(range(1, 11)) and
          [r["loss"] for r in m] == [json.loads(l)["loss"] for l in before.splitlines()],
          "a resumed run keeps the metrics of steps 1-5 and rewrites 6-10 (steps %s)"
          % [r["step"] for r in m])
    # 1c. checkpoint.dir: missing parents created before training; one that cannot be a
    # folder refused before the first step, --dry-run included (which creates nothing); a plan
    # path with a quote in it is recorded as given (export-hf then needs no --config)
    deep = os.path.join(tmp, "deep", "er", "ckpt")
    odd = os.path.join(tmp, 'we"ird plan.yaml')
    with open(cfg("fsdp")) as f, open(odd, "w") as g:  # the data path made absolute
        g.write(f.read().replace("../data/", os.path.join(ROOT, "data") + "/"))
    p, _ = run(2, [odd, "--set", "train.steps=2", "--set", "checkpoint.interval=2", "--set",
                   "checkpoint.dir=" + deep, "--dry-run"])
    check(p.returncode == 0 and not os.path.exists(os.path.join(tmp, "deep")),
          "--dry-run with a checkpoint.dir to be created creates nothing")
    train(2, "fsdp", ["train.steps=2", "checkpoint.interval=2", "checkpoint.dir=" + deep])
    check(os.path.isdir(os.path.join(deep, "step-00000002")),
          "checkpoint.dir's missing parents are created")
    shutil.rmtree(os.path.join(tmp, "deep"), ignore_errors=True)
    os.makedirs(os.path.dirname(deep), exist_ok=True)  # what follows does not depend on it
    p, _ = run(2, [odd, "--set", "train.steps=2", "--set", "checkpoint.interval=2", "--set",
                   "checkpoint.dir=" + deep])
    try:
        with open(os.path.join(deep, "step-00000002", "train_state.json")) as f:
            under = json.load(f).get("saved_under", {})
    except (OSError, ValueError):
        under = {}
    check(p.returncode == 0 and under.get("plan") == odd and under.get("world_size") == 2,
          "a plan path with a quote is recorded as given (%r)" % under.get("plan"))
    out = os.path.join(tmp, "odd-hf")
    p = sh([TOOL, "export-hf", os.path.join(deep, "step-00000002"), out], timeout=300)
    check(p.returncode == 0 and os.path.exists(os.path.join(out, "config.json")),
          "export-hf of its checkpoint finds the model in train_state.json")
    blocked = os.path.join(tmp, "a-file")
    with open(blocked, "w") as f:
        f.write("x")
    for extra in ([], ["--dry-run"]):
        p, _ = run(2, [cfg("fsdp"), "--set", "checkpoint.interval=2", "--set",
                       "checkpoint.dir=" + os.path.join(blocked, "ckpt")] + extra)
        check(p.returncode != 0 and "step " not in p.stdout and ranks_saying(
            p.stderr, r"checkpoint\.dir '.*a-file/ckpt': .*'.*a-file' is not a folder") ==
              {"0", "1"},
              "checkpoint.dir under a file: every rank refuses it before training %s(exit %d)"
              % (" ".join(extra) + " " if extra else "", p.returncode))
    p, _ = run(2, [cfg("fsdp"), "--set", "train.steps=3", "--metrics", "/dev/full"])
    check(p.returncode != 0 and "step " not in p.stdout and ranks_saying(
        p.stderr, r"--metrics \(or log\.metrics\) '/dev/full': is a device, not a regular file") ==
          {"0", "1"},
          "metrics at a device: every rank refuses it before training (exit %d)" % p.returncode)
    # 2. resume under other plans: global batch 24 everywhere
    ref = os.path.join(tmp, "ref.jsonl")
    train(1, "debug", ["train.steps=10", "data.batch_size=24"], ref)
    want = [r["loss"] for r in losses(ref)][5:]
    # checksum blocks of 64 bytes: a load under another plan reads the blocks its rows touch
    s = os.path.join(tmp, "s")
    train(4, "fsdp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + s,
                      "checkpoint.interval=5", "checkpoint.block_bytes=64"])
    t = os.path.join(tmp, "t")
    train(8, "hsdp-tp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + t,
                         "checkpoint.interval=5", "checkpoint.block_bytes=64"])

    def stored(folder):  # the tensor bytes of a checkpoint (model and optimizer state)
        return sum(len(st_read(os.path.join(folder, sub, f))[1])
                   for sub in ("model", "optim") for f in os.listdir(os.path.join(folder, sub)))

    def reads_touched_blocks(p, folder, n):
        """rank 0 read at least the bytes it needs; on one rank, everything; on several, less
        than the whole checkpoint (test_dcp checks the exact blocks)"""
        rd = re.search(r"read (\d+) bytes of tensor data, needing (\d+)", p.stdout)
        read, need = (int(rd.group(1)), int(rd.group(2))) if rd else (0, -1)
        total = stored(folder)
        return need <= read and (read == total if n == 1 else read < total), (read, need, total)

    for n, name, batch, src, extra in [
            (1, "debug", 24, s, []), (4, "hsdp", 6, s, []), (3, "fsdp", 8, s, []),
            (8, "hsdp-int-reshard", 3, s, []), (2, "tp", 24, s, []), (8, "hsdp-tp", 6, s, []),
            (4, "hsdp-tp", 12, s, ["mesh.dp_replicate=1"]),  # tp=2 x dp_shard=2
            (4, "fsdp", 6, t, []), (1, "debug", 24, t, [])]:
        m = os.path.join(tmp, "x%d.jsonl" % len(os.listdir(tmp)))  # a new file per run
        p = train(n, name, ["train.steps=10", "data.batch_size=%d" % batch,
                            "checkpoint.load=" + os.path.join(src, "step-00000005")] + extra, m)
        got = [r["loss"] for r in losses(m)] if os.path.exists(m) else []
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, want)) if got else 1
        check(len(got) == 5 and worst <= 1e-5,
              "saved by %s, resumed by %s on %d: losses match the uninterrupted run "
              "(worst %.2e)" % ("hsdp-tp on 8 ranks" if src == t else "fsdp on 4 ranks", name, n,
                                worst))
        good, (read, need, total) = reads_touched_blocks(p, os.path.join(src, "step-00000005"), n)
        check(good, "%s on %d: rank 0 reads the 64-byte blocks its shards touch: %d bytes, "
              "needing %d, of %d saved" % (name, n, read, need, total))
    # 2b. offline: fsdp-ckpt reshard lays the fsdp checkpoint out as hsdp-tp and debug would
    # save it; the result has a live save's files, shapes and offsets, and resumes exactly

    def layout(folder):
        out = {}
        for sub in ("model", "optim"):
            for f in sorted(os.listdir(os.path.join(folder, sub))):
                h, _ = st_read(os.path.join(folder, sub, f))
                info = json.loads(h.pop("__metadata__")["DCP_SHARDING_INFO"])
                out[sub + "/" + f] = {k: (v["shape"], info[k]["saved_offsets"]) for k, v in h.items()}
        return out

    for n, name, batch in [(8, "hsdp-tp", 6), (1, "debug", 24)]:
        rs = os.path.join(tmp, "rs-" + name)
        p = sh([TOOL, "reshard", os.path.join(s, "step-00000005"), "--to", cfg(name), rs,
                "--set", "data.batch_size=%d" % batch], timeout=300)
        check(p.returncode == 0, "fsdp-ckpt reshard to %s runs" % name)
        if p.returncode != 0:
            print(p.stderr)
            continue
        if name == "hsdp-tp":
            check(layout(rs) == layout(os.path.join(t, "step-00000005")),
                  "reshard to hsdp-tp: the files, shapes and offsets of a live hsdp-tp save")
        m = os.path.join(tmp, "x%d.jsonl" % len(os.listdir(tmp)))
        p = train(n, name, ["train.steps=10", "data.batch_size=%d" % batch, "checkpoint.load=" + rs], m)
        got = [r["loss"] for r in losses(m)] if os.path.exists(m) else []
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, want)) if got else 1
        rd = re.search(r"read (\d+) bytes of tensor data, needing (\d+), plus \d+ header bytes of "
                       r"(\d+) files", p.stdout)
        check(len(got) == 5 and worst <= 1e-5 and bool(rd) and rd.group(1) == rd.group(2),
              "resharded offline for %s on %d: losses match the uninterrupted run (worst %.2e), "
              "rank 0 reads exactly its own chunks" % (name, n, worst))
    # a plan of only mesh: and parallelize: (no model, data or training): the checkpoint's
    # recorded model is laid out as the full hsdp-tp plan lays it out
    text = open(cfg("hsdp-tp")).read()
    only = re.search(r"^mesh:\n(?:  .*\n)+", text, re.M).group(0) + \
        re.search(r"^parallelize:\n(?:  .*\n)+", text, re.M).group(0)
    bare = os.path.join(tmp, "mesh-only.yaml")
    with open(bare, "w") as f:
        f.write(only)
    rs = os.path.join(tmp, "rs-mesh-only")
    p = sh([TOOL, "reshard", os.path.join(s, "step-00000005"), "--to", bare, rs], timeout=300)
    check(p.returncode == 0 and "model:" not in only and "data:" not in only and
          layout(rs) == layout(os.path.join(t, "step-00000005")),
          "reshard with a plan of only mesh: and parallelize: takes the checkpoint's model: the "
          "layout of a live hsdp-tp save (%s)" % (p.stderr.strip()[-200:] or "ok"))
    # a plan with another model: refused, naming the first difference
    p = sh([TOOL, "reshard", os.path.join(s, "step-00000005"), "--to", cfg("debug"),
            os.path.join(tmp, "rs-other"), "--set", "model.n_layers=3"], timeout=300)
    check(p.returncode != 0 and "differs from the model of" in p.stderr and
          "n_layers 2 vs 3" in p.stderr, "reshard to another model names the difference")
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
    check(p.returncode == 0, "a dry run of one rank (to find the device)")
    if p.returncode != 0:
        print(p.stdout[-1500:], p.stderr[-1500:])
        return
    if " on cuda" not in p.stdout:
        print("no CUDA device: skipped")
        sys.exit(77)
    # train.device with one device visible: auto takes it for one rank (the header names it),
    # the CPU for two (NCCL needs a device per rank), cuda refuses two ranks on every rank
    one = {"CUDA_VISIBLE_DEVICES": "0"}
    share = r"local ranks 0 and 1 of this node would share CUDA device GPU-[0-9a-f-]{36} "
    for n, dev, ok, want in [(1, "auto", True, r"world 1 rank on cuda:0.*\n(.*\n)*  devices: rank 0 "
                              r"cuda:0 GPU-[0-9a-f]{8}\n"),
                             (1, "cpu", True, r"world 1 rank on cpu"),
                             (2, "auto", True, r"world 2 ranks on cpu.*\n  train\.device auto: " +
                              share),
                             (2, "cuda", False, r"\[ranks 0,1\] .*train\.device: cuda: " + share +
                              r"\(2 ranks, 1 device seen by rank 0; NCCL needs one per rank\)")]:
        p = sh([MPIRUN] + MPI_ARGS + ["-n", str(n), EXE, cfg, "--dry-run", "--set",
                                      "mesh.dp_shard=%d" % n, "--set", "train.device=" + dev],
               60, env=one)
        text = p.stdout if ok else p.stderr
        check((p.returncode == 0) == ok and re.search(want, text) is not None,
              "train.device=%s on %d rank%s, one device: exit %d /%s/" %
              (dev, n, "s" if n > 1 else "", p.returncode, want))
    # bf16 attention: cuDNN's fused kernels by default (FSDPC_PROFILE's summary counts their
    # calls); with train.deterministic, batched products, and two runs give the same losses
    bf16 = ["--set", "parallelize.fully_shard.mp_policy.param_dtype=bf16", "--set",
            "train.steps=6"]
    runs = []
    for det in ("false", "true", "true"):
        m = os.path.join(tmp, "det%d.jsonl" % len(runs))
        p = sh([MPIRUN] + MPI_ARGS + ["-n", "1", EXE, cfg, "--set", "train.deterministic=" + det,
                                      "--metrics", m] + bf16, 300, env={"FSDPC_PROFILE": "1"})
        want = ("attention: batched cuBLAS products (train.deterministic" if det == "true" else
                "attention: cuDNN fused, ")
        check(p.returncode == 0 and want in p.stdout,
              "bf16 on the GPU, train.deterministic=%s: runs, and says '%s'" % (det, want))
        if p.returncode != 0 or want not in p.stdout:
            print(p.stdout[-1500:], p.stderr[-1500:])
        runs.append([r["loss"] for r in losses(m)] if p.returncode == 0 else [])
    check(len(runs[1]) == 6 and runs[1] == runs[2],
          "train.deterministic: two bf16 runs, the same losses bit for bit (%s vs %s)" %
          (runs[1][:2], runs[2][:2]))
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

def gpu_multi():
    """Several ranks on this machine's one GPU through the host-staged groups in their lazy test
    mode (FSDPC_PG=staged-lazy): FSDP on 2 ranks, HSDP 2x2, FSDP 2 x TP 2 and HSDP 2x2 x TP 2
    train configs/hsdp-tp.yaml's model on the device with the losses of one rank on the CPU
    taking the same global batch (the plans' parity promise, within the GPU's f32 rounding)."""
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "hsdp-tp.yaml")
    try:  # the GPUs the driver lists; the runs below ask for CUDA and say so if they miss it
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=60).stdout.count("GPU ")
    except (OSError, subprocess.TimeoutExpired):
        gpus = 0
    if gpus == 0:
        print("no GPU (nvidia-smi lists none): skipped")
        sys.exit(77)
    p, _ = run(1, [cfg, "--dry-run", "--set", "mesh.dp_replicate=1", "--set", "mesh.dp_shard=1",
                   "--set", "mesh.tp=1", "--set", "train.device=cuda"])
    if "built without CUDA" in p.stderr:
        print("fsdp-train was built without CUDA: skipped")
        sys.exit(77)
    check(p.returncode == 0 and " on cuda" in p.stdout,
          "one rank, train.device=cuda: a dry run on the GPU")
    if p.returncode != 0 or " on cuda" not in p.stdout:
        print(p.stdout[-1500:], p.stderr[-1500:])
    steps = ["--set", "train.steps=10"]
    wants = {}  # data-parallel ranks: one CPU rank's losses at that many times the batch (2)
    for dp in (2, 4):
        ref = os.path.join(tmp, "cpu%d.jsonl" % dp)
        p, _ = run(1, [cfg, "--set", "mesh.dp_replicate=1", "--set", "mesh.dp_shard=1", "--set",
                       "mesh.tp=1", "--set", "train.device=cpu", "--set",
                       "data.batch_size=%d" % (2 * dp), "--metrics", ref] + steps)
        check(p.returncode == 0, "one rank on the CPU, batch %d: the reference run" % (2 * dp))
        wants[dp] = [r["loss"] for r in losses(ref)] if p.returncode == 0 else []
    for name, n, mesh in [("FSDP", 2, (1, 2, 1)), ("HSDP 2x2", 4, (2, 2, 1)),
                          ("FSDP 2 x TP 2", 4, (1, 2, 2)), ("HSDP 2x2 x TP 2", 8, (2, 2, 2))]:
        m = os.path.join(tmp, "gpu%d.jsonl" % n)
        sets = []
        for key, size in zip(("dp_replicate", "dp_shard", "tp"), mesh):
            sets += ["--set", "mesh.%s=%d" % (key, size)]
        p, _ = run(n, [cfg, "--set", "train.device=cuda", "--metrics", m] + sets + steps,
                   mpi_args=("-x", "FSDPC_PG=staged-lazy"))
        got = [r["loss"] for r in losses(m)] if p.returncode == 0 else []
        want = wants[mesh[0] * mesh[1]]
        worst = (max(abs(a - b) / abs(b) for a, b in zip(got, want))
                 if got and len(got) == len(want) else float("inf"))
        check(p.returncode == 0 and "on cuda:0" in p.stdout and
              "process groups: host-staged, lazy test mode" in p.stdout and worst <= 1e-4,
              "%s on %d ranks sharing the GPU: one CPU rank's losses (worst relative %.2e)"
              % (name, n, worst))
        if p.returncode != 0:
            print(p.stdout[-1500:], p.stderr[-2500:])


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


def hf_expected(cfg):
    """Hugging Face LlamaForCausalLM tensor names and shapes for a config.json."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    want = {"model.embed_tokens.weight": [v, d], "model.norm.weight": [d]}
    if not cfg.get("tie_word_embeddings"):
        want["lm_head.weight"] = [v, d]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        want.update({p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
                     p + "self_attn.q_proj.weight": [d, d], p + "self_attn.k_proj.weight": [kv, d],
                     p + "self_attn.v_proj.weight": [kv, d], p + "self_attn.o_proj.weight": [d, d],
                     p + "mlp.gate_proj.weight": [f, d], p + "mlp.up_proj.weight": [f, d],
                     p + "mlp.down_proj.weight": [d, f]})
    return want


def py_logits(folder, ids):
    """Llama logits from a Hugging Face folder in plain Python (double precision), independent
    of the project: config.json, model.safetensors (F32) and the LlamaForCausalLM math."""
    import math
    import struct
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    h, data = st_read(os.path.join(folder, "model.safetensors"))
    W = {}
    for k, t in h.items():
        if k == "__metadata__":
            continue
        b, e = t["data_offsets"]
        vals = struct.unpack("<%df" % ((e - b) // 4), data[b:e])
        cols = t["shape"][1] if len(t["shape"]) > 1 else None
        W[k] = [list(vals[r * cols:(r + 1) * cols]) for r in range(t["shape"][0])] if cols else list(vals)
    D, H, KV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, eps, theta = D // H, c["rms_norm_eps"], c["rope_theta"]
    mv = lambda M, x: [sum(a * b for a, b in zip(row, x)) for row in M]

    def norm(x, w):
        r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
        return [wi * v * r for wi, v in zip(w, x)]

    def rope(x, t):
        out = []
        for hh in range(len(x) // hd):
            v = x[hh * hd:(hh + 1) * hd]
            half = hd // 2
            rot = [-a for a in v[half:]] + v[:half]
            for j in range(hd):
                a = t * theta ** (-2.0 * (j % half) / hd)
                out.append(v[j] * math.cos(a) + rot[j] * math.sin(a))
        return out

    xs = [list(W["model.embed_tokens.weight"][i]) for i in ids]
    for L in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % L
        n1 = [norm(x, W[p + "input_layernorm.weight"]) for x in xs]
        q = [rope(mv(W[p + "self_attn.q_proj.weight"], x), t) for t, x in enumerate(n1)]
        k = [rope(mv(W[p + "self_attn.k_proj.weight"], x), t) for t, x in enumerate(n1)]
        v = [mv(W[p + "self_attn.v_proj.weight"], x) for x in n1]
        att = []
        for t in range(len(xs)):
            o = []
            for hh in range(H):
                g = hh // (H // KV)
                qs = q[t][hh * hd:(hh + 1) * hd]
                sc = [sum(a * b for a, b in zip(qs, k[u][g * hd:(g + 1) * hd])) / math.sqrt(hd)
                      for u in range(t + 1)]
                m = max(sc)
                ex = [math.exp(z - m) for z in sc]
                tot = sum(ex)
                o += [sum(ex[u] / tot * v[u][g * hd + j] for u in range(t + 1)) for j in range(hd)]
            att.append(mv(W[p + "self_attn.o_proj.weight"], o))
        xs = [[a + b for a, b in zip(x, y)] for x, y in zip(xs, att)]
        n2 = [norm(x, W[p + "post_attention_layernorm.weight"]) for x in xs]
        mlp = []
        for x in n2:
            gt, up = mv(W[p + "mlp.gate_proj.weight"], x), mv(W[p + "mlp.up_proj.weight"], x)
            mlp.append(mv(W[p + "mlp.down_proj.weight"],
                          [a / (1 + math.exp(-a)) * b for a, b in zip(gt, up)]))
        xs = [[a + b for a, b in zip(x, y)] for x, y in zip(xs, mlp)]
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return [mv(head, norm(x, W["model.norm.weight"])) for x in xs]


def ckpt_tool():
    """fsdp-ckpt inspect / export-hf / import-hf, checked by an independent reader."""
    import struct
    tmp = mkdtemp()
    ck = os.path.join(tmp, "ck")
    p, _ = run(4, [os.path.join(ROOT, "configs", "fsdp.yaml"), "--set", "train.steps=3",
                   "--set", "checkpoint.dir=" + ck, "--set", "checkpoint.interval=3"])
    check(p.returncode == 0, "fsdp on 4 ranks saves a checkpoint")
    step = os.path.join(ck, "step-00000003")
    tool_run = lambda *a: sh([TOOL] + list(a), timeout=120)
    p = tool_run("inspect", step)
    check(p.returncode == 0 and "after step 3" in p.stdout and "fsdp.yaml" in p.stdout and
          re.search(r"model\.layers\.1\.mlp\.down_proj\.weight\s+F32\s+64x160\s+4\s+40960",
                    p.stdout) is not None and "optimizer state" in p.stdout,
          "inspect lists the plan, tensors, dtypes, shapes, chunks and bytes")
    # the checkpoint's values, assembled from its shard files by the saved offsets, by row
    saved = {}
    for k, (_, shape, raw) in assemble(os.path.join(step, "model"))[0].items():
        vals = struct.unpack("<%df" % (len(raw) // 4), raw)
        cols = shape[1] if len(shape) > 1 else 1
        saved[k] = {r: vals[r * cols:(r + 1) * cols] for r in range(shape[0])}
    for dtype, shard_bytes in (("f32", None), ("bf16", "100000")):
        out = os.path.join(tmp, "hf-" + dtype)
        args = ["export-hf", step, out, "--dtype", dtype]
        if shard_bytes:
            args += ["--max-shard-bytes", shard_bytes]
        p = tool_run(*args)
        check(p.returncode == 0, "export-hf --dtype %s runs" % dtype)
        if p.returncode != 0:
            print(p.stderr)
            continue
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        want = hf_expected(cfg)
        check(cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 64 and
              cfg["torch_dtype"] == ("float32" if dtype == "f32" else "bfloat16"),
              "%s: config.json describes the model" % dtype)
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        if shard_bytes:
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                index = json.load(f)
            check(len(files) > 1 and sorted(set(index["weight_map"].values())) == files and
                  set(index["weight_map"]) == set(want),
                  "%s: %d files and an index mapping every tensor" % (dtype, len(files)))
        else:
            check(files == ["model.safetensors"], "f32: one model.safetensors")
        got, exact, total = {}, True, 0
        for name in files:
            h, data = st_read(os.path.join(out, name))
            for k, t in h.items():
                if k == "__metadata__":
                    continue
                got[k] = (t["dtype"], t["shape"])
                b, e = t["data_offsets"]
                total += e - b
                if dtype == "f32":
                    vals = struct.unpack("<%df" % ((e - b) // 4), data[b:e])
                    cols = t["shape"][1] if len(t["shape"]) > 1 else 1
                    exact = exact and all(vals[r * cols:(r + 1) * cols] == saved[k][r]
                                          for r in range(t["shape"][0]))
        st = "F32" if dtype == "f32" else "BF16"
        check(got == {k: (st, v) for k, v in want.items()},
              "%s: Hugging Face Llama names, shapes and dtype %s" % (dtype, st))
        if dtype == "f32":
            check(exact, "f32: every exported value equals the checkpoint's")
    # the exported weights' logits: the C model against an independent plain-Python Llama
    ids = [72, 101, 108, 108, 111, 44, 32, 119]
    p = sh([os.path.join(os.path.dirname(EXE), "..", "tests", "hf_logits"),
            os.path.join(tmp, "hf-f32")] + [str(i) for i in ids], timeout=120)
    if p.returncode == 0:
        got = json.loads(p.stdout)["logits"]
        want = py_logits(os.path.join(tmp, "hf-f32"), ids)
        num = sum((a - b) ** 2 for ra, rb in zip(got, want) for a, b in zip(ra, rb))
        den = sum(b * b for rb in want for b in rb)
        rel = (num / den) ** 0.5
        check(len(got) == len(ids) and rel <= 1e-5,
              "the exported model's logits: C vs plain Python, relative L2 %.2e" % rel)
    else:
        check(False, "hf_logits runs on the export: " + p.stderr[-500:])
    # round trip: import the export, load it under HSDP; the same first loss as the export
    # read by model.init_from on one rank
    imp = os.path.join(tmp, "imported")
    p = tool_run("import-hf", os.path.join(tmp, "hf-f32"), imp)
    check(p.returncode == 0 and os.path.exists(os.path.join(imp, "train_state.json")),
          "import-hf writes a checkpoint")
    ma, mb = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b.jsonl")
    pa, _ = run(4, [os.path.join(ROOT, "configs", "hsdp.yaml"), "--set", "train.steps=2",
                    "--set", "checkpoint.load=" + imp, "--set", "data.batch_size=2",
                    "--metrics", ma])
    dbg = os.path.join(tmp, "debug-init.yaml")
    with open(os.path.join(ROOT, "configs", "debug.yaml")) as f:
        text = f.read()
    text = re.sub(r"model:\n(  .*\n)+", "model:\n  init_from: %s\n" % os.path.join(tmp, "hf-f32"),
                  text)
    text = text.replace("path: ../data", "path: " + os.path.join(ROOT, "data"))
    with open(dbg, "w") as f:
        f.write(text)
    pb, _ = run(1, [dbg, "--set", "train.steps=2", "--metrics", mb])
    ok = pa.returncode == 0 and pb.returncode == 0
    check(ok, "the imported checkpoint loads under hsdp, the export under model.init_from")
    if ok:
        la, lb = losses(ma)[0]["loss"], losses(mb)[0]["loss"]
        check(abs(la - lb) <= 1e-5 * abs(lb) and "resumed from" in pa.stdout,
              "imported under hsdp (2x2) and exported read on one rank: first loss %.7f vs %.7f"
              % (la, lb))
    else:
        print(pa.stdout[-1500:], pa.stderr[-1500:], pb.stdout[-1500:], pb.stderr[-1500:])
    # a multi-file Hugging Face folder (the bf16 export: three files and an index) read by
    # model.init_from under FSDP on 2 ranks: the same first loss as its import-hf checkpoint
    # loaded under hsdp
    imp16 = os.path.join(tmp, "imported-bf16")
    p = tool_run("import-hf", os.path.join(tmp, "hf-bf16"), imp16)
    mc, md = os.path.join(tmp, "c.jsonl"), os.path.join(tmp, "d.jsonl")
    pc, _ = run(4, [os.path.join(ROOT, "configs", "hsdp.yaml"), "--set", "train.steps=2",
                    "--set", "checkpoint.load=" + imp16, "--set", "data.batch_size=2",
                    "--metrics", mc])
    dbg16 = os.path.join(tmp, "fsdp-init-bf16.yaml")
    with open(dbg16, "w") as f:
        f.write(text.replace(os.path.join(tmp, "hf-f32"), os.path.join(tmp, "hf-bf16"))
                .replace("dp_shard: 1", "dp_shard: 2"))
    pd, _ = run(2, [dbg16, "--set", "train.steps=2", "--set", "data.batch_size=4",
                    "--metrics", md])
    ok = p.returncode == 0 and pc.returncode == 0 and pd.returncode == 0
    check(ok, "model.init_from reads a Hugging Face folder of three files and an index")
    if ok:
        lc, ld = losses(mc)[0]["loss"], losses(md)[0]["loss"]
        check(abs(lc - ld) <= 1e-5 * abs(lc),
              "bf16 export: imported under hsdp %.7f, init_from on 2 ranks %.7f" % (lc, ld))
    else:
        print(p.stderr[-1500:], pc.stderr[-1500:], pd.stderr[-1500:])
    # broken Hugging Face folders under model.init_from: a file the index names is missing; a
    # tensor in two files
    hf16 = os.path.join(tmp, "hf-bf16")
    shards = sorted(f for f in os.listdir(hf16) if f.endswith(".safetensors"))
    lacking, twice = os.path.join(tmp, "hf-lacking"), os.path.join(tmp, "hf-twice")
    shutil.copytree(hf16, lacking)
    os.remove(os.path.join(lacking, shards[1]))
    shutil.copytree(hf16, twice)
    with open(os.path.join(twice, "model.safetensors.index.json")) as f:
        index = json.load(f)
    extra = "extra.safetensors"
    shutil.copy(os.path.join(twice, shards[0]), os.path.join(twice, extra))
    index["weight_map"]["zz.extra"] = extra  # names the copy: its tensors are then in two files
    with open(os.path.join(twice, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    for folder, want in [(lacking, re.escape(shards[1])), (twice, r"is in both .*" + extra +
                                                           r"|is in both .*" + shards[0])]:
        bad_cfg = os.path.join(tmp, "init-broken.yaml")
        with open(bad_cfg, "w") as f:
            f.write(text.replace(os.path.join(tmp, "hf-f32"), folder))
        p, _ = run(1, [bad_cfg, "--set", "train.steps=1"], timeout=60)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None,
              "init_from %s: exit %d, says /%s/" % (os.path.basename(folder), p.returncode, want))
    # mistakes: a clear message and a non-zero exit
    for args, want in [(["export-hf", os.path.join(tmp, "nowhere"), os.path.join(tmp, "x")],
                        r"nowhere: not a folder"),
                       (["export-hf", step, os.path.join(tmp, "hf-f32")], r"exists and is not empty"),
                       (["export-hf", step, os.path.join(tmp, "y"), "--dtype", "i32"],
                        r"--dtype: expected f32, bf16 or f16"),
                       (["import-hf", tmp, os.path.join(tmp, "z")], r"config\.json"),
                       (["import-hf", os.path.join(tmp, "hf-f32"), imp], r"already exists"),
                       (["frobnicate", step], r"unknown command 'frobnicate'")]:
        p = tool_run(*args)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None,
              "fsdp-ckpt %s: exit %d, says /%s/" % (args[0], p.returncode, want))
    # import-hf checks config.json against a plan's limits and every tensor against the model it
    # describes, before writing anything; model.init_from reads config.json the same way
    src = os.path.join(tmp, "hf-f32")
    with open(os.path.join(src, "config.json")) as f:
        cfg_text = f.read()
    cfg = json.loads(cfg_text)
    vocab, ffn = cfg["vocab_size"], cfg["intermediate_size"]

    def variant(name, edit=None, raw=None, transpose=None):
        folder = os.path.join(tmp, "hf-" + name)
        shutil.copytree(src, folder)
        if edit or raw:
            c = dict(cfg)
            if edit:
                c.update(edit)
            with open(os.path.join(folder, "config.json"), "w") as f:
                f.write(raw if raw else json.dumps(c))
        if transpose:  # the same bytes declared with the shape's dimensions swapped
            path = os.path.join(folder, "model.safetensors")
            edit_header(path, lambda h: h[transpose].update(shape=h[transpose]["shape"][::-1]))
        return folder
    down = "model.layers.0.mlp.down_proj.weight"
    for name, folder, want in (
            ("vocab 2^40", variant("vocab", {"vocab_size": 2 ** 40}),
             r"vocab_size must be a size from 1 to 2147483648, got 1099511627776"),
            ("10^7 layers", variant("layers", {"num_hidden_layers": 10 ** 7}),
             r"num_hidden_layers must be a size from 1 to 4096, got 10000000"),
            ("ffn 2^31", variant("ffn", {"intermediate_size": 2 ** 31}),
             r"tensor '%s' has shape \[%d, %d\], but config\.json's model needs \[%d, %d\]" % (
                 "model.layers.0.mlp.gate_proj.weight", ffn, cfg["hidden_size"], 2 ** 31,
                 cfg["hidden_size"])),
            ("a transposed down_proj", variant("transposed", transpose=down),
             r"tensor '%s' has shape \[%d, %d\], but config\.json's model needs \[%d, %d\]" % (
                 down.replace(".", "\\."), ffn, cfg["hidden_size"], cfg["hidden_size"], ffn)),
            ("vocab_size given twice", variant("twice-key", raw=cfg_text.replace(
                '"vocab_size"', '"vocab_size": %d, "vocab_size"' % (vocab + 1), 1)),
             r"'vocab_size' is given twice")):
        out = os.path.join(tmp, "imp-" + os.path.basename(folder))
        t = time.time()
        p = tool_run("import-hf", folder, out)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not os.path.exists(out) and not glob.glob(out + ".tmp*") and time.time() - t < 30,
              "import-hf of a folder with %s: refused before writing /%s/" % (name, want[:60]))
        if not re.search(want, p.stderr or ""):
            print(p.stderr[-800:])
        if name in ("10^7 layers", "vocab_size given twice"):
            bad_cfg = os.path.join(tmp, "init-%s.yaml" % os.path.basename(folder))
            with open(bad_cfg, "w") as f:
                f.write(text.replace(src, folder))
            t = time.time()
            p, _ = run(1, [bad_cfg, "--set", "train.steps=1"], timeout=60)
            check(p.returncode != 0 and re.search(want, p.stderr) is not None and
                  time.time() - t < 30, "model.init_from with %s: refused at once" % name)
    # an imported checkpoint is this project's: integrity records that verify, and catch a
    # flipped byte
    p = tool_run("inspect", imp)
    check(p.returncode == 0 and "another tool" not in p.stdout + p.stderr and
          tool_run("verify", imp).returncode == 0,
          "an import-hf checkpoint carries integrity records and verifies")
    flipped = os.path.join(tmp, "imported-flipped")
    shutil.copytree(imp, flipped)
    shard = os.path.join(flipped, "model", "model.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    p = tool_run("verify", flipped)
    check(p.returncode != 0 and re.search(r"model\.safetensors", p.stdout + p.stderr),
          "verify of an imported checkpoint with a flipped byte names the file")

def gpt2_folder(path):
    """A GPT-2-style Hugging Face folder (Conv1D weights, biases, tied-free lm head absent) with
    odd sizes, f32 and one f16 tensor, written by hand: {name: (dtype, shape, bytes)}."""
    import random
    import struct
    rnd = random.Random(7)
    d, ff, vocab, pos = 24, 96, 50, 13
    shapes = {"transformer.wte.weight": [vocab, d], "transformer.wpe.weight": [pos, d],
              "transformer.ln_f.weight": [d], "transformer.ln_f.bias": [d]}
    for i in range(2):
        h = "transformer.h.%d." % i
        shapes.update({h + "ln_1.weight": [d], h + "ln_1.bias": [d],
                       h + "attn.c_attn.weight": [d, 3 * d], h + "attn.c_attn.bias": [3 * d],
                       h + "attn.c_proj.weight": [d, d], h + "attn.c_proj.bias": [d],
                       h + "ln_2.weight": [d], h + "ln_2.bias": [d],
                       h + "mlp.c_fc.weight": [d, ff], h + "mlp.c_fc.bias": [ff],
                       h + "mlp.c_proj.weight": [ff, d], h + "mlp.c_proj.bias": [d]})
    tensors, header, data = {}, {}, b""
    for name in sorted(shapes):
        n = 1
        for x in shapes[name]:
            n *= x
        dt = "F16" if name == "transformer.wpe.weight" else "F32"
        raw = struct.pack("<%d%s" % (n, "e" if dt == "F16" else "f"),
                          *[rnd.uniform(-1, 1) for _ in range(n)])
        tensors[name] = (dt, shapes[name], raw)
        header[name] = {"dtype": dt, "shape": shapes[name],
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    os.makedirs(path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + data)
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": d,
              "n_layer": 2, "n_head": 2, "vocab_size": vocab, "n_positions": pos,
              "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors, config


def assemble(folder):
    """A shard folder's tensors put together from their chunks by saved_offsets: {name: (dtype,
    shape, bytes)}, every element written exactly once (asserted), and {file: {name: chunk
    shape}}."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2}
    parts, out = {}, {}
    for fname in sorted(os.listdir(folder)):
        h, data = st_read(os.path.join(folder, fname))
        info = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
        for k, t in h.items():
            if k == "__metadata__":
                continue
            b, e = t["data_offsets"]
            parts.setdefault(k, []).append((t, info[k], data[b:e]))
    layout = {}
    for k, chunks in parts.items():
        gshape = chunks[0][1]["global_shape"] if "global_shape" in chunks[0][1] else None
        if gshape is None:  # the extent: the largest offset + size per dim
            gshape = [max(c[1]["saved_offsets"][i] + c[0]["shape"][i] for c in chunks)
                      for i in range(len(chunks[0][0]["shape"]))]
        es = sizes[chunks[0][0]["dtype"]]
        cols = gshape[1] if len(gshape) > 1 else 1
        buf, seen = bytearray(es * (gshape[0] if gshape else 1) * cols), set()
        for t, inf, raw in chunks:
            r0 = inf["saved_offsets"][0] if gshape else 0
            c0 = inf["saved_offsets"][1] if len(gshape) > 1 else 0
            rows = t["shape"][0] if gshape else 1
            w = t["shape"][1] if len(gshape) > 1 else 1
            for r in range(rows):
                for c in range(w):
                    at = (r0 + r) * cols + c0 + c
                    assert at not in seen, "%s: element %d twice" % (k, at)
                    seen.add(at)
                    buf[at * es:(at + 1) * es] = raw[(r * w + c) * es:(r * w + c + 1) * es]
        assert len(seen) == len(buf) // es, "%s: %d of %d elements" % (k, len(seen), len(buf) // es)
        out[k] = (chunks[0][0]["dtype"], gshape, bytes(buf))
    for fname in sorted(os.listdir(folder)):
        h, _ = st_read(os.path.join(folder, fname))
        layout[fname] = {k: t["shape"] for k, t in h.items() if k != "__metadata__"}
    return out, layout


def ckpt_any_model():
    """fsdp-ckpt on a model it does not know (GPT-2 names, biases, Conv1D shapes, odd sizes, an
    f16 tensor): import-hf, reshard 4 -> 2x2 (dp_shard x tp, colwise/rowwise rules on its
    layers and embedding) -> 1 with no model config, each layout assembled by an independent
    reader and the boxes of the tp plan checked, export-hf back bit for bit."""
    tmp = mkdtemp()
    tool_run = lambda *a: sh([TOOL] + list(a), timeout=120)
    hf = os.path.join(tmp, "gpt2")
    tensors, config = gpt2_folder(hf)
    ck0 = os.path.join(tmp, "ck0")
    p = tool_run("import-hf", hf, ck0)
    check(p.returncode == 0 and "imported 28 tensors" in p.stdout,
          "import-hf takes a GPT-2 folder: %s" % (p.stdout + p.stderr).strip()[-300:])
    plans = {"fsdp4": "mesh: {dp_shard: 4}\nparallelize:\n  fully_shard:\n"
                      "    units: [\"transformer.h.*\"]\n",
             "tp2x2": "mesh: {dp_shard: 2, tp: 2}\nparallelize:\n  fully_shard:\n"
                      "    units: [\"transformer.h.*\"]\n  tensor_parallel:\n    plan:\n"
                      "      \"transformer.h.*.mlp.c_fc\": colwise\n"
                      "      \"transformer.h.*.mlp.c_proj\": rowwise\n"
                      "      \"transformer.wte\": colwise\n",
             "one": "mesh: {dp_shard: 1}\n"}
    for name, text in plans.items():
        with open(os.path.join(tmp, name + ".yaml"), "w") as f:
            f.write(text)
    src, layouts = ck0, {}
    for name, files in (("fsdp4", 4), ("tp2x2", 4), ("one", 1)):
        dst = os.path.join(tmp, "ck-" + name)
        p = tool_run("reshard", src, "--to", os.path.join(tmp, name + ".yaml"), dst)
        ok = p.returncode == 0 and "%d file%s" % (files, "" if files == 1 else "s") in p.stdout
        check(ok, "reshard %s -> %s: %s" % (os.path.basename(src), name,
                                            (p.stdout + p.stderr).strip()[-300:]))
        if not ok:
            return
        got, layouts[name] = assemble(os.path.join(dst, "model"))
        same = got.keys() == tensors.keys() and all(
            got[k][0] == tensors[k][0] and got[k][1] == tensors[k][1] and got[k][2] == tensors[k][2]
            for k in tensors)
        check(same and len(layouts[name]) == files,
              "%s: %d files whose chunks put together are the original tensors bit for bit"
              % (name, len(layouts[name])))
        p = tool_run("verify", dst)
        check(p.returncode == 0 and "0 tensors damaged" in p.stdout, "verify %s" % name)
        src = dst
    # the boxes: fsdp4 splits rows 13,13,13,11 (wte's 50) and 6 each (ln's 24); tp2x2 splits a
    # colwise linear's rows on tp then (strided) on dp, a rowwise one's columns on tp and rows
    # on dp, the colwise embedding's columns on tp and rows on dp, a rowwise bias on dp only
    want = {"fsdp4": {"transformer.wte.weight": [[13, 24], [13, 24], [13, 24], [11, 24]],
                      "transformer.ln_f.bias": [[6]] * 4},
            "tp2x2": {"transformer.h.0.mlp.c_fc.weight": [[6, 96]] * 4,
                      "transformer.h.0.mlp.c_fc.bias": [[24]] * 4,
                      "transformer.h.1.mlp.c_proj.weight": [[48, 12]] * 4,
                      "transformer.h.1.mlp.c_proj.bias": [[12], None, [12], None],
                      "transformer.wte.weight": [[25, 12]] * 4,
                      "transformer.h.0.attn.c_attn.weight": [[12, 72], None, [12, 72], None]}}
    for plan, boxes in want.items():
        files = sorted(layouts[plan])
        for t, shapes in boxes.items():
            have = [layouts[plan][f].get(t) for f in files]
            check(have == shapes, "%s: %s per rank %s (want %s)" % (plan, t, have, shapes))
    # back to Hugging Face: the same bytes, the same config but torch_dtype
    out = os.path.join(tmp, "hf-out")
    p = tool_run("export-hf", os.path.join(tmp, "ck-one"), out)
    ok = p.returncode == 0
    if ok:
        h, data = st_read(os.path.join(out, "model.safetensors"))
        same = set(k for k in h if k != "__metadata__") == set(tensors) and all(
            h[k]["dtype"] == tensors[k][0] and h[k]["shape"] == tensors[k][1] and
            data[h[k]["data_offsets"][0]:h[k]["data_offsets"][1]] == tensors[k][2]
            for k in tensors)
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        ok = same and cfg == config
    check(ok, "export-hf after 4 -> 2x2 -> 1: every tensor and config.json as imported, bit "
              "for bit")
    # what cannot be placed says why, and writes nothing
    bad = os.path.join(tmp, "bad.yaml")
    with open(bad, "w") as f:
        f.write(plans["tp2x2"].replace("mlp.c_fc\": colwise", "ln_1\": colwise"))
    for extra, plan, want in [(["--embedding", "transformer.h.*.mlp.c_fc"], "tp2x2",
                               r"mlp\.c_fc.*an embedding with a bias is not supported"),
                              ([], "bad", r"ln_1.*colwise applies to linear and embedding layers, "
                                          r"not a layernorm")]:
        p = tool_run("reshard", os.path.join(tmp, "ck-fsdp4"), "--to",
                     os.path.join(tmp, plan + ".yaml"), os.path.join(tmp, "never"), *extra)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not os.path.exists(os.path.join(tmp, "never")) and
              not glob.glob(os.path.join(tmp, "never.tmp*")),
              "reshard %s %s: exit %d, says /%s/ (%s)" % (plan, " ".join(extra), p.returncode,
                                                         want, p.stderr.strip()[-200:]))


def ckpt_corrupt():
    """Damaged checkpoints given to fsdp-train's checkpoint.load: a message naming the file
    (and the tensor where there is one), a non-zero exit on every rank, no crash."""
    import struct
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "fsdp-grad-accum.yaml")
    ck = os.path.join(tmp, "ck")
    p, _ = run(2, [cfg, "--set", "train.steps=2", "--set", "checkpoint.dir=" + ck,
                   "--set", "checkpoint.interval=2"])
    check(p.returncode == 0, "fsdp-grad-accum on 2 ranks saves a checkpoint")
    good = os.path.join(ck, "step-00000002")

    def flip(raw):
        (n,) = struct.unpack("<Q", raw[:8])
        h = json.loads(raw[8:8 + n])
        b, e = h["model.layers.1.mlp.down_proj.weight"]["data_offsets"]
        pos = 8 + n + (b + e) // 2
        return raw[:pos] + bytes([raw[pos] ^ 0x10]) + raw[pos + 1:]

    # (the damage table, mode ckpt-damage, runs every damage through every command; these
    # few run with the sanitizers' leak check too)
    cases = [
        ("truncated file", lambda raw: raw[:len(raw) // 2],
         r"shard-00000\.safetensors: tensor '[^']+' ends at byte \d+, past the"),
        ("flipped data byte", flip,
         r"shard-00000\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight': "
         r"checksum mismatch"),
        ("malformed header JSON", lambda raw: raw[:8] + b"{]" + raw[10:],
         r"shard-00000\.safetensors.*(JSON|header)"),
        ("a shape changed", header_edit(
            lambda h: h["model.layers.0.mlp.up_proj.weight"].__setitem__("shape", [64, 80])),
         r"shard-00000\.safetensors: the header does not match its checksum"),
    ]
    for name, damage, want in cases:
        bad = os.path.join(tmp, name.replace(" ", "-"))
        shutil.copytree(good, bad)
        path = os.path.join(bad, "model", "shard-00000.safetensors")
        with open(path, "rb") as f:
            raw = f.read()
        with open(path, "wb") as f:
            f.write(damage(raw))
        try:
            p, secs = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + bad],
                          timeout=60)
        except subprocess.TimeoutExpired:
            check(False, "%s: finishes (timed out)" % name)
            continue
        said = [l for l in p.stderr.splitlines() if re.search(want, l)]
        crashed = re.search(r"AddressSanitizer|runtime error|Segmentation|core dumped", p.stderr)
        ok = p.returncode != 0 and said and not crashed and re.search(RANKS, said[0])
        check(ok, "%s: exit %d, a rank says /%s/" % (name, p.returncode, want))
        if not ok:
            print(p.stderr[-2000:])
    # a shard header with 100,000 extra tensors: parsed in O(n log n), the load goes on (the
    # folder's integrity records removed, as another tool would write it: read unchecked)
    many = os.path.join(tmp, "many-tensors")
    shutil.copytree(good, many)
    strip_records(many)
    path = os.path.join(many, "model", "shard-00000.safetensors")
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    h, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    for i in range(100000):
        h["extra.%06d" % i] = {"dtype": "F32", "shape": [1],
                               "data_offsets": [len(data) + 4 * i, len(data) + 4 * i + 4]}
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data + b"\0" * 400000)
    p, secs = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + many],
                  timeout=120)
    check(p.returncode == 0 and secs < 60 and "has no checksums (written by another tool)" in p.stdout,
          "a shard of 100,000 tensors loads in %.1f s, unchecked and said so (exit %d)"
          % (secs, p.returncode))
    # a non-finite step stops the run before the optimizer applies it: the checkpoints on disk
    # stay finite (keep: 1 never prunes the last finite one for a broken one) and resume
    nf = os.path.join(tmp, "nonfinite")
    p, _ = run(2, [cfg, "--set", "optim.lr=1000", "--set", "train.steps=40", "--set",
                   "checkpoint.dir=" + nf, "--set", "checkpoint.interval=2", "--set",
                   "checkpoint.keep=1"], timeout=120)
    said = re.findall(RANKS + r" step (\d+): the loss is \S+ and the gradient norm \S+; "
                      r"stopping before the optimizer applies the step", p.stderr)
    left = sorted(os.listdir(nf)) if os.path.isdir(nf) else []
    bad_step = int(said[0][1]) if said else 0
    check(p.returncode != 0 and set().union(*[rank_set(r) for r, _ in said]) == {"0", "1"} and
          left == ["step-%08d" % ((bad_step - 1) // 2 * 2)],
          "optim.lr=1000: both ranks stop at the first non-finite step (%d), the newest "
          "checkpoint before it is kept (%s)" % (bad_step, left))
    if left:
        p, _ = run(2, [cfg, "--set", "train.steps=%d" % (int(left[0][5:]) + 1), "--set",
                       "checkpoint.load=" + os.path.join(nf, left[0])], timeout=120)
        check(p.returncode == 0 and re.search(r"loss\s+\d", p.stdout) is not None,
              "the checkpoint kept after the non-finite step resumes with a finite loss")
    p, _ = run(2, [cfg, "--set", "optim.lr=1000", "--set", "train.steps=12", "--set",
                   "train.nonfinite=skip"], timeout=120)
    check(p.returncode == 0 and "is skipped (train.nonfinite: skip)" in p.stderr,
          "train.nonfinite: skip skips the non-finite steps and finishes")
    # load: auto says which newer folder it passed over, and why; an unfinished save (.tmp) of
    # a job that died is removed at the start
    os.makedirs(os.path.join(ck, "step-00000009"))
    os.makedirs(os.path.join(ck, "step-00000011.tmp"))
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.dir=" + ck, "--set",
                   "checkpoint.load=auto"], timeout=120)
    check(p.returncode == 0 and "resumed from %s" % good in p.stdout and
          re.search(r"checkpoint\.load=auto: skipped the newer \S+step-00000009 \(no "
                    r"train_state\.json", p.stderr) is not None and
          re.search(r"removed 1 unfinished save \(step-\*\.tmp\)", p.stderr) is not None and
          not os.path.exists(os.path.join(ck, "step-00000011.tmp")),
          "load: auto resumes the newest complete checkpoint and names the newer one it "
          "skipped; the unfinished save is removed")
    # a rank that stops answering (SIGSTOP) mid-training: the collective watchdog ends the job
    cmd = [MPIRUN] + MPI_ARGS + ["-n", "3", EXE, cfg, "--set", "mesh.dp_shard=3", "--set",
                                 "data.batch_size=2", "--set", "train.steps=1000000", "--set",
                                 "train.comm_timeout_s=3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    import threading
    lines, training = [], threading.Event()

    def read_stdout():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step "):
                training.set()
    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    training.wait(timeout=120)  # the first step is done: every rank is in the training loop
    ranks = sorted(int(x) for x in subprocess.run(["pgrep", "-P", str(proc.pid)],
                                                  capture_output=True, text=True).stdout.split())
    os.kill(ranks[-1], signal.SIGSTOP)
    t = time.time()
    try:
        err = proc.stderr.read() if proc.wait(timeout=60) is not None else ""
        secs = time.time() - t
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        err = proc.stderr.read()
        secs = None
    kill_session(proc.pid)
    said = ranks_saying(err, r"has not completed in 3 s: another rank stopped answering")
    check(secs is not None and secs < 30 and proc.returncode != 0 and {"0", "1"} <= said,
          "a rank stopped with SIGSTOP: the job ends in %s s, the waiting ranks name the "
          "watchdog (%s)" % ("%.1f" % secs if secs else "never", sorted(said)))
    # fsdp-ckpt verify reads every chunk whole: the good checkpoint passes, the flipped byte is
    # named (a resharding load, which reads only the rows it needs, would not see it)
    p = sh([TOOL, "verify", good], timeout=120)
    check(p.returncode == 0 and re.search(r"(\d+) chunks match their checksums, 0 saved without "
                                          r"one, 0 tensors damaged", p.stdout) is not None,
          "verify passes the good checkpoint (model and optimizer state)")
    p = sh([TOOL, "verify", os.path.join(tmp, "flipped-data-byte")], timeout=120)
    check(p.returncode != 0 and re.search(
        r"shard-00000\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight': "
        r"checksum mismatch", p.stderr) is not None and "1 tensors damaged" in p.stdout,
          "verify names the flipped tensor and exits non-zero")
    # checkpoint.verify: a load under another plan (4 ranks: partial chunks, unchecked by the
    # load itself) checks every chunk first, the tensors split over the ranks
    p, _ = run(4, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + good,
                   "--set", "checkpoint.verify=true"], timeout=120)
    m = re.search(r"checkpoint\.verify: (\d+) chunks read whole, every block matches its "
                  r"checksum", p.stdout)
    check(p.returncode == 0 and m is not None and int(m.group(1)) > 0,
          "checkpoint.verify passes the good checkpoint on 4 ranks")
    # the header's counts; a resume under another global batch is said; checkpoint.verify on
    # files without checksums says there is nothing to verify
    p, _ = run(1, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + good,
                   "--set", "mesh.dp_shard=1", "--set", "data.batch_size=3"], timeout=120)
    check(p.returncode == 0 and "world 1 rank on" in p.stdout and re.search(
        r"fully_shard: 3 groups \(2 units \+ root\)", p.stdout) is not None,
          "the header counts one rank and 3 groups: 2 layer units and the root")
    m = re.search(r"warning: \S+ was saved with a global batch of (\d+) samples, this run takes "
                  r"(\d+)", p.stderr)
    check(m is not None and m.group(2) == "12" and m.group(1) != "12",
          "a resume under another global batch says so (%s)" % str(m.groups() if m else None))
    bare = os.path.join(tmp, "no-records")
    shutil.copytree(good, bare)
    strip_records(bare)
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + bare,
                   "--set", "checkpoint.verify=true"], timeout=120)
    check(p.returncode == 0 and "checkpoint.verify: nothing to verify (the files carry no "
          "checksums)" in p.stdout, "checkpoint.verify on files without checksums says so")
    check("global batch" not in p.stderr, "a resume under the saved global batch: no warning")
    check("reading the data" not in p.stderr, "a resume in the saved data order: no warning")
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + good,
                   "--set", "data.shuffle=true", "--set", "train.seed=7"], timeout=120)
    check(p.returncode == 0 and re.search(
        r"warning: \S+ was saved reading the data in file order, samples of (\d+) tokens; this "
        r"run reads it shuffled by train\.seed 7, samples of \1 tokens", p.stderr) is not None,
          "a resume under another data order says so")
    p, _ = run(4, [cfg, "--set", "train.steps=3", "--set",
                   "checkpoint.load=" + os.path.join(tmp, "flipped-data-byte"),
                   "--set", "checkpoint.verify=true"], timeout=120)
    ranks = ranks_saying(p.stderr,
                         r"model\.layers\.1\.mlp\.down_proj\.weight': checksum mismatch")
    check(p.returncode != 0 and ranks == {"0", "1", "2", "3"},
          "checkpoint.verify stops a resharding load of the flipped byte on every rank (%s)"
          % sorted(ranks))


def ckpt_damage():
    """The damage table: each damage of a 2-rank checkpoint given to a resume on 1 and on 3
    ranks and to every fsdp-ckpt command that reads a checkpoint. Each outcome is one of:
    refused (non-zero exit, the expected message naming the file, no output left behind),
    ok (the command does not read what was damaged, or the folder declares no checksums and
    says so), or wrong: a crash, a hang, or an exit 0 where the damage should be refused."""
    import struct
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "fsdp-grad-accum.yaml")
    ck = os.path.join(tmp, "ck")
    p, _ = run(2, [cfg, "--set", "train.steps=4", "--set", "checkpoint.dir=" + ck,
                   "--set", "checkpoint.interval=2"])
    check(p.returncode == 0, "fsdp-grad-accum on 2 ranks saves checkpoints after steps 2 and 4")
    good, later = os.path.join(ck, "step-00000002"), os.path.join(ck, "step-00000004")

    def model_file(folder, k=0):
        return os.path.join(folder, "model", "shard-%05d.safetensors" % k)

    def sharding(h, f):  # edits DCP_SHARDING_INFO in place
        info = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
        f(info)
        h["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info, separators=(",", ":"))

    def integrity(h, f):
        rec = json.loads(h["__metadata__"]["FSDPC_INTEGRITY"])
        f(rec)
        h["__metadata__"]["FSDPC_INTEGRITY"] = json.dumps(rec, separators=(",", ":"))

    def flip(path, name="model.layers.1.mlp.down_proj.weight"):
        def f(raw):
            (n,) = struct.unpack("<Q", raw[:8])
            b, e = json.loads(raw[8:8 + n])[name]["data_offsets"]
            pos = 8 + n + (b + e) // 2
            return raw[:pos] + bytes([raw[pos] ^ 0x10]) + raw[pos + 1:]
        edit_file(path, f)

    def rename(h):
        h["model.norm.weighx"] = h.pop("model.norm.weight")
        sharding(h, lambda i: i.__setitem__("model.norm.weighx", i.pop("model.norm.weight")))

    def reshape(h):  # same bytes, another shape: [80, 64] stored as [64, 80]
        h["model.layers.0.mlp.up_proj.weight"]["shape"] = [64, 80]

    def retype(h):  # same size, an integer dtype
        h["model.layers.0.self_attn.q_proj.weight"]["dtype"] = "I32"

    def six_dims(h):  # the reader's bound on dimensions: a 6-D chunk once wrote out of bounds
        name = "model.layers.0.mlp.up_proj.weight"
        h[name]["shape"] = [1, 1, 1, 1] + h[name]["shape"]
        sharding(h, lambda i: i[name].__setitem__("saved_offsets",
                                                  [0, 0, 0, 0] + i[name]["saved_offsets"]))

    def onto_other(h):  # rank 1's chunk of the embedding declared at rank 0's offsets
        sharding(h, lambda i: i["model.embed_tokens.weight"].__setitem__("saved_offsets", [0, 0]))

    def block_hash(rec):
        rec["blocks"] = ("0" if rec["blocks"][0] != "0" else "1") + rec["blocks"][1:]

    def drop_record(h):
        h["__metadata__"].pop("FSDPC_INTEGRITY")

    def legacy(folder, drop=None):  # an earlier version's files: a CRC-32 per chunk, no record
        import zlib
        edit_state(folder, lambda st: st.pop("integrity"))
        for path in [os.path.join(folder, sub, f) for sub in ("model", "optim")
                     for f in os.listdir(os.path.join(folder, sub))]:
            with open(path, "rb") as x:
                raw = x.read()
            (n,) = struct.unpack("<Q", raw[:8])
            h, data = json.loads(raw[8:8 + n]), raw[8 + n:]
            h["__metadata__"].pop("FSDPC_INTEGRITY")

            def crcs(info):
                for k, v in h.items():
                    if k != "__metadata__" and k != drop:
                        b, e = v["data_offsets"]
                        info[k]["crc32"] = "%08x" % zlib.crc32(data[b:e])
            sharding(h, crcs)
            edit_header(path, lambda g: g.update(h))

    def swap_folder(folder, sub):  # the whole folder of the later save
        shutil.rmtree(os.path.join(folder, sub))
        shutil.copytree(os.path.join(later, sub), os.path.join(folder, sub))

    m0, m1 = (lambda d: model_file(d, 0)), (lambda d: model_file(d, 1))
    header_sum = r"shard-0000%d\.safetensors: the header does not match its checksum"
    ALL = ("resume-1", "resume-3", "inspect", "verify", "export-hf", "reshard")
    READERS = ("resume-1", "resume-3", "verify", "export-hf", "reshard")  # they read the data
    cases = [  # (damage, how, message, the operations that must refuse it)
        ("truncated file", lambda d: edit_file(m0(d), lambda raw: raw[:len(raw) // 2]),
         r"shard-00000\.safetensors: tensor '[^']+' ends at byte \d+, past the", ALL),
        ("flipped data byte", lambda d: flip(m0(d)),
         r"shard-00000\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight': "
         r"checksum mismatch in block 1 of 1", READERS),
        ("malformed header JSON", lambda d: edit_file(m0(d), lambda raw: raw[:8] + b"{]" + raw[10:]),
         r"shard-00000\.safetensors.*(JSON|header)", ALL),
        ("header length past the end",
         lambda d: edit_file(m0(d), lambda raw: struct.pack("<Q", len(raw) * 4) + raw[8:]),
         r"shard-00000\.safetensors.*header", ALL),
        ("tensor renamed", lambda d: edit_header(m0(d), rename), header_sum % 0, ALL),
        ("shape changed", lambda d: edit_header(m0(d), reshape), header_sum % 0, ALL),
        ("dtype changed", lambda d: edit_header(m0(d), retype), header_sum % 0, ALL),
        ("a chunk declared 6-D", lambda d: edit_header(m0(d), six_dims),
         r"shard-00000\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has 6 "
         r"dimensions; at most 5 are supported", ALL),
        ("saved_offsets moved onto another chunk's", lambda d: edit_header(m1(d), onto_other),
         header_sum % 1, ALL),
        ("a block checksum changed",
         lambda d: edit_header(m0(d), lambda h: integrity(h, block_hash)), header_sum % 0, ALL),
        ("integrity record removed", lambda d: edit_header(m0(d), drop_record),
         r"shard-00000\.safetensors has no FSDPC_INTEGRITY record while "
         r"shard-00001\.safetensors has one", ALL),
        ("record removed and a byte flipped",
         lambda d: (edit_header(m0(d), drop_record), flip(m0(d))),
         r"shard-00000\.safetensors has no FSDPC_INTEGRITY record", ALL),
        ("shard file deleted", lambda d: os.remove(m1(d)),
         r"shard-00001\.safetensors is missing \(the checkpoint's files list it\)", ALL),
        ("a file added", lambda d: shutil.copy(m0(d), model_file(d, 2)),
         r"shard-00002\.safetensors is not one of the files this checkpoint lists", ALL),
        ("a file of another save", lambda d: shutil.copy(m1(later), m1(d)),
         r"shard-00000\.safetensors and shard-00001\.safetensors belong to different saves",
         ALL),
        ("no records (another tool's folder), shape changed",
         lambda d: (strip_records(d), edit_header(m0(d), reshape)),
         r"the chunks of tensor 'model\.layers\.0\.mlp\.up_proj\.weight' hold \d+ elements, "
         r"its shape \[160,80\] has 12800", ALL),
        ("no records, saved_offsets moved onto another chunk's",
         lambda d: (strip_records(d), edit_header(m1(d), onto_other)),
         r"the chunks of tensor 'model\.embed_tokens\.weight' hold 16384 elements, its shape "
         r"\[128,64\] has 8192", ALL),
        ("train_state.json: the step changed",
         lambda d: edit_state(d, lambda st: st.__setitem__("step", 3)),
         r"train_state\.json does not match its checksum", ALL),
        ("train_state.json: its record removed",
         lambda d: edit_state(d, lambda st: st.pop("integrity")),
         r"train_state\.json has no integrity record while the files of model/ have one", ALL),
        ("optim/ of another save", lambda d: swap_folder(d, "optim"),
         r"optim was not written by the save that wrote \S+train_state\.json", ALL),
        ("model/ of another save", lambda d: swap_folder(d, "model"),
         r"model was not written by the save that wrote \S+train_state\.json", ALL),
        ("an earlier version's files (CRC-32s), a byte flipped",
         lambda d: (legacy(d), flip(m0(d))),
         r"shard-00000\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight': "
         r"checksum mismatch in block 1 of 1", READERS),
        ("an earlier version's files, a CRC-32 removed",
         lambda d: legacy(d, drop="model.norm.weight"),
         r"tensor 'model\.norm\.weight' has no crc32 while the other chunks of the folder",
         ALL),
        ("no records, a byte flipped: read unchecked, said once",
         lambda d: (strip_records(d), flip(m0(d))), r"no checksums \(written by another tool\)", ()),
    ]
    def one(k, op):
        """(outcome, what to report) of operation op on damage k"""
        name, _, want, refuse = cases[k]
        bad = os.path.join(tmp, "case-%02d" % k)
        out = os.path.join(tmp, "out-%02d-%s" % (k, op))
        try:
            if op.startswith("resume"):
                p, _ = run(int(op[-1]), [cfg, "--set", "train.steps=3", "--set",
                                         "checkpoint.load=" + bad], timeout=120)
            else:
                args = {"inspect": [bad], "verify": [bad], "export-hf": [bad, out],
                        "reshard": [bad, "--to", cfg, out, "--world", "3"]}[op]
                p = sh([TOOL, op] + args, timeout=120)
        except subprocess.TimeoutExpired:
            return "hang", "%s / %s: finishes (timed out)" % (name, op), ""
        crashed = p.returncode < 0 or re.search(
            r"AddressSanitizer|runtime error|Segmentation|core dumped|signal \d+", p.stderr)
        said = re.search(want, p.stderr + p.stdout) is not None
        left = os.path.exists(out) or glob.glob(out + ".tmp*")
        if crashed:
            outcome = "crash"
        elif op in refuse:
            outcome = ("refused" if p.returncode != 0 and said and not left and
                       (not op.startswith("resume") or re.search(RANKS, p.stderr)) else
                       "silent" if p.returncode == 0 else "other")
        elif not refuse:  # folders without checksums: read unchecked, said once (per folder)
            said = len(re.findall(want, p.stdout + p.stderr))
            outcome = ("ok" if p.returncode == 0 and
                       (said == 1 if op.startswith("resume") else 1 <= said <= 2) else "other")
        else:  # the damage is outside what op reads (inspect reads no tensor data)
            outcome = "ok" if p.returncode == 0 else "other"
        what = "%s / %s: %s (exit %d; expected %s /%s/)" % (
            name, op, outcome, p.returncode, "refused with" if op in refuse else "ok", want)
        return outcome, what, "" if outcome in ("refused", "ok") else p.stdout[-1500:] + \
            p.stderr[-1500:]

    for k, (name, damage, _, _) in enumerate(cases):
        bad = os.path.join(tmp, "case-%02d" % k)
        shutil.copytree(good, bad)
        damage(bad)
    import concurrent.futures  # mostly launch latency: three at a time on two cores
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda kop: one(*kop),
                                [(k, op) for k in range(len(cases)) for op in ALL]))
    counts = {"refused": 0, "ok": 0, "crash": 0, "hang": 0, "silent": 0, "other": 0}
    rows = []
    for k, (name, _, _, _) in enumerate(cases):
        row = []
        for j, op in enumerate(ALL):
            outcome, what, detail = results[k * len(ALL) + j]
            counts[outcome] += 1
            row.append(outcome)
            check(outcome in ("refused", "ok"), what)
            if detail:
                print(detail)
        rows.append((name, row))
    print("\n%-52s %s" % ("damage", " ".join("%-9s" % op for op in ALL)))
    for name, row in rows:
        print("%-52s %s" % (name[:52], " ".join("%-9s" % x for x in row)))
    print("damage table: %d damages x %d operations: %d refused, %d ok, %d crashes, %d hangs, "
          "%d silent-wrong, %d other" % (len(cases), len(ALL), counts["refused"], counts["ok"],
                                         counts["crash"], counts["hang"], counts["silent"],
                                         counts["other"]))


def rank_pids(marker):
    """The fsdp-train processes (not mpirun) whose command line holds marker."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                args = f.read().split(b"\0")
            exe = os.path.basename(os.readlink("/proc/%s/exe" % pid))
        except OSError:
            continue
        if exe == "fsdp-train" and any(marker.encode() in a for a in args):
            out.append(int(pid))
    return out


def start(n, args, marker):
    """fsdp-train under mpirun (n > 0) or alone (n == 0) in a session of its own; returns the
    process and a list that fills with the numbers of the step lines it prints."""
    import threading
    if n:
        cmd = [MPIRUN] + MPI_ARGS + ["-n", str(n), EXE] + args
    else:
        cmd = [EXE] + args
    proc = subprocess.Popen(cmd + ["--set", "log.metrics=" + marker], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    steps, out, err = [], [], []

    def read():
        for line in proc.stdout:
            out.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if m:
                steps.append(int(m.group(1)))

    def read_err():
        for line in proc.stderr:
            err.append(line)
    proc.readers = [threading.Thread(target=f, daemon=True) for f in (read, read_err)]
    for t in proc.readers:
        t.start()
    proc.lines, proc.err_lines = out, err
    return proc, steps


def wait_step(steps, k, proc, limit=120):
    t = time.time()
    while (not steps or steps[-1] < k) and proc.poll() is None and time.time() - t < limit:
        time.sleep(0.02)
    return bool(steps) and steps[-1] >= k


def finish(proc, limit=120):
    """Waits for a process of start(): its exit status (None if it had to be killed), its
    standard output and its standard error."""
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()
        rc = None
    for t in proc.readers:  # to the end of both pipes
        t.join(timeout=30)
    err = "".join(proc.err_lines)
    if SANITIZER_REPORT.search(err):
        check(False, "%s: ends without a sanitizer report" % proc.args[0])
        print(err[-3000:])
    return rc, "".join(proc.lines), err


def operations():
    """Runs that survive operations: the last step always saved; signals and train.time_limit
    stop at a step boundary, save, and resume bit-identically; one job per checkpoint folder;
    late refusals made before the first step and by --dry-run; removals never follow links and
    outputs never replace inputs."""
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "fsdp.yaml")
    debug = os.path.join(ROOT, "configs", "debug.yaml")
    data = os.path.join(ROOT, "data", "corpus.txt")

    def saved(folder):
        return sorted(d for d in os.listdir(folder) if d.startswith("step-"))

    # 1. the last step is always saved: no interval, and steps past the last interval
    for sets, want in ((["train.steps=3"], ["step-00000003"]),
                       (["train.steps=12", "checkpoint.interval=10"],
                        ["step-00000010", "step-00000012"])):
        ck = os.path.join(tmp, "last-%d" % len(sets))
        args = [debug, "--set", "checkpoint.dir=" + ck]
        for kv in sets:
            args += ["--set", kv]
        p, _ = run(1, args)
        got = saved(ck) if os.path.isdir(ck) else []
        check(p.returncode == 0 and got == want,
              "checkpoint.dir with %s leaves %s (%s)" % (" ".join(sets), want, got))

    # 2. signals and the time limit, on 4 ranks: a save at the step boundary, exit 75, and a
    # resume whose losses equal an uninterrupted run's bit for bit
    S = 200
    ref = os.path.join(tmp, "ref.jsonl")
    p, ref_secs = run(4, [cfg, "--set", "train.steps=%d" % S, "--metrics", ref])
    ref_losses = [r["loss"] for r in losses(ref)] if p.returncode == 0 else []
    check(len(ref_losses) == S, "the uninterrupted run of %d steps (%.1f s)" % (S, ref_secs))

    def interrupted(name, deliver, sets=()):
        ck, m = os.path.join(tmp, "ck-" + name), os.path.join(tmp, name + ".jsonl")
        args = [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck,
                "--set", "checkpoint.interval=1000", "--set", "log.interval=1"]
        for kv in sets:
            args += ["--set", kv]
        proc, steps = start(4, args, m)
        if deliver:
            wait_step(steps, 20, proc)
            deliver(proc, m)
        rc, out, err = finish(proc)
        hit = re.search(r"(interrupted by (SIG\w+)|stopped before train\.time_limit \(\d+ s\)) at "
                        r"step (\d+); saved (\S+) \(resume with checkpoint\.load: auto\)", out)
        stopped = hit is not None and 0 < int(hit.group(3)) < S
        check(rc not in (0, None) and stopped and os.path.isdir(hit.group(4)) and
              saved(ck)[-1:] == [os.path.basename(hit.group(4))],
              "%s: the job says where it stopped, saves that step and exits non-zero (exit %s; "
              "%s)" % (name, rc, hit.group(0) if hit else err[-300:]))
        if not stopped:
            return hit
        p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck,
                       "--set", "checkpoint.load=auto", "--metrics", m])
        got = [r["loss"] for r in losses(m)] if p.returncode == 0 else []
        check(len(got) == S and got == ref_losses,
              "%s: resumed from step %s with checkpoint.load: auto, the losses equal the "
              "uninterrupted run's bit for bit" % (name, hit.group(3)))
        return hit

    def to_ranks(sig, first_only=False):
        def deliver(proc, marker):
            pids = sorted(rank_pids(marker))
            for pid in pids[:1] if first_only else pids:
                os.kill(pid, sig)
        return deliver

    hit = interrupted("sigterm-every-rank", to_ranks(signal.SIGTERM))
    check(hit is not None and hit.group(2) == "SIGTERM", "SIGTERM is named")
    if os.environ.get("FSDPC_TEST_SANITIZED"):  # the same code paths as the one above
        print("sanitized build: SIGUSR1 through mpirun, SIGTERM to one rank, with async saves "
              "and the time limit run in the plain build")
    else:
        hit = interrupted("sigusr1-to-mpirun", lambda proc, m: os.kill(proc.pid, signal.SIGUSR1))
        check(hit is not None and hit.group(2) == "SIGUSR1",
              "SIGUSR1 forwarded by mpirun is named")
        interrupted("sigterm-one-rank", to_ranks(signal.SIGTERM, first_only=True))
        hit = interrupted("sigterm-async", to_ranks(signal.SIGTERM),
                          ["checkpoint.async=true", "checkpoint.interval=7"])
        check(hit is not None and int(hit.group(3)) > 7,
              "with checkpoint.async, the stop's save follows the interval saves in flight")
        hit = interrupted("time-limit", None, ["train.time_limit=%.2f" % (ref_secs / 2)])
        check(hit is not None and hit.group(1).startswith("stopped before train.time_limit"),
              "train.time_limit stops the run before it")

    # a second SIGTERM during the save: exits at once (128 + 15); the previous checkpoint
    # stays complete and loads; the unfinished save is removed at the next start
    ck = os.path.join(tmp, "ck-second")
    big = [debug, "--set", "model.dim=512", "--set", "model.n_layers=6", "--set",
           "model.ffn_dim=1376", "--set", "model.n_heads=8", "--set", "model.n_kv_heads=4",
           "--set", "data.batch_size=1", "--set", "data.seq_len=16", "--set", "log.interval=1",
           "--set", "checkpoint.dir=" + ck, "--set", "train.steps=100000"]
    proc, steps = start(0, big + ["--set", "checkpoint.interval=3"], os.path.join(tmp, "2.jsonl"))
    wait_step(steps, 4, proc)
    proc.send_signal(signal.SIGTERM)
    t, seen = time.time(), False
    while time.time() - t < 60 and proc.poll() is None:
        if glob.glob(os.path.join(ck, "step-*.tmp", "*")):
            proc.send_signal(signal.SIGTERM)
            seen = True
            break
        time.sleep(0.001)
    rc, out, err = finish(proc)
    check(seen and rc == 128 + signal.SIGTERM and saved(ck)[:1] == ["step-00000003"],
          "a second SIGTERM during the save exits at once with 143 (exit %s, %s)" % (rc, saved(ck)))
    p, _ = run(1, big + ["--set", "train.steps=4", "--set", "checkpoint.load=auto",
                         "--set", "checkpoint.verify=true"])
    check(p.returncode == 0 and "resumed from %s/step-00000003" % ck in p.stdout and
          not glob.glob(os.path.join(ck, "step-*.tmp")),
          "the previous checkpoint verifies and resumes; the unfinished save is gone")

    # asynchronous saves: the same training, checkpoints that verify and resume bit-identically
    ck, m = os.path.join(tmp, "ck-async"), os.path.join(tmp, "async.jsonl")
    p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck, "--set",
                   "checkpoint.interval=50", "--set", "checkpoint.async=true", "--metrics", m])
    rows = losses(m) if p.returncode == 0 else []
    check(p.returncode == 0 and [r["loss"] for r in rows] == ref_losses and
          saved(ck) == ["step-00000050", "step-00000100", "step-00000150", "step-00000200"] and
          all(sh([TOOL, "verify", os.path.join(ck, d)], timeout=120).returncode == 0
              for d in saved(ck)) and
          [r["ckpt_saved_step"] for r in rows if "ckpt_saved_step" in r] == [50, 100, 150, 200],
          "checkpoint.async: the losses of a run without saves, every checkpoint committed and "
          "verified (%s)" % saved(ck))
    m2 = os.path.join(tmp, "async-resumed.jsonl")
    p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.load=" +
                   os.path.join(ck, "step-00000050"), "--metrics", m2])
    check(p.returncode == 0 and [r["loss"] for r in losses(m2)] == ref_losses[50:],
          "an asynchronous checkpoint resumes with the losses of the uninterrupted run")
    # a write that fails in the background stops the run at a following step boundary on every
    # rank, naming the file: the ranks' files are limited to 16 MiB (mpirun's own are not), and
    # each rank's shard of this model is 24 MB
    ck = os.path.join(tmp, "ck-async-full")
    args = [cfg, "--set", "train.steps=60", "--set", "checkpoint.dir=" + ck, "--set",
            "checkpoint.interval=10", "--set", "checkpoint.async=true", "--set", "log.interval=1",
            "--set", "model.dim=512", "--set", "model.n_heads=8", "--set", "model.n_kv_heads=4",
            "--set", "model.ffn_dim=1376", "--set", "model.n_layers=4"]
    limited = 'trap "" XFSZ; ulimit -f 16384; exec "$0" "$@"'  # a write past it fails (EFBIG)
    p = sh([MPIRUN] + MPI_ARGS + ["-n", "2", "sh", "-c", limited, EXE] + args, timeout=120)
    last = max([int(x) for x in re.findall(r"^step\s+(\d+)/", p.stdout, re.M)] or [0])
    want = r"\S+step-00000010\.tmp/(model|optim)/shard-0000[01]\.safetensors"
    check(p.returncode != 0 and ranks_saying(p.stderr, want) == {"0", "1"} and 10 <= last < 20
          and saved(ck) == [],
          "checkpoint.async: a background write that fails stops the run after step %d on both "
          "ranks, naming the file; no folder is left" % last)
    if ranks_saying(p.stderr, want) != {"0", "1"}:
        print(p.stderr[-1500:])

    # 3. one job per checkpoint folder
    ck = os.path.join(tmp, "ck-lock")
    a, steps = start(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=100000",
                         "--set", "checkpoint.dir=" + ck, "--set", "checkpoint.interval=20",
                         "--set", "log.interval=1"], os.path.join(tmp, "lock-a.jsonl"))
    wait_step(steps, 25, a)
    p, secs = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "checkpoint.dir=" + ck,
                      "--set", "checkpoint.load=auto"], timeout=60)
    holder = re.search(r"checkpoint\.dir '\S+' is in use by another fsdp-train: pid (\d+) on host",
                       p.stderr)
    check(p.returncode != 0 and holder is not None and int(holder.group(1)) in
          rank_pids(os.path.join(tmp, "lock-a.jsonl")) and "step " not in p.stdout and secs < 30,
          "a second job on the same checkpoint.dir refuses at once, naming the first's pid")
    n = len(steps)
    wait_step(steps, steps[-1] + 5, a)
    check(a.poll() is None and len(steps) > n, "the first job trains on")
    a.send_signal(signal.SIGUSR1)
    rc, _, _ = finish(a)
    good = all(sh([TOOL, "verify", os.path.join(ck, d)], timeout=120).returncode == 0
               for d in saved(ck))
    check(rc == 75 and good and len(saved(ck)) >= 2, "its checkpoints verify (%s)" % saved(ck))
    with open(os.path.join(ck, "fsdp-train.lock"), "w") as f:  # a job killed with -9 left this
        f.write('{"host": "%s", "pid": 999999999, "started": "2026-01-01T00:00:00Z", '
                '"plan": "x.yaml"}' % os.uname().nodename)
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "checkpoint.dir=" + ck,
                   "--set", "checkpoint.load=auto", "--set", "train.steps=%d" %
                   (int(saved(ck)[-1][5:]) + 1)])
    check(p.returncode == 0 and re.search(r"took over the lock of pid 999999999 on host \S+ since "
                                          r"2026-01-01T00:00:00Z \(plan x\.yaml\), which ended "
                                          r"without releasing it \(no longer running\)", p.stderr),
          "a lock left by a dead process is taken over with a note")

    # 4. late refusals: before the first step (no step line), and by --dry-run
    ck = os.path.join(tmp, "ck-newer")
    run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=20", "--set",
            "checkpoint.dir=" + ck, "--set", "checkpoint.interval=2"])
    short = os.path.join(tmp, "short.txt")
    with open(data, "rb") as f, open(short, "wb") as g:
        g.write(f.read()[:65])  # data.seq_len + 1 tokens: one sample, no second start
    cases = [
        ("a rerun into a folder of newer checkpoints",
         ["--set", "checkpoint.dir=" + ck],
         r"checkpoint\.dir '\S+' holds 10 step folders after step 0, where this run starts "
         r"\(the newest: \S+step-00000020\).*checkpoint\.load: auto.*checkpoint\.overwrite: true"),
        ("a rollback to step 18 where step 20 exists",
         ["--set", "checkpoint.dir=" + ck, "--set",
          "checkpoint.load=" + os.path.join(ck, "step-00000018")],
         r"holds 1 step folder after step 18, where this run starts \(the newest: "
         r"\S+step-00000020\)"),
        ("a checkpoint of 2 layers resumed by a 1-layer plan",
         ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"), "--set",
          "model.n_layers=1"],
         r"checkpoint\.load: '\S+step-00000020' was saved with model\.n_layers = 2, the plan "
         r"has 1"),
        ("tied embeddings on an untied checkpoint",
         ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"), "--set",
          "model.tie_embeddings=true"],
         r"was saved with model\.tie_embeddings = false, the plan has true"),
        ("another rope_theta", ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                                "--set", "model.rope_theta=500000"],
         r"was saved with model\.rope_theta = 10000, the plan has 500000"),
        ("another norm_eps", ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                              "--set", "model.norm_eps=1e-6"],
         r"was saved with model\.norm_eps = 1e-05, the plan has 1e-06"),
        ("data of data.seq_len + 1 tokens", ["--set", "data.path=" + short, "--set",
                                              "data.seq_len=64"],
         r"data\.path: '\S+short\.txt' has 65 tokens; a sample needs data\.seq_len \+ 2 = 66"),
        ("eval data of data.seq_len + 1 tokens", ["--set", "eval.path=" + short, "--set",
                                                   "data.seq_len=64"],
         r"eval\.path: '\S+short\.txt' has 65 tokens; a sample needs data\.seq_len \+ 2 = 66"),
    ]
    for name, extra, want in cases:
        for dry in ([], ["--dry-run"]):
            p, secs = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=30"] +
                          extra + dry, timeout=60)
            said = ranks_saying(p.stderr, want) == {"0", "1"}
            check(p.returncode != 0 and said and not re.search(r"^step ", p.stdout, re.M),
                  "%s%s: refused on both ranks before the first step /%s/" %
                  (name, " (--dry-run)" if dry else "", want[:60]))
            if not said:
                print(p.stderr[-800:])
    # checkpoint.overwrite: the rollback runs; the newer folders go once its first save commits
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=20", "--set",
                   "checkpoint.dir=" + ck, "--set", "checkpoint.interval=2", "--set",
                   "checkpoint.load=" + os.path.join(ck, "step-00000016"), "--set",
                   "checkpoint.overwrite=true"])
    check(p.returncode == 0 and saved(ck)[-3:] == ["step-00000016", "step-00000018",
                                                   "step-00000020"] and
          "replaced the step folders after step 16" in p.stderr,
          "checkpoint.overwrite: true rolls back, replacing the newer folders (%s)" % saved(ck))
    # ranks started with different plans: refused at once, naming the keys and the ranks
    for name, a_sets, b_sets, want in (
            ("train.steps", ["train.steps=5"], ["train.steps=8"],
             r"\[rank 1\] this rank's plan differs from rank 0's \(train\.steps: 8 here, 5 on "
             r"rank 0\)"),
            ("model.n_layers", ["model.n_layers=2"], ["model.n_layers=3"],
             r"\[rank 1\] this rank's plan differs from rank 0's \(model\.n_layers: 3 here, 2 "
             r"on rank 0\)")):
        for dry in ([], ["--dry-run"]):
            cmd = [MPIRUN] + MPI_ARGS
            for sets in (a_sets, b_sets):
                cmd += ["-n", "1", EXE, cfg, "--set", "mesh.dp_shard=2"] + dry
                for kv in sets:
                    cmd += ["--set", kv]
                cmd.append(":")
            t = time.time()
            p = sh(cmd[:-1], timeout=60)
            check(p.returncode != 0 and re.search(want, p.stderr) and time.time() - t < 30 and
                  "MPI_ERR" not in p.stderr and not re.search(r"^step ", p.stdout, re.M),
                  "ranks started with different %s%s: refused at once, naming the key" %
                  (name, " (--dry-run)" if dry else ""))

    # folders named as fsdp-train never names them are not its checkpoints: load: auto passes
    # them by; a data.path whose name holds [ but names a file is that file, not a pattern
    kd = os.path.join(tmp, "ck-names")
    run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + kd])
    os.makedirs(os.path.join(kd, "step-6"))
    os.makedirs(os.path.join(kd, "step-123456789012345678901"))
    p, _ = run(1, [debug, "--set", "train.steps=3", "--set", "checkpoint.dir=" + kd, "--set",
                   "checkpoint.load=auto"])
    check(p.returncode == 0 and "resumed from %s/step-00000002" % kd in p.stdout,
          "load: auto passes by folders named step-6 and step-<21 digits>")
    literal, other = os.path.join(tmp, "tok[1].bin"), os.path.join(tmp, "tok1.bin")
    shutil.copy(data, literal)
    with open(data, "rb") as f, open(other, "wb") as g:
        g.write(f.read()[:5000])
    p, _ = run(1, [debug, "--set", "train.steps=1", "--set", "data.path=" + literal])
    check(p.returncode == 0 and re.search(r"data: \S*tok\[1\]\.bin \(160329 tokens\)",
                                          p.stdout),
          "data.path tok[1].bin names that file, not tok1.bin by a pattern")

    # 5. removals never follow links; outputs never replace inputs
    kd = os.path.join(tmp, "ck-keep")
    run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + kd])
    archive = os.path.join(tmp, "archive")
    shutil.copytree(os.path.join(kd, "step-00000002"), archive)
    before = sorted(os.listdir(archive))
    os.symlink(archive, os.path.join(kd, "step-00000001"))
    victim = os.path.join(tmp, "victim")
    os.makedirs(victim)
    with open(os.path.join(victim, "keep.txt"), "w") as f:
        f.write("x")
    os.symlink(victim, os.path.join(kd, "step-00000007.tmp"))
    p, _ = run(1, [debug, "--set", "train.steps=6", "--set", "checkpoint.dir=" + kd, "--set",
                   "checkpoint.interval=2", "--set", "checkpoint.keep=1", "--set",
                   "checkpoint.load=auto"])
    check(p.returncode == 0 and sorted(os.listdir(archive)) == before and
          os.path.exists(os.path.join(victim, "keep.txt")) and sorted(os.listdir(kd)) ==
          ["step-00000006"],
          "checkpoint.keep removes a linked checkpoint's link, not the archive it points to; "
          "a linked unfinished save loses its link, not its target (%s)" % sorted(os.listdir(kd)))
    for op, args in (("export-hf", [os.path.join(ck, "step-00000020")]),
                     ("reshard", [os.path.join(ck, "step-00000020"), "--to", debug]),
                     ("import-hf", None)):
        out = os.path.join(tmp, "out-" + op)
        if op == "import-hf":
            args = [os.path.join(tmp, "out-export-hf")]
        for tail in (".tmp", ".tmp-000000"):
            if not os.path.lexists(out + tail):
                os.symlink(victim, out + tail)
        p = sh([TOOL, op] + args + [out], timeout=120)
        check(p.returncode == 0 and os.path.isdir(out) and
              os.path.exists(os.path.join(victim, "keep.txt")),
              "fsdp-ckpt %s beside OUT.tmp links: writes OUT, leaves what they point to" % op)
        link = os.path.join(tmp, "link-" + op)
        os.symlink(os.path.join(tmp, "nowhere-" + op), link)
        p = sh([TOOL, op] + args + [link], timeout=120)
        check(p.returncode != 0 and "is a symbolic link" in p.stderr and
              not os.path.exists(os.path.join(tmp, "nowhere-" + op)),
              "fsdp-ckpt %s refuses an OUT that is a symbolic link" % op)
    state = os.path.join(ck, "step-00000020", "train_state.json")
    plot = os.path.join(os.path.dirname(EXE), "fsdp-plot")
    plan_tool = os.path.join(os.path.dirname(EXE), "fsdp-plan")
    ds = os.path.join(tmp, "zero3.json")
    shutil.copy(os.path.join(ROOT, "tests", "convert", "deepspeed-zero3.json"), ds)
    plan = os.path.join(tmp, "plan.yaml")  # copies: a failing check must not touch the tree
    shutil.copy(debug, plan)
    tokens = os.path.join(tmp, "tokens.txt")
    shutil.copy(data, tokens)
    mine = [EXE, plan, "--set", "train.steps=1", "--set", "data.path=" + tokens]
    metrics = os.path.join(tmp, "ref.jsonl")
    for name, cmd, victim_file in (
            ("--metrics at the training data", mine + ["--metrics", tokens], tokens),
            ("--metrics at the plan", mine + ["--metrics", plan], plan),
            ("--metrics at the resumed checkpoint's train_state.json",
             mine + ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                     "--metrics", state], state),
            ("--plot at the plan", mine + ["--metrics", os.path.join(tmp, "p.jsonl"), "--plot",
                                           plan], plan),
            ("fsdp-plot -o at its input", [plot, metrics, "-o", metrics], metrics),
            ("fsdp-plan -o at its input", [plan_tool, "convert", ds, "-o", ds], ds),
            ("fsdp-plot -o /dev/null", [plot, metrics, "-o", "/dev/null"], None),
            ("fsdp-plan -o /dev/null", [plan_tool, "convert", ds, "-o", "/dev/null"], None),
            ("--metrics at /dev/null", mine + ["--metrics", "/dev/null"], None)):
        keep = open(victim_file, "rb").read() if victim_file else None
        p = sh(cmd, timeout=120)
        intact = (open(victim_file, "rb").read() == keep if victim_file else
                  os.path.exists("/dev/null") and not os.path.isfile("/dev/null"))
        check(p.returncode != 0 and intact and
              re.search(r"an input of this run|not a regular file|the metrics file it draws",
                        p.stderr),
              "%s: refused, the file intact (%s)" % (name, p.stderr.strip()[-160:]))


def messages():
    """What the header says and the hints a mistaken path gets: activation checkpointing,
    offload on the CPU, the optimizer and its groups (set by --set with a quoted key), a global
    batch that derives grad_accum, data read many times over, checkpoint.load at a run folder or
    a Hugging Face folder, fsdp-ckpt inspect of a run folder, singular counts."""
    tmp = mkdtemp()
    fsdp_yaml = os.path.join(ROOT, "configs", "fsdp.yaml")
    p, _ = run(1, [fsdp_yaml, "--dry-run", "--set", "mesh.dp_shard=1", "--set",
                   "train.activation_checkpointing=true", "--set", "parallelize.fully_shard.offload=true",
                   "--set", 'optim.param_groups."*norm*".weight_decay=0.5', "--set",
                   "optim.param_groups.'model.embed_tokens.*'.lr=1e-4", "--set",
                   "data.global_batch_size=8", "--set", "train.steps=5000"])
    out = p.stdout
    check(p.returncode == 0 and "; activation checkpointing on" in out,
          "the header says activation checkpointing is on")
    check("offload (no effect on the CPU: the state is in host memory already)" in out,
          "the header says offload does nothing on the CPU")
    check(re.search(r'^  optim: AdamW lr 0\.003, betas \(0\.9, 0\.95\), eps 1e-08, weight_decay 0\.1, '
                    r'clip_grad_norm 1; warmup 10 steps, cosine to 0\.1 x lr; param_groups "\*norm\*" '
                    r'weight_decay 0\.5, "model\.embed_tokens\.\*" lr 0\.0001$', out, re.M),
          "--set reaches param_groups patterns with dots in quotes; the header lists the groups")
    check("grad_accum 4 (global batch 8 samples)" in out,
          "data.global_batch_size 8 over 1 rank of 2 samples derives grad_accum 4")
    check(re.search(r"data: note: the run reads 2560000 tokens, 16\.0 times the 160329 the data "
                    r"holds: each sample is seen about 16 times", out),
          "a run that reads its data 16 times over says so")
    p, _ = run(1, [fsdp_yaml, "--dry-run", "--set", "mesh.dp_shard=1"])
    check("activation checkpointing off" in p.stdout and "offload" not in p.stdout and
          "data: note" not in p.stdout, "the header's defaults: checkpointing off, no notes")
    p, _ = run(1, [fsdp_yaml, "--dry-run", "--set", "mesh.dp_shard=2"])
    check("but the world has 1 rank\n" in p.stderr, "one rank is '1 rank' (%s)" % p.stderr.strip())
    # checkpoint.load at a run's folder, at a Hugging Face folder
    ck = os.path.join(tmp, "ck")
    train_args = [fsdp_yaml, "--set", "mesh.dp_shard=1", "--set", "train.steps=2", "--set",
                  "checkpoint.dir=" + ck]
    p, _ = run(1, train_args)
    check(p.returncode == 0 and "done: 2 steps" in p.stdout, "a 2-step run saves its last step")
    os.makedirs(os.path.join(ck, "step-00000004.tmp"))
    hf = os.path.join(tmp, "hf")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write("{}")
    for folder, want in [(ck, r"it is a run's checkpoint folder, the newest complete checkpoint "
                              r".*/ck/step-00000002: name that, or resume the newest with "
                              r"checkpoint\.dir: .*/ck and checkpoint\.load: auto"),
                         (hf, r"it is a Hugging Face folder \(config\.json\): start from its "
                              r"weights with model\.init_from: .*/hf, or convert it with fsdp-ckpt "
                              r"import-hf")]:
        p, _ = run(1, [fsdp_yaml, "--dry-run", "--set", "mesh.dp_shard=1", "--set",
                       "checkpoint.load=" + folder])
        check(p.returncode != 0 and re.search(want, p.stderr),
              "checkpoint.load at %s: the hint /%s/" % (os.path.basename(folder), want[:40]))
    # a sequence-parallel norm whose input no tensor-parallel layer split: refused (taken for
    # Shard(1), the sequence would come back twice as long); with input: replicate it splits it
    # and trains the one-rank losses
    text = open(fsdp_yaml).read().replace("dp_shard: -1", "dp_shard: 1\n  tp: 2").replace(
        "../data/", os.path.join(ROOT, "data") + "/").replace(
        "parallelize:\n", "parallelize:\n  tensor_parallel:\n    sequence_parallel: true\n"
        "    plan: {model.norm: NORM, lm_head: {style: colwise, output: replicate}}\n")
    got = {}
    for name, norm in (("split", "sequence_parallel"),
                       ("replicate", "{style: sequence_parallel, input: replicate}")):
        plan = os.path.join(tmp, "sp-%s.yaml" % name)
        with open(plan, "w") as f:
            f.write(text.replace("NORM", norm))
        metrics = os.path.join(tmp, "sp-%s.jsonl" % name)
        got[name], _ = run(2, [plan, "--set", "train.steps=3", "--metrics", metrics])
        got[name + "-losses"] = [r["loss"] for r in losses(metrics)] if os.path.exists(metrics) else []
    one = os.path.join(tmp, "one.jsonl")
    run(1, [fsdp_yaml, "--set", "mesh.dp_shard=1", "--set", "train.steps=3", "--metrics", one])
    ref = [r["loss"] for r in losses(one)] if os.path.exists(one) else []
    check(got["split"].returncode != 0 and re.search(
        r"tensor parallel: model\.norm \(sequence_parallel\): its input comes from no "
        r"tensor-parallel layer, so every rank holds the whole sequence", got["split"].stderr),
        "a sequence-parallel norm given a replicated activation is refused")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["replicate-losses"], ref)) if ref else 1
    check(got["replicate"].returncode == 0 and len(got["replicate-losses"]) == 3 and len(ref) == 3
          and worst <= 1e-5, "with input: replicate it splits the sequence itself: the one-rank "
          "losses (worst %.2e)" % worst)
    p = sh([TOOL, "inspect", ck], timeout=60)
    check(p.returncode == 0 and re.search(
        r"ck: a run's checkpoint folder, 1 complete checkpoint:\n  step-00000002 +complete\n"
        r"  step-00000004\.tmp +a save that did not finish", p.stdout),
        "fsdp-ckpt inspect of a run's folder lists its checkpoints (%s)" % p.stdout.strip()[:200])


{"configs": lambda: (configs(), pytorch(), plots(), converts(), evaluation(), shuffling()), "errors": errors,
 "dry-run": lambda: (dry_run(), messages()),
 "checkpoint": checkpoints, "gpu": gpu, "gpu-multi": gpu_multi, "ckpt-tool": lambda: (ckpt_tool(), ckpt_any_model()),
 "ckpt-corrupt": ckpt_corrupt, "ckpt-damage": ckpt_damage, "operations": operations}[MODE]()
for d in TEMPS:
    shutil.rmtree(d, ignore_errors=True)
print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
