"""Checkpoints of GPU shards, and several ranks sharing the GPU (skip, 77, without one)."""
import os
import re
import subprocess
import sys

from common import (EXE, MPIRUN, MPI_ARGS, ROOT, check, losses, mkdtemp, run, sh)


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
    taking the same global batch (the plans' parity promise, within the GPU's f32 rounding), and
    the tiny Qwen3-MoE with its balancing loss and its experts split over 2 ranks (FSDP 2 and
    4 x EP 2) likewise."""
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "hsdp-tp.yaml")
    try:  # the GPUs the driver lists; the runs below ask for CUDA and say so if they miss it
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=60).stdout.count("GPU ")
    except (OSError, subprocess.TimeoutExpired):
        gpus = 0
    if os.environ.get("FSDPC_TEST_CUDA_EMULATED"):  # fsdp-train on the CUDA emulator's device
        gpus = 1
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
    # a mixture of experts split over ranks sharing the GPU (mesh.ep: the all-to-all through the
    # host-staged groups; the routing, its statistics for the balancing loss and the grouped
    # products on the device) against one CPU rank taking the same global batch
    from configs import family_plan  # the plan of the tiny models
    plan = family_plan(mkdtemp(), "tiny_qwen3_moe_aux")
    batch = ["--set", "data.global_batch_size=4", "--set", "train.steps=6"]
    ref = os.path.join(tmp, "moe-cpu.jsonl")
    p, _ = run(1, [plan, "--set", "mesh.dp_shard=1", "--set", "train.device=cpu", "--metrics",
                   ref] + batch)
    check(p.returncode == 0, "tiny_qwen3_moe_aux, one rank on the CPU: the reference run")
    want = [(r["loss"], r["grad_norm"]) for r in losses(ref)] if p.returncode == 0 else []
    for name, n, sets in [("FSDP 2 x EP 2", 2, ["mesh.dp_shard=2", "mesh.ep=2"]),
                          ("FSDP 4 x EP 2", 4, ["mesh.dp_shard=4", "mesh.ep=2"])]:
        m = os.path.join(tmp, "moe-gpu%d.jsonl" % n)
        p, _ = run(n, [plan, "--set", "train.device=cuda", "--metrics", m] + batch +
                   sum((["--set", s] for s in sets), []), mpi_args=("-x", "FSDPC_PG=staged-lazy"))
        got = [(r["loss"], r["grad_norm"]) for r in losses(m)] if p.returncode == 0 else []
        worst = (max(abs(a[i] - b[i]) / abs(b[i]) for a, b in zip(got, want) for i in (0, 1))
                 if got and len(got) == len(want) == 6 else float("inf"))
        check(p.returncode == 0 and "on cuda:0" in p.stdout and
              "process groups: host-staged, lazy test mode" in p.stdout and worst <= 1e-4,
              "tiny_qwen3_moe_aux, %s on %d ranks sharing the GPU: one CPU rank's losses and "
              "gradient norms (worst relative %.2e)" % (name, n, worst))
        if p.returncode != 0:
            print(p.stdout[-1500:], p.stderr[-2500:])
