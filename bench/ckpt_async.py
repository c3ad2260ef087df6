#!/usr/bin/env python3
"""The training stall of a checkpoint, synchronous and asynchronous (checkpoint.async).

  bench/ckpt_async.py [--exe build/tools/fsdp-train] [--config configs/llama-100m.json]
                      [--ranks 1,4] [--saves 3] [--every 12] [--batch 1] [--seq 64]
                      [--dir FOLDER]

For each rank count it trains the model of CONFIG (a Hugging Face config.json) under plain
FSDP (one unit per decoder layer) on the bundled corpus, saving every EVERY steps SAVES times,
once with synchronous saves and once with checkpoint.async: true, and prints per save
  stall  the time the step that saves (and, asynchronously, the step at whose boundary the
         save commits) spends on the checkpoint instead of training: fsdp-train's metrics
         field ckpt_stall_s, the save itself when synchronous, the copy into staging memory
         and the commit when asynchronous;
  save   the time from the save's start to its commit (ckpt_save_s): synchronous, the stall
         itself; asynchronous, how long the files took to write while training went on.
The last line per rank count is the ratio of the median asynchronous stall to the median
synchronous save (target: at most 0.10). The last step's save waits for its commit in both
modes, so it is left out. The first asynchronous save also touches its staging memory for the
first time; later ones reuse it. EVERY should leave the files time to be written (a save
waits for the one before it). Checkpoints go to a temporary folder under --dir (default /tmp),
removed at the end.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from fsdpc_version import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]

PLAN = """\
mesh:
  dp_shard: -1
model:
  dim: {hidden_size}
  n_layers: {num_hidden_layers}
  n_heads: {num_attention_heads}
  n_kv_heads: {num_key_value_heads}
  ffn_dim: {intermediate_size}
  vocab_size: {vocab_size}
  max_seq_len: {max_position_embeddings}
  rope_theta: {rope_theta}
  norm_eps: {rms_norm_eps}
parallelize:
  fully_shard:
    units: ["model.layers.*"]
data:
  path: {data}
  format: text
  seq_len: {seq}
  batch_size: {batch}
train:
  steps: {steps}
log:
  interval: 1000000
"""


def run(args, ranks, plan, folder, asynchronous):
    metrics = os.path.join(folder, "metrics-%d-%s.jsonl" % (ranks, asynchronous))
    ck = os.path.join(folder, "ck-%d-%s" % (ranks, asynchronous))
    cmd = ([] if ranks == 1 else MPI + ["-n", str(ranks)]) + [
        args.exe, plan, "--metrics", metrics, "--set", "checkpoint.dir=" + ck,
        "--set", "checkpoint.interval=%d" % args.every,
        "--set", "checkpoint.async=%s" % ("true" if asynchronous else "false")]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit("fsdp-train failed:\n" + p.stdout[-2000:] + p.stderr[-2000:])
    rows = [json.loads(line) for line in open(metrics)]
    shutil.rmtree(ck, ignore_errors=True)
    last = rows[-1]["step"]
    stalls = [r.get("ckpt_stall_s", 0.0) for r in rows if r["step"] < last]
    saves = [r["ckpt_save_s"] for r in rows if "ckpt_save_s" in r and r["ckpt_saved_step"] < last]
    steps = [r["step_time_s"] for r in rows[1:]]
    # the stall of each save: the steps whose boundary did checkpoint work for it
    per_save = []
    for r in rows:
        if r["step"] >= last or "ckpt_stall_s" not in r:
            continue
        if r["step"] % args.every == 0:
            per_save.append(r["ckpt_stall_s"])
        elif per_save:
            per_save[-1] += r["ckpt_stall_s"]  # the commit, at a later boundary
    return per_save, saves, statistics.median(steps), sum(stalls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "fsdp-train"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-100m.json"))
    ap.add_argument("--ranks", default="1,4")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    cfg = json.load(open(args.config))
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rms_norm_eps", 1e-6)
    folder = tempfile.mkdtemp(prefix="fsdpc-ckpt-async-", dir=args.dir)
    try:
        plan = os.path.join(folder, "plan.yaml")
        with open(plan, "w") as f:
            f.write(PLAN.format(data=os.path.join(ROOT, "data", "corpus.txt"), seq=args.seq,
                                batch=args.batch, steps=args.every * (args.saves + 1), **cfg))
        print("%s, batch %d x %d per rank, a save every %d steps" %
              (os.path.basename(args.config), args.batch, args.seq, args.every))
        for ranks in [int(x) for x in args.ranks.split(",")]:
            sync, sync_saves, sync_step, _ = run(args, ranks, plan, folder, False)
            asyn, asyn_saves, asyn_step, _ = run(args, ranks, plan, folder, True)
            print("%d rank%s: step %.3f s (sync run) / %.3f s (async run)" %
                  (ranks, "" if ranks == 1 else "s", sync_step, asyn_step))
            for k in range(max(len(sync), len(asyn))):
                print("  save %d: sync stall %.3f s; async stall %.3f s, written in %.3f s" %
                      (k + 1, sync[k] if k < len(sync) else float("nan"),
                       asyn[k] if k < len(asyn) else float("nan"),
                       asyn_saves[k] if k < len(asyn_saves) else float("nan")))
            ratio = statistics.median(asyn) / statistics.median(sync)
            print("  stall ratio (async / sync, medians): %.3f  (target <= 0.10)" % ratio)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
