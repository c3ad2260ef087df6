"""fsdp-plot's and --plot's SVG, and plans converted from Accelerate and DeepSpeed configs
(fsdp-plan) trained and read back as their own tools read them."""
import glob
import json
import math
import os
import re
import shutil
import time

from common import (BASE, EXE, ROOT, check, losses, mkdtemp, run, sh)


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
    strloss = os.path.join(tmp, "strloss.jsonl")
    with open(strloss, "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": "abc"}\n')
    for args, want in [([a, os.path.join(tmp, "missing.jsonl")], r"missing\.jsonl"),
                       ([strloss], r"strloss\.jsonl:2: 'loss' is not a number"),
                       ([a, "-o", os.path.join(tmp, "y.svg")],
                        r"-o: the output is already given"),
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
    # -o replaces a plot, not another file: a metrics file named there by mistake is kept
    kept = open(b).read()
    e = sh([plot, a, "-o", b], timeout=60)
    check(e.returncode != 0 and "-o '%s': exists and is not an SVG plot (it begins '{" % b
          in e.stderr and open(b).read() == kept,
          "fsdp-plot -o naming a metrics file: refused, the file untouched (%s)"
          % e.stderr.strip()[-200:])
    # a lone point is a dot; a line without a value does not break the curve (a null does);
    # steps out of order are drawn in order, a step given twice by its last line, said; runs
    # beyond the ten colours are dashed
    def write(name, rows):
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        return path
    lone = write("lone.jsonl", [{"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0,
                                 "tokens_per_s": 10.0}])
    evalonly = write("evalonly.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "eval_loss": 2.5},
                                        {"step": 3, "loss": 2.0}])
    shuffled = write("shuffled.jsonl", [{"step": 3, "loss": 1.0}, {"step": 1, "loss": 9.0},
                                        {"step": 2, "loss": 2.0}, {"step": 1, "loss": 3.0}])
    many = [write("m%d.jsonl" % i, [{"step": 1, "loss": 1.0 + i}, {"step": 2, "loss": 0.5 + i}])
            for i in range(11)]
    got = {}
    for name, files in (("lone", [lone]), ("evalonly", [evalonly]), ("shuffled", [shuffled]),
                        ("many", many)):
        svg = os.path.join(tmp, name + ".svg")
        e = sh([plot] + files + ["-o", svg], timeout=60)
        root = ET.parse(svg).getroot() if e.returncode == 0 else None
        loss = [g for g in root.iter(ns + "g") if g.get("id") == "loss"][0] if root else None
        got[name] = (e, root, loss)
    e, root, loss = got["lone"]
    check(root is not None and len([c for c in root.iter(ns + "circle")
                                    if c.get("class") == "run0"]) == 4,
          "a run of one step is a dot in each panel")
    e, root, loss = got["evalonly"]
    check(loss is not None and [len(pl.get("points").split()) for pl in loss.iter(ns + "polyline")]
          == [2], "a line with an evaluation alone leaves the loss curve whole")
    e, root, loss = got["shuffled"]
    pts = [tuple(map(float, pt.split(","))) for pl in loss.iter(ns + "polyline")
           for pt in pl.get("points").split()] if loss is not None else []
    check(len(pts) == 3 and pts[0][0] < pts[1][0] < pts[2][0] and pts[0][1] < pts[1][1] and
          "its steps are not in order, and some are given more than once" in e.stderr and
          any("(3 steps)" in (t.text or "") for t in root.iter(ns + "text")),
          "steps out of order are drawn in order, step 1 by its last line (%s)" % pts)
    e, root, loss = got["many"]
    dashed = {pl.get("class") for pl in loss.iter(ns + "polyline")
              if pl.get("stroke-dasharray")} if loss is not None else set()
    check(dashed == {"run10"}, "the eleventh run is dashed, the first ten not (%s)" % dashed)
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
optim:
  clip_grad_norm: 0
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
    for k, (name, n, hand, said) in enumerate(CONVERTED):
        src = os.path.join(ROOT, "tests", "convert", name)
        out = os.path.join(tmp, name + ".plan.yaml")
        # -o, --output and --output= alike
        o = [["-o", out], ["--output", out], ["--output=" + out]][k % 3]
        p = sh([tool, "convert", src] + o, timeout=60)
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
    # -o replaces a plan it wrote (edited since: the model added above), not another file
    # (the hand-written plan, a metrics file)
    src = os.path.join(ROOT, "tests", "convert", CONVERTED[0][0])
    again = os.path.join(tmp, CONVERTED[0][0] + ".plan.yaml")
    p = sh([tool, "convert", src, "-o", again], timeout=60)
    check(p.returncode == 0 and CONVERT_MODEL not in open(again).read(),
          "fsdp-plan convert -o replaces the plan it wrote (exit %d)" % p.returncode)
    for mine in (os.path.join(tmp, CONVERTED[0][0] + ".hand.yaml"),
                 os.path.join(tmp, "%s.hand.jsonl" % CONVERTED[0][0])):
        kept = open(mine, "rb").read()
        p = sh([tool, "convert", src, "-o", mine], timeout=60)
        check(p.returncode != 0 and re.search(r"-o '%s': exists and is not a plan fsdp-plan "
                                              r"wrote \(it begins '" % re.escape(mine),
                                              p.stderr) is not None and
              open(mine, "rb").read() == kept,
              "fsdp-plan convert -o %s: refused, the file untouched (%s)"
              % (os.path.basename(mine), p.stderr.strip()[-200:]))
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
    with open(os.path.join(tmp, "ds-nostage.json"), "w") as f:
        f.write('{"zero_optimization": {}}')
    with open(os.path.join(tmp, "ds-nozero.json"), "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2}')
    with open(os.path.join(tmp, "acc-dsnozero.yaml"), "w") as f:
        f.write("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                "  deepspeed_config_file: ds-nozero.json\n")
    with open(os.path.join(tmp, "ds-auto.json"), "w") as f:
        f.write('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto"}}')
    bomb = "distributed_type: FSDP\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        "a%d: &a%d [%s]\n" % (i, i, ", ".join(["*a%d" % (i - 1)] * 10)) for i in range(1, 8))
    # (name, file, text, regexes the plan (stdout) must hold, regexes it must not, stderr's)
    cases = [
        ("bf16 'auto' in a DeepSpeed config", "auto.json",
         '{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "auto"}}',
         [r"#   bf16\.enabled: 'auto': the Hugging Face Trainer fills it"],
         [r"^\s+param_dtype:"], []),
        ("an Accelerate config naming a deepspeed_config_file", "acc-dsfile.yaml",
         "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
         "  deepspeed_config_file: ds-file.json\n",
         [r"zero_stage: 3", r"batch_size: 2", r"with its DeepSpeed config \S*ds-file\.json",
          r"clip_grad_norm: 0  # .*gradient_clipping not given: DeepSpeed does not clip"],
         [r"deepspeed_config_file: no equivalent"], []),
        ("fp16 'auto' in the deepspeed_config_file of an Accelerate config", "acc-dsauto.yaml",
         "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
         "  deepspeed_config_file: ds-auto.json\n",
         [r"fp16\.enabled: 'auto': Accelerate fills it from accelerate launch --mixed_precision"],
         [r"translated above", r"^\s+param_dtype:"], []),
        ("no ZeRO stage in the deepspeed_config_file of an Accelerate config: DeepSpeed's 0",
         "acc-dsnostage.yaml",
         "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
         "  deepspeed_config_file: ds-nostage.json\n",
         [r"sharding_strategy: NO_SHARD  # zero_optimization\.stage not given: DeepSpeed's "
          r"default 0"], [r"Accelerate's default"], []),
        ("a null deepspeed_config_file (a template's): Accelerate's own section",
         "acc-dsnull.yaml",
         "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: null\n",
         [r"zero_stage: 2  # deepspeed_config\.zero_stage not given: Accelerate's default 2"],
         [r"DeepSpeed's default", r"clip_grad_norm: 0"], []),
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
         [r'units: \["model\.layers\.\*", "transformer\.h\.\*"\]  # .*one pattern per model'],
         [r"units are FQN patterns"], []),
        ("GPT-2's layer class", "acc-gpt2.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
         "  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n",
         [r'units: \["transformer\.h\.\*"\]  # .*GPT2Block'], [r"units are FQN patterns"], []),
        ("Qwen3-MoE's layer class", "acc-qwen3moe.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
         "  fsdp_transformer_layer_cls_to_wrap: Qwen3MoeDecoderLayer\n",
         [r'units: \["model\.layers\.\*"\]  # .*Qwen3MoeDecoderLayer'], [], []),
        ("a layer class of another model", "acc-other.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
         "  fsdp_transformer_layer_cls_to_wrap: MyBlock\n",
         [r"'MyBlock': units are FQN patterns", r"the plan has no units, so the whole model"],
         [r"^\s+units:"], []),
        ("NO_WRAP", "acc-nowrap.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n",
         [r"units: \[\]  # .*the whole model is gathered at once"], [], []),
        ("MiCS at stage 3: HSDP", "mics.json", '{"zero_optimization": {"stage": 3, '
                                               '"mics_shard_size": 2}}',
         [r"dp_shard: 2", r"dp_replicate: -1", r"sharding_strategy: HYBRID_SHARD"],
         [r"zero_stage:"], []),
        ("stage-3 settings at stage 2: listed", "stage2-only3.json",
         '{"zero_optimization": {"stage": 2, "mics_shard_size": 2, "zero_hpz_partition_size": 2, '
         '"offload_param": {"device": "cpu"}}}',
         [r"mics_shard_size: MiCS applies at ZeRO stage 3 only",
          r"zero_hpz_partition_size: 2: hpZ applies at ZeRO stage 3 only",
          r"offload_param: parameters are offloaded at ZeRO stage 3 only"],
         [r"dp_replicate", r"offload: true", r"reshard_after_forward"], []),
        ("no ZeRO stage: DeepSpeed's default, 0", "nostage.json",
         '{"train_micro_batch_size_per_gpu": 2}',
         [r"sharding_strategy: NO_SHARD  # zero_optimization\.stage not given: DeepSpeed's "
          r"default 0"], [], []),
        ("betas 'auto' (Hugging Face's template)", "betas-auto.json",
         '{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": '
         '{"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}}',
         [r"#   optimizer\.params\.betas: 'auto': taken from the training script"],
         [r"beta1:"], []),
        ("settings of no equivalent listed, each", "leftovers.json",
         '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "loss_scale": 0}, '
         '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": true}}, '
         '"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "foo": 1}}}',
         [r"#   fp16\.loss_scale: no equivalent here", r"#   optimizer\.params\.amsgrad: no "
          r"equivalent here", r"#   scheduler\.params\.foo: no equivalent here",
          r"#   scheduler\.params\.total_num_steps: not given \(DeepSpeed requires it"], [], []),
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
         [r"min_lr_ratio: 1\.0  # scheduler\.type WarmupLR", r"warmup_steps: 5",
          r"^  lr: 0\.001  # scheduler\.params\.warmup_max_lr not given: DeepSpeed's 1e-3"],
         [r"linear warmup then cosine decay"], []),
        # WarmupLR's peak is its warmup_max_lr, whatever the optimizer's lr
        ("WarmupLR's warmup_max_lr", "warmupmax.json",
         '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": '
         '{"lr": 0.0001}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, '
         '"warmup_max_lr": 0.001, "warmup_num_steps": 5, "warmup_type": "linear"}}}',
         [r"^  lr: 0\.001  # scheduler\.params\.warmup_max_lr$"], [r"^  lr: 0\.0001"], []),
        # what a DeepSpeed file leaves out is DeepSpeed's default, not this plan's
        ("DeepSpeed's defaults", "ds-defaults.json",
         '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": '
         '{"lr": 1e-4}}, "scheduler": {"type": "WarmupCosineLR", "params": '
         '{"total_num_steps": 100}}}',
         [r"^  clip_grad_norm: 0  # gradient_clipping not given: DeepSpeed does not clip",
          r"^  beta2: 0\.999  # optimizer\.params\.betas not given",
          r"^  weight_decay: 0  # optimizer\.params\.weight_decay not given: DeepSpeed's 0",
          r"^  min_lr_ratio: 0\.0001  # scheduler\.params\.cos_min_ratio not given",
          r"^  warmup_steps: 1000  # scheduler\.params\.warmup_num_steps not given",
          r"scheduler\.params\.warmup_type: 'log': the warmup here is linear"], [], []),
        ("no optimizer or scheduler section", "ds-none.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}',
         [r"#   optimizer: not in the config: the training script's",
          r"#   scheduler: not in the config: the training script's"], [r"^  lr:"], []),
        ("Adam with L2 regularisation", "adam-l2.json",
         '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": '
         '{"lr": 0.001, "adam_w_mode": false}}}',
         [r"adam_w_mode: false: Adam with L2 regularisation there"], [], []),
        ("the legacy bfloat16 section", "bfloat16.json",
         '{"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": true}}',
         [r"param_dtype: bf16  # bfloat16\.enabled"], [r"bfloat16: no equivalent"], []),
        ("MiCS", "mics.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"mics_shard_size": 2}}',
         [r"^  dp_shard: 2  # zero_optimization\.mics_shard_size",
          r"^  dp_replicate: -1  # zero_optimization\.mics_shard_size"], [r"bucket or overlap"],
         []),
        ("the deprecated cpu_offload_param", "legacy-offload.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"cpu_offload": true, "cpu_offload_param": true}}',
         [r"^    offload: true  # zero_optimization\.cpu_offload"], [r"bucket or overlap"], []),
        ("Accelerate's optimizer-only offload", "acc-offload-opt.yaml",
         "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
         "  offload_optimizer_device: cpu\n",
         [r"offload_optimizer_device: device cpu for the optimizer alone"],
         [r"^\s+offload: true"], []),
        ("TRANSFORMER_BASED_WRAP without a class", "acc-noclass.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
         "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n",
         [r'units: \["model\.layers\.\*"\]  # .*_no_split_modules'], [], []),
        ("YAML's booleans and nulls", "acc-yaml.yaml",
         "distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: on\n"
         "  fsdp_sharding_strategy: ~\nmixed_precision: null\n",
         [r"^    offload: true"], [r"'~'", r"'null'"], []),
        ("train_batch_size alone", "tbs.json", '{"train_batch_size": 16}',
         [r"^  global_batch_size: 16", r"#   train_batch_size: without "
          r"train_micro_batch_size_per_gpu, DeepSpeed derives the micro-batch"], [], []),
        ("launcher settings", "acc-launch.yaml",
         "distributed_type: FSDP\nnum_machines: 2\nmachine_rank: 0\nnum_processes: 8\n",
         [r"#   num_machines: '2': a launcher setting.*--ranks-per-node",
          r"#   machine_rank: a launcher setting"], [], []),
        ("stage3_gather_16bit_weights_on_model_save", "gather16.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, '
         '"stage3_gather_16bit_weights_on_model_save": true}}',
         [r"stage3_gather_16bit_weights_on_model_save: a save format.*export-hf"],
         [r"bucket or overlap"], []),
        ("a key given twice", "twice.json",
         '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "stage": 3}}',
         [r"zero_stage: 3"], [r"zero_stage: 2"],
         [r"zero_optimization\.stage is given more than once; the last value is taken"]),
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
    # refused as the tools refuse them; an output that is the DeepSpeed file the config names
    # is an input
    with open(os.path.join(tmp, "acc-fsdp2-int.yaml"), "w") as f:
        f.write("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                "  fsdp_reshard_after_forward: 2\n")
    with open(os.path.join(tmp, "bad-sizes.json"), "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 0, "gradient_clipping": -1}')
    with open(os.path.join(tmp, "uneven.json"), "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, '
                '"train_batch_size": 15}')
    with open(os.path.join(tmp, "both.json"), "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, '
                '"fp16": {"enabled": true}}')
    with open(os.path.join(tmp, "acc-conflict.yaml"), "w") as f:
        f.write("distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n"
                "  deepspeed_config_file: ds-file.json\n  zero_stage: 2\n")
    with open(os.path.join(tmp, "acc-strategy.yaml"), "w") as f:
        f.write("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                "  fsdp_reshard_after_forward: true\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    # values DeepSpeed itself refuses: every one named, nothing written
    with open(os.path.join(tmp, "invalid.json"), "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": '
                '{"lr": 0.001, "betas": "0.9"}}, "zero_optimization": {"stage": 5, '
                '"zero_hpz_partition_size": 2.5}}')
    with open(ds) as f:
        ds_text = f.read()
    for args, want in (
            (["invalid.json", "-o", os.path.join(tmp, "invalid.yaml")],
             r"invalid\.json \(a DeepSpeed config\): 3 settings are not valid there; nothing was "
             r"written\n  zero_optimization\.zero_hpz_partition_size: '2\.5' is not a whole number "
             r"of ranks\n  zero_optimization\.stage: stage '5' is not a ZeRO stage \(0, 1, 2 or "
             r"3\)\n  optimizer\.params\.betas: not a pair of numbers"),
            (["both.json"], r"bf16 and fp16 are both enabled: DeepSpeed refuses that"),
            (["bad-sizes.json"],
             r"train_micro_batch_size_per_gpu: '0' is not a whole number of at least 1\n"
             r"  gradient_clipping: '-1' is not a finite number of at least 0"),
            (["uneven.json"], r"train_batch_size: 15 is not a whole number of data-parallel "
                              r"ranks' 4 samples"),
            (["acc-fsdp2-int.yaml"], r"fsdp_config\.fsdp_reshard_after_forward: '2' under "
                                     r"fsdp_version 2, which takes true or false"),
            (["acc-strategy.yaml"], r"fsdp_config\.fsdp_reshard_after_forward: 'true' disagrees "
                                    r"with fsdp_config\.fsdp_sharding_strategy SHARD_GRAD_OP"),
            (["acc-conflict.yaml"], r"deepspeed_config\.zero_stage, mixed_precision beside "
                                    r"deepspeed_config\.deepspeed_config_file: Accelerate "
                                    r"refuses them"),
            (["acc-dsfile.yaml", "-o", ds], r"-o .*ds-file\.json.*its deepspeed_config_file"),
            (["acc-dsnozero.yaml"], r"its deepspeed_config_file \S*ds-nozero\.json has no "
                                    r"zero_optimization section: Accelerate refuses such a file")):
        e = sh([tool, "convert", os.path.join(tmp, args[0])] + args[1:], timeout=60)
        with open(ds) as f:
            kept = f.read() == ds_text
        check(e.returncode != 0 and re.search(want, e.stderr) is not None and kept and
              not os.path.exists(os.path.join(tmp, "invalid.yaml")),
              "fsdp-plan convert %s: refused /%s/, the DeepSpeed file kept"
              % (" ".join(os.path.basename(a) for a in args), want))
        if e.returncode == 0 or not re.search(want, e.stderr):
            print(e.stderr[-400:])
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
