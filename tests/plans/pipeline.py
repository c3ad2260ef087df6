"""Pipeline parallelism in fsdp-train (mesh.pp and the pipeline section)."""
import os
import re

from common import (ROOT, TOOL, check, hf_folder, losses, mkdtemp, ranks_saying, run, sh,
                    st_read)

PLAN = """\
mesh:
  dp_shard: -1
model:
  dim: 32
  n_layers: 4
  n_heads: 2
  n_kv_heads: 2
  ffn_dim: 64
  vocab_size: 256
  max_seq_len: 64
  seed: 3
parallelize:
  fully_shard:
    units: ["model.layers.*"]
optim:
  lr: 3.0e-3
data:
  path: {data}
  format: text
  seq_len: 16
  batch_size: 1
  global_batch_size: 4
train:
  steps: 10
log:
  interval: 5
"""

MP = "parallelize.fully_shard.mp_policy={param_dtype: bf16, reduce_dtype: f32}"

# (what, ranks, settings, global batch): each against one rank of the same global batch
PLANS = [
    ("pp 2, gpipe", 2, ["mesh.pp=2", "mesh.dp_shard=1", "pipeline.schedule=gpipe"], 4),
    ("pp 2, 1f1b", 2, ["mesh.pp=2", "mesh.dp_shard=1"], 4),
    ("pp 2, interleaved_1f1b (2 stages a rank)", 2,
     ["mesh.pp=2", "mesh.dp_shard=1", "pipeline.schedule=interleaved_1f1b"], 4),
    ("pp 4, gpipe", 4, ["mesh.pp=4", "mesh.dp_shard=1", "pipeline.schedule=gpipe"], 4),
    ("pp 4, 1f1b", 4, ["mesh.pp=4", "mesh.dp_shard=1", "pipeline.schedule=1f1b"], 4),
    ("pp 2 x dp_shard 2", 4, ["mesh.pp=2", "mesh.dp_shard=2"], 4),
    ("pp 2 x dp_shard 2, resharded and reduced after every microbatch", 4,
     ["mesh.pp=2", "mesh.dp_shard=2", "pipeline.sync_every_microbatch=true"], 4),
    ("pp 2 x tp 2", 4, ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=2"], 4),
    ("pp 2 x tp 2 with sequence parallelism (sequence shards between the stages)", 4,
     ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=2",
      "parallelize.tensor_parallel.sequence_parallel=true"], 4),
    ("pp 2 x dp_replicate 2 x dp_shard 2", 8,
     ["mesh.pp=2", "mesh.dp_replicate=2", "mesh.dp_shard=2", "data.global_batch_size=8"], 8),
    ("pp 2 x HFSDP 2 x 2 (optimizer_sharding: full)", 8,
     ["mesh.pp=2", "mesh.dp_replicate=2", "mesh.dp_shard=2", "data.global_batch_size=8",
      "parallelize.fully_shard.optimizer_sharding=full"], 8),
    ("pp 2 x dp_shard 2, interleaved, 4 microbatches, checkpointed blocks", 4,
     ["mesh.pp=2", "mesh.dp_shard=2", "pipeline.schedule=interleaved_1f1b",
      "train.activation_checkpointing=true", "data.global_batch_size=8"], 8),
    ("pp 2, 8 microbatches (grad accumulation) from pipeline.microbatches", 2,
     ["mesh.pp=2", "mesh.dp_shard=1", "data.global_batch_size=null",
      "pipeline.microbatches=8"], 8),
    ("pp 2, tied embeddings (the shared weight on the first and last ranks)", 2,
     ["mesh.pp=2", "mesh.dp_shard=1", "model.tie_embeddings=true"], "tied"),
    ("pp 4 x nothing, tied embeddings", 4,
     ["mesh.pp=4", "mesh.dp_shard=1", "model.tie_embeddings=true"], "tied"),
    ("pp 2 x dp_shard 2, tied embeddings", 4,
     ["mesh.pp=2", "mesh.dp_shard=2", "model.tie_embeddings=true"], "tied"),
    # a stage's gradients, kept over the microbatches, add up in reduce_dtype (f32), as one
    # rank's reduced gradients do, not in the bf16 they are computed in
    ("pp 2, bf16 compute, f32 reduction", 2, ["mesh.pp=2", "mesh.dp_shard=1", MP], "bf16"),
    ("pp 4, interleaved_1f1b over 8 blocks (2 stages a rank)", 4,
     ["mesh.pp=4", "mesh.dp_shard=1", "pipeline.schedule=interleaved_1f1b", "model.n_layers=8"],
     "8 blocks"),
]


def sets(kvs):
    out = []
    for kv in kvs:
        out += ["--set", kv]
    return out


def worst(a, b):
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm"))


def dry(n, plan, kvs):
    """--dry-run for a world of n: its p2p_bytes and comm_bytes lines (or None) and output."""
    p, _ = run(1, [plan, "--dry-run", "--world", str(n)] + sets(kvs))
    get = lambda k: int(re.search(r"^%s (\d+)$" % k, p.stdout, re.M).group(1)) \
        if re.search(r"^%s (\d+)$" % k, p.stdout, re.M) else None  # noqa: E731
    return get("p2p_bytes"), get("comm_bytes"), p


def pipeline():
    """Llama of 4 blocks: every schedule on 2 and 4 pipeline ranks, with FSDP (gathered once a
    step and reduced after the last microbatch, or after every one), TP and HSDP inside the
    stages, interleaved with checkpointed blocks, and 8 microbatches, trains one rank's ten
    losses and gradient norms within 2e-5; each step's point-to-point bytes (summed
    over the pipeline) equal --dry-run's closed form, and its communication --dry-run's
    estimate, and every pipeline rank's peak its estimate within 15%; 1f1b keeps less in flight
    than gpipe at 8 microbatches; a checkpoint of pp 4
    resumes at pp 4 (bit for bit), pp 2, one rank and FSDP on 4; --dry-run prints each pipeline
    rank's stages and actions and the bubble; a Qwen3-MoE's load-balancing loss trains, reports
    and evaluates as one rank's; what does not fit is refused by name."""
    tmp = mkdtemp()
    plan = os.path.join(tmp, "plan.yaml")
    with open(plan, "w") as f:
        f.write(PLAN.format(data=os.path.join(ROOT, "data", "corpus.txt")))
    refs = {}
    for g, kvs in ((4, []), (8, ["data.global_batch_size=8"]), ("8 blocks", ["model.n_layers=8"]),
                   ("tied", ["model.tie_embeddings=true"]), ("bf16", [MP])):
        m = os.path.join(tmp, "one-%s.jsonl" % str(g).replace(" ", "-"))
        run(1, [plan, "--metrics", m, "--set", "mesh.dp_shard=1"] + sets(kvs))
        refs[g] = losses(m) if os.path.exists(m) else []
    check(all(len(x) == 10 for x in refs.values()), "one rank trains the reference runs")
    for k, (what, n, kvs, g) in enumerate(PLANS):
        m = os.path.join(tmp, "pp-%d.jsonl" % k)
        p, _ = run(n, [plan, "--metrics", m] + sets(kvs))
        got = losses(m) if p.returncode == 0 else []
        w = worst(refs[g], got)
        check(w <= 2e-5, "%s on %d ranks: one rank's ten losses and gradient norms within 2e-5 "
                         "(worst %.2e)" % (what, n, w))
        if g == "tied":  # the head's stage gathers the shared weight as its unit's, not on demand
            check("ran outside the forward" not in p.stderr,
                  "%s: the tied head runs inside its unit, without an on-demand warning" % what)
        if p.returncode != 0:
            print(p.stdout[-1500:], p.stderr[-1500:])
            continue
        p2p, comm, _ = dry(n, plan, kvs)
        real = {(r["p2p_bytes"], r["comm_bytes"]) for r in got}
        want_comm = comm if comm is not None else got[0]["comm_bytes"]  # tp: not estimated
        check(real == {(p2p, want_comm)},
              "%s: every step's point-to-point bytes %s equal the closed form %s, and its "
              "communication --dry-run's %s" % (what, sorted(real)[:2], p2p, comm))
    # under bf16 compute with sequence parallelism the stages' kept gradients add up in f32
    # too (the norms' summed gradients included): pp 2 x tp 2 trains tp 2's bits
    sp = ["mesh.dp_shard=1", "mesh.tp=2", "parallelize.tensor_parallel.sequence_parallel=true", MP]
    got = []
    for n, kvs in ((2, sp), (4, sp + ["mesh.pp=2"])):
        m = os.path.join(tmp, "sp-bf16-%d.jsonl" % n)
        p, _ = run(n, [plan, "--metrics", m] + sets(kvs))
        got.append([(r["loss"], r["grad_norm"]) for r in losses(m)] if p.returncode == 0 else [])
    check(len(got[0]) == 10 and got[1] == got[0],
          "pp 2 x tp 2 with sequence parallelism in bf16: tp 2's ten losses and gradient norms "
          "bit for bit (worst %.2e)" % worst([{"loss": a, "grad_norm": b} for a, b in got[0]],
                                             [{"loss": a, "grad_norm": b} for a, b in got[1]]))
    # 1f1b keeps fewer microbatches' activations than gpipe (pipeline rank 0, 8 microbatches)
    peaks = {}
    for sched in ("gpipe", "1f1b"):
        m = os.path.join(tmp, "peak-%s.jsonl" % sched)
        run(2, [plan, "--metrics", m] + sets(["mesh.pp=2", "mesh.dp_shard=1",
                                              "data.global_batch_size=8",
                                              "pipeline.schedule=" + sched]))
        peaks[sched] = max(r["peak_mem_bytes"] for r in losses(m)) if os.path.exists(m) else 0
    _, _, d = dry(2, plan, ["mesh.pp=2", "mesh.dp_shard=1", "data.global_batch_size=8",
                            "pipeline.schedule=gpipe"])
    check(0 < peaks["1f1b"] < peaks["gpipe"] and
          "pipeline rank 0: stage 0 (blocks 0-1, embedding); 8 microbatches in flight" in
          d.stdout and "bubble 0.1111" in d.stdout and
          "pipeline rank 1: stage 1 (blocks 2-3, final norm and head)" in d.stdout and
          " F0.7 B0.0 " in d.stdout,
          "at 8 microbatches 1f1b's peak (%d B) is below gpipe's (%d B); --dry-run prints each "
          "rank's stages, actions and in-flight microbatches, and the bubble 1/9"
          % (peaks["1f1b"], peaks["gpipe"]))
    # evaluation through the stages; a Hugging Face folder as the start (each rank reads its
    # stages' tensors)
    ev = ["eval.path=" + os.path.join(ROOT, "data", "corpus.txt"), "eval.interval=5",
          "eval.batches=2"]
    for what, n, kvs, ref_kvs in (
            ("pp 2", 2, ["mesh.pp=2", "mesh.dp_shard=1"], ["mesh.dp_shard=1"]),
            ("pp 2 x dp_shard 2", 4, ["mesh.pp=2", "mesh.dp_shard=2", "data.global_batch_size=8"],
             ["mesh.dp_shard=2", "data.global_batch_size=8"]),
            # two stages a rank, five batches in flight through four stages
            ("pp 2 interleaved", 2, ["mesh.pp=2", "mesh.dp_shard=1", "eval.batches=5",
                                     "pipeline.schedule=interleaved_1f1b"],
             ["mesh.dp_shard=1", "eval.batches=5"])):
        got = {}
        for name, k, at in (("pipe", n, kvs), ("ref", n // 2, ref_kvs)):
            m = os.path.join(tmp, "eval-%s-%d.jsonl" % (name, n))
            run(k, [plan, "--metrics", m] + sets(ev + at))  # at's settings last: they win
            got[name] = [r["eval_loss"] for r in losses(m) if "eval_loss" in r] \
                if os.path.exists(m) else []
        # the weights themselves differ by the gradients' summation order (dp x pp against
        # dp): measured 2.5e-8 under OpenBLAS's Haswell kernels, 0 under SkylakeX's
        w = max([abs(a - b) / abs(b) for a, b in zip(got["pipe"], got["ref"])] or [1])
        check(len(got["pipe"]) == len(got["ref"]) == 2 and w <= 1e-6,
              "%s evaluates through the stages: the eval losses of the same plan without the "
              "pipeline within 1e-6 (%s, worst %.2e)" % (what, got["pipe"], w))
    init = PLAN.format(data=os.path.join(ROOT, "data", "corpus.txt")).split("model:")[0] + \
        "model:\n  init_from: %s\n" % hf_folder(mkdtemp(), "tiny_qwen2") + \
        "parallelize:" + PLAN.split("parallelize:")[1].format(
            data=os.path.join(ROOT, "data", "corpus.txt"))
    hfplan = os.path.join(tmp, "hf.yaml")
    with open(hfplan, "w") as f:
        f.write(init)
    for tag in ("tiny_qwen2", "tiny_qwen3_moe"):  # Qwen3-MoE: a sparse layer on each stage's
        with open(hfplan, "w") as f:  # side of the split (its routing counted by every rank)
            f.write(init.replace(init.split("init_from: ")[1].split("\n")[0],
                                 hf_folder(mkdtemp(), tag)))
        runs = {}
        plans = [("one", 1, ["mesh.dp_shard=1"]), ("pp 2", 2, ["mesh.pp=2", "mesh.dp_shard=1"])]
        if "moe" in tag:  # the experts split over each stage's two dp_shard ranks
            plans.append(("pp 2 x dp_shard 2 x ep 2", 4,
                          ["mesh.pp=2", "mesh.dp_shard=2", "mesh.ep=2"]))
        for name, n, kvs in plans:
            m = os.path.join(tmp, "hf-%s-%s.jsonl" % (tag, name.replace(" ", "")))
            run(n, [hfplan, "--metrics", m] + sets(kvs))
            runs[name] = losses(m) if os.path.exists(m) else []
        for name, _, _ in plans[1:]:
            w = worst(runs["one"], runs[name])
            loads = [r.get("expert_load") for r in runs[name]]
            # the routers' balance, reported (unweighted) though it is not trained
            wa = max([abs(a.get("aux_loss", 0) - b.get("aux_loss", 1)) / max(a.get("aux_loss", 0),
                                                                              1e-30)
                      for a, b in zip(runs["one"], runs[name])] or [1]) if "moe" in tag else 0
            check(w <= 2e-5 and loads == [r.get("expert_load") for r in runs["one"]] and
                  wa <= 2e-5,
                  "model.init_from (%s's folder) under %s: one rank's losses within 2e-5 (worst "
                  "%.2e)%s" % (tag, name, w, ", its expert loads and aux_loss (%.2e)" % wa
                               if "moe" in tag else ""))
    # the routers' load-balancing loss: every stage's blocks' routing of a microbatch summed
    # over the pipeline before its backward; the loss, its gradient, the reported aux_loss and
    # the evaluation's loss as one rank's (tiny_qwen3_moe's folder is the last one written)
    aux = ["moe.aux_loss_coef=0.1"] + ev
    runs = {}
    plans = [("one", 1, ["mesh.dp_shard=1"]), ("pp 2", 2, ["mesh.pp=2", "mesh.dp_shard=1"]),
             ("pp 2, gpipe, checkpointed blocks", 2,
              ["mesh.pp=2", "mesh.dp_shard=1", "pipeline.schedule=gpipe",
               "train.activation_checkpointing=true"]),
             ("pp 2 x dp_shard 2 x ep 2", 4, ["mesh.pp=2", "mesh.dp_shard=2", "mesh.ep=2"]),
             ("dp_shard 2 x ep 2", 2, ["mesh.dp_shard=2", "mesh.ep=2"])]
    # with experts split, the reference is the same ranks without the pipeline (the experts'
    # products sum their rows in another order than one rank's: 1.1e-5 by step 9 either way),
    # and evaluation splits its batches over the data-parallel ranks
    same = {"pp 2 x dp_shard 2 x ep 2": "dp_shard 2 x ep 2"}
    for name, n, kvs in plans:
        m = os.path.join(tmp, "aux-%s.jsonl" % re.sub(r"[^a-z0-9]", "", name))
        run(n, [hfplan, "--metrics", m] + sets(kvs + aux))
        runs[name] = losses(m) if os.path.exists(m) else []
        runs[name + " eval"] = [r["eval_loss"] for r in losses(m) if "eval_loss" in r] \
            if os.path.exists(m) else []
    one = runs["one"]
    check(len(one) == 10 and all(r.get("aux_loss", 0) > 0 for r in one),
          "one rank trains tiny_qwen3_moe with moe.aux_loss_coef=0.1 and reports its aux_loss")
    for name, _, _ in plans[1:-1]:
        got, base = runs[name], runs[same.get(name, "one")]
        w = worst(base, got)
        wa = max([abs(a["aux_loss"] - b["aux_loss"]) / a["aux_loss"] for a, b in zip(base, got)]
                 or [1])
        ref = runs[same.get(name, "one") + " eval"]
        we = max([abs(a - b) / abs(a) for a, b in zip(ref, runs[name + " eval"])] or [1])
        check(len(got) == 10 and w <= 2e-5 and wa <= 2e-5 and
              len(runs[name + " eval"]) == len(ref) == 2 and we <= 1e-6 and
              [r.get("expert_load") for r in got] == [r.get("expert_load") for r in base],
              "the load-balancing loss under %s: the losses and gradient norms of %s within "
              "2e-5 (worst %.2e), its aux_loss (%.2e), its eval losses within 1e-6 (%.2e), the "
              "same expert loads" % (name, same.get(name, "one rank"), w, wa, we))
    # the evaluation's loss is the cross-entropy alone: the same samples in batches of 1 or 2
    # give the same value, whatever the routers' balance within each batch
    split_eval = {}
    for size, batches in ((1, 4), (2, 2)):
        m = os.path.join(tmp, "aux-eval-%d.jsonl" % size)
        run(1, [hfplan, "--metrics", m] + sets(["mesh.dp_shard=1", "moe.aux_loss_coef=1",
                                                 "eval.path=" + os.path.join(ROOT, "data",
                                                                             "corpus.txt"),
                                                 "eval.interval=5", "eval.batch_size=%d" % size,
                                                 "eval.batches=%d" % batches]))
        split_eval[size] = [r["eval_loss"] for r in losses(m) if "eval_loss" in r] \
            if os.path.exists(m) else []
    we = max([abs(a - b) / abs(a) for a, b in zip(split_eval[1], split_eval[2])] or [1])
    check(len(split_eval[1]) == len(split_eval[2]) == 2 and we <= 1e-6,
          "a model with experts evaluates the same samples in batches of 1 and of 2 to the same "
          "loss within 1e-6 (%.2e)" % we)
    # pipeline.split_points: stage 1 begins at block 1 (three blocks and the head on it)
    split = os.path.join(tmp, "split.yaml")
    for points, n, why in ((["model.layers.1"], 2, None),
                           (["model.norm"], 2, "'model.norm' is not a block of the model"),
                           (["model.layers.1", "model.layers.2"], 2,
                            "2 names for 2 stages (one for each stage after the first"),
                           (["model.layers.3", "model.layers.2", "model.layers.1"], 4,
                            "'model.layers.2' does not come after the stage before")):
        with open(plan) as f, open(split, "w") as g:
            g.write(f.read() + "pipeline:\n  split_points: [%s]\n" % ", ".join(points))
        kvs = ["mesh.pp=%d" % n, "mesh.dp_shard=1"]
        m = os.path.join(tmp, "split.jsonl")
        p, _ = run(n, [split, "--metrics", m] + sets(kvs))
        if why is None:
            got = losses(m) if p.returncode == 0 else []
            _, _, d = dry(n, split, kvs)
            w = worst(refs[4], got)
            check(w <= 2e-5 and "pipeline rank 0: stage 0 (blocks 0-0, embedding)" in d.stdout and
                  "pipeline rank 1: stage 1 (blocks 1-3, final norm and head)" in d.stdout,
                  "split_points [model.layers.1]: stages of 1 and 3 blocks (as --dry-run says) "
                  "train one rank's losses within 2e-5 (worst %.2e)" % w)
        else:
            said = ranks_saying(p.stderr, re.escape(why))
            check(p.returncode != 0 and said == {str(r) for r in range(n)},
                  "split_points %s on pp %d is refused by name on every rank (%s)"
                  % (points, n, p.stderr.strip()[-150:]))
    # HYBRID_SHARD under a pipeline: a stage of fewer ranks than a node shards over its own
    # (4 ranks on one node, pp 2: dp_shard 2 a stage, not the node's 4)
    p, _ = run(4, [plan, "--dry-run"] + sets(["mesh.pp=2", "mesh.dp_shard=-1",
                                                "parallelize.fully_shard.sharding_strategy="
                                                "HYBRID_SHARD"]))
    check(p.returncode == 0 and "mesh pp=2 x dp_replicate=1 x dp_shard=2 x tp=1" in p.stdout, "HYBRID_SHARD with mesh.pp=2 on 4 ranks of a node shards each stage over "
          "its 2 ranks (%s)" % (p.stderr.strip()[-160:] or p.stdout[:200]))
    # the same split and units given on the command line as lists
    _, _, d = dry(2, plan, ["mesh.pp=2", "mesh.dp_shard=1",
                            "pipeline.split_points=[model.layers.1]"])
    _, _, u = dry(1, plan, ["mesh.dp_shard=1",
                            "parallelize.fully_shard.units=[ 'model.layers.*' , model.norm ]"])
    check("pipeline rank 1: stage 1 (blocks 1-3, final norm and head)" in d.stdout and
          re.search(r"^  model\.norm\s+compute", u.stdout, re.M) is not None,
          "--set KEY=[a, b] gives a list: split_points and units from the command line")
    # each schedule's peak on every pipeline rank against --dry-run's estimate, at a size where the
    # activations in flight weigh (dim 128, 64 tokens x 2 samples, 8 microbatches)
    big = os.path.join(tmp, "big.yaml")
    with open(plan) as f, open(big, "w") as g:
        g.write(f.read().replace("dim: 32", "dim: 128").replace("ffn_dim: 64", "ffn_dim: 256")
                .replace("vocab_size: 256", "vocab_size: 512").replace("seq_len: 16", "seq_len: 64")
                .replace("max_seq_len: 64", "max_seq_len: 128").replace("batch_size: 1\n",
                                                                        "batch_size: 2\n")
                .replace("global_batch_size: 4", "global_batch_size: 16")
                .replace("steps: 10", "steps: 3"))
    for what, n, kvs in (("gpipe", 2, ["mesh.pp=2", "pipeline.schedule=gpipe"]),
                         ("1f1b", 2, ["mesh.pp=2"]),
                         ("interleaved_1f1b", 2, ["mesh.pp=2", "pipeline.schedule=interleaved_1f1b"]),
                         ("1f1b, checkpointed blocks", 2,
                          ["mesh.pp=2", "train.activation_checkpointing=true"]),
                         ("pp 4", 4, ["mesh.pp=4"]),
                         ("pp 2 x dp_shard 2", 4, ["mesh.pp=2", "mesh.dp_shard=2"]),
                         ("pp 2 x dp_shard 2, synced every microbatch", 4,
                          ["mesh.pp=2", "mesh.dp_shard=2", "pipeline.sync_every_microbatch=true"])):
        kvs = kvs + ([] if "mesh.dp_shard=2" in kvs else ["mesh.dp_shard=1"])
        m = os.path.join(tmp, "mem-%s.jsonl" % what.replace(" ", "_"))
        p, _ = run(n, [big, "--metrics", m] + sets(kvs))
        rows = losses(m) if p.returncode == 0 else []
        real = [max(r["pp_peak_mem_bytes"][q] for r in rows)
                for q in range(len(rows[0]["pp_peak_mem_bytes"]))] if rows else []
        d, _ = run(n, [big, "--dry-run"] + sets(kvs))  # the whole job: every stage's estimate
        est = {int(x.group(1)): int(x.group(2))
               for x in re.finditer(r"^pp_peak_bytes (\d+) (\d+)$", d.stdout, re.M)}
        planned, _ = run(1, [big, "--dry-run", "--world", str(n)] + sets(kvs))
        first = re.search(r"^peak_bytes (\d+)$", planned.stdout, re.M)
        off = [(est.get(q, 0) - x) / x for q, x in enumerate(real)]
        check(real and len(est) == len(real) and all(abs(o) <= 0.15 for o in off) and
              first is not None and int(first.group(1)) == est.get(0),
              "%s: every pipeline rank's peak within 15%% of --dry-run's estimate for it (%s; "
              "planned from one process, rank 0's the same)"
              % (what, ", ".join("rank %d %+.1f%%" % (q, 100 * o) for q, o in enumerate(off))))
    # checkpoints move between pipeline layouts
    ck, full = os.path.join(tmp, "ck-pp4"), os.path.join(tmp, "pp4-full.jsonl")
    run(4, [plan, "--metrics", full] + sets(["mesh.pp=4", "mesh.dp_shard=1",
                                             "checkpoint.dir=" + ck, "checkpoint.interval=5"]))
    want = [r["loss"] for r in losses(full)][5:] if os.path.exists(full) else []
    for n, kvs, what in ((4, ["mesh.pp=4", "mesh.dp_shard=1"], "pp 4"),
                         (2, ["mesh.pp=2", "mesh.dp_shard=1"], "pp 2"),
                         (1, ["mesh.dp_shard=1"], "one rank"),
                         (4, ["mesh.dp_shard=4"], "FSDP on 4")):
        m = os.path.join(tmp, "resume-%d-%s.jsonl" % (n, what[:2]))
        p, _ = run(n, [plan, "--metrics", m, "--set",
                       "checkpoint.load=" + os.path.join(ck, "step-00000005")] + sets(kvs))
        got = [r["loss"] for r in losses(m)] if p.returncode == 0 else []
        w = max([abs(a - b) / abs(b) for a, b in zip(got, want)] or [1])
        check(len(got) == len(want) == 5 and (got == want if what == "pp 4" else w <= 1e-6),
              "the step-5 checkpoint of pp 4 resumes at %s with the uninterrupted run's losses "
              "(%s)" % (what, "bit for bit" if what == "pp 4" else "worst %.2e" % w))
    # tied embeddings: pp 2 x dp_shard 2's checkpoint (the shared weight saved once) resumes
    # on one rank
    ck2, full2 = os.path.join(tmp, "ck-tied"), os.path.join(tmp, "tied-full.jsonl")
    tied = ["model.tie_embeddings=true"]
    run(4, [plan, "--metrics", full2] + sets(tied + ["mesh.pp=2", "mesh.dp_shard=2",
                                                     "checkpoint.dir=" + ck2,
                                                     "checkpoint.interval=5"]))
    m = os.path.join(tmp, "tied-resumed.jsonl")
    p, _ = run(1, [plan, "--metrics", m, "--set", "checkpoint.load=" +
                   os.path.join(ck2, "step-00000005")] + sets(tied + ["mesh.dp_shard=1"]))
    got = [r["loss"] for r in losses(m)] if p.returncode == 0 else []
    want2 = [r["loss"] for r in losses(full2)][5:] if os.path.exists(full2) else []
    w = max([abs(a - b) / abs(b) for a, b in zip(got, want2)] or [1])
    check(len(got) == len(want2) == 5 and w <= 1e-6,
          "tied embeddings: pp 2 x dp_shard 2's step-5 checkpoint resumes on one rank with the "
          "uninterrupted run's losses (worst %.2e)" % w)
    # fsdp-ckpt reshard lays it out for pp 2 x dp_shard 2, which resumes it
    rs, m = os.path.join(tmp, "ck-pp2dp2"), os.path.join(tmp, "resume-rs.jsonl")
    kvs = ["mesh.pp=2", "mesh.dp_shard=2"]
    q = sh([TOOL, "reshard", os.path.join(ck, "step-00000005"), "--to", plan, rs] + sets(kvs),
           timeout=120)
    said = q.stdout
    if q.returncode == 0:
        q, _ = run(4, [plan, "--metrics", m, "--set", "checkpoint.load=" + rs] + sets(kvs))
    got = [r["loss"] for r in losses(m)] if q.returncode == 0 else []
    w = max([abs(a - b) / abs(b) for a, b in zip(got, want)] or [1])
    check(len(got) == len(want) == 5 and w <= 1e-6 and "for 4 ranks" in said,
          "fsdp-ckpt reshard of pp 4's step-5 checkpoint for pp 2 x dp_shard 2 (4 ranks) resumes "
          "there with the uninterrupted run's losses (worst %.2e)" % w)
    # a plan of mesh: and parallelize: alone (no data section, so one microbatch) lays it
    # out the same: the microbatches lay nothing out
    bare = os.path.join(tmp, "pp-bare.yaml")
    with open(bare, "w") as f:
        f.write("mesh:\n  pp: 2\n  dp_shard: 2\nparallelize:\n  fully_shard:\n"
                "    units: [\"model.layers.*\"]\n")
    rs2 = os.path.join(tmp, "ck-pp2dp2-bare")
    q = sh([TOOL, "reshard", os.path.join(ck, "step-00000005"), "--to", bare, rs2], timeout=120)

    def boxes(folder):
        out = {}
        for name in sorted(os.listdir(os.path.join(folder, "model"))):
            h, _ = st_read(os.path.join(folder, "model", name))
            out[name] = {k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"}
        return out
    check(q.returncode == 0 and os.path.isdir(rs2) and boxes(rs2) == boxes(rs),
          "fsdp-ckpt reshard --to a plan of only mesh: (pp 2) and parallelize: writes the full "
          "plan's files (%s)" % (q.stderr.strip()[-160:] or "ok"))
    # refused by name, before any step
    for kvs, n, why in (
            (["mesh.pp=8", "mesh.dp_shard=1", "data.global_batch_size=8"], 8,
             "8 x pipeline.stages_per_rank 1 = 8 stages outnumber the model's 4 layers"),
            (["mesh.pp=2", "mesh.dp_shard=1", "data.global_batch_size=1"], 2,
             "--set mesh.pp=2: mesh.pp: 2: pipeline schedule 1f1b: 1 microbatch for 2 ranks; "
             "it needs at least as many microbatches as ranks (a step's microbatches are its "
             "micro-batches: data.grad_accum, or data.global_batch_size over data.batch_size x "
             "data-parallel ranks, or pipeline.microbatches)"),
            (["mesh.pp=2", "mesh.dp_shard=1", "model.n_layers=9",
              "pipeline.schedule=interleaved_1f1b"], 2,
             "4 stages do not fit: stages_per_rank must divide the model's 9 layers"),
            (["mesh.pp=2", "mesh.dp_shard=1", "pipeline.microbatches=3",
              "pipeline.split_points=[model.layers.1]"], 2,
             "--set pipeline.microbatches=3: pipeline.microbatches: 3, but the data section "
             "gives 4 micro-batches a step"),
            (["mesh.pp=2", "mesh.dp_shard=1", "pipeline.split_points=[model.layers.0]",
              "pipeline.microbatches=4"], 2,
             "--set pipeline.split_points=[model.layers.0]: pipeline.split_points[0]: "
             "'model.layers.0' does not come after the stage before"),
            (["pipeline.schedule=1f1b"], 2, "pipeline: the section needs mesh.pp above 1"),
            (["mesh.pp=2", "mesh.dp_shard=1", "pipeline.schedule=zb"], 2,
             "'zb' is not a schedule (gpipe, 1f1b, interleaved_1f1b)"),
            (["mesh.pp=2", "mesh.dp_shard=1", "parallelize.fully_shard.offload=true"], 2,
             "mesh.pp: 2 does not compose with offload yet")):
        p, _ = run(n, [plan] + sets(kvs), timeout=60)
        said = ranks_saying(p.stderr, re.escape(why))
        check(p.returncode != 0 and said == {str(r) for r in range(n)},
              "%s on %d ranks is refused by name on every rank (%s)"
              % (" ".join(kvs), n, p.stderr.strip()[-150:]))
    # optim.param_groups name the whole model's parameters: under a pipeline a pattern of one
    # stage's (the head's, the embedding's) trains as on one rank, and one of no stage's is
    # refused alike on every rank
    grouped = os.path.join(tmp, "grouped.yaml")
    with open(grouped, "w") as f:
        f.write(PLAN.format(data=os.path.join(ROOT, "data", "corpus.txt")).replace(
            "  lr: 3.0e-3\n", "  lr: 3.0e-3\n  param_groups:\n    \"lm_head.*\": {lr: 1.0e-3}\n"
            "    \"model.embed_tokens.*\": {weight_decay: 0.0}\n"))
    one, two = os.path.join(tmp, "grouped-one.jsonl"), os.path.join(tmp, "grouped-pp.jsonl")
    run(1, [grouped, "--metrics", one, "--set", "mesh.dp_shard=1"])
    p, _ = run(2, [grouped, "--metrics", two, "--set", "mesh.pp=2", "--set", "mesh.dp_shard=1"])
    got, want = (losses(two) if p.returncode == 0 else []), (losses(one) if os.path.exists(one)
                                                            else [])
    w = worst(want, got)
    check(len(want) == 10 and w <= 2e-5,
          "param_groups of the head and the embedding on pp 2: one rank's losses within 2e-5 "
          "(worst %.2e; %s)" % (w, p.stderr.strip()[-200:]))
    nowhere = os.path.join(tmp, "grouped-nowhere.yaml")
    with open(grouped) as f, open(nowhere, "w") as g:
        g.write(f.read().replace("model.embed_tokens.*", "model.nowhere.*"))
    p, _ = run(2, [nowhere, "--set", "mesh.pp=2", "--set", "mesh.dp_shard=1"], timeout=60)
    said = ranks_saying(p.stderr, re.escape("'model.nowhere.*' matches no parameter of the model"))
    check(p.returncode != 0 and said == {"0", "1"},
          "a param_groups pattern of no stage's parameter: refused by name on every rank (%s)"
          % p.stderr.strip()[-200:])
