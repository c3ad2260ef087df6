"""fsdp-ckpt inspect, export-hf (read by an independent parser) and import-hf, for Llama
and other models' folders."""
import glob
import json
import os
import re
import shutil
import struct
import time

from common import (EXE, ROOT, TOOL, check, edit_header, edit_state, hf_folder, losses, mkdtemp,
                    run, sh, st_read, strip_records)


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
    # a weight stored as integers (the same bytes read as their values: another model)
    ints = os.path.join(tmp, "hf-int")
    shutil.copytree(os.path.join(tmp, "hf-f32"), ints)
    edit_header(os.path.join(ints, "model.safetensors"),
                lambda h: h["lm_head.weight"].update(dtype="I32"))
    for folder, want in [(lacking, re.escape(shards[1])), (twice, r"is in both .*" + extra +
                                                           r"|is in both .*" + shards[0]),
                         (ints, r"tensor 'lm_head\.weight' is stored as I32; the model's "
                                r"parameters are floating point")]:
        bad_cfg = os.path.join(tmp, "init-broken.yaml")
        with open(bad_cfg, "w") as f:
            f.write(text.replace(os.path.join(tmp, "hf-f32"), folder))
        p, _ = run(1, [bad_cfg, "--set", "train.steps=1"], timeout=60)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None,
              "init_from %s: exit %d, says /%s/" % (os.path.basename(folder), p.returncode, want))
        # import-hf alike, before anything is written
        out_dir = os.path.join(tmp, "imported-" + os.path.basename(folder))
        p = sh([TOOL, "import-hf", folder, out_dir], timeout=60)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not os.path.exists(out_dir),
              "import-hf %s: exit %d, says /%s/, writes nothing" % (os.path.basename(folder),
                                                                   p.returncode, want))
    # mistakes: a clear message and a non-zero exit
    for args, want in [(["export-hf", os.path.join(tmp, "nowhere"), os.path.join(tmp, "x")],
                        r"nowhere: not a folder"),
                       (["export-hf", step, os.path.join(tmp, "hf-f32")], r"exists and is not empty"),
                       (["export-hf", step, os.path.join(tmp, "y"), "--dtype", "i32"],
                        r"--dtype: expected f32, bf16 or f16"),
                       (["import-hf", tmp, os.path.join(tmp, "z")], r"config\.json"),
                       (["import-hf", os.path.join(tmp, "hf-f32"), imp], r"already exists"),
                       (["frobnicate", step], r"unknown command 'frobnicate'"),
                       (["import-hf", "", os.path.join(tmp, "z")], r"import-hf: argument 1 is empty"),
                       (["export-hf", step, os.path.join(tmp, "y"), "--max-shard-bytes", " 100"],
                        r"--max-shard-bytes: expected a positive integer, got ' 100'"),
                       (["reshard", step, "--to", os.path.join(ROOT, "configs", "fsdp.yaml"),
                         os.path.join(tmp, "y"), "--world", "100000000"],
                        r"--world: expected a number of ranks from 1 to 1048576, got '100000000'")]:
        p = tool_run(*args)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None,
              "fsdp-ckpt %s: exit %d, says /%s/" % (args[0], p.returncode, want))
    # OUT: an empty folder stays as it was when the export fails, a trailing slash names the
    # same folder, and a path inside what the command reads is refused before anything is
    # written
    empty = os.path.join(tmp, "empty-out")
    os.mkdir(empty)
    damaged = os.path.join(tmp, "damaged-step")
    shutil.copytree(step, damaged)
    shard0 = sorted(glob.glob(os.path.join(damaged, "model", "*.safetensors")))[0]
    with open(shard0, "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    p = tool_run("export-hf", damaged, empty)
    check(p.returncode != 0 and os.path.isdir(empty) and not os.listdir(empty) and
          not glob.glob(empty + ".tmp*"),
          "export-hf of a damaged checkpoint into an empty folder: refused, the folder kept")
    p = tool_run("export-hf", step, empty + "/")
    check(p.returncode == 0 and os.path.isfile(os.path.join(empty, "model.safetensors")),
          "export-hf into an empty folder named with a trailing slash")
    # an empty mount point as OUT (a container's volume): refused before the export is
    # written, since it cannot be renamed onto (where this machine lets the test mount one)
    mnt = os.path.join(tmp, "mount-out")
    os.mkdir(mnt)
    if sh(["sh", "-c", "mount -t tmpfs none \"$0\" 2>/dev/null", mnt], timeout=30).returncode == 0:
        try:
            p = tool_run("export-hf", step, mnt)
            check(p.returncode != 0 and "is a mount point" in p.stderr and not os.listdir(mnt) and
                  not glob.glob(mnt + ".tmp*"),
                  "export-hf into an empty mount point: refused before writing (%s)"
                  % p.stderr.strip()[-200:])
        finally:
            sh(["umount", mnt], timeout=30)
        # a bind mount of a folder of the same file system too
        bind_src = os.path.join(tmp, "bind-source")
        os.mkdir(bind_src)
        if sh(["mount", "--bind", bind_src, mnt], timeout=30).returncode == 0:
            try:
                p = tool_run("export-hf", step, mnt)
                check(p.returncode != 0 and "is a mount point" in p.stderr and
                      not glob.glob(mnt + ".tmp*"),
                      "export-hf into a bind mount: refused before writing (%s)"
                      % p.stderr.strip()[-200:])
            finally:
                sh(["umount", mnt], timeout=30)
    else:
        print("skip  export-hf into a mount point: this machine does not let the test mount one")
    os.makedirs(os.path.join(tmp, "dot-out"))
    p = tool_run("export-hf", step, os.path.join(tmp, "dot-out", "."))
    check(p.returncode != 0 and "ends in '.' or '..': name the folder by its own name" in
          p.stderr and not os.listdir(os.path.join(tmp, "dot-out")),
          "export-hf into 'DIR/.': refused before writing (%s)" % p.stderr.strip()[-200:])
    before = sorted(os.listdir(step)), sorted(os.listdir(os.path.join(step, "model")))
    src_hf = os.path.join(tmp, "hf-f32")
    for op, args in (("export-hf", [step, os.path.join(step, "model", "shard-x.safetensors")]),
                     ("reshard", [step, "--to", os.path.join(ROOT, "configs", "fsdp.yaml"),
                                  "--world", "2", os.path.join(step, "rs")]),
                     ("import-hf", [src_hf, os.path.join(src_hf, "ck")])):
        p = tool_run(op, *args)
        check(p.returncode != 0 and "lies inside" in p.stderr and not os.path.exists(args[-1]),
              "fsdp-ckpt %s into its own input: refused (%s)" % (op, p.stderr.strip()[-120:]))
    check((sorted(os.listdir(step)), sorted(os.listdir(os.path.join(step, "model")))) == before
          and tool_run("verify", step).returncode == 0, "the inputs stay as they were")
    # outputs whose folder's path is 4000 bytes long: written whole into OUT (paths are never
    # cut short, which named a file beside OUT), a file there kept
    deep = tmp
    while len(deep) < 3700:
        deep = os.path.join(deep, "d" * 200)
    deep = os.path.join(deep, "e" * (3999 - len(deep)))
    os.makedirs(deep)
    with open(os.path.join(deep, "config.json"), "w") as f:
        f.write("kept")
    made = ["config.json"]
    for op, args, out in (
            ("export-hf", [step], "o"), ("import-hf", [src_hf], "i"),
            ("reshard", [step, "--to", os.path.join(ROOT, "configs", "fsdp.yaml"), "--world", "2"],
             "r")):
        p = tool_run(op, *(args + [os.path.join(deep, out)]))
        made.append(out)
        check(p.returncode == 0 and open(os.path.join(deep, "config.json")).read() == "kept" and
              sorted(os.listdir(deep)) == sorted(made) and
              len(os.listdir(os.path.join(deep, out))) >= 2,
              "fsdp-ckpt %s into a folder of a 4000-byte path: all of it in OUT (%s)" %
              (op, sorted(os.listdir(deep))))
        if p.returncode != 0:
            print(p.stderr[-600:])
    # the resharded checkpoint keeps the training run's record (a resume under another global
    # batch or data order is warned of, as from the source)
    def under(folder):
        with open(os.path.join(folder, "train_state.json")) as f:
            return json.load(f)["saved_under"]
    src, rs = under(step), under(os.path.join(deep, "r"))
    kept = ("global_batch", "data_order", "schedule")
    check(all(k in src and rs.get(k) == src[k] for k in kept) and
          rs.get("world_size") == 2 and rs.get("resharded_from") == step,
          "reshard keeps the source's global_batch, data_order and schedule, records its new world "
          "(%s)" % {k: rs.get(k) for k in ("global_batch", "data_order", "schedule", "world_size")})
    # inspect shows a record of another tool, whose saved_under is no object, without it
    other = os.path.join(tmp, "other-tool")
    shutil.copytree(step, other)
    strip_records(other)
    edit_state(other, lambda st: st.update(saved_under=[1]))
    p = tool_run("inspect", other)
    check(p.returncode == 0 and "after step 3" in p.stdout,
          "inspect of a checkpoint whose saved_under is a list (rc %d)" % p.returncode)
    # export-hf checks the config it writes against the tensors, as import-hf would
    with open(os.path.join(src_hf, "config.json")) as f:
        tied = json.load(f)
    tied["tie_word_embeddings"] = True
    tied_path, tied_out = os.path.join(tmp, "tied.json"), os.path.join(tmp, "hf-tied")
    with open(tied_path, "w") as f:
        json.dump(tied, f)
    p = tool_run("export-hf", step, tied_out, "--config", tied_path)
    check(p.returncode != 0 and re.search(r"describes another model than the checkpoint's "
                                          r"\(tie", p.stderr)
          and not os.path.exists(tied_out) and not glob.glob(tied_out + ".tmp*"),
          "export-hf --config of a model without the checkpoint's lm_head: refused, no OUT (%s)"
          % p.stderr.strip()[-160:])
    # --config must be a model config (model_type), and the checkpoint's model's
    for name, given, want in [
            ("state", os.path.join(step, "train_state.json"), r"no model_type: not a Hugging Face "
             r"model config"),
            ("bert", {"model_type": "bert"}, r"model_type 'bert', but the checkpoint's tensors "
             r"are a llama model's")]:
        path, out = os.path.join(tmp, name + ".json"), os.path.join(tmp, "hf-" + name)
        if isinstance(given, dict):
            with open(path, "w") as f:
                json.dump(given, f)
        else:
            path = given
        p = tool_run("export-hf", step, out, "--config", path)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not os.path.exists(out), "export-hf --config of %s: refused, no OUT (%s)"
              % (name, p.stderr.strip()[-200:]))
    # verify: a step folder without train_state.json, which every load refuses
    nostate = os.path.join(tmp, "no-state")
    shutil.copytree(step, nostate)
    os.remove(os.path.join(nostate, "train_state.json"))
    p = tool_run("verify", nostate)
    check(p.returncode != 0 and "no train_state.json" in p.stderr,
          "verify of a step folder without train_state.json exits non-zero")
    # export-hf refuses it too (given a config or not); inspect lists it, saying so
    for extra in ([], ["--config", os.path.join(tmp, "hf-f32", "config.json")]):
        out = os.path.join(tmp, "no-state-hf")
        p = tool_run("export-hf", nostate, out, *extra)
        check(p.returncode != 0 and "%s: no train_state.json: not a complete checkpoint, which "
              "every load refuses" % nostate in p.stderr and not os.path.exists(out),
              "export-hf%s of a step folder without train_state.json: refused, no OUT (%s)"
              % (" --config" if extra else "", p.stderr.strip()[-200:]))
    # a checkpoint without checksums (another tool's) that no load would take: a parameter or
    # a moment missing, a parameter of an integer dtype, a step beyond 2^53; verify and
    # reshard refuse it, naming what, and write nothing (before, reshard wrote it out with
    # fresh checksums); the same checkpoint whole passes both
    def unchecked(name, drop=None, retype=None, state=None):
        dst = os.path.join(tmp, name)
        shutil.copytree(step, dst)
        strip_records(dst)

        def edit(path):  # the tensor dropped with its bytes, the rest laid out again
            import struct
            h, data = st_read(path)
            info = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
            info.pop(drop, None)
            h["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
            h.pop(drop, None)
            if retype in h:
                h[retype]["dtype"] = "I32"
            out = b""
            for k in sorted((k for k in h if k != "__metadata__"),
                            key=lambda k: h[k]["data_offsets"][0]):
                b, e = h[k]["data_offsets"]
                h[k]["data_offsets"] = [len(out), len(out) + e - b]
                out += data[b:e]
            hj = json.dumps(h).encode()
            hj += b" " * (-len(hj) % 8)
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(hj)) + hj + out)
        for sub in ("model", "optim"):
            for fname in os.listdir(os.path.join(dst, sub)):
                edit(os.path.join(dst, sub, fname))
        edit_state(dst, lambda st: st.update(state or {}))
        return dst
    q = "model.layers.0.self_attn.q_proj.weight"
    to = os.path.join(ROOT, "configs", "fsdp.yaml")
    for name, kw, said in (
            ("whole", {}, None),
            ("no-q", {"drop": q}, "model: missing tensor '%s'" % q),
            ("no-moment", {"drop": q + ".exp_avg_sq"}, "optim: missing tensor '%s.exp_avg_sq'" % q),
            ("int-q", {"retype": q}, "tensor '%s' is stored as I32, not a float dtype" % q),
            ("huge-step", {"state": {"step": 2 ** 70}}, '"step" is 1.1805916207174113e+21: '
             'expected a whole number of steps from 0 to 2^53')):
        src = unchecked("unchecked-" + name, **kw)
        out = os.path.join(tmp, "unchecked-%s-rs" % name)
        v = tool_run("verify", src)
        r = tool_run("reshard", src, "--to", to, out, "--world", "2")
        if said is None:
            check(v.returncode == 0 and r.returncode == 0 and os.path.isdir(out),
                  "a checkpoint without checksums, whole: verify and reshard take it (%s)"
                  % (v.stderr + r.stderr).strip()[-300:])
            # the reshard keeps the step's metrics line (which a resumed run writes when its
            # file lacks it)
            was, now = ({} if not os.path.isdir(x) else json.load(open(os.path.join(
                x, "train_state.json")))["saved_under"] for x in (src, out))
            check("metrics" in was and now.get("metrics") == was["metrics"],
                  "reshard keeps the step's metrics line: %s" % now.get("metrics"))
        else:
            check(v.returncode != 0 and said in v.stderr and r.returncode != 0 and
                  said in r.stderr and not os.path.exists(out),
                  "a checkpoint without checksums, %s: verify and reshard refuse it, /%s/, no OUT "
                  "(%s)" % (name, said, (v.stderr + r.stderr).strip()[-300:]))
    # a name holding a NUL character (\u0000), which a C string ends at: refused, not read as
    # the name before it
    nul = os.path.join(tmp, "hf-nul")
    shutil.copytree(os.path.join(tmp, "hf-f32"), nul)

    def nul_name(h):
        h[q + "\u0000junk"] = h.pop(q)
    edit_header(os.path.join(nul, "model.safetensors"), nul_name)
    out = os.path.join(tmp, "hf-nul-ck")
    p = tool_run("import-hf", nul, out)
    check(p.returncode != 0 and "holds a NUL character" in p.stderr and not os.path.exists(out),
          "import-hf of a tensor name holding \\u0000: refused, no OUT (%s)"
          % p.stderr.strip()[-200:])
    out = os.path.join(tmp, "bare-hf")  # a folder of tensors only: the model's config asked for
    p = tool_run("export-hf", os.path.join(step, "model"), out)
    check(p.returncode != 0 and "model: no train_state.json, which records the model's config "
          "in a checkpoint fsdp-train saves: give --config CONFIG.json" in p.stderr and
          not os.path.exists(out),
          "export-hf of a folder of tensors only asks for --config (%s)" % p.stderr.strip()[-200:])
    p = tool_run("inspect", nostate)
    check(p.returncode == 0 and "no train_state.json: not a complete checkpoint" in p.stdout and
          "mlp.down_proj.weight" in p.stdout,
          "inspect of a step folder without train_state.json: its tensors, said incomplete")
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
             r"'vocab_size' is given twice"),
            # values a plan refuses: not read as "not given", not infinite
            ("rope_theta -1", variant("theta-m1", {"rope_theta": -1}),
             r"rope_theta must be positive and finite, got -1"),
            ("rope_theta 1e400", variant("theta-inf", raw=json.dumps(dict(cfg, rope_theta=1))
                                         .replace('"rope_theta": 1', '"rope_theta": 1e400')),
             r"'rope_theta' must be a finite number"),
            ("rms_norm_eps 10", variant("eps-10", {"rms_norm_eps": 10}),
             r"rms_norm_eps must be in \(0, 1\], got 10"),
            # two sections of the rotary embedding that disagree: no silent choice
            ("rope_scaling and rope_parameters of other factors", variant("rope-both", {
                "rope_scaling": {"rope_type": "linear", "factor": 2},
                "rope_parameters": {"rope_type": "linear", "factor": 4}}),
             r"'rope_scaling' and 'rope_parameters' give different factor \(2 and 4\)"),
            # model_type: none is a Llama's (checked as one), one that names nothing refused
            ("an empty model_type", variant("type-empty", {"model_type": ""}),
             r"model_type must name the model \(a string such as \"llama\"\), not an empty "
             r"string"),
            ("no model_type and 7 layers", variant("type-none", raw=json.dumps(
                {k: v for k, v in dict(cfg, num_hidden_layers=7).items() if k != "model_type"})),
             r"no tensor 'model\.layers\.2\.input_layernorm\.weight', which config\.json's "
             r"model has"),
            ("num_hidden_layers 1e400", variant("layers-inf", raw=json.dumps(
                dict(cfg, num_hidden_layers=1)).replace('"num_hidden_layers": 1',
                                                        '"num_hidden_layers": 1e400')),
             r"'num_hidden_layers' must be an integer")):
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
    # export-hf --config of another model than the checkpoint's (the same shapes, another
    # rope_theta or heads) is refused: the folder would describe what its tensors did not train
    # as; the checkpoint's own config is taken
    imp = os.path.join(tmp, "imp-for-config")
    p = tool_run("import-hf", src, imp)
    for name, edit in (("rope_theta", {"rope_theta": 500.0}),
                       ("heads", {"num_attention_heads": cfg["num_attention_heads"] * 2,
                                  "num_key_value_heads": cfg["num_key_value_heads"] * 2,
                                  "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]
                                  // 2})):
        other = os.path.join(variant("config-" + name, edit), "config.json")
        out = os.path.join(tmp, "exp-config-" + name)
        q = tool_run("export-hf", imp, out, "--config", other)
        check(p.returncode == 0 and q.returncode != 0 and
              "describes another model than the checkpoint's" in q.stderr and
              not os.path.exists(out),
              "export-hf --config of another %s than the checkpoint's is refused (%s)"
              % (name, q.stderr.strip()[-160:]))
    q = tool_run("export-hf", imp, os.path.join(tmp, "exp-config-same"), "--config",
                 os.path.join(src, "config.json"))
    check(q.returncode == 0, "export-hf --config of the checkpoint's own model writes it")
    # a quantized model's config: the float tensors written are not quantized, so its
    # quantization_config is left out (transformers would read them as quantized), with a note
    quant = os.path.join(variant("config-quant", {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}), "config.json")
    out = os.path.join(tmp, "exp-config-quant")
    q = tool_run("export-hf", imp, out, "--config", quant)
    with open(os.path.join(out, "config.json")) if q.returncode == 0 else open(os.devnull) as f:
        written = f.read()
    check(q.returncode == 0 and "quantization_config is left out" in q.stderr and
          '"hidden_size"' in written and "quantization_config" not in written,
          "export-hf of a quantized model's config leaves quantization_config out (%s)"
          % q.stderr.strip()[-160:])
    # import-hf reads model.safetensors or the index's files only; a Llama's parameters are
    # floating point
    extra = variant("extra-file")
    shutil.copy(os.path.join(extra, "model.safetensors"),
                os.path.join(extra, "consolidated.safetensors"))
    with open(os.path.join(extra, "adapter.safetensors"), "w") as f:
        f.write("junk")
    p = tool_run("import-hf", extra, os.path.join(tmp, "imp-extra"))
    check(p.returncode == 0 and "from 1 file" in p.stdout,
          "import-hf leaves a folder's other .safetensors files unread (%s)" % p.stderr[-200:])
    # with both model.safetensors and an index, model.safetensors is the model (transformers'
    # choice): an index naming a file that is not there is not read
    with open(os.path.join(extra, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    p = tool_run("import-hf", extra, os.path.join(tmp, "imp-both"))
    check(p.returncode == 0 and "from 1 file" in p.stdout,
          "import-hf of a folder with model.safetensors and an index reads model.safetensors, "
          "as transformers does (%s)" % (p.stdout + p.stderr).strip()[-200:])
    ints = variant("int-norm")
    edit_header(os.path.join(ints, "model.safetensors"),
                lambda h: h["model.norm.weight"].update(dtype="I32"))
    p = tool_run("import-hf", ints, os.path.join(tmp, "imp-int"))
    check(p.returncode != 0 and re.search(r"'model\.norm\.weight' is stored as I32", p.stderr) and
          not os.path.exists(os.path.join(tmp, "imp-int")),
          "import-hf of a Llama with an I32 norm weight: refused before writing")
    # export-hf --dtype f16 of a value beyond f16's range (70000 in an f32 norm weight) is
    # refused, naming the tensor, not written as infinity; bf16 holds it
    def norm_first(name, value):  # a folder whose final norm's first weight is value (f32)
        folder = variant(name)
        path = os.path.join(folder, "model.safetensors")
        h, _ = st_read(path)
        with open(path, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(8 + n + h["model.norm.weight"]["data_offsets"][0])
            f.write(struct.pack("<f", value))
        return folder
    big = norm_first("big-norm", 70000.0)
    p = tool_run("import-hf", big, os.path.join(tmp, "imp-big"))
    q = tool_run("export-hf", os.path.join(tmp, "imp-big"), os.path.join(tmp, "big-f16"),
                 "--dtype", "f16")
    r = tool_run("export-hf", os.path.join(tmp, "imp-big"), os.path.join(tmp, "big-bf16"),
                 "--dtype=bf16")  # (an option's value after '=')
    check(p.returncode == 0 and q.returncode != 0 and
          "tensor 'model.norm.weight' has 1 value beyond f16's range (largest magnitude 70000"
          in q.stderr and not os.path.exists(os.path.join(tmp, "big-f16")) and
          r.returncode == 0,
          "export-hf --dtype f16 of a value beyond f16's range is refused, naming the tensor; "
          "bf16 exports it (%s)" % q.stderr.strip()[-200:])
    # starting weights that hold a NaN: the first step's non-finite loss names them, not the
    # learning rate
    nan = norm_first("nan-norm", float("nan"))
    nan_cfg = os.path.join(tmp, "init-nan.yaml")
    with open(nan_cfg, "w") as f:
        f.write(text.replace(src, nan))
    p, _ = run(1, [nan_cfg, "--set", "train.steps=2"], timeout=60)
    check(p.returncode != 0 and re.search(
        r"step 1: the loss is nan and the gradient norm nan at the run's first step, before any "
        r"update of its own: the weights it starts from \(model\.init_from \S+hf-nan-norm\) "
        r"hold non-finite values", p.stderr) is not None,
          "a NaN in model.init_from's weights: the first step's refusal names them (%s)"
          % p.stderr.strip()[-200:])
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
    config = {"model_type": "my_gpt2", "architectures": ["MyGPT2LMHeadModel"], "n_embd": d,
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
    # per-expert tensors of a model it does not know: numbered from 0, each once
    import struct
    gap = os.path.join(tmp, "experts-gap")
    os.mkdir(gap)
    with open(os.path.join(gap, "config.json"), "w") as f:
        json.dump({"model_type": "another"}, f)
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for j in (1, 2):
        header["m.experts.%d.w.weight" % j] = {"dtype": "F32", "shape": [4, 8],
                                               "data_offsets": [len(data), len(data) + 128]}
        data += bytes(128)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(gap, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    p = tool_run("import-hf", gap, os.path.join(tmp, "ck-gap"))
    check(p.returncode != 0 and re.search(r"expert 0 is missing", p.stderr) and
          not os.path.exists(os.path.join(tmp, "ck-gap")),
          "import-hf of experts 1 and 2 without 0: refused (%s)" % p.stderr.strip()[-160:])
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
                              ([], "bad", r"ln_1.*colwise applies to linear, conv1d and "
                                          r"embedding layers, not to a module of kind "
                                          r"'layernorm'")]:
        p = tool_run("reshard", os.path.join(tmp, "ck-fsdp4"), "--to",
                     os.path.join(tmp, plan + ".yaml"), os.path.join(tmp, "never"), *extra)
        check(p.returncode != 0 and re.search(want, p.stderr) is not None and
              not os.path.exists(os.path.join(tmp, "never")) and
              not glob.glob(os.path.join(tmp, "never.tmp*")),
              "reshard %s %s: exit %d, says /%s/ (%s)" % (plan, " ".join(extra), p.returncode,
                                                         want, p.stderr.strip()[-200:]))


FAMILY_TP_PLAN = """\
mesh:
  dp_shard: 2
  tp: 2
parallelize:
  fully_shard:
    units: ["model.layers.*"]
  tensor_parallel:
    sequence_parallel: true
"""
FAMILY_MOE_PLAN = """\
mesh:
  dp_shard: 2
  tp: 2
  ep: 2
parallelize:
  fully_shard:
    units: ["model.layers.*"]
  tensor_parallel:
    sequence_parallel: true
"""
FAMILY_GPT2_TP_PLAN = """\
mesh:
  dp_shard: 2
  tp: 2
parallelize:
  fully_shard:
    units: ["transformer.h.*"]
  tensor_parallel:
    sequence_parallel: true
"""


def saved_chunks(ck, name):
    """Every (shape, offsets) box of tensor name in checkpoint ck's model files."""
    chunks = []
    for fname in sorted(os.listdir(os.path.join(ck, "model"))):
        ch, _ = st_read(os.path.join(ck, "model", fname))
        info = json.loads(ch["__metadata__"]["DCP_SHARDING_INFO"])
        if name in ch:
            chunks.append((ch[name]["shape"], info[name]["saved_offsets"]))
    return chunks


def write_st(path, tensors, order=None):
    """A safetensors file of tensors {name: (dtype, shape, bytes)}, in the order of the names
    in order (sorted by default, as the safetensors library writes them)."""
    import struct
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name in order or sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = {"dtype": dt, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + data)


def gpt2_hub():
    """GPT-2 as the Hub keeps it (saved from GPT2Model: no "transformer." in the names, each
    layer's attention masks attn.bias and attn.masked_bias beside the parameters): init_from
    trains the losses of the prefixed folder, import-hf writes the same checkpoint (the masks
    left out); a tensor under both names, or one missing, is refused by name."""
    import struct
    tmp = mkdtemp()
    hf = hf_folder(tmp, "tiny_gpt2")
    with open(os.path.join(hf, "config.json")) as f:
        pos = json.load(f)["n_positions"]
    head, data = st_read(os.path.join(hf, "model.safetensors"))
    prefixed = {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
                for k, v in head.items() if k != "__metadata__"}
    mask = struct.pack("<%df" % (pos * pos), *[1.0 if c <= r else 0.0
                                                for r in range(pos) for c in range(pos)])
    hub = {k[len("transformer."):] if k.startswith("transformer.") else k: v
           for k, v in prefixed.items()}
    layers = sorted({k.split(".")[1] for k in hub if k.startswith("h.")})
    for i in layers:
        hub["h.%s.attn.bias" % i] = ("F32", [1, 1, pos, pos], mask)
        hub["h.%s.attn.masked_bias" % i] = ("F32", [], struct.pack("<f", -1e4))

    def folder(name, tensors):
        path = os.path.join(tmp, name)
        os.mkdir(path)
        os.symlink(os.path.join(hf, "config.json"), os.path.join(path, "config.json"))
        write_st(os.path.join(path, "model.safetensors"), tensors)
        return path

    hub_dir = folder("hub", hub)
    plan_text = ("model:\n  init_from: %s\nparallelize:\n  fully_shard:\n    units: "
                 "[\"transformer.h.*\"]\ndata:\n  path: %s\n  seq_len: 32\n  batch_size: 1\n"
                 "train:\n  steps: 4\n")
    got = {}
    for tag, src in (("prefixed", hf), ("hub", hub_dir)):
        plan = os.path.join(tmp, tag + ".yaml")
        with open(plan, "w") as f:
            f.write(plan_text % (src, os.path.join(ROOT, "data", "corpus.txt")))
        m = os.path.join(tmp, tag + ".jsonl")
        p, _ = run(2, [plan, "--metrics", m])
        got[tag] = [r["loss"] for r in losses(m)] if p.returncode == 0 else p.stderr[-300:]
    check(isinstance(got["hub"], list) and len(got["hub"]) == 4 and got["hub"] == got["prefixed"],
          "GPT-2 in the Hub's layout (no transformer. prefix, attention masks): model.init_from "
          "trains the prefixed folder's losses bit for bit (%s)" % got["hub"])
    ck_hub, ck_pre = os.path.join(tmp, "ck-hub"), os.path.join(tmp, "ck-prefixed")
    p = sh([TOOL, "import-hf", hub_dir, ck_hub], timeout=120)
    q = sh([TOOL, "import-hf", hf, ck_pre], timeout=120)
    same = p.returncode == 0 and q.returncode == 0 and \
        assemble(os.path.join(ck_hub, "model"))[0] == assemble(os.path.join(ck_pre, "model"))[0]
    check(same and "imported %d tensors" % len(prefixed) in p.stdout,
          "import-hf of the Hub's layout writes the prefixed folder's checkpoint, masks left out "
          "(%s)" % (p.stdout.strip()[-120:] or p.stderr.strip()[-200:]))
    both = dict(hub, **{"transformer.wte.weight": prefixed["transformer.wte.weight"]})
    both_dir = folder("both", both)
    p = sh([TOOL, "import-hf", both_dir, os.path.join(tmp, "ck-both")], timeout=120)
    plan = os.path.join(tmp, "both.yaml")
    with open(plan, "w") as f:
        f.write(plan_text % (both_dir, os.path.join(ROOT, "data", "corpus.txt")))
    q, _ = run(1, [plan])
    check(p.returncode != 0 and "'transformer.wte.weight' is there under two names" in p.stderr
          and q.returncode != 0 and "'transformer.wte.weight' is there under two names" in
          q.stderr and not os.path.exists(os.path.join(tmp, "ck-both")),
          "a folder with wte.weight and transformer.wte.weight is refused by name by import-hf "
          "and init_from (%s / %s)" % (p.stderr.strip()[-100:], q.stderr.strip()[-100:]))
    less = {k: v for k, v in hub.items() if k != "h.0.mlp.c_fc.bias"}
    p = sh([TOOL, "import-hf", folder("less", less), os.path.join(tmp, "ck-less")], timeout=120)
    check(p.returncode != 0 and "no tensor 'transformer.h.0.mlp.c_fc.bias'" in p.stderr,
          "import-hf of a GPT-2 folder without a parameter is refused, naming it (%s)"
          % p.stderr.strip()[-160:])


def ckpt_family():
    """Qwen2, Qwen3, GPT-2 and Qwen3-MoE checkpoints, no model flags given: import-hf of
    tests/reference's folder (Qwen3-MoE's per-expert tensors stacked), inspect and verify,
    reshard to FSDP 2 x TP 2 by the architecture's built-in plan (Qwen3-MoE: with mesh.ep=2,
    each ep rank's two experts of each layer sharded over its tp ranks, as the run saves them)
    (GPT-2's c_attn, [dim, 3 dim] in the folder, kept [dim, 3, dim] and split by head: each
    rank's chunk holds its heads of q, k and v), export-hf back: config.json of its architecture
    and every tensor of the folder bit for bit (the tied lm_head left out, as transformers
    leaves it out; GPT-2's Conv1D weights [in, out] as stored)."""
    tool = lambda *a: sh([TOOL] + list(a), timeout=120)  # noqa: E731
    for tag, model_type in (("tiny_qwen2", "qwen2"), ("tiny_qwen3", "qwen3"),
                            ("tiny_gpt2", "gpt2"), ("tiny_qwen3_moe", "qwen3_moe")):
        tmp = mkdtemp()
        hf = hf_folder(tmp, tag)
        # keys the model does not read (the tokens' ids, a version) go through to the export
        with open(os.path.join(hf, "config.json")) as f:
            extra = dict(json.load(f), bos_token_id=1, eos_token_id=[2, 3], pad_token_id=None,
                         transformers_version="4.51.3")
        os.remove(os.path.join(hf, "config.json"))
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(extra, f)
        ck, tp, out = (os.path.join(tmp, x) for x in ("ck", "ck-tp", "hf-out"))
        plan = os.path.join(tmp, "tp.yaml")
        with open(plan, "w") as f:
            f.write(FAMILY_GPT2_TP_PLAN if "gpt2" in tag else
                    FAMILY_MOE_PLAN if "moe" in tag else FAMILY_TP_PLAN)
        steps = [("import-hf", hf, ck), ("inspect", ck), ("verify", ck),
                 ("reshard", ck, "--to", plan, tp), ("export-hf", tp, out)]
        done = True
        for args in steps:
            p = tool(*args)
            done = done and p.returncode == 0
            if p.returncode != 0:
                print(p.stdout[-1500:], p.stderr[-1500:])
        check(done, "%s: import-hf, inspect, verify, reshard and export-hf run" % tag)
        if not done:
            continue
        if "moe" in tag:  # one stacked tensor per layer's experts in the checkpoint
            p = tool("inspect", ck)
            check(re.search(r"model\.layers\.0\.mlp\.experts\.up_proj\s+F32\s+4x32x64", p.stdout)
                  is not None and "experts.0.up_proj" not in p.stdout,
                  "%s: import-hf stacks each layer's experts into one tensor" % tag)
            chunks = saved_chunks(tp, "model.layers.0.mlp.experts.up_proj")
            want_chunks = [([1, 32, 64], [e, 0, 0]) for e in range(4)]
            check(sorted(chunks) == want_chunks, "%s: resharded for mesh.ep=2 (x tp 2), the "
                  "experts' chunks are %s (want %s: each ep rank's two, sharded over its tp "
                  "ranks as the run's fully_shard shards them)" % (tag, sorted(chunks), want_chunks))
            # another routing (top-k, renormalisation) is another model: refused by name when
            # resumed or resharded to, before anything runs or is written
            with open(os.path.join(hf, "config.json")) as f:
                base = json.load(f)
            for key, value, said in (("num_experts_per_tok", 4, "num_experts_per_tok 2 vs 4"),
                                     ("norm_topk_prob", False, "norm_topk_prob true vs false")):
                other = os.path.join(tmp, key + ".json")
                with open(other, "w") as f:
                    json.dump(dict(base, **{key: value}), f)
                resume = os.path.join(tmp, key + ".yaml")
                with open(resume, "w") as f:
                    f.write("model:\n  config: %s\ndata:\n  path: %s\n  format: text\n"
                            "  seq_len: 16\n  batch_size: 1\ntrain:\n  steps: 1\n"
                            "checkpoint:\n  load: %s\n"
                            % (other, os.path.join(ROOT, "data", "corpus.txt"), ck))
                p = sh([EXE, resume], timeout=120)
                q = tool("reshard", ck, "--to", resume, os.path.join(tmp, "rs-" + key), "--world",
                         "2")
                check(p.returncode != 0 and "was saved from another model (%s: saved vs "
                      "planned)" % said in p.stderr and q.returncode != 0 and
                      "differs from the model of %s (%s" % (resume, said) in q.stderr and
                      not os.path.exists(os.path.join(tmp, "rs-" + key)),
                      "%s: resuming or resharding to a model with another %s is refused, naming "
                      "it (%s / %s)" % (tag, key, p.stderr.strip()[-120:], q.stderr.strip()[-120:]))
        if "gpt2" in tag:  # c_attn by head: [dim / dp, 3, dim / tp] a rank, at its tp offset
            with open(os.path.join(hf, "config.json")) as f:
                d = json.load(f)["n_embd"]
            chunks = saved_chunks(tp, "transformer.h.0.attn.c_attn.weight")
            want_chunks = sorted(([d // 2, 3, d // 2], [r * d // 2, 0, t * d // 2])
                                 for r in range(2) for t in range(2))
            check(sorted(chunks) == want_chunks, "%s: c_attn's chunks under FSDP 2 x TP 2 are "
                  "%s (want %s)" % (tag, sorted(chunks), want_chunks))
        want_h, want_data = st_read(os.path.join(hf, "model.safetensors"))
        h, data = st_read(os.path.join(out, "model.safetensors"))
        names = sorted(k for k in h if k != "__metadata__")
        same = names == sorted(k for k in want_h if k != "__metadata__") and all(
            h[k]["shape"] == want_h[k]["shape"] and
            data[h[k]["data_offsets"][0]:h[k]["data_offsets"][1]] ==
            want_data[want_h[k]["data_offsets"][0]:want_h[k]["data_offsets"][1]] for k in names)
        check(same, "%s: export-hf after a reshard gives the folder's %d tensors bit for bit%s"
              % (tag, len(names), " (lm_head.weight left out: tied)" if tag in (
                  "tiny_qwen3", "tiny_gpt2") else ""))
        if "moe" in tag:  # in several files: each layer's experts together, the same bytes
            split = os.path.join(tmp, "hf-split")
            p = tool("export-hf", tp, split, "--max-shard-bytes", "40000")
            with open(os.path.join(split, "model.safetensors.index.json")) as f:
                where = json.load(f)["weight_map"]
            split_data = {}
            for name in sorted(set(where.values())):
                sh_h, sh_data = st_read(os.path.join(split, name))
                for k, t in sh_h.items():
                    if k != "__metadata__":
                        b, e = t["data_offsets"]
                        split_data[k] = (t["shape"], sh_data[b:e], where.get(k) == name)
            files_of = lambda layer, proj: {where.get(k) for k in where  # noqa: E731
                                            if ".%d.mlp.experts." % layer in k and proj in k}
            check(p.returncode == 0 and len(set(where.values())) > 2 and
                  sorted(split_data) == names and all(
                      split_data[k][0] == want_h[k]["shape"] and split_data[k][2] and
                      split_data[k][1] == want_data[want_h[k]["data_offsets"][0]:
                                                    want_h[k]["data_offsets"][1]]
                      for k in names) and
                  all(len(files_of(0, proj)) == 1 for proj in ("up_proj", "gate_proj")),
                  "%s: export-hf --max-shard-bytes 40000 writes the same tensors into %d files, "
                  "the index naming each one's file and a layer's experts in one file"
                  % (tag, len(set(where.values()))))
            # experts in any order and split over files (safetensors writes names sorted, so
            # experts.10 before experts.2): experts 3 and 2 in one file, in that order, the
            # rest in another; imported and exported back, the same bytes. Experts 3 and 1
            # in one file are refused, naming the gap
            mixed = os.path.join(tmp, "hf-mixed")
            os.makedirs(mixed)
            shutil.copy(os.path.join(hf, "config.json"), mixed)
            tensors = {k: (t["dtype"], t["shape"], want_data[t["data_offsets"][0]:
                                                           t["data_offsets"][1]])
                       for k, t in want_h.items() if k != "__metadata__"}
            one = [k for k in tensors if re.search(r"\.experts\.[23]\.", k)]
            one.sort(key=lambda k: -int(re.search(r"\.experts\.(\d+)\.", k).group(1)))
            write_st(os.path.join(mixed, "a.safetensors"), {k: tensors[k] for k in one}, one)
            rest = [k for k in tensors if k not in one]
            rest.sort(key=lambda k: (re.sub(r"\.experts\.\d+\.", ".", k), -len(k), k),
                      reverse=True)
            write_st(os.path.join(mixed, "b.safetensors"), {k: tensors[k] for k in rest}, rest)
            with open(os.path.join(mixed, "model.safetensors.index.json"), "w") as f:
                json.dump({"weight_map": dict({k: "a.safetensors" for k in one},
                                              **{k: "b.safetensors" for k in rest})}, f)
            back = os.path.join(tmp, "hf-mixed-back")
            p = tool("import-hf", mixed, os.path.join(tmp, "ck-mixed"))
            q = tool("export-hf", os.path.join(tmp, "ck-mixed"), back) if p.returncode == 0 \
                else p
            h2, data2 = st_read(os.path.join(back, "model.safetensors")) \
                if q.returncode == 0 else ({}, b"")
            check(sorted(k for k in h2 if k != "__metadata__") == names and all(
                data2[h2[k]["data_offsets"][0]:h2[k]["data_offsets"][1]] == tensors[k][2]
                for k in names),
                  "%s: import-hf of experts in another order, split over two files (3 and 2 in "
                  "one), exports back the same tensors bit for bit (%s)"
                  % (tag, (p.stderr + q.stderr).strip()[-200:]))
            gap = [k for k in tensors if re.search(r"\.experts\.[13]\.", k)]
            write_st(os.path.join(mixed, "a.safetensors"), {k: tensors[k] for k in gap})
            rest = [k for k in tensors if k not in gap]
            write_st(os.path.join(mixed, "b.safetensors"), {k: tensors[k] for k in rest})
            with open(os.path.join(mixed, "model.safetensors.index.json"), "w") as f:
                json.dump({"weight_map": dict({k: "a.safetensors" for k in gap},
                                              **{k: "b.safetensors" for k in rest})}, f)
            p = tool("import-hf", mixed, os.path.join(tmp, "ck-gap"))
            check(p.returncode != 0 and re.search(
                r"a\.safetensors: the experts of 'model\.layers\.\d\.mlp\.experts\.\w+' in this "
                r"file are not consecutive \(1, then 3\)", p.stderr) and
                  not os.path.exists(os.path.join(tmp, "ck-gap")),
                  "%s: import-hf of a file holding experts 1 and 3 of a tensor is refused, naming "
                  "the gap (%s)" % (tag, p.stderr.strip()[-200:]))
            # a layer's experts both stacked and one tensor per expert: refused, naming it
            both = os.path.join(tmp, "hf-both-forms")
            os.makedirs(both)
            shutil.copy(os.path.join(hf, "config.json"), both)
            per = sorted(k for k in tensors if ".0.mlp.experts." in k and ".up_proj." in k)
            stacked = dict(tensors)
            stacked["model.layers.0.mlp.experts.up_proj"] = (
                tensors[per[0]][0], [len(per)] + tensors[per[0]][1],
                b"".join(tensors[k][2] for k in sorted(per, key=lambda k: int(
                    re.search(r"\.experts\.(\d+)\.", k).group(1)))))
            write_st(os.path.join(both, "model.safetensors"), stacked)
            p = tool("import-hf", both, os.path.join(tmp, "ck-both"))
            check(p.returncode != 0 and "tensor 'model.layers.0.mlp.experts.up_proj' is there "
                  "both whole and one tensor per expert" in p.stderr and
                  not os.path.exists(os.path.join(tmp, "ck-both")),
                  "%s: import-hf of experts both stacked and per expert is refused, naming the "
                  "tensor (%s)" % (tag, p.stderr.strip()[-200:]))
        with open(os.path.join(out, "config.json")) as f:
            got = json.load(f)
        with open(os.path.join(hf, "config.json")) as f:
            want = json.load(f)
        keys = ("model_type", "architectures", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta",
                "n_embd", "n_layer", "n_head", "n_positions", "activation_function",
                "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")
        diff = [k for k in keys if k in want and got.get(k) != want[k]]
        check(got.get("model_type") == model_type and not diff,
              "%s: export-hf writes a %s config.json (differs in: %s)"
              % (tag, model_type, ", ".join(diff) or "nothing"))
        if tag == "tiny_qwen3":  # a run from model.init_from records them too
            init, ckd = os.path.join(tmp, "init.yaml"), os.path.join(tmp, "ck-init")
            with open(init, "w") as f:
                f.write("model:\n  init_from: %s\ndata:\n  path: %s\n  format: text\n"
                        "  seq_len: 16\n  batch_size: 1\ntrain:\n  steps: 1\ncheckpoint:\n"
                        "  dir: %s\n" % (hf, os.path.join(ROOT, "data", "corpus.txt"), ckd))
            p = sh([EXE, init], timeout=120)
            q = tool("export-hf", os.path.join(ckd, "step-00000001"),
                     os.path.join(tmp, "hf-init")) if p.returncode == 0 else p
            got = {}
            if q.returncode == 0:
                with open(os.path.join(tmp, "hf-init", "config.json")) as f:
                    got = json.load(f)
            check(got.get("eos_token_id") == [2, 3] and got.get("bos_token_id") == 1 and
                  got.get("transformers_version") == "4.51.3",
                  "%s: a checkpoint trained from model.init_from exports the folder's token ids "
                  "and version (%s)" % (tag, (p.stderr + q.stderr).strip()[-200:]))
            # and so does one from model.config naming the folder, saving every step, then a
            # run that resumes its checkpoint with the architecture's keys (the record's)
            cfg_plan, ckc = os.path.join(tmp, "config.yaml"), os.path.join(tmp, "ck-config")
            corpus = os.path.join(ROOT, "data", "corpus.txt")
            with open(cfg_plan, "w") as f:
                f.write("model:\n  config: %s\ndata:\n  path: %s\n  format: text\n"
                        "  seq_len: 16\n  batch_size: 1\ntrain:\n  steps: 2\ncheckpoint:\n"
                        "  dir: %s\n  interval: 1\n" % (hf, corpus, ckc))
            keys_plan, ckk = os.path.join(tmp, "keys.yaml"), os.path.join(tmp, "ck-keys")
            with open(keys_plan, "w") as f:
                f.write("model:\n  architecture: qwen3\n  dim: 64\n  n_layers: 2\n  n_heads: 4\n"
                        "  n_kv_heads: 2\n  head_dim: 24\n  ffn_dim: 160\n  vocab_size: 256\n"
                        "  max_seq_len: 64\n  rope_theta: 1000000.0\n  norm_eps: 1.0e-6\n"
                        "  tie_embeddings: true\ndata:\n  path: %s\n  format: text\n"
                        "  seq_len: 16\n  batch_size: 1\ntrain:\n  steps: 3\ncheckpoint:\n"
                        "  dir: %s\n  load: %s\n" % (corpus, ckk,
                                                    os.path.join(ckc, "step-00000002")))
            outs = []
            for plan_file, step in ((cfg_plan, os.path.join(ckc, "step-00000001")),
                                    (keys_plan, os.path.join(ckk, "step-00000003"))):
                p = sh([EXE, plan_file], timeout=120)
                dest = os.path.join(tmp, "hf-" + os.path.basename(plan_file)[:-5])
                q = tool("export-hf", step, dest) if p.returncode == 0 else p
                got = {}
                if q.returncode == 0:
                    with open(os.path.join(dest, "config.json")) as f:
                        got = json.load(f)
                outs.append(got.get("eos_token_id") == [2, 3] or
                            (p.stderr + q.stderr).strip()[-200:])
            check(outs == [True, True], "%s: model.config naming the folder saves every step "
                  "and exports its token ids, and a resume by the architecture's keys keeps them "
                  "(%s)" % (tag, outs))
