"""Damaged checkpoints given to fsdp-train: named errors; hostile headers, non-finite
steps, load: auto, the watchdog, verify."""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import time

from common import (EXE, MPIRUN, MPI_ARGS, RANKS, ROOT, TOOL, check, header_edit, kill_session,
                    edit_state, mkdtemp, rank_set, ranks_saying, run, sh, strip_records)


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

    def junk_after_header(raw):
        (n,) = struct.unpack("<Q", raw[:8])
        head = raw[8:8 + n].rstrip(b" ") + b"!"
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head + raw[8 + n:]

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
        ("bytes after the header's JSON", junk_after_header,
         r"shard-00000\.safetensors: the header has bytes after its JSON object"),
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
    # checkpoint.load: auto taking a damaged newest checkpoint: the error names the one before
    # it, to check and resume instead
    auto = os.path.join(tmp, "auto")
    p, _ = run(2, [cfg, "--set", "train.steps=4", "--set", "checkpoint.dir=" + auto,
                   "--set", "checkpoint.interval=2"])
    newest = os.path.join(auto, "step-00000004", "model", "shard-00000.safetensors")
    with open(newest, "rb") as f:
        raw = f.read()
    with open(newest, "wb") as f:
        f.write(flip(raw))
    p, _ = run(2, [cfg, "--set", "train.steps=6", "--set", "checkpoint.dir=" + auto, "--set",
                   "checkpoint.load=auto"], timeout=60)
    older = os.path.join(auto, "step-00000002")
    check(p.returncode != 0 and "checksum mismatch" in p.stderr and
          "to resume the one before it, check it with fsdp-ckpt verify %s and give "
          "checkpoint.load=%s)" % (older, older) in p.stderr and "step 5" not in p.stdout,
          "checkpoint.load: auto of a damaged newest checkpoint names the one before it (%s)"
          % p.stderr.strip()[-300:])
    # a shard header with 100,000 extra tensors: parsed in O(n log n), and the first of them,
    # no parameter's, named at once (the folder's integrity records removed, as another tool
    # would write it)
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
    check(p.returncode != 0 and secs < 60 and "tensor 'extra.000000' is no parameter of the "
          "model" in p.stderr,
          "a shard of 100,000 tensors no parameter names is read and refused in %.1f s, naming "
          "the first (exit %d)" % (secs, p.returncode))
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
    # load: auto says which newer folder it passed over, and why; an unfinished save (.tmp,
    # marked as a save's) of a job that died is removed at the start, while a step-N.tmp
    # without the mark (a user's) is left and named
    os.makedirs(os.path.join(ck, "step-00000009"))
    os.makedirs(os.path.join(ck, "step-00000011.tmp"))
    open(os.path.join(ck, "step-00000011.tmp", ".fsdpc-partial"), "w").close()
    # killed as it made the folder: empty, or holding only the mark not yet named
    os.makedirs(os.path.join(ck, "step-00000012.tmp"))
    os.makedirs(os.path.join(ck, "step-00000014.tmp"))
    open(os.path.join(ck, "step-00000014.tmp", ".fsdpc-partial.new"), "w").close()
    users = os.path.join(ck, "step-00000007.tmp")
    os.makedirs(users)
    with open(os.path.join(users, "notes.txt"), "w") as f:
        f.write("mine\n")
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.dir=" + ck, "--set",
                   "checkpoint.load=auto"], timeout=120)
    check(p.returncode == 0 and "resumed from %s" % good in p.stdout and
          re.search(r"checkpoint\.load=auto: skipped the newer \S+step-00000009 \(no "
                    r"train_state\.json", p.stderr) is not None and
          re.search(r"removed 3 unfinished saves or removals \(step-\*\.tmp, "
                    r"step-\*\.removing\)", p.stderr) is not None and
          not os.path.exists(os.path.join(ck, "step-00000011.tmp")) and
          not os.path.exists(os.path.join(ck, "step-00000012.tmp")) and
          not os.path.exists(os.path.join(ck, "step-00000014.tmp")) and
          re.search(r"1 unfinished entry \(step-\*\.tmp, step-\*\.removing\) stays .*"
                    r"step-00000007\.tmp holds no \.fsdpc-partial mark", p.stderr) is not None and
          open(os.path.join(users, "notes.txt")).read() == "mine\n",
          "load: auto resumes the newest complete checkpoint and names the newer one it "
          "skipped; the unfinished save is removed, an unmarked step-N.tmp left (%s)"
          % p.stderr.strip()[-400:])
    shutil.rmtree(users)
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
        r"checksum mismatch", p.stderr) is not None and "1 tensor damaged" in p.stdout,
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
    # a step folder copied under another step's name: load: auto would take it for step 8
    renamed = os.path.join(tmp, "renamed")
    shutil.copytree(good, os.path.join(renamed, "step-00000008"))
    p, _ = run(2, [cfg, "--set", "train.steps=10", "--set", "checkpoint.dir=" + renamed,
                   "--set", "checkpoint.load=auto"], timeout=120)
    want = (r"step-00000008/train_state\.json records step 2, but its folder is named for step 8 "
            r"\(renamed, or copied over another step's name\?\).*name the folder step-00000002")
    check(p.returncode != 0 and ranks_saying(p.stderr, want) == {"0", "1"} and
          "step 1 " not in p.stdout,
          "a step folder named for another step is refused at start on both ranks (%s)"
          % p.stderr.strip()[-300:])
    p = sh([TOOL, "verify", os.path.join(renamed, "step-00000008")], timeout=60)
    check(p.returncode != 0 and re.search(want, p.stderr) is not None,
          "fsdp-ckpt verify names a step folder named for another step")
    bare = os.path.join(tmp, "no-records")
    shutil.copytree(good, bare)
    strip_records(bare)
    # its run's schedule made this one's (train.steps 3): no schedule warning below
    edit_state(bare, lambda st: st["saved_under"]["schedule"].update(steps=3))
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + bare,
                   "--set", "checkpoint.verify=true"], timeout=120)
    check(p.returncode == 0 and "checkpoint.verify: nothing to verify (the files carry no "
          "checksums)" in p.stdout, "checkpoint.verify on files without checksums says so")
    check("global batch" not in p.stderr, "a resume under the saved global batch: no warning")
    check("reading the data" not in p.stderr, "a resume in the saved data order: no warning")
    check("learning-rate schedule" not in p.stderr, "a resume under the saved schedule: no warning")
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + good,
                   "--set", "data.shuffle=true", "--set", "train.seed=7"], timeout=120)
    check(p.returncode == 0 and re.search(
        r"warning: \S+ was saved reading the data in file order, samples of data\.seq_len (\d+); "
        r"this run reads it shuffled by train\.seed 7, samples of data\.seq_len \1", p.stderr)
          is not None,
          "a resume under another data order says so")
    # train.steps 2 -> 3, within the 10 warmup steps: the same rate at step 3, the only step
    # left: nothing to warn of
    check("learning-rate schedule" not in p.stderr,
          "a resume under another train.steps with the same rates over the steps left: no warning")
    p, _ = run(2, [cfg, "--set", "train.steps=3", "--set", "checkpoint.load=" + good,
                   "--set", "optim.lr=0.001"], timeout=120)
    check(p.returncode == 0 and re.search(
        r"optim\.lr 0\.003; this run's: 3, 10, 0\.1, 0\.001\): from step 3 the learning rate "
        r"follows this run's, 0\.0003 where the saved run's would be 0\.0009", p.stderr)
          is not None, "a resume under another optim.lr says so")
    p, _ = run(4, [cfg, "--set", "train.steps=3", "--set",
                   "checkpoint.load=" + os.path.join(tmp, "flipped-data-byte"),
                   "--set", "checkpoint.verify=true"], timeout=120)
    ranks = ranks_saying(p.stderr,
                         r"model\.layers\.1\.mlp\.down_proj\.weight': checksum mismatch")
    check(p.returncode != 0 and ranks == {"0", "1", "2", "3"},
          "checkpoint.verify stops a resharding load of the flipped byte on every rank (%s)"
          % sorted(ranks))
