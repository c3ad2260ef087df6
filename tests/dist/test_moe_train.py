#!/usr/bin/env python3
"""A model with a mixture-of-experts block (moe_train.c) trained by train_main: fully sharded
on 2 and 4 ranks (the block one unit, its stacked experts split by expert rows), with deferred
initialisation, and as HSDP 2 x 2, it trains one rank's ten losses and gradient norms within
2e-5; a 4-rank checkpoint resumes on one rank with the uninterrupted run's losses. With
DeepSeek-V3's routing (--sigmoid: sigmoid scores, an expert bias moved by 0.01 toward the mean
load after each step) FSDP on 4 and HSDP 2 x 2 train one rank's losses, the bias moves by whole
steps and is checkpointed, and a resumed run continues it.

  test_moe_train.py BUILD_ROOT MPIRUN SOURCE_ROOT
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

BUILD, MPIRUN, ROOT = sys.argv[1:4]
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
PROG = os.path.join(BUILD, "tests", "moe-train")
PLAN = """mesh:
  dp_shard: -1
model:
  seed: 3
parallelize:
  fully_shard:
    units: ["moe"]
optim:
  lr: 3.0e-3
  clip_grad_norm: 1.0
data:
  path: %s
  format: text
  seq_len: 32
  batch_size: 1
  global_batch_size: 4
train:
  steps: 10
  device: cpu        # four ranks: on a machine with one GPU they would share it
log:
  interval: 1
""" % os.path.join(ROOT, "data", "corpus.txt")
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def train(tmp, name, n, sets, sigmoid=False):
    """The metrics of a run on n ranks, or [] (its output printed)."""
    plan = os.path.join(tmp, "plan.yaml")
    m = os.path.join(tmp, name + ".jsonl")
    cmd = [MPIRUN] + MPI_ARGS + ["-n", str(n), PROG] + (["--sigmoid"] if sigmoid else []) + \
        [plan, "--metrics", m]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        print(p.stdout[-1500:], p.stderr[-1500:])
        return []
    with open(m) as f:
        return [json.loads(line) for line in f]


def worst(a, b):
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm"))


def expert_bias(step_dir):
    """moe.expert_bias from a checkpoint's model files (every rank's box), or None."""
    import struct
    got = {}
    folder = os.path.join(step_dir, "model")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = json.loads(f.read(n))
            data = f.read()
        if "moe.expert_bias" not in head:
            continue
        info = json.loads(head["__metadata__"]["DCP_SHARDING_INFO"])["moe.expert_bias"]
        a, b = head["moe.expert_bias"]["data_offsets"]
        for i, v in enumerate(struct.unpack("<%df" % ((b - a) // 4), data[a:b])):
            got[info["saved_offsets"][0] + i] = v
    return [got[i] for i in sorted(got)] if len(got) == 4 else None


def sigmoid(tmp):
    ref = train(tmp, "sig-one", 1, ["checkpoint.dir=" + os.path.join(tmp, "sig-one")], True)
    check(len(ref) == 10 and ref[-1]["loss"] < ref[0]["loss"] - 0.5,
          "sigmoid routing with an expert bias: one rank trains, the loss falling (%s)" %
          ("%.3f -> %.3f" % (ref[0]["loss"], ref[-1]["loss"]) if ref else "failed"))
    bias = expert_bias(os.path.join(tmp, "sig-one", "step-00000010"))
    steps = [round(b / 0.01, 3) for b in bias or []]
    check(bias is not None and any(steps) and all(s == int(s) and abs(s) <= 10 for s in steps),
          "the saved expert_bias moved by whole steps of 0.01 over ten steps (%s)" % steps)
    for name, n, sets in [("sig-fsdp4", 4, ["checkpoint.dir=" + os.path.join(tmp, "sig-four"),
                                            "checkpoint.interval=5"]),
                          ("sig-hsdp", 4, ["mesh.dp_replicate=2", "mesh.dp_shard=2"])]:
        w = worst(ref, train(tmp, name, n, sets, True))
        check(w <= 2e-5, "sigmoid routing, %s on %d ranks: one rank's losses and gradient norms "
                         "within 2e-5 (worst %.2e)" % (name, n, w))
    four = expert_bias(os.path.join(tmp, "sig-four", "step-00000010"))
    check(four is not None and bias is not None and
          max(abs(a - b) for a, b in zip(four, bias)) < 1e-6,
          "FSDP on 4 ends with one rank's expert_bias (%s)" % four)
    got = train(tmp, "sig-resumed", 1, ["checkpoint.load=" + os.path.join(tmp, "sig-four",
                                                                          "step-00000005")], True)
    w = worst(ref[5:], got)
    check(w <= 2e-5, "one rank resumes the 4-rank sigmoid checkpoint of step 5, its bias with "
                     "it: steps 6-10 within 2e-5 (worst %.2e)" % w)


def main():
    tmp = tempfile.mkdtemp(prefix="fsdpc-moe-train-")
    with open(os.path.join(tmp, "plan.yaml"), "w") as f:
        f.write(PLAN)
    ref = train(tmp, "one", 1, ["checkpoint.dir=" + os.path.join(tmp, "one")])
    check(len(ref) == 10 and ref[-1]["loss"] < ref[0]["loss"] - 0.5,
          "one rank trains ten steps, the loss falling (%s)" %
          ("%.3f -> %.3f" % (ref[0]["loss"], ref[-1]["loss"]) if ref else "failed"))
    for name, n, sets in [("fsdp2", 2, []), ("fsdp4", 4, []),
                          ("fsdp4-deferred", 4, ["model.deferred_init=true"]),
                          ("hsdp", 4, ["mesh.dp_replicate=2", "mesh.dp_shard=2"])]:
        got = train(tmp, name, n, sets +
                    (["checkpoint.dir=" + os.path.join(tmp, "four"), "checkpoint.interval=5"]
                     if name == "fsdp4" else []))
        w = worst(ref, got)
        check(w <= 2e-5, "%s on %d ranks: one rank's losses and gradient norms within 2e-5 "
                         "(worst %.2e)" % (name, n, w))
    got = train(tmp, "resumed", 1, ["checkpoint.load=" + os.path.join(tmp, "four",
                                                                      "step-00000005")])
    w = worst(ref[5:], got)
    check([x["step"] for x in got] == list(range(6, 11)) and w <= 2e-5,
          "one rank resumes the 4-rank checkpoint of step 5: steps 6-10 within 2e-5 "
          "(worst %.2e)" % w)
    sigmoid(tmp)
    shutil.rmtree(tmp)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
