"""Final saves, signals, the time limit, the folder lock, refusals before the first step,
links and outputs."""
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import time

from common import (EXE, MPIRUN, MPI_ARGS, ROOT, SANITIZER_REPORT, TOOL, check, kill_session,
                    edit_state, losses, mkdtemp, ranks_saying, run, sh, strip_records)


def rank_pids(marker):
    """The fsdp-train processes (not mpirun) whose command line holds marker."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                args = f.read().split(b"\0")
            exe = os.path.basename(os.readlink("/proc/%s/exe" % pid))
        except OSError:
            continue
        if exe == "fsdp-train" and any(marker.encode() in a for a in args):
            out.append(int(pid))
    return out


def start(n, args, marker):
    """fsdp-train under mpirun (n > 0) or alone (n == 0) in a session of its own; returns the
    process and a list that fills with the numbers of the step lines it prints."""
    import threading
    if n:
        cmd = [MPIRUN] + MPI_ARGS + ["-n", str(n), EXE] + args
    else:
        cmd = [EXE] + args
    proc = subprocess.Popen(cmd + ["--set", "log.metrics=" + marker], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    steps, out, err = [], [], []

    def read():
        for line in proc.stdout:
            out.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if m:
                steps.append(int(m.group(1)))

    def read_err():
        for line in proc.stderr:
            err.append(line)
    proc.readers = [threading.Thread(target=f, daemon=True) for f in (read, read_err)]
    for t in proc.readers:
        t.start()
    proc.lines, proc.err_lines = out, err
    return proc, steps


def wait_step(steps, k, proc, limit=120):
    t = time.time()
    while (not steps or steps[-1] < k) and proc.poll() is None and time.time() - t < limit:
        time.sleep(0.02)
    return bool(steps) and steps[-1] >= k


def finish(proc, limit=120):
    """Waits for a process of start(): its exit status (None if it had to be killed), its
    standard output and its standard error."""
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()
        rc = None
    for t in proc.readers:  # to the end of both pipes
        t.join(timeout=30)
    err = "".join(proc.err_lines)
    if SANITIZER_REPORT.search(err):
        check(False, "%s: ends without a sanitizer report" % proc.args[0])
        print(err[-3000:])
    return rc, "".join(proc.lines), err


def mpirun_passes_on(sig, tmp):
    """Whether this machine's mpirun passes sig on to the ranks of a job (Open MPI's does for
    SIGUSR1 and SIGUSR2; a launcher set up otherwise may not): a probe job of two shell ranks
    that exit 3 on it, signalled once both wait for it."""
    ready = os.path.join(tmp, "probe")
    os.makedirs(ready, exist_ok=True)
    name = signal.Signals(sig).name[3:]
    script = ('trap "exit 3" %s; touch %s/$$; i=0; '
              'while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done' % (name, ready))
    proc = subprocess.Popen([MPIRUN] + MPI_ARGS + ["-n", "2", "sh", "-c", script],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t = time.time()
    while len(os.listdir(ready)) < 2 and proc.poll() is None and time.time() - t < 60:
        time.sleep(0.02)
    os.kill(proc.pid, sig)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()
        rc = None
    return rc == 3


def operations():
    """Runs that survive operations: the last step always saved; signals and train.time_limit
    stop at a step boundary, save, and resume bit-identically; one job per checkpoint folder;
    late refusals made before the first step and by --dry-run; removals never follow links and
    outputs never replace inputs."""
    tmp = mkdtemp()
    cfg = os.path.join(ROOT, "configs", "fsdp.yaml")
    debug = os.path.join(ROOT, "configs", "debug.yaml")
    data = os.path.join(ROOT, "data", "corpus.txt")

    def saved(folder):
        return sorted(d for d in os.listdir(folder) if d.startswith("step-"))

    # 1. the last step is always saved: no interval, and steps past the last interval
    for sets, want in ((["train.steps=3"], ["step-00000003"]),
                       (["train.steps=12", "checkpoint.interval=10"],
                        ["step-00000010", "step-00000012"])):
        ck = os.path.join(tmp, "last-%d" % len(sets))
        args = [debug, "--set", "checkpoint.dir=" + ck]
        for kv in sets:
            args += ["--set", kv]
        p, _ = run(1, args)
        got = saved(ck) if os.path.isdir(ck) else []
        check(p.returncode == 0 and got == want,
              "checkpoint.dir with %s leaves %s (%s)" % (" ".join(sets), want, got))
    # 1b. a run stopped by a bad sample, a non-finite step or a full metrics disk saves the
    # step before it: a u16 file whose token 256 x 7 + 10 (read by step 8 on 2 ranks of 2
    # samples of 64) is outside the vocabulary
    import struct
    bad = os.path.join(tmp, "bad16.bin")
    toks = [(i * 7) % 256 for i in range(256 * 20)]
    toks[256 * 7 + 10] = 300
    with open(bad, "wb") as f:
        f.write(struct.pack("<%dH" % len(toks), *toks))
    ck = os.path.join(tmp, "bad-sample")
    p, _ = run(2, [cfg, "--set", "data.path=" + bad, "--set", "data.format=u16", "--set",
                   "train.steps=20", "--set", "checkpoint.interval=5", "--set",
                   "checkpoint.dir=" + ck])
    got = saved(ck) if os.path.isdir(ck) else []
    check(p.returncode == 1 and "data.path: data file %s: the token at byte offset %d has id "
          "300" % (bad, 2 * (256 * 7 + 10)) in p.stderr and "stopping after step 7 on the "
          "error below; saved %s/step-00000007 first" % ck in p.stderr and
          got == ["step-00000005", "step-00000007"],
          "a bad token met at step 8 stops every rank, naming data.path, and saves step 7 "
          "first (%s; %s)" % (got, p.stderr.strip()[-200:]))
    # a resume reading other data (another data.path) is warned of; the same data is not
    rw, small = os.path.join(tmp, "resume-data"), os.path.join(tmp, "small.txt")
    with open(data, "rb") as f, open(small, "wb") as g:
        g.write(f.read()[:20000])
    run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + rw])
    said = {}
    for steps, path in ((3, data), (4, small)):
        p, _ = run(1, [debug, "--set", "train.steps=%d" % steps, "--set", "checkpoint.dir=" + rw,
                       "--set", "checkpoint.load=auto", "--set", "data.path=" + path])
        said[path] = p.stderr if p.returncode == 0 else "exit %d" % p.returncode
    check("was trained on data of" not in said[data] and
          re.search(r"step-00000003 was trained on data of \d+ tokens, this run's data\.path "
                    r"holds 20000", said[small]) is not None,
          "a resume on other data (20000 tokens) is warned of, one on the same data is not")
    # a resume whose metrics file lacks the lines before its step (lost with a checkpoint
    # folder, or by hand) says which are missing, writes its step's line from the checkpoint,
    # and appends after them
    gm, gck = os.path.join(tmp, "gap.jsonl"), os.path.join(tmp, "gap")
    run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.dir=" + gck, "--metrics", gm])
    with open(gm) as f:
        head = f.readlines()[:6]
    with open(gm, "w") as f:
        f.writelines(head)
    p, _ = run(1, [debug, "--set", "train.steps=10", "--set", "checkpoint.dir=" + gck, "--set",
                   "checkpoint.load=auto", "--metrics", gm])
    check(p.returncode == 0 and "the metrics file '%s' ends at step 6; the line of step 7 is "
          "missing" % gm in p.stderr and [r["step"] for r in losses(gm)] ==
          [1, 2, 3, 4, 5, 6, 8, 9, 10],
          "a resume after a metrics file's missing lines warns of the gap (%s)" %
          p.stderr.strip()[-200:])
    # a metrics file that fills up (its rank's files limited to 64 KiB, which the checkpoints of
    # this model fit) stops the run, saving the step whose line was lost with that line: the
    # resumed run writes it, and the file holds every step
    fk, fm = os.path.join(tmp, "fill"), os.path.join(tmp, "fill.jsonl")
    tiny = [debug, "--set", "model.dim=8", "--set", "model.n_heads=2", "--set",
            "model.n_kv_heads=1", "--set", "model.ffn_dim=16", "--set", "model.n_layers=1",
            "--set", "data.seq_len=8", "--set", "data.batch_size=1", "--set",
            "checkpoint.dir=" + fk, "--set", "checkpoint.load=auto", "--set", "log.interval=1000",
            "--metrics", fm]
    run(1, tiny + ["--set", "train.steps=170"])
    limited = 'trap "" XFSZ; ulimit -f 128; exec "$0" "$@"'
    p = sh([MPIRUN] + MPI_ARGS + ["-n", "1", "sh", "-c", limited, EXE] + tiny +
           ["--set", "train.steps=400"], timeout=120)
    stopped = saved(fk)[-1] if os.path.isdir(fk) else ""
    q, _ = run(1, tiny + ["--set", "train.steps=400"])
    check(p.returncode != 0 and "cannot write the metrics file" in p.stderr and
          stopped > "step-00000170" and q.returncode == 0 and
          "written from the checkpoint's record" in q.stderr and
          [r["step"] for r in losses(fm)] == list(range(1, 401)),
          "a full metrics file stops the run at %s, whose line the resumed run writes: every "
          "step's line is there (%s)" % (stopped, q.stderr.strip()[-200:]))
    # without checkpoint.dir no line has checkpoint fields
    nm = os.path.join(tmp, "no-ckpt.jsonl")
    p, _ = run(1, [debug, "--set", "train.steps=2", "--metrics", nm])
    rows = losses(nm) if p.returncode == 0 else []
    check(len(rows) == 2 and not any(k.startswith("ckpt_") for r in rows for k in r),
          "a run without checkpoint.dir writes no ckpt_ field (%s)" % rows[-1:])
    # a fresh run given that file again replaces it, saying so
    p, _ = run(1, [debug, "--set", "train.steps=1", "--metrics", nm])
    check(p.returncode == 0 and "note: the metrics file '%s' held 2 lines of an earlier run; "
          "this run starts at step 0 and replaces them" % nm in p.stderr and len(losses(nm)) == 1,
          "a fresh run replaces an earlier run's metrics file, noting its lines (%s)"
          % p.stderr.strip()[-200:])
    # a file that holds no metrics line (a mistyped name) is not replaced: refused before the
    # run, by --dry-run too; an empty file is written
    notes = os.path.join(tmp, "notes.txt")
    for dry in ([], ["--dry-run"]):
        with open(notes, "w") as f:
            f.write("\nmy notes\n")
        p, _ = run(1, [debug, "--set", "train.steps=1", "--metrics", notes] + dry)
        check(p.returncode != 0 and "'%s' holds no metrics line (line 2 is not a JSON object "
              "with a \"step\")" % notes in p.stderr and open(notes).read() == "\nmy notes\n" and
              "step 1 " not in p.stdout,
              "a --metrics file of other content is refused%s, untouched (%s)"
              % (" by --dry-run" if dry else "", p.stderr.strip()[-200:]))
    open(notes, "w").close()
    p, _ = run(1, [debug, "--set", "train.steps=1", "--metrics", notes])
    check(p.returncode == 0 and len(losses(notes)) == 1, "an empty --metrics file is written")
    # --plot replaces a plot, not another file (the metrics file named in its place, say)
    other = os.path.join(tmp, "other-run.jsonl")
    shutil.copy(nm, other)
    kept = open(other).read()
    for dry in ([], ["--dry-run"]):
        p, _ = run(1, [debug, "--set", "train.steps=1", "--metrics",
                       os.path.join(tmp, "plotted.jsonl"), "--plot", other] + dry)
        check(p.returncode != 0 and "--plot '%s': exists and is not an SVG plot (it begins "
              "'{\"step\":" % other in p.stderr and open(other).read() == kept and
              "step 1 " not in p.stdout,
              "--plot naming another run's metrics file is refused%s, that file untouched (%s)"
              % (" by --dry-run" if dry else "", p.stderr.strip()[-200:]))
    svg = os.path.join(tmp, "plotted.svg")
    for _ in range(2):  # written, then replaced
        p, _ = run(1, [debug, "--set", "train.steps=1", "--metrics",
                       os.path.join(tmp, "plotted.jsonl"), "--plot", svg])
        check(p.returncode == 0 and open(svg).read().startswith("<?xml"),
              "--plot writes its plot, and replaces it on the next run (%s)"
              % p.stderr.strip()[-200:])
    # a metrics file that cannot be written: refused before the run, by --dry-run too (as
    # another user: root writes any file)
    ro = os.path.join(tmp, "ro")
    os.makedirs(ro)
    os.chmod(tmp, 0o755)
    os.chmod(ro, 0o777)
    with open(os.path.join(ro, "m.jsonl"), "w") as f:
        f.write("kept\n")
    os.chmod(os.path.join(ro, "m.jsonl"), 0o444)
    who = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 \
        else []
    # the refused run leaves no trace: the checkpoint.dir folders it made are gone, the one
    # that was there stays
    os.makedirs(os.path.join(ro, "kept"))
    os.chmod(os.path.join(ro, "kept"), 0o777)
    for dry in (["--dry-run"], []):
        # (made/../kept/run: "kept" is reached through a folder the run made, and stays)
        for ck in (os.path.join(ro, "made", "by", "run"), os.path.join(ro, "kept"),
                   os.path.join(ro, "made", "..", "kept", "run")):
            p = sh(who + [EXE, debug, "--metrics", os.path.join(ro, "m.jsonl"), "--set",
                          "checkpoint.dir=" + ck] + dry, timeout=60)
            check(p.returncode != 0 and "m.jsonl': exists and cannot be written (Permission "
                  "denied)" in p.stderr and "step 1 " not in p.stdout and
                  not os.path.exists(os.path.join(ro, "made")) and
                  os.listdir(os.path.join(ro, "kept")) == [],
                  "a read-only metrics file is refused before any step%s, leaving %s as it was "
                  "(%s)" % (" by --dry-run" if dry else "", os.path.basename(ck),
                            p.stderr.strip()[-200:]))
    # a last line cut short (a kill in its write): left out, the next line starts on its own
    with open(gm) as f:
        rows = f.readlines()
    with open(gm, "w") as f:
        f.writelines(rows[:7] + [rows[7][:25]])  # steps 1-6, 8 and a piece of 9's line
    p, _ = run(1, [debug, "--set", "train.steps=11", "--set", "checkpoint.dir=" + gck, "--set",
                   "checkpoint.load=auto", "--metrics", gm])
    check(p.returncode == 0 and "the metrics file '%s' had 1 line that is no step's metrics" % gm
          in p.stderr and [r["step"] for r in losses(gm)] == [1, 2, 3, 4, 5, 6, 8, 10, 11],
          "a resume after a cut last metrics line leaves it out and writes whole lines (%s)" %
          p.stderr.strip()[-300:])
    # a branch of that run (from its step 8, into another checkpoint.dir) given its metrics
    # file would replace its lines of steps 10 and 11: refused, the file untouched
    before = open(gm).read()
    for dry in ([], ["--dry-run"]):
        p, _ = run(1, [debug, "--set", "train.steps=12", "--set", "checkpoint.dir=" +
                       os.path.join(tmp, "branch"), "--set", "checkpoint.load=" +
                       os.path.join(gck, "step-00000008"), "--metrics", gm] + dry)
        check(p.returncode != 0 and re.search(
            r"'\S+gap\.jsonl' holds the lines of steps 10 to 11, after step 8, where this run "
            r"resumes from '\S+step-00000008', outside its checkpoint\.dir", p.stderr) and
              open(gm).read() == before,
              "a branch into another folder is refused the metrics file of the run it branches "
              "from%s (%s)" % (" (--dry-run)" if dry else "", p.stderr.strip()[-200:]))
    # so is one that saves nowhere (no checkpoint.dir)
    p, _ = run(1, [debug, "--set", "train.steps=12", "--set", "checkpoint.load=" +
                   os.path.join(gck, "step-00000008"), "--metrics", gm])
    check(p.returncode != 0 and re.search(
        r"holds the lines of steps 10 to 11, after step 8, where this run resumes from "
        r"'\S+step-00000008', without a checkpoint\.dir", p.stderr) and open(gm).read() == before,
          "a branch without a checkpoint.dir is refused the metrics file of the run it branches "
          "from (%s)" % p.stderr.strip()[-200:])
    # the evaluation's batches are read before the first step (and by --dry-run)
    for dry in ([], ["--dry-run"]):
        ck = os.path.join(tmp, "bad-eval%d" % len(dry))
        p, _ = run(2, [cfg, "--set", "eval.path=" + bad, "--set", "eval.format=u16", "--set",
                       "eval.batches=8", "--set", "eval.interval=100", "--set",
                       "checkpoint.dir=" + ck] + dry)
        check(p.returncode == 1 and "eval.path: data file %s: the token at byte offset" % bad
              in p.stderr and "step " not in p.stdout and not (os.path.isdir(ck) and saved(ck)),
              "a bad token in eval.path's batches is refused before the first step%s (%s)"
              % (" by --dry-run" if dry else "", p.stderr.strip()[-160:]))
    # a closed output (| head) does not kill the run: it trains on and saves its last step
    ck = os.path.join(tmp, "closed-pipe")
    proc = subprocess.Popen([EXE, debug, "--set", "train.steps=40", "--set", "log.interval=1",
                             "--set", "checkpoint.dir=" + ck], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    proc.stdout.readline()
    proc.stdout.close()
    rc = proc.wait(timeout=120)
    check(rc == 0 and saved(ck) == ["step-00000040"],
          "fsdp-train with its output closed (| head) trains on and saves its last step "
          "(exit %d, %s)" % (rc, saved(ck) if os.path.isdir(ck) else []))

    # 2. signals and the time limit, on 4 ranks: a save at the step boundary, exit 75, and a
    # resume whose losses equal an uninterrupted run's bit for bit
    S = 200
    ref = os.path.join(tmp, "ref.jsonl")
    p, ref_secs = run(4, [cfg, "--set", "train.steps=%d" % S, "--metrics", ref])
    ref_losses = [r["loss"] for r in losses(ref)] if p.returncode == 0 else []
    check(len(ref_losses) == S, "the uninterrupted run of %d steps (%.1f s)" % (S, ref_secs))

    def interrupted(name, deliver, sets=()):
        ck, m = os.path.join(tmp, "ck-" + name), os.path.join(tmp, name + ".jsonl")
        args = [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck,
                "--set", "checkpoint.interval=1000", "--set", "log.interval=1"]
        for kv in sets:
            args += ["--set", kv]
        proc, steps = start(4, args, m)
        if deliver:
            wait_step(steps, 20, proc)
            deliver(proc, m)
        rc, out, err = finish(proc)
        hit = re.search(r"(interrupted by (SIG\w+)|stopped before train\.time_limit \([\d.e+]+ s\)) at "
                        r"step (\d+); saved (\S+) \(resume with checkpoint\.load: auto\)", out)
        stopped = hit is not None and 0 < int(hit.group(3)) < S
        check(rc not in (0, None) and stopped and os.path.isdir(hit.group(4)) and
              saved(ck)[-1:] == [os.path.basename(hit.group(4))],
              "%s: the job says where it stopped, saves that step and exits non-zero (exit %s; "
              "%s)" % (name, rc, hit.group(0) if hit else err[-300:]))
        if not stopped:
            return hit
        p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck,
                       "--set", "checkpoint.load=auto", "--metrics", m])
        got = [r["loss"] for r in losses(m)] if p.returncode == 0 else []
        check(len(got) == S and got == ref_losses,
              "%s: resumed from step %s with checkpoint.load: auto, the losses equal the "
              "uninterrupted run's bit for bit" % (name, hit.group(3)))
        return hit

    def to_ranks(sig, first_only=False):
        def deliver(proc, marker):
            pids = sorted(rank_pids(marker))
            for pid in pids[:1] if first_only else pids:
                os.kill(pid, sig)
        return deliver

    hit = interrupted("sigterm-every-rank", to_ranks(signal.SIGTERM))
    check(hit is not None and hit.group(2) == "SIGTERM", "SIGTERM is named")
    if os.environ.get("FSDPC_TEST_SANITIZED"):  # the same code paths as the one above
        print("sanitized build: SIGUSR1 through mpirun, SIGTERM to one rank, with async saves "
              "and the time limit run in the plain build")
    else:
        if mpirun_passes_on(signal.SIGUSR1, tmp):
            hit = interrupted("sigusr1-to-mpirun",
                              lambda proc, m: os.kill(proc.pid, signal.SIGUSR1))
            check(hit is not None and hit.group(2) == "SIGUSR1",
                  "SIGUSR1 forwarded by mpirun is named")
        else:  # the launcher's setting, not the job's: reported, the rest still checked
            print("skip  sigusr1-to-mpirun: this machine's mpirun does not pass SIGUSR1 on to its "
                  "ranks (a job of two shell ranks waiting for it never got it)")
        interrupted("sigterm-one-rank", to_ranks(signal.SIGTERM, first_only=True))
        hit = interrupted("sigterm-async", to_ranks(signal.SIGTERM),
                          ["checkpoint.async=true", "checkpoint.interval=7"])
        check(hit is not None and int(hit.group(3)) > 7,
              "with checkpoint.async, the stop's save follows the interval saves in flight")
        hit = interrupted("time-limit", None, ["train.time_limit=%.2f" % (ref_secs / 2)])
        check(hit is not None and hit.group(1).startswith("stopped before train.time_limit"),
              "train.time_limit stops the run before it")

    # a signal during start-up (held from the program's start until the plan's handlers are
    # in place; seen here in /proc as blocked) stops the run at its first step, saved, exit 75
    ck, m = os.path.join(tmp, "ck-start-signal"), os.path.join(tmp, "start-signal.jsonl")
    proc, steps = start(0, [debug, "--set", "train.steps=50", "--set", "checkpoint.dir=" + ck], m)
    held, t = False, time.time()
    while not held and proc.poll() is None and time.time() - t < 30:
        try:
            with open("/proc/%d/status" % proc.pid) as f:
                blk = re.search(r"^SigBlk:\s*([0-9a-f]+)", f.read(), re.M)
            held = blk is not None and int(blk.group(1), 16) & (1 << (signal.SIGTERM - 1)) != 0
        except OSError:
            break
    if held:
        os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    check(held and rc == 75 and "interrupted by SIGTERM at step 1; saved" in out and
          saved(ck) == ["step-00000001"],
          "SIGTERM during start-up: the run stops at step 1, saved, exit 75 (held %s, exit %s, "
          "%s)" % (held, rc, (out + err).strip()[-200:]))

    # a signal while the start-up reads an evaluation of 10^6 batches for bad tokens (minutes
    # of reading) ends that read: the run stops at its first step, within seconds
    ck = os.path.join(tmp, "ck-precheck-signal")
    proc, steps = start(0, [debug, "--set", "train.steps=50", "--set", "checkpoint.dir=" + ck,
                            "--set", "eval.path=" + data, "--set", "eval.batches=1000000",
                            "--set", "eval.batch_size=64"], os.path.join(tmp, "pre.jsonl"))
    time.sleep(3)
    t = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    took = time.time() - t
    check(rc == 75 and "interrupted by SIGTERM at step 1; saved" in out and took < 20,
          "SIGTERM while the start-up reads a long evaluation's samples: stopped at step 1 in "
          "%.1f s (exit %s, %s)" % (took, rc, (out + err).strip()[-200:]))

    # a signal during a step's save stops the run at that step, already saved: no second step
    # and save after it
    ck, m = os.path.join(tmp, "ck-save-signal"), os.path.join(tmp, "save-signal.jsonl")
    proc, steps = start(0, [debug, "--set", "model.dim=512", "--set", "model.n_layers=6",
                            "--set", "model.ffn_dim=1376", "--set", "model.n_heads=8", "--set",
                            "model.n_kv_heads=4", "--set", "data.batch_size=1", "--set",
                            "data.seq_len=16", "--set", "train.steps=100", "--set",
                            "checkpoint.interval=5", "--set", "checkpoint.dir=" + ck], m)
    t = time.time()
    while not os.path.isdir(os.path.join(ck, "step-00000005.tmp")) and proc.poll() is None \
            and time.time() - t < 60:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    check(rc == 75 and "interrupted by SIGTERM at step 5; saved" in out and
          saved(ck) == ["step-00000005"],
          "SIGTERM during step 5's save: the run stops at step 5, saved once (exit %s, %s, %s)"
          % (rc, saved(ck) if os.path.isdir(ck) else [], (out + err).strip()[-160:]))

    # a stop skips the evaluation its step is due (it would delay the stop): the resumed run
    # makes it first, as the uninterrupted run did, into the step's line of the metrics file
    ev = [debug, "--set", "train.steps=60", "--set", "log.interval=1", "--set",
          "eval.path=" + data, "--set", "eval.interval=1", "--set", "eval.batches=2"]
    ev_ref = os.path.join(tmp, "eval-ref.jsonl")
    p, ev_secs = run(1, ev + ["--metrics", ev_ref])
    want = {r["step"]: r.get("eval_loss") for r in losses(ev_ref)} if p.returncode == 0 else {}
    # a signal may come during the step's evaluation, which then runs first; the time limit
    # stops at the step's agreement, before it
    for how in ("SIGTERM", "train.time_limit"):
        ck, m = os.path.join(tmp, "ck-eval-" + how), os.path.join(tmp, "eval-%s.jsonl" % how)
        if how == "SIGTERM":
            proc, steps = start(0, ev + ["--set", "checkpoint.dir=" + ck], m)
            wait_step(steps, 5, proc)
            os.kill(proc.pid, signal.SIGTERM)
            rc, out, _ = finish(proc)
        else:
            q, _ = run(1, ev + ["--set", "checkpoint.dir=" + ck, "--set",
                                "train.time_limit=%.2f" % (ev_secs / 2), "--metrics", m])
            rc, out = q.returncode, q.stdout
        at = re.search(r"(interrupted by SIGTERM|stopped before train\.time_limit \(\S+ s\)) "
                       r"at step (\d+)", out)
        p, _ = run(1, ev + ["--set", "checkpoint.dir=" + ck, "--set", "checkpoint.load=auto",
                            "--metrics", m])
        got = {r["step"]: r.get("eval_loss") for r in losses(m)} if p.returncode == 0 else {}
        said = "eval after step %s: loss" % (at.group(2) if at else "?")
        check(rc == 75 and at is not None and len(want) == 60 and got == want and
              (out + p.stdout).count(said) == 1 and (how == "SIGTERM" or said in p.stdout),
              "%s at step %s: each evaluation made once, by the %s run, every step's eval_loss "
              "equal to the uninterrupted run's (exit %s, differing steps %s)"
              % (how, at.group(2) if at else "none",
                 "resumed" if said in p.stdout else "stopped", rc,
                 [k for k in want if got.get(k) != want[k]][:5]))

    # a long evaluation (4000 batches, seconds): a SIGTERM during it ends it between two
    # batches, the step saved with its evaluation pending, which the resumed run makes (a short
    # one there: `short`); the time limit counts the evaluation due after a step (one of 2 x
    # 10^4 batches, estimated at a minute, which it never starts; its samples are read before
    # the first step, seconds at most); an eval.path cut short since the start stops the run
    # with its step saved
    ev_copy = os.path.join(tmp, "eval-copy.txt")
    shutil.copy(data, ev_copy)
    long_ev = [debug, "--set", "train.steps=12", "--set", "log.interval=1", "--set",
               "eval.path=" + ev_copy, "--set", "eval.interval=10", "--set", "eval.batches=4000"]
    short, huge = ["--set", "eval.batches=50"], ["--set", "eval.batches=20000"]
    ck = os.path.join(tmp, "ck-long-eval")
    proc, steps = start(0, long_ev + ["--set", "checkpoint.dir=" + ck],
                        os.path.join(tmp, "long-eval.jsonl"))
    wait_step(steps, 9, proc)
    time.sleep(0.5)  # step 10 takes milliseconds, its evaluation seconds
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, _ = finish(proc)
    state = os.path.join(ck, "step-00000010", "train_state.json")
    pending = json.load(open(state))["saved_under"].get("eval_pending") \
        if os.path.exists(state) else None
    # the resumed run's first evaluation (the pending one) stops the same way, before any step,
    # the checkpoint as it was (a job preempted again and again still gets through)
    proc, steps = start(0, long_ev + ["--set", "checkpoint.dir=" + ck, "--set",
                                      "checkpoint.load=auto"], os.path.join(tmp, "again.jsonl"))
    t0 = time.time()
    while not any("resumed from" in ln for ln in proc.lines) and proc.poll() is None and \
            time.time() - t0 < 60:
        time.sleep(0.01)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    rc2, out2, _ = finish(proc)
    check(rc2 == 75 and "interrupted by SIGTERM during the evaluation of step 10" in out2 and
          "eval after step 10" not in out2 and saved(ck) == ["step-00000010"],
          "SIGTERM during the evaluation a resumed run makes first: exit 75 before any step, "
          "the checkpoint as it was (exit %s, %s)" % (rc2, out2.strip()[-160:]))
    p, _ = run(1, long_ev + short + ["--set", "checkpoint.dir=" + ck, "--set",
                                     "checkpoint.load=auto"])
    check(rc == 75 and "interrupted by SIGTERM at step 10" in out and
          "eval after step 10" not in out and pending is True and p.returncode == 0 and
          p.stdout.count("eval after step 10") == 1,
          "SIGTERM during a long evaluation ends it: step 10 saved with its evaluation pending, "
          "made once by the resumed run (exit %s, pending %s)" % (rc, pending))
    ck = os.path.join(tmp, "ck-eval-limit")
    t0 = time.time()
    p, _ = run(1, long_ev + huge + ["--set", "checkpoint.dir=" + ck, "--set",
                                    "train.time_limit=4"])
    took = time.time() - t0
    check(p.returncode == 75 and "stopped before train.time_limit (4 s) at step 10" in p.stdout
          and "eval after step 10" not in p.stdout and took < 4,
          "train.time_limit counts the evaluation due after a step: stops at step 10 before "
          "it, within the limit (%.1f s, exit %s)" % (took, p.returncode))
    # its resume makes that evaluation first, which cannot fit in the limit: refused (exit 1),
    # not stopped with exit 75 for a requeue that would stop there again for ever
    # (under a pipeline too, whose last stage counts the batches it finished)
    for n, pp in ((1, []), (2, ["--set", "mesh.pp=2", "--set", "pipeline.microbatches=2"])):
        p, _ = run(n, long_ev + huge + pp + ["--set", "checkpoint.dir=" + ck, "--set",
                                             "train.time_limit=4", "--set", "checkpoint.load=auto"])
        check(p.returncode == 1 and re.search(
            r"the evaluation of step 10, which the run makes first, was cut by train\.time_limit "
            r"\(4 s\): it takes about [1-9]\d* s \([1-9]\d* of its \d+ forwards in [\d.]+ s\) "
            r"after a start-up of \d+ s, and every resume would repeat both", p.stderr) is not None,
            "a resume%s whose first evaluation cannot fit in train.time_limit exits 1, saying so "
            "(exit %s: %s)" % (" under mesh.pp=2" if pp else "", p.returncode,
                               p.stderr.strip()[-250:]))
    # a step saved before its evaluation (checkpoint.interval) whose evaluation a signal cuts
    # short: its checkpoint is marked pending after the fact, so that a resume without a
    # metrics file (which would show it) still makes it
    ck = os.path.join(tmp, "ck-saved-then-cut")
    cut_m = os.path.join(tmp, "saved-then-cut.jsonl")
    proc, steps = start(0, long_ev + ["--set", "checkpoint.dir=" + ck, "--set",
                                      "checkpoint.interval=10"], cut_m)
    t0 = time.time()
    while not os.path.isdir(os.path.join(ck, "step-00000010")) and proc.poll() is None and \
            time.time() - t0 < 60:
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, _ = finish(proc)
    state = os.path.join(ck, "step-00000010", "train_state.json")
    pending = json.load(open(state))["saved_under"].get("eval_pending") \
        if os.path.exists(state) else None
    v = sh([TOOL, "verify", os.path.join(ck, "step-00000010")], timeout=60)
    if os.path.exists(cut_m):
        os.remove(cut_m)  # the checkpoint alone says what is pending
    p, _ = run(1, long_ev + short + ["--set", "checkpoint.dir=" + ck, "--set",
                                     "checkpoint.load=auto"])
    check(rc == 75 and "eval after step 10" not in out and pending is True and
          v.returncode == 0 and p.returncode == 0 and p.stdout.count("eval after step 10") == 1,
          "a signal cutting the evaluation of a step saved before it: the checkpoint marked "
          "pending (and still verifies), the resumed run makes it (exit %s, pending %s, %s)"
          % (rc, pending, v.stderr.strip()[-120:]))
    # the same after the last step: a signal during its evaluation (the step saved already)
    # ends the run as stopped, exit 75, and the time limit stops it before that evaluation;
    # the run resumed with nothing to train makes it
    for how in ("SIGTERM", "train.time_limit"):
        ck = os.path.join(tmp, "ck-last-eval-" + how)
        last = long_ev + ["--set", "train.steps=10", "--set", "checkpoint.dir=" + ck]
        if how == "SIGTERM":
            proc, steps = start(0, last, os.path.join(tmp, "last-eval.jsonl"))
            t0 = time.time()
            while not os.path.isdir(os.path.join(ck, "step-00000010")) and \
                    proc.poll() is None and time.time() - t0 < 60:
                time.sleep(0.01)
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
            rc, out, _ = finish(proc)
        else:
            q, _ = run(1, last + huge + ["--set", "train.time_limit=4"])
            rc, out = q.returncode, q.stdout
        said = ("interrupted by SIGTERM" if how == "SIGTERM" else
                "stopped before train.time_limit (4 s)") + " at step 10; saved"
        p, _ = run(1, last + short + ["--set", "checkpoint.load=auto"])
        check(rc == 75 and said in out and "eval after step 10" not in out and
              p.returncode == 0 and "nothing to train" in p.stdout and
              p.stdout.count("eval after step 10") == 1,
              "%s during the last step's evaluation: exit 75, the step saved, the evaluation "
              "made by the resumed run (exit %s, %s)" % (how, rc, out.strip()[-160:]))
    ck = os.path.join(tmp, "ck-eval-cut")
    proc, steps = start(0, [debug, "--set", "train.steps=400", "--set", "log.interval=1",
                            "--set", "eval.path=" + ev_copy, "--set", "eval.interval=100",
                            "--set", "checkpoint.dir=" + ck], os.path.join(tmp, "cut.jsonl"))
    wait_step(steps, 20, proc)
    os.truncate(ev_copy, 1000)
    rc, out, err = finish(proc)
    check(rc == 1 and "eval.path: data file %s: changed since the run opened it (the file is "
          "shorter than when it was opened)" % ev_copy in err and
          "stopping after step 100 on the error below; saved %s/step-00000100 first" % ck in err
          and saved(ck) == ["step-00000100"],
          "an eval.path cut short during the run stops it at step 100's evaluation, step 100 "
          "saved first (exit %s, %s)" % (rc, err.strip()[-200:]))

    # a kill after a save commits and before its step's line (or during the last step's
    # evaluation, which follows the save): the resumed run writes the line from the
    # checkpoint's record, with the evaluation made then, as the uninterrupted run wrote it
    ck, m = os.path.join(tmp, "ck-lost-line"), os.path.join(tmp, "lost-line.jsonl")
    lost = [debug, "--set", "train.steps=6", "--set", "checkpoint.interval=3", "--set",
            "checkpoint.dir=" + ck, "--set", "eval.path=" + data, "--set", "eval.interval=3",
            "--set", "eval.batches=2", "--set", "checkpoint.load=auto", "--metrics", m]
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")

    def lines_of(path):
        return [{k: r.get(k) for k in keys} for r in losses(path)]

    p, _ = run(1, lost)
    whole = lines_of(m) if p.returncode == 0 else []
    for drop_from, what in ((6, "the last step"), (3, "an interval step")):
        with open(m) as f:
            kept = [ln for ln in f if json.loads(ln)["step"] < drop_from]
        with open(m, "w") as f:
            f.writelines(kept)
        if drop_from == 3:
            shutil.rmtree(os.path.join(ck, "step-00000006"), ignore_errors=True)
        q, _ = run(1, lost)
        check(q.returncode == 0 and len(whole) == 6 and whole[2]["eval_loss"] is not None and
              lines_of(m) == whole and "written from the checkpoint's record" in q.stderr and
              "are missing" not in q.stderr,
              "a kill between %s's save and its metrics line: the resumed run writes the line "
              "from the checkpoint, evaluated, as the uninterrupted run (exit %s, %s, %s)"
              % (what, q.returncode, lines_of(m) if os.path.exists(m) else None,
                 q.stderr.strip()[-200:]))

    # a second SIGTERM during the save: exits at once (128 + 15); the previous checkpoint
    # stays complete and loads; the unfinished save is removed at the next start
    ck = os.path.join(tmp, "ck-second")
    big = [debug, "--set", "model.dim=512", "--set", "model.n_layers=6", "--set",
           "model.ffn_dim=1376", "--set", "model.n_heads=8", "--set", "model.n_kv_heads=4",
           "--set", "data.batch_size=1", "--set", "data.seq_len=16", "--set", "log.interval=1",
           "--set", "checkpoint.dir=" + ck, "--set", "train.steps=100000"]
    proc, steps = start(0, big + ["--set", "checkpoint.interval=3"], os.path.join(tmp, "2.jsonl"))
    wait_step(steps, 4, proc)
    proc.send_signal(signal.SIGTERM)
    t, seen = time.time(), False
    while time.time() - t < 60 and proc.poll() is None:
        if glob.glob(os.path.join(ck, "step-*.tmp", "*")):
            proc.send_signal(signal.SIGTERM)
            seen = True
            break
        time.sleep(0.001)
    rc, out, err = finish(proc)
    check(seen and rc == 128 + signal.SIGTERM and saved(ck)[:1] == ["step-00000003"],
          "a second SIGTERM during the save exits at once with 143 (exit %s, %s)" % (rc, saved(ck)))
    p, _ = run(1, big + ["--set", "train.steps=4", "--set", "checkpoint.load=auto",
                         "--set", "checkpoint.verify=true"])
    check(p.returncode == 0 and "resumed from %s/step-00000003" % ck in p.stdout and
          not glob.glob(os.path.join(ck, "step-*.tmp")),
          "the previous checkpoint verifies and resumes; the unfinished save is gone")

    # asynchronous saves: the same training, checkpoints that verify and resume bit-identically
    ck, m = os.path.join(tmp, "ck-async"), os.path.join(tmp, "async.jsonl")
    p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.dir=" + ck, "--set",
                   "checkpoint.interval=50", "--set", "checkpoint.async=true", "--metrics", m])
    rows = losses(m) if p.returncode == 0 else []
    check(p.returncode == 0 and [r["loss"] for r in rows] == ref_losses and
          saved(ck) == ["step-00000050", "step-00000100", "step-00000150", "step-00000200"] and
          all(sh([TOOL, "verify", os.path.join(ck, d)], timeout=120).returncode == 0
              for d in saved(ck)) and
          [r["ckpt_saved_step"] for r in rows if "ckpt_saved_step" in r] == [50, 100, 150, 200],
          "checkpoint.async: the losses of a run without saves, every checkpoint committed and "
          "verified (%s)" % saved(ck))
    # only steps that spent time on a save have ckpt_stall_s: none before the first
    check(rows and not any("ckpt_stall_s" in r for r in rows[:49]) and "ckpt_stall_s" in rows[49],
          "checkpoint.async: no ckpt_stall_s before the first save (steps %s)"
          % [r["step"] for r in rows[:49] if "ckpt_stall_s" in r][:5])
    m2 = os.path.join(tmp, "async-resumed.jsonl")
    p, _ = run(4, [cfg, "--set", "train.steps=%d" % S, "--set", "checkpoint.load=" +
                   os.path.join(ck, "step-00000050"), "--metrics", m2])
    check(p.returncode == 0 and [r["loss"] for r in losses(m2)] == ref_losses[50:],
          "an asynchronous checkpoint resumes with the losses of the uninterrupted run")
    # a write that fails in the background stops the run at a following step boundary on every
    # rank, naming the file: the ranks' files are limited to 16 MiB (mpirun's own are not), and
    # each rank's shard of this model is 24 MB
    ck = os.path.join(tmp, "ck-async-full")
    args = [cfg, "--set", "train.steps=60", "--set", "checkpoint.dir=" + ck, "--set",
            "checkpoint.interval=10", "--set", "checkpoint.async=true", "--set", "log.interval=1",
            "--set", "model.dim=512", "--set", "model.n_heads=8", "--set", "model.n_kv_heads=4",
            "--set", "model.ffn_dim=1376", "--set", "model.n_layers=4"]
    limited = 'trap "" XFSZ; ulimit -f 16384; exec "$0" "$@"'  # a write past it fails (EFBIG)
    p = sh([MPIRUN] + MPI_ARGS + ["-n", "2", "sh", "-c", limited, EXE] + args, timeout=120)
    last = max([int(x) for x in re.findall(r"^step\s+(\d+)/", p.stdout, re.M)] or [0])
    want = r"\S+step-00000010\.tmp/(model|optim)/shard-0000[01]\.safetensors"
    check(p.returncode != 0 and ranks_saying(p.stderr, want) == {"0", "1"} and 10 <= last < 20
          and not os.path.exists(ck),
          "checkpoint.async: a background write that fails stops the run after step %d on both "
          "ranks, naming the file; no folder is left, not even checkpoint.dir it made" % last)
    if ranks_saying(p.stderr, want) != {"0", "1"}:
        print(p.stderr[-1500:])

    # 3. one job per checkpoint folder
    ck = os.path.join(tmp, "ck-lock")
    a, steps = start(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=100000",
                         "--set", "checkpoint.dir=" + ck, "--set", "checkpoint.interval=20",
                         "--set", "log.interval=1"], os.path.join(tmp, "lock-a.jsonl"))
    wait_step(steps, 25, a)
    p, secs = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "checkpoint.dir=" + ck,
                      "--set", "checkpoint.load=auto"], timeout=60)
    holder = re.search(r"checkpoint\.dir '\S+' is in use by another training job: pid (\d+) on host",
                       p.stderr)
    check(p.returncode != 0 and holder is not None and int(holder.group(1)) in
          rank_pids(os.path.join(tmp, "lock-a.jsonl")) and "step " not in p.stdout and secs < 30,
          "a second job on the same checkpoint.dir refuses at once, naming the first's pid")
    n = len(steps)
    wait_step(steps, steps[-1] + 5, a)
    check(a.poll() is None and len(steps) > n, "the first job trains on")
    # nor its metrics file: a second job naming it (another checkpoint.dir) is refused at once,
    # not given a file of its own renamed over the first one's
    mine = os.path.join(tmp, "lock-a.jsonl")
    before = len(open(mine).read().splitlines())
    p, secs = run(1, [cfg, "--set", "train.steps=3", "--metrics", mine], timeout=60)
    after = len(open(mine).read().splitlines())
    check(p.returncode != 0 and re.search(r"--metrics \(or log\.metrics\) '\S+lock-a\.jsonl': "
                                          r"another running job writes it", p.stderr) and
          "step " not in p.stdout and after >= before > 0,
          "a second job on the same metrics file refuses at once, the first's %d lines kept (%d)"
          % (before, after))
    p, _ = run(1, [cfg, "--set", "train.steps=3", "--metrics", mine, "--dry-run"], timeout=60)
    check(p.returncode == 0 and "lock-a.jsonl': another running job writes it; this plan's run "
          "would be refused" in p.stderr, "--dry-run of such a job says so and plans on")
    a.send_signal(signal.SIGUSR1)
    rc, _, _ = finish(a)
    good = all(sh([TOOL, "verify", os.path.join(ck, d)], timeout=120).returncode == 0
               for d in saved(ck))
    check(rc == 75 and good and len(saved(ck)) >= 2, "its checkpoints verify (%s)" % saved(ck))
    with open(os.path.join(ck, "fsdp-train.lock"), "w") as f:  # a job killed with -9 left this
        f.write('{"host": "%s", "pid": 999999999, "started": "2026-01-01T00:00:00Z", '
                '"plan": "x.yaml"}' % os.uname().nodename)
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "checkpoint.dir=" + ck,
                   "--set", "checkpoint.load=auto", "--set", "train.steps=%d" %
                   (int(saved(ck)[-1][5:]) + 1)])
    check(p.returncode == 0 and re.search(r"took over the lock of pid 999999999 on host \S+ since "
                                          r"2026-01-01T00:00:00Z \(plan x\.yaml\), which ended "
                                          r"without releasing it \(no longer running\)", p.stderr),
          "a lock left by a dead process is taken over with a note")
    # a lock that is another name of a file (a hard link): refused, the file untouched
    hl = os.path.join(tmp, "ck-hardlink")
    os.makedirs(hl)
    precious = os.path.join(tmp, "precious.txt")
    with open(precious, "w") as f:
        f.write("mine\n")
    os.link(precious, os.path.join(hl, "fsdp-train.lock"))
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=2", "--set",
                   "checkpoint.dir=" + hl])
    check(p.returncode != 0 and "is a hard link of another file, not a job's lock" in p.stderr
          and open(precious).read() == "mine\n" and saved(hl) == [],
          "a lock file that is a hard link of another file is refused, that file untouched")
    # a lock that is a symbolic link: refused, named, never followed
    sl = os.path.join(tmp, "ck-symlink")
    os.makedirs(sl)
    os.symlink(precious, os.path.join(sl, "fsdp-train.lock"))
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=2", "--set",
                   "checkpoint.dir=" + sl])
    check(p.returncode != 0 and "is a symbolic link, not a job's lock; nothing was written"
          in p.stderr and open(precious).read() == "mine\n" and saved(sl) == [],
          "a lock file that is a symbolic link is refused, named, its target untouched (%s)"
          % p.stderr.strip()[-200:])
    # a lock file holding something else than a job's record (a user's file of that name):
    # refused, untouched; --dry-run says so
    ul = os.path.join(tmp, "ck-userlock")
    os.makedirs(ul)
    with open(os.path.join(ul, "fsdp-train.lock"), "w") as f:
        f.write("user text\n")
    for dry in ([], ["--dry-run"]):
        p, _ = run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + ul] + dry)
        check(("holds no training job's record" in p.stderr) and
              (p.returncode == 0) == bool(dry) and saved(ul) == [] and
              open(os.path.join(ul, "fsdp-train.lock")).read() == "user text\n",
              "a lock file holding no job's record is refused%s, untouched (%s)"
              % (" (--dry-run: noted)" if dry else "", p.stderr.strip()[-200:]))

    # 4. late refusals: before the first step (no step line), and by --dry-run
    ck = os.path.join(tmp, "ck-newer")
    run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=20", "--set",
            "checkpoint.dir=" + ck, "--set", "checkpoint.interval=2"])
    short = os.path.join(tmp, "short.txt")
    with open(data, "rb") as f, open(short, "wb") as g:
        g.write(f.read()[:65])  # data.seq_len + 1 tokens: one sample, no second start
    # a checkpoint of a model with a scaled rotary embedding (its record, as another tool's)
    scaled = os.path.join(tmp, "scaled-rope")
    shutil.copytree(os.path.join(ck, "step-00000020"), scaled)
    strip_records(scaled)
    edit_state(scaled, lambda st: st["saved_under"]["model"].update(
        rope_scaling={"rope_type": "linear", "factor": 2.0}))
    foreign = os.path.join(tmp, "ck-foreign")  # a user's folder named as a save's temporary
    os.makedirs(os.path.join(foreign, "step-00000007.tmp"))
    with open(os.path.join(foreign, "step-00000007.tmp", "notes.txt"), "w") as f:
        f.write("mine\n")
    cases = [
        ("a step-N.tmp that is no save's, in the run's steps",
         ["--set", "checkpoint.dir=" + foreign],
         r"checkpoint\.dir '\S+ck-foreign' holds step-00000007\.tmp, which is no save's \(it "
         r"lacks the \.fsdpc-partial mark a save gives its folder\): a save of that step would "
         r"be refused"),
        ("a rerun into a folder of newer checkpoints",
         ["--set", "checkpoint.dir=" + ck],
         r"checkpoint\.dir '\S+' holds 10 step folders after step 0, where this run starts "
         r"\(the newest: \S+step-00000020\).*checkpoint\.load: auto.*checkpoint\.overwrite: true"),
        ("a rollback to step 18 where step 20 exists",
         ["--set", "checkpoint.dir=" + ck, "--set",
          "checkpoint.load=" + os.path.join(ck, "step-00000018")],
         r"holds 1 step folder after step 18, where this run starts \(the newest: "
         r"\S+step-00000020\)"),
        ("a checkpoint of 2 layers resumed by a 1-layer plan",
         ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"), "--set",
          "model.n_layers=1"],
         r"checkpoint\.load: '\S+step-00000020' was saved with model\.n_layers = 2, the plan "
         r"has 1: a checkpoint resumes only the model it was saved from \(set the plan's "
         r"model\.n_layers to 2: its tensors have that model's shapes\)"),
        ("tied embeddings on an untied checkpoint",
         ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"), "--set",
          "model.tie_embeddings=true"],
         r"was saved with model\.tie_embeddings = false, the plan has true"),
        ("another rope_theta", ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                                "--set", "model.rope_theta=500000"],
         r"was saved with model\.rope_theta = 10000, the plan has 500000: .*\(set the plan's "
         r"model\.rope_theta to 10000, or start from its weights with model\.init_from after "
         r"fsdp-ckpt export-hf\)"),
        ("another rope scaling", ["--set", "checkpoint.load=" + scaled],
         r"was saved from another model \(rope_scaling \(rope_type\) linear vs default: saved "
         r"vs planned\)"),
        ("another norm_eps", ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                              "--set", "model.norm_eps=1e-6"],
         r"was saved with model\.norm_eps = 1e-05, the plan has 1e-06"),
        ("data of data.seq_len + 1 tokens", ["--set", "data.path=" + short, "--set",
                                              "data.seq_len=64"],
         r"data\.path: '\S+short\.txt' has 65 tokens; a sample needs data\.seq_len \+ 2 = 66"),
        ("eval data of data.seq_len + 1 tokens", ["--set", "eval.path=" + short, "--set",
                                                   "data.seq_len=64"],
         r"eval\.path: '\S+short\.txt' has 65 tokens; a sample needs data\.seq_len \+ 2 = 66"),
    ]
    for name, extra, want in cases:
        for dry in ([], ["--dry-run"]):
            p, secs = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=30"] +
                          extra + dry, timeout=60)
            said = ranks_saying(p.stderr, want) == {"0", "1"}
            check(p.returncode != 0 and said and not re.search(r"^step ", p.stdout, re.M),
                  "%s%s: refused on both ranks before the first step /%s/" %
                  (name, " (--dry-run)" if dry else "", want[:60]))
            if not said:
                print(p.stderr[-800:])
    check(open(os.path.join(foreign, "step-00000007.tmp", "notes.txt")).read() == "mine\n",
          "the step-N.tmp that is no save's is left as it was")
    # checkpoint.overwrite: the rollback runs; the newer folders go once its first save commits
    p, _ = run(2, [cfg, "--set", "mesh.dp_shard=2", "--set", "train.steps=20", "--set",
                   "checkpoint.dir=" + ck, "--set", "checkpoint.interval=2", "--set",
                   "checkpoint.load=" + os.path.join(ck, "step-00000016"), "--set",
                   "checkpoint.overwrite=true"])
    check(p.returncode == 0 and saved(ck)[-3:] == ["step-00000016", "step-00000018",
                                                   "step-00000020"] and
          "replaced the step folders after step 16" in p.stderr,
          "checkpoint.overwrite: true rolls back, replacing the newer folders (%s)" % saved(ck))
    # and its metrics file keeps the lines of those folders' steps until then: a rollback that
    # stops before its first save (here a bad sample in its first step) leaves the file whole
    rb, rm = os.path.join(tmp, "rollback"), os.path.join(tmp, "rollback.jsonl")
    bad5 = os.path.join(tmp, "bad-step5.bin")  # one rank of 8 samples of 64: step 5 reads 2100
    toks = [(i * 7) % 256 for i in range(256 * 20)]
    toks[2100] = 300
    with open(bad5, "wb") as f:
        f.write(struct.pack("<%dH" % len(toks), *toks))
    run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.interval=4", "--set",
            "checkpoint.dir=" + rb, "--metrics", rm])
    before = open(rm).read() if os.path.exists(rm) else ""
    p, _ = run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.dir=" + rb, "--set",
                   "checkpoint.load=" + os.path.join(rb, "step-00000004"), "--set",
                   "checkpoint.overwrite=true", "--set", "data.path=" + bad5, "--set",
                   "data.format=u16", "--metrics", rm])
    left = sorted(os.listdir(tmp))
    check(p.returncode == 1 and before.count("\n") == 8 and open(rm).read() == before and
          saved(rb) == ["step-00000004", "step-00000008"] and
          not [f for f in left if f.startswith("rollback.jsonl.")],
          "a checkpoint.overwrite rollback stopped before its first save leaves the metrics "
          "file's 8 lines and the folders as they were (%s)" % saved(rb))
    # so does a rerun from scratch under checkpoint.overwrite (a bad token at step 1 here)
    bad1 = os.path.join(tmp, "bad-step1.bin")
    toks[2100], toks[10] = 7, 300
    with open(bad1, "wb") as f:
        f.write(struct.pack("<%dH" % len(toks), *toks))
    p, _ = run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.dir=" + rb, "--set",
                   "checkpoint.overwrite=true", "--set", "data.path=" + bad1, "--set",
                   "data.format=u16", "--metrics", rm])
    check(p.returncode == 1 and open(rm).read() == before and
          saved(rb) == ["step-00000004", "step-00000008"] and
          not [f for f in os.listdir(tmp) if f.startswith("rollback.jsonl.")] and
          not os.path.exists(os.path.join(rb, "fsdp-train.rollback")),
          "a rerun from scratch under checkpoint.overwrite stopped before its first save leaves "
          "the metrics file and the folders as they were (%s)" % saved(rb))
    # an asynchronous save in flight when every rank stops alike (a non-finite step 7 here)
    # commits, as it would have without checkpoint.async; the folder checkpoint.overwrite moved
    # aside for it is not left behind
    nf = os.path.join(tmp, "nonfinite")
    blow = ["--set", "train.steps=12", "--set", "optim.lr=1e3", "--set", "optim.clip_grad_norm=0",
            "--set", "schedule.warmup_steps=0", "--set", "checkpoint.dir=" + nf, "--set",
            "checkpoint.interval=1"]
    p1, _ = run(1, [debug] + blow)
    p, _ = run(1, [debug] + blow + ["--set", "checkpoint.load=" + os.path.join(nf, "step-00000005"),
                                    "--set", "checkpoint.overwrite=true", "--set",
                                    "checkpoint.async=true"])
    check(p1.returncode == 1 and p.returncode == 1 and "step 7: the loss is" in p.stderr and
          "saved %s (written in the background)" % os.path.join(nf, "step-00000006") in p.stdout
          and saved(nf) == ["step-%08d" % k for k in range(1, 7)],
          "an asynchronous save in flight at a non-finite step commits; nothing is left moved "
          "aside (%s)" % saved(nf))
    # a rollback killed after its first save committed, before the history it replaces was
    # removed (journal fsdp-train.rollback left, old step folders back in place): the next
    # start finishes it; one that committed nothing is undone; a removal cut short
    # (step-N.removing) is removed. Built from a finished rollback of steps 4 -> 6 (the old
    # steps 7 and 8 copied back, the journal written as the killed job left it).
    rj, rm = os.path.join(tmp, "rollback-journal"), os.path.join(tmp, "rollback.jsonl")
    run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.interval=1", "--set",
            "checkpoint.dir=" + rj, "--metrics", rm])
    with open(rm) as f:
        old_lines = f.read()
    old = os.path.join(tmp, "rollback-journal-old")
    os.makedirs(old)
    for k in (7, 8):
        shutil.copytree(os.path.join(rj, "step-%08d" % k), os.path.join(old, "step-%08d" % k))
    roll = ["--set", "checkpoint.dir=" + rj, "--set", "checkpoint.interval=1", "--set",
            "checkpoint.overwrite=true", "--set", "optim.lr=1.0e-3"]
    p1, _ = run(1, [debug, "--set", "train.steps=6", "--set",
                    "checkpoint.load=" + os.path.join(rj, "step-00000004"), "--metrics", rm] +
                roll)
    with open(os.path.join(rj, "step-00000005", "train_state.json")) as f:
        rid = json.load(f)["saved_under"].get("run", "")
    with open(rm) as f:  # the rollback's lines: in its own file while it was killed
        new_lines = f.read()
    with open(rm, "w") as f:
        f.write(old_lines)
    own = rm + ".tmp-Ab12Cd"
    with open(own, "w") as f:
        f.write(new_lines)
    with open(rm + ".tmp-Zz99Yy", "w") as f:  # a rewrite a killed resume left
        f.write(old_lines[:40])
    with open(os.path.join(rj, "fsdp-train.rollback.tmp-Qq77Rr"), "w") as f:  # a journal's write
        f.write('{"after": 4')
    for left in (rm + ".tmp-Zz99Yy", os.path.join(rj, "fsdp-train.rollback.tmp-Qq77Rr")):
        os.utime(left, (time.time() - 60, time.time() - 60))  # left a while ago
    for k in (7, 8):
        shutil.copytree(os.path.join(old, "step-%08d" % k), os.path.join(rj, "step-%08d" % k))
    os.makedirs(os.path.join(rj, "step-00000002.removing", "model"))
    journal = os.path.join(rj, "fsdp-train.rollback")
    with open(journal, "w") as f:
        json.dump({"after": 4, "run": rid, "own_file": own}, f)
    p, _ = run(1, [debug, "--set", "train.steps=6", "--set", "checkpoint.load=auto", "--metrics",
                   rm] + roll)
    check(p1.returncode == 0 and len(rid) == 16 and p.returncode == 0 and
          "finished the checkpoint.overwrite rollback a job stopped in: removed the 2 step "
          "folders it replaces" in p.stderr and "removed 1 unfinished save or removal" in p.stderr
          and "checkpoint is after step 6" in p.stdout and
          saved(rj) == ["step-%08d" % k for k in range(1, 7)] and not os.path.exists(journal) and
          open(rm).read() == new_lines and
          "removed 1 unfinished rewrite of the metrics file" in p.stderr and
          not glob.glob(rm + ".tmp-*") and not glob.glob(journal + ".tmp-*"),
          "a rollback killed between its first save and the removal of what it replaces is "
          "finished by the next start, its metrics file given its name, the temporary files "
          "gone (%s; %s)" % (saved(rj), p.stderr.strip()[-200:]))
    with open(journal, "w") as f:
        json.dump({"after": 4, "run": "0123456789abcdef", "own_file": ""}, f)
    p, _ = run(1, [debug, "--set", "train.steps=6", "--set", "checkpoint.load=auto"] + roll)
    check(p.returncode == 0 and "had saved nothing; the step folders are as they were" in
          p.stderr and saved(rj) == ["step-%08d" % k for k in range(1, 7)] and
          not os.path.exists(journal),
          "a rollback that committed nothing is undone by the next start (%s)" % saved(rj))
    # checkpoint.keep left undone by a kill during the last save's pruning: the next start,
    # with nothing left to train from the newest checkpoint (auto), prunes
    kp = os.path.join(tmp, "keep-undone")
    run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.interval=2", "--set",
            "checkpoint.dir=" + kp])
    p, _ = run(1, [debug, "--set", "train.steps=8", "--set", "checkpoint.dir=" + kp, "--set",
                   "checkpoint.keep=2", "--set", "checkpoint.load=auto"])
    check(p.returncode == 0 and saved(kp) == ["step-00000006", "step-00000008"],
          "checkpoint.keep undone by a kill is done by the next start with nothing to train (%s)"
          % saved(kp))
    # a job killed while such a save was in flight: the next start puts the folder moved aside
    # back, or removes it when its replacement committed
    os.rename(os.path.join(nf, "step-00000006"), os.path.join(nf, "step-00000006.replaced-4242"))
    shutil.copytree(os.path.join(nf, "step-00000005"), os.path.join(nf, "step-00000005.replaced-99"))
    p, _ = run(1, [debug] + blow + ["--set", "checkpoint.load=auto", "--set", "train.steps=6"])
    check(p.returncode == 0 and "put back 1 step folder" in p.stderr and
          "removed 1 step folder that checkpoint.overwrite had replaced" in p.stderr and
          "resumed from %s" % os.path.join(nf, "step-00000006") in p.stdout and
          saved(nf) == ["step-%08d" % k for k in range(1, 7)],
          "the next start puts back a folder moved aside for a save that never committed (%s)"
          % saved(nf))
    # ranks started with different plans: refused at once, naming the keys and the ranks
    for name, a_sets, b_sets, want in (
            ("train.steps", ["train.steps=5"], ["train.steps=8"],
             r"\[rank 1\] this rank's plan differs from rank 0's \(train\.steps: 8 here, 5 on "
             r"rank 0\)"),
            ("model.n_layers", ["model.n_layers=2"], ["model.n_layers=3"],
             r"\[rank 1\] this rank's plan differs from rank 0's \(model\.n_layers: 3 here, 2 "
             r"on rank 0\)")):
        for dry in ([], ["--dry-run"]):
            cmd = [MPIRUN] + MPI_ARGS
            for sets in (a_sets, b_sets):
                cmd += ["-n", "1", EXE, cfg, "--set", "mesh.dp_shard=2"] + dry
                for kv in sets:
                    cmd += ["--set", kv]
                cmd.append(":")
            t = time.time()
            p = sh(cmd[:-1], timeout=60)
            check(p.returncode != 0 and re.search(want, p.stderr) and time.time() - t < 30 and
                  "MPI_ERR" not in p.stderr and not re.search(r"^step ", p.stdout, re.M),
                  "ranks started with different %s%s: refused at once, naming the key" %
                  (name, " (--dry-run)" if dry else ""))
    # one rank's dry run beside another's training would wait in its collectives
    cmd = [MPIRUN] + MPI_ARGS + ["-n", "1", EXE, cfg, "--set", "mesh.dp_shard=2", ":", "-n", "1",
                                 EXE, cfg, "--set", "mesh.dp_shard=2", "--dry-run"]
    t = time.time()
    p = sh(cmd, timeout=60)
    check(p.returncode != 0 and time.time() - t < 30 and re.search(
        r"\[rank 1\] this rank's plan differs from rank 0's \(--dry-run: given here, absent on "
        r"rank 0\)", p.stderr) and not re.search(r"^step ", p.stdout, re.M),
        "a dry run on one rank beside training on another: refused at once, naming --dry-run")

    # folders named as fsdp-train never names them are not its checkpoints: load: auto passes
    # them by; a data.path whose name holds [ but names a file is that file, not a pattern
    kd = os.path.join(tmp, "ck-names")
    run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + kd])
    os.makedirs(os.path.join(kd, "step-6"))
    os.makedirs(os.path.join(kd, "step-123456789012345678901"))
    p, _ = run(1, [debug, "--set", "train.steps=3", "--set", "checkpoint.dir=" + kd, "--set",
                   "checkpoint.load=auto"])
    check(p.returncode == 0 and "resumed from %s/step-00000002" % kd in p.stdout,
          "load: auto passes by folders named step-6 and step-<21 digits>")
    literal, other = os.path.join(tmp, "tok[1].bin"), os.path.join(tmp, "tok1.bin")
    shutil.copy(data, literal)
    with open(data, "rb") as f, open(other, "wb") as g:
        g.write(f.read()[:5000])
    p, _ = run(1, [debug, "--set", "train.steps=1", "--set", "data.path=" + literal])
    check(p.returncode == 0 and re.search(r"data: \S*tok\[1\]\.bin \(160329 tokens\)",
                                          p.stdout),
          "data.path tok[1].bin names that file, not tok1.bin by a pattern")

    # 5. removals never follow links; outputs never replace inputs
    kd = os.path.join(tmp, "ck-keep")
    run(1, [debug, "--set", "train.steps=2", "--set", "checkpoint.dir=" + kd])
    archive = os.path.join(tmp, "archive")
    shutil.copytree(os.path.join(kd, "step-00000002"), archive)
    before = sorted(os.listdir(archive))
    os.symlink(archive, os.path.join(kd, "step-00000001"))
    victim = os.path.join(tmp, "victim")
    os.makedirs(victim)
    with open(os.path.join(victim, "keep.txt"), "w") as f:
        f.write("x")
    os.symlink(victim, os.path.join(kd, "step-00000007.tmp"))
    p, _ = run(1, [debug, "--set", "train.steps=6", "--set", "checkpoint.dir=" + kd, "--set",
                   "checkpoint.interval=2", "--set", "checkpoint.keep=1", "--set",
                   "checkpoint.load=auto"])
    check(p.returncode == 0 and sorted(os.listdir(archive)) == before and
          os.path.exists(os.path.join(victim, "keep.txt")) and sorted(os.listdir(kd)) ==
          ["step-00000006"],
          "checkpoint.keep removes a linked checkpoint's link, not the archive it points to; "
          "a linked unfinished save loses its link, not its target (%s)" % sorted(os.listdir(kd)))
    for op, args in (("export-hf", [os.path.join(ck, "step-00000020")]),
                     ("reshard", [os.path.join(ck, "step-00000020"), "--to", debug]),
                     ("import-hf", None)):
        out = os.path.join(tmp, "out-" + op)
        if op == "import-hf":
            args = [os.path.join(tmp, "out-export-hf")]
        for tail in (".tmp", ".tmp-000000"):
            if not os.path.lexists(out + tail):
                os.symlink(victim, out + tail)
        p = sh([TOOL, op] + args + [out], timeout=120)
        check(p.returncode == 0 and os.path.isdir(out) and
              os.path.exists(os.path.join(victim, "keep.txt")),
              "fsdp-ckpt %s beside OUT.tmp links: writes OUT, leaves what they point to" % op)
        # what a stopped command left (OUT.tmp-XXXXXX, a folder marked .fsdpc-partial, no
        # longer locked) is removed, said; a folder of that name without the mark (the
        # user's), one whose mark a live command holds locked, and the command's own input
        # are left
        again = out + "-again"
        os.makedirs(os.path.join(again + ".tmp-q1W2e3", "model"))
        open(os.path.join(again + ".tmp-q1W2e3", ".fsdpc-partial"), "w").close()
        users = again + ".tmp-backup"
        os.makedirs(users)
        with open(os.path.join(users, "notes.txt"), "w") as f:
            f.write("mine")
        live = again + ".tmp-L1v3ee"
        os.makedirs(live)
        held = open(os.path.join(live, ".fsdpc-partial"), "w")
        fcntl.flock(held, fcntl.LOCK_EX)
        p = sh([TOOL, op] + args + [again], timeout=120)
        held.close()
        check(p.returncode == 0 and os.path.isdir(again) and
              sorted(glob.glob(again + ".tmp-*")) == sorted([users, live]) and
              "removed 1 unfinished output beside" in p.stderr,
              "fsdp-ckpt %s removes the unfinished output a stopped run left beside OUT, not "
              "the user's folder of that name nor a running command's (%s)"
              % (op, p.stderr.strip()[-160:]))
        shutil.rmtree(live)
        # an input named like OUT's temporary (a copy the user made) is read, not removed
        named = os.path.join(tmp, "in-%s.tmp-final1" % op)
        source = args[0] if op != "import-hf" else os.path.join(tmp, "out-export-hf")
        shutil.copytree(source, named)
        open(os.path.join(named, ".fsdpc-partial"), "w").close()
        p = sh([TOOL, op, named] + args[1:] + [os.path.join(tmp, "in-%s" % op)], timeout=120)
        check(p.returncode == 0 and os.path.isdir(named) and "removed" not in p.stderr,
              "fsdp-ckpt %s leaves its input named like OUT's temporary (%s)"
              % (op, p.stderr.strip()[-160:]))
        # or lying inside a marked leftover of that name; a mark that is a folder is no mark
        holder = os.path.join(tmp, "in2-%s.tmp-abcdef" % op)
        os.makedirs(holder)
        open(os.path.join(holder, ".fsdpc-partial"), "w").close()
        inside = os.path.join(holder, "input")
        shutil.copytree(source, inside)
        foldered = os.path.join(tmp, "in2-%s.tmp-fold3r" % op)
        os.makedirs(os.path.join(foldered, ".fsdpc-partial"))
        p = sh([TOOL, op, inside] + args[1:] + [os.path.join(tmp, "in2-%s" % op)], timeout=120)
        check(p.returncode == 0 and os.path.isdir(inside) and os.path.isdir(foldered) and
              "removed" not in p.stderr,
              "fsdp-ckpt %s leaves a leftover its input lies in, and a folder whose mark is a "
              "folder (%s)" % (op, p.stderr.strip()[-160:]))
        link = os.path.join(tmp, "link-" + op)
        os.symlink(os.path.join(tmp, "nowhere-" + op), link)
        p = sh([TOOL, op] + args + [link], timeout=120)
        check(p.returncode != 0 and "is a symbolic link" in p.stderr and
              not os.path.exists(os.path.join(tmp, "nowhere-" + op)),
              "fsdp-ckpt %s refuses an OUT that is a symbolic link" % op)
    state = os.path.join(ck, "step-00000020", "train_state.json")
    plot = os.path.join(os.path.dirname(EXE), "fsdp-plot")
    plan_tool = os.path.join(os.path.dirname(EXE), "fsdp-plan")
    ds = os.path.join(tmp, "zero3.json")
    shutil.copy(os.path.join(ROOT, "tests", "convert", "deepspeed-zero3.json"), ds)
    plan = os.path.join(tmp, "plan.yaml")  # copies: a failing check must not touch the tree
    shutil.copy(debug, plan)
    tokens = os.path.join(tmp, "tokens.txt")
    shutil.copy(data, tokens)
    mine = [EXE, plan, "--set", "train.steps=1", "--set", "data.path=" + tokens]
    metrics = os.path.join(tmp, "ref.jsonl")
    arch = os.path.join(tmp, "llama-tiny.json")  # the plan's model.config
    shutil.copy(os.path.join(ROOT, "configs", "llama-tiny.json"), arch)
    arch_plan = os.path.join(tmp, "arch.yaml")
    with open(debug) as f, open(arch_plan, "w") as g:
        text = re.sub(r"(?m)^  (dim|n_layers|n_heads|n_kv_heads|ffn_dim|vocab_size|"
                      r"max_seq_len): .*\n", "", f.read())
        g.write(text.replace("model:\n", "model:\n  config: %s\n" % arch, 1))
    with_arch = [EXE, arch_plan, "--set", "train.steps=1", "--set", "data.path=" + tokens]
    for name, cmd, victim_file in (
            ("--metrics at the training data", mine + ["--metrics", tokens], tokens),
            ("--metrics at the plan", mine + ["--metrics", plan], plan),
            ("--metrics at the resumed checkpoint's train_state.json",
             mine + ["--set", "checkpoint.load=" + os.path.join(ck, "step-00000020"),
                     "--metrics", state], state),
            ("--plot at the plan", mine + ["--metrics", os.path.join(tmp, "p.jsonl"), "--plot",
                                           plan], plan),
            ("--metrics at model.config's file", with_arch + ["--metrics", arch], arch),
            ("--plot at model.config's file",
             with_arch + ["--metrics", os.path.join(tmp, "c.jsonl"), "--plot", arch], arch),
            ("fsdp-plot -o at its input", [plot, metrics, "-o", metrics], metrics),
            ("fsdp-plan -o at its input", [plan_tool, "convert", ds, "-o", ds], ds),
            ("fsdp-plot -o /dev/null", [plot, metrics, "-o", "/dev/null"], None),
            ("fsdp-plan -o /dev/null", [plan_tool, "convert", ds, "-o", "/dev/null"], None),
            ("--metrics at /dev/null", mine + ["--metrics", "/dev/null"], None)):
        keep = open(victim_file, "rb").read() if victim_file else None
        p = sh(cmd, timeout=120)
        intact = (open(victim_file, "rb").read() == keep if victim_file else
                  os.path.exists("/dev/null") and not os.path.isfile("/dev/null"))
        check(p.returncode != 0 and intact and
              re.search(r"an input of this run|not a regular file|the metrics file it draws",
                        p.stderr),
              "%s: refused, the file intact (%s)" % (name, p.stderr.strip()[-160:]))
    # outputs where checkpoint.dir's run prunes, replaces or locks: refused before step 1
    own = os.path.join(tmp, "own-ck")
    sh(mine + ["--set", "checkpoint.dir=" + own], timeout=120)  # leaves step-00000001
    for name, out, said in (
            ("--metrics inside a step folder", ["--metrics",
                                                os.path.join(own, "step-00000001", "m.jsonl")],
             "lies in checkpoint.dir's step folder step-00000001"),
            ("--metrics at the lock file", ["--metrics", os.path.join(own, "fsdp-train.lock")],
             "is checkpoint.dir's lock file"),
            ("--metrics named as a later step folder",
             ["--metrics", os.path.join(own, "step-00000004")],
             "is named as checkpoint.dir's step folders are"),
            ("--plot named as a later step folder",
             ["--metrics", os.path.join(tmp, "q.jsonl"), "--plot",
              os.path.join(own, "step-00000004")], "is named as checkpoint.dir's step folders"),
            ("--metrics ''", ["--metrics", ""], "--metrics '': empty path"),
            ("eval.path inside a step folder (checkpoint.keep would remove it while read)",
             ["--set", "eval.path=" + os.path.join(own, "step-00000001", "train_state.json"),
              "--set", "checkpoint.keep=1"],
             "eval.path's file '%s' lies in checkpoint.dir's step folder step-00000001"
             % os.path.join(own, "step-00000001", "train_state.json")),
            ("--plot naming the metrics file another way",
             ["--metrics", os.path.join(tmp, "same.jsonl"), "--plot",
              os.path.join(tmp, ".", "same.jsonl")], "is the metrics file it draws")):
        p = sh(mine + ["--set", "train.steps=4", "--set", "checkpoint.dir=" + own,
                       "--set", "checkpoint.load=auto"] + out, timeout=120)
        check(p.returncode != 0 and said in p.stderr and
              sorted(os.listdir(own)) == ["step-00000001"],
              "%s: refused before the first step (%s)" % (name, p.stderr.strip()[-160:]))
    # a file-size limit (ulimit -f) reached by the metrics file takes a full disk's path: the
    # step saved first, whole lines left, not a kill by SIGXFSZ (the plain build's: hundreds
    # of steps)
    if not os.environ.get("FSDPC_TEST_SANITIZED"):
        import resource
        fz, fzm = os.path.join(tmp, "fsize-ck"), os.path.join(tmp, "fsize.jsonl")
        sh(mine + ["--set", "train.steps=3", "--set", "checkpoint.dir=" + fz, "--metrics", fzm],
           timeout=120)
        with open(fzm) as f:
            rows = [json.loads(r) for r in f]
        with open(fzm, "w") as f:  # ~4 MB of lines: the limit comes within hundreds of steps
            f.writelines(json.dumps(dict(r, pad="x" * 1350000)) + "\n" for r in rows)
        limit = 4 << 20
        p = subprocess.run(mine + ["--set", "train.steps=5000", "--set", "checkpoint.dir=" + fz,
                                   "--set", "checkpoint.load=auto", "--metrics", fzm],
                           capture_output=True, text=True, timeout=300,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                                 (limit, limit)))
        last = saved(fz)[-1]
        with open(fzm) as f:
            tail = f.read().splitlines()[-1]
        check(p.returncode == 1 and "cannot write the metrics file '%s': File too large" % fzm
              in p.stderr and "saved %s/%s first" % (fz, last) in p.stderr and
              last != "step-00000003" and json.loads(tail)["step"] == int(last[5:]) - 1,
              "a metrics file at ulimit -f: the run stops on the error, its step saved first, the "
              "file's lines whole (exit %s, %s)" % (p.returncode, p.stderr.strip()[-200:]))
    # a fresh run's metrics file is a new file renamed over the old one: a hard link to the
    # old one (a snapshot) keeps its lines
    snap_m, snap = os.path.join(tmp, "linked.jsonl"), os.path.join(tmp, "linked-snapshot.jsonl")
    sh(mine + ["--set", "train.steps=3", "--metrics", snap_m], timeout=120)
    os.link(snap_m, snap)
    p = sh(mine + ["--set", "train.steps=2", "--metrics", snap_m], timeout=120)
    check(p.returncode == 0 and len(open(snap).readlines()) == 3 and
          len(open(snap_m).readlines()) == 2,
          "a fresh run replaces its metrics file, leaving a hard link's lines as they were")
    # --metrics and log.metrics both given: the command line's is written, with a note
    pm, cm = os.path.join(tmp, "plan-named.jsonl"), os.path.join(tmp, "cli-named.jsonl")
    p = sh(mine + ["--set", "train.steps=1", "--set", "log.metrics=" + pm, "--metrics", cm],
           timeout=120)
    check(p.returncode == 0 and "note: --metrics '%s' is written; the plan's log.metrics '%s' is "
          "not" % (cm, pm) in p.stderr and os.path.exists(cm) and not os.path.exists(pm),
          "--metrics wins over log.metrics, with a note (%s)" % p.stderr.strip()[-200:])
    # checkpoint.keep that cannot remove a folder (a file in it that may not go: chattr +i)
    # warns, naming the file's cause, prunes the others and goes on; the half-removed folder
    # it leaves is warned of, not refused, by the next start
    kp = os.path.join(tmp, "keep-stuck")
    sh(mine + ["--set", "train.steps=4", "--set", "checkpoint.interval=1", "--set",
               "checkpoint.dir=" + kp], timeout=120)
    pinned = os.path.join(kp, "step-00000001", "train_state.json")
    if sh(["chattr", "+i", pinned], timeout=30).returncode != 0:
        print("note: chattr +i is refused here; checkpoint.keep's failed removal not checked")
        return
    try:
        more = mine + ["--set", "checkpoint.interval=1", "--set", "checkpoint.dir=" + kp,
                       "--set", "checkpoint.load=auto", "--set", "checkpoint.keep=2"]
        p = sh(more + ["--set", "train.steps=6"], timeout=120)
        q = sh(more + ["--set", "train.steps=7"], timeout=120)
        check(p.returncode == 0 and "warning: checkpoint.keep: checkpoint: cannot remove all of "
              "%s/step-00000001.removing: Operation not permitted" % kp in p.stderr and
              q.returncode == 0 and "1 unfinished entry (step-*.tmp, step-*.removing) stays" in q.stderr and
              saved(kp) == ["step-00000001.removing", "step-00000006", "step-00000007"],
              "checkpoint.keep warns of a folder it cannot remove, prunes the rest, and the "
              "next start goes on (%s; %s)" % (saved(kp), (p.stderr + q.stderr).strip()[-300:]))
    finally:
        sh(["chattr", "-i", os.path.join(kp, "step-00000001.removing", "train_state.json")],
           timeout=30)
        sh(["chattr", "-i", pinned], timeout=30)
