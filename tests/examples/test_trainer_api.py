#!/usr/bin/env python3
"""The trainer as a library call (train/trainer.h): examples/tiny_lm.c, a model of its own that
only says how to build itself, trained by train_main under YAML plans.

  test_trainer_api.py BUILD_ROOT MPIRUN SOURCE_ROOT

- one rank trains ten steps, evaluating after steps 5 and 10 and saving a checkpoint after
  step 5: the reference; its metrics file holds every step's figures and the two evaluations;
- FSDP on 4 ranks (tiny_lm.yaml) and FSDP 2 x TP 2 (tiny_lm_tp.yaml) train the reference's
  losses, gradient norms and evaluation losses within 2e-5 (the same global batches);
- the tensor-parallel plan resumes the one-rank checkpoint of step 5 and trains steps 6-10 as
  the reference did; a run stopped by SIGTERM saves, exits 75 and resumes to the losses of a
  run that was not stopped;
- refusals on every rank: a model key in the plan, a checkpoint of another model (fsdp-train's);
  a model built without its names, one describing itself by something not a JSON object, one
  whose head has fewer columns than its vocabulary (tests/examples/own_model_misuse.c), each
  before any step;
- --dry-run plans 4 ranks from one process and prints each parameter's placements, and the
  communication of a fully sharded step as the run counts it;
- docs/your-model.md shows the program's main as it is.
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

BUILD, MPIRUN, ROOT = sys.argv[1:4]
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
LM = os.path.join(BUILD, "examples", "tiny-lm")
FSDP_PLAN = os.path.join(ROOT, "examples", "tiny_lm.yaml")
TP_PLAN = os.path.join(ROOT, "examples", "tiny_lm_tp.yaml")
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(n, plan, sets, timeout=240):
    """tiny-lm on n ranks (n 0: alone, no launcher) with --set options; the completed process."""
    cmd = ([] if n == 0 else [MPIRUN] + MPI_ARGS + ["-n", str(n)]) + [LM, plan]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def worst(a, b, key):
    """The largest relative difference of key between the lines of a and b of equal steps."""
    other = {y["step"]: y for y in b}
    pairs = [(x[key], other[x["step"]].get(key)) for x in a if key in x and x["step"] in other]
    if not pairs or any(y is None for _, y in pairs):
        return float("inf")
    return max(abs(x - y) / abs(x) for x, y in pairs)


def main():
    tmp = tempfile.mkdtemp(prefix="fsdpc-trainer-api-")
    common = ["train.steps=10", "eval.interval=5", "log.interval=1"]
    # the reference: one rank (an evaluation batch is the global batch, in every plan)
    ref_m = os.path.join(tmp, "ref.jsonl")
    p = run(1, FSDP_PLAN, common + ["log.metrics=" + ref_m,
                                    "checkpoint.dir=" + os.path.join(tmp, "ref"),
                                    "checkpoint.interval=5"])
    check(p.returncode == 0, "tiny-lm on 1 rank trains 10 steps")
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
        return 1
    ref = metrics(ref_m)
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "comm_bytes", "peak_mem_bytes"}
    check([x["step"] for x in ref] == list(range(1, 11)) and all(keys <= set(x) for x in ref),
          "its metrics file has a line of %s for each step" % ", ".join(sorted(keys)))
    check([x["step"] for x in ref if "eval_loss" in x] == [5, 10],
          "it evaluates after steps 5 and 10")
    check(ref[-1]["loss"] < 0.8 * ref[0]["loss"],
          "the loss goes down (%.4f -> %.4f)" % (ref[0]["loss"], ref[-1]["loss"]))
    check(os.path.exists(os.path.join(tmp, "ref", "step-00000005", "train_state.json")) and
          os.path.exists(os.path.join(tmp, "ref", "step-00000010", "train_state.json")),
          "it saves checkpoints after steps 5 and 10")
    # other plans: the same losses, norms and evaluations
    for what, n, plan in [("FSDP on 4 ranks", 4, FSDP_PLAN), ("FSDP 2 x TP 2", 4, TP_PLAN)]:
        path = os.path.join(tmp, "m%d%s.jsonl" % (n, "tp" if plan == TP_PLAN else ""))
        p = run(n, plan, common + ["log.metrics=" + path])
        got = metrics(path) if p.returncode == 0 else []
        w = [worst(ref, got, k) for k in ("loss", "grad_norm", "eval_loss")]
        check(len(got) == 10 and max(w) <= 2e-5,
              "%s: one rank's losses, gradient norms and evaluations within 2e-5 (worst %.2e, "
              "%.2e, %.2e)" % ((what,) + tuple(w)))
        if p.returncode != 0:
            print(p.stderr[-2000:])
    # the dry run of the fully sharded plan: its communication is the run's
    p = subprocess.run([LM, FSDP_PLAN, "--dry-run", "--world", "4"], capture_output=True,
                       text=True, timeout=120)
    said = re.search(r"^comm_bytes (\d+)$", p.stdout, re.M)
    ran = metrics(os.path.join(tmp, "m4.jsonl"))
    check(said is not None and all(x["comm_bytes"] == float(said.group(1)) for x in ran),
          "--dry-run --world 4 of tiny_lm.yaml counts each step's communication (%s B)" %
          (said.group(1) if said else "?"))
    # the tensor-parallel plan resumes the one-rank checkpoint
    path = os.path.join(tmp, "resumed.jsonl")
    p = run(4, TP_PLAN, common + ["log.metrics=" + path,
                                 "checkpoint.load=" + os.path.join(tmp, "ref", "step-00000005")])
    got = metrics(path) if p.returncode == 0 else []
    w = max(worst(ref, got, "loss"), worst(ref, got, "eval_loss"))
    check([x["step"] for x in got] == list(range(6, 11)) and w <= 2e-5 and
          "resumed from" in p.stdout,
          "FSDP 2 x TP 2 resumes one rank's step 5 and trains its steps 6-10 (worst %.2e)" % w)
    # a run stopped by SIGTERM saves, exits 75 and resumes where it stopped
    long = ["train.steps=150", "log.interval=1", "eval.batch_size=8"]
    full_m, cut_m, cut_d = (os.path.join(tmp, x) for x in ("full.jsonl", "cut.jsonl", "cut"))
    p = run(0, FSDP_PLAN, long + ["log.metrics=" + full_m])
    full = metrics(full_m) if p.returncode == 0 else []
    cmd = [LM, FSDP_PLAN] + sum((["--set", s] for s in long + ["log.metrics=" + cut_m,
                                                               "checkpoint.dir=" + cut_d]), [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(cut_m) and len(open(cut_m).read().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=120)
    stopped = re.search(r"interrupted by SIGTERM at step (\d+); saved", out)
    p = run(0, FSDP_PLAN, long + ["log.metrics=" + cut_m, "checkpoint.dir=" + cut_d,
                                  "checkpoint.load=auto"])
    cut = metrics(cut_m) if p.returncode == 0 else []
    check(proc.returncode == 75 and stopped is not None and int(stopped.group(1)) < 150 and
          len(cut) == 150 and len(full) == 150 and worst(full, cut, "loss") <= 2e-5,
          "SIGTERM at step %s: saved, exit %s, and the resumed run ends with the losses of one "
          "not stopped" % (stopped.group(1) if stopped else "?", proc.returncode))
    # refusals, on every rank
    bad = os.path.join(tmp, "bad.yaml")
    with open(bad, "w") as f:
        f.write("model:\n  dim: 8\n")
    p = subprocess.run([MPIRUN] + MPI_ARGS + ["-n", "2", LM, bad], capture_output=True,
                       text=True, timeout=120)
    said = re.findall(r"\[ranks 0,1\] .*bad.yaml:2:\d+: model.dim: this program trains its own "
                      r"model \(tiny-lm\)", p.stderr)
    check(p.returncode != 0 and len(said) == 1,
          "a model key in the plan is refused on both ranks, named")
    ft = subprocess.run([os.path.join(BUILD, "tools", "fsdp-train"),
                         os.path.join(ROOT, "configs", "debug.yaml"), "--set", "train.steps=1",
                         "--set", "checkpoint.dir=" + os.path.join(tmp, "llama")],
                        capture_output=True, text=True, timeout=120)
    p = run(2, FSDP_PLAN, ["checkpoint.load=" + os.path.join(tmp, "llama", "step-00000001")])
    said = re.findall(r"\[ranks 0,1\] checkpoint.load: \S+ holds another model than this "
                      r"program's 'tiny-lm'", p.stderr)
    check(ft.returncode == 0 and p.returncode != 0 and len(said) == 1,
          "a checkpoint of fsdp-train's Llama is refused on both ranks, named")
    # a model built wrong is named before any step (a narrow head: at the first forward, not
    # at the step whose data first holds a token id beyond it)
    misuse = os.path.join(BUILD, "tests", "own-model-misuse")
    for how, want in (("unnamed", r"the model 'misuse' was built without its names: call "
                                  r"nn_module_finalize\(root\)"),
                      ("describe", r"the model 'misuse' describes itself by something not a "
                                   r"JSON object"),
                      ("narrow", r"the model's logits have 255 columns, fewer than vocab_size "
                                 r"256")):
        p = subprocess.run([MPIRUN] + MPI_ARGS + ["-n", "2", "-x", "TRAINER_MISUSE=" + how,
                                                  misuse, FSDP_PLAN, "--set", "train.steps=2",
                                                  "--set", "parallelize.fully_shard.units=[]"],
                           capture_output=True, text=True, timeout=120)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not re.search(r"^step ", p.stdout, re.M),
              "a model %s: refused before any step, named (%s)" % (how, p.stderr.strip()[-200:]))
    # the dry run plans a larger job from one process
    p = subprocess.run([LM, TP_PLAN, "--dry-run", "--world", "4"], capture_output=True,
                       text=True, timeout=120)
    check(p.returncode == 0 and re.search(r"^  head.weight +\(SS\(0,2\), S\(0\)\) +256x64 +64x64 "
                                          r"64x64$", p.stdout, re.M) is not None and
          "model: tiny-lm (the program's own)" in p.stdout,
          "--dry-run --world 4 prints the tensor-parallel plan's placements")
    # docs/your-model.md shows the example's main, unchanged
    doc = open(os.path.join(ROOT, "docs", "your-model.md")).read()
    source = open(os.path.join(ROOT, "examples", "tiny_lm.c")).read()
    m = re.search(r"## Train it with the trainer.*?```c\n(.*?)```", doc, re.S)
    check(m is not None and source.endswith(m.group(1)) and "train_main" in m.group(1),
          "docs/your-model.md's trainer program is examples/tiny_lm.c's main")
    shutil.rmtree(tmp)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
