"""Saving, and resuming under other plans."""
import json
import os
import re
import shutil
import subprocess
import time

from common import (EXE, MPIRUN, MPI_ARGS, ROOT, TOOL, check, kill_session, losses, mkdtemp,
                    ranks_saying, run, sh, st_read)


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
    # rewritten (a rollback of its own folder: the run the lines are of); a run with nothing to
    # train leaves it as it is; a write error stops the run
    with open(ma) as f:
        before = f.read()
    p = train(4, "fsdp", ["train.steps=10", "checkpoint.load=" + os.path.join(a, "step-00000010")],
              ma)
    with open(ma) as f:
        check(f.read() == before and "nothing to train" in p.stdout,
              "a run with nothing to train leaves the metrics file as it is")
    with open(ma, "a") as f:
        f.write(before.splitlines()[-1] + "\n")  # a line past the end, as a longer run leaves
    train(4, "fsdp", ["train.steps=10", "checkpoint.load=" + os.path.join(a, "step-00000005"),
                      "checkpoint.dir=" + a, "checkpoint.interval=5", "checkpoint.overwrite=true"],
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
    # where no folder can be made whatever the permissions say (/proc, even for root); where
    # one can, the dry run's probe folder is gone after it
    for extra in ([], ["--dry-run"]):
        p, _ = run(2, [cfg("fsdp"), "--set", "checkpoint.dir=/proc/fsdpc-ckpt"] + extra)
        check(p.returncode != 0 and "step " not in p.stdout and ranks_saying(
            p.stderr, r"checkpoint\.dir '/proc/fsdpc-ckpt': cannot create") == {"0", "1"},
              "checkpoint.dir in /proc: every rank refuses it before training %s(%s)"
              % (" ".join(extra) + " " if extra else "", p.stderr.strip()[-160:]))
    probed = os.path.join(tmp, "probed")
    os.makedirs(probed)
    p, _ = run(2, [cfg("fsdp"), "--set", "checkpoint.dir=" + os.path.join(probed, "new", "sub"),
                   "--dry-run"])
    check(p.returncode == 0 and os.listdir(probed) == [],
          "--dry-run with a checkpoint.dir to be made leaves nothing where it probed (%s)"
          % os.listdir(probed))
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
    # per-parameter shard dimensions: the MLP's weights on dimension 1, attention's on their
    # last, the embedding on 1 (under hsdp-tp both tp layouts: a colwise Shard(0) and a
    # rowwise Shard(1), strided by dp)
    sd = ["parallelize.fully_shard.shard_dims.%s=%s" % kv for kv in (
        ('"model.layers.*.mlp.*.weight"', 1), ('"model.layers.*.self_attn.*.weight"', -1),
        ('"model.embed_tokens.weight"', 1))]
    u = os.path.join(tmp, "u")
    train(4, "fsdp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + u,
                      "checkpoint.interval=5", "checkpoint.block_bytes=64"] + sd)
    # HFSDP: the parameters and optimizer state saved from 1/(R x S) shards
    hf = ["parallelize.fully_shard.optimizer_sharding=full"]
    hf_sd = hf + sd
    w = os.path.join(tmp, "w")
    train(4, "hsdp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + w,
                      "checkpoint.interval=5", "checkpoint.block_bytes=64"] + hf)
    whole = os.path.join(tmp, "hfsdp-whole.jsonl")
    train(4, "hsdp", ["train.steps=10", "data.batch_size=6"] + hf, whole)
    resumed = os.path.join(tmp, "hfsdp-resumed.jsonl")
    train(4, "hsdp", ["train.steps=10", "data.batch_size=6",
                      "checkpoint.load=" + os.path.join(w, "step-00000005")] + hf, resumed)
    def what(extra):  # the plan changes a run takes, in words
        return {id(sd): " with shard_dims", id(hf): " with optimizer_sharding full",
                id(hf_sd): " with optimizer_sharding full and shard_dims"}.get(id(extra), "")

    la = [r["loss"] for r in losses(whole)][5:] if os.path.exists(whole) else []
    lb = [r["loss"] for r in losses(resumed)] if os.path.exists(resumed) else []
    check(len(la) == 5 and la == lb,
          "HFSDP resumed under its own plan: losses bit-identical (%s vs %s)" % (la[:1], lb[:1]))

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
            (4, "fsdp", 6, t, []), (1, "debug", 24, t, []),
            (4, "fsdp", 6, s, sd), (8, "hsdp-tp", 6, s, sd), (1, "debug", 24, u, []),
            (8, "hsdp-tp", 6, u, []),
            (1, "debug", 24, w, []), (4, "fsdp", 6, w, []), (4, "hsdp", 6, w, []),
            (2, "tp", 24, w, []), (4, "hsdp", 6, s, hf), (4, "hsdp", 6, u, hf_sd),
            (8, "hsdp-tp", 6, w, hf)]:
        m = os.path.join(tmp, "x%d.jsonl" % len(os.listdir(tmp)))  # a new file per run
        p = train(n, name, ["train.steps=10", "data.batch_size=%d" % batch,
                            "checkpoint.load=" + os.path.join(src, "step-00000005")] + extra, m)
        got = [r["loss"] for r in losses(m)] if os.path.exists(m) else []
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, want)) if got else 1
        check(len(got) == 5 and worst <= 1e-5,
              "saved by %s, resumed by %s%s on %d: losses match the uninterrupted run "
              "(worst %.2e)" % ({t: "hsdp-tp on 8 ranks", s: "fsdp on 4 ranks",
                                 w: "hsdp with optimizer_sharding full on 4 ranks"}.get(
                  src, "fsdp with shard_dims on 4 ranks"), name, what(extra), n, worst))
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

    v = os.path.join(tmp, "v")  # a live hsdp-tp save with shard_dims, for its layout
    train(8, "hsdp-tp", ["train.steps=5", "data.batch_size=6", "checkpoint.dir=" + v,
                         "checkpoint.interval=5", "checkpoint.block_bytes=64"] + sd)
    for n, name, batch, extra, live in [(8, "hsdp-tp", 6, [], t), (1, "debug", 24, [], None),
                                        (8, "hsdp-tp", 6, sd, v), (4, "hsdp", 6, hf, w),
                                        (8, "hsdp-tp", 6, hf, None)]:
        rs = os.path.join(tmp, "rs-%s%s" % (name, what(extra).replace(" ", "-")))
        p = sh([TOOL, "reshard", os.path.join(s, "step-00000005"), "--to", cfg(name), rs,
                "--set", "data.batch_size=%d" % batch] +
               [x for kv in extra for x in ("--set", kv)], timeout=300)
        check(p.returncode == 0, "fsdp-ckpt reshard to %s%s runs" % (name, what(extra)))
        if p.returncode != 0:
            print(p.stderr)
            continue
        if live is not None:
            check(layout(rs) == layout(os.path.join(live, "step-00000005")),
                  "reshard to %s%s: the files, shapes and offsets of a live save"
                  % (name, what(extra)))
        m = os.path.join(tmp, "x%d.jsonl" % len(os.listdir(tmp)))
        p = train(n, name, ["train.steps=10", "data.batch_size=%d" % batch,
                            "checkpoint.load=" + rs] + extra, m)
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
    p = sh([TOOL, "reshard", os.path.join(s, "step-00000005"), "--to", cfg("debug"),
            os.path.join(tmp, "rs-other"), "--set", "model.rope_theta=500000"], timeout=300)
    check(p.returncode != 0 and "rope_theta 10000 vs 500000" in p.stderr and
          not os.path.exists(os.path.join(tmp, "rs-other")),
          "reshard to a model of other parameters' values (rope_theta) names the difference")
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
