"""The damage table: every damage x resume on 1 and 3 ranks and every fsdp-ckpt command
that reads it."""
import glob
import json
import os
import re
import shutil
import subprocess

from common import (RANKS, ROOT, TOOL, check, edit_file, edit_header, edit_state, mkdtemp, run,
                    sh, strip_records)


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

    def extra_tensor(raw):  # a tensor no parameter names, its data appended
        (n,) = struct.unpack("<Q", raw[:8])
        h, data = json.loads(raw[8:8 + n]), raw[8 + n:]
        name = "model.layers.9.mlp.up_proj.weight"
        h[name] = {"dtype": "F32", "shape": [2, 4], "data_offsets": [len(data), len(data) + 32]}
        sharding(h, lambda i: i.__setitem__(name, {"saved_offsets": [0, 0]}))
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + data + bytes(32)

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
        ("no records, a tensor no parameter names",
         lambda d: (strip_records(d), edit_file(m0(d), extra_tensor)),
         r"'model\.layers\.9\.mlp\.up_proj(\.weight)?'", ("resume-1", "resume-3", "verify",
                                                            "export-hf", "reshard")),
        ("no records, the recorded model not valid (0 heads)",
         lambda d: (strip_records(d), edit_state(
             d, lambda st: st["saved_under"]["model"].__setitem__("num_attention_heads", 0))),
         r"num_attention_heads must be a size from 1 to 65536, got 0",
         ("resume-1", "resume-3", "verify", "export-hf", "reshard")),
        ("train_state.json: the step changed",
         lambda d: edit_state(d, lambda st: st.__setitem__("step", 3)),
         r"train_state\.json does not match its checksum", ALL),
        ("train_state.json: bytes after its object",
         lambda d: edit_file(os.path.join(d, "train_state.json"), lambda raw: raw + b"garbage{{"),
         r"train_state\.json: not a JSON object \(alone", ALL),
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
