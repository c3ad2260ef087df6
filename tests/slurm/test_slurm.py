#!/usr/bin/env python3
"""fsdp-train under a real Slurm: a one-node cluster started on this machine for the test.

  test_slurm.py FSDP_TRAIN SOURCE_ROOT

Starts munged with a key of its own and slurmctld and slurmd from a slurm.conf of its own
(localhost, this machine's cores, every file under a temporary folder, free ports), submits
scripts/slurm-train.sbatch with 4 tasks (srun --mpi=pmix), and does to the job what clusters
do:
  1. scancel --signal=USR1 (as a preemption notice would): the job saves at a step boundary,
     exits 75, requeues itself (FSDP_REQUEUE=1, submitted with --requeue) and the requeued
     run resumes with checkpoint.load: auto to completion; its losses equal an uninterrupted
     run's (the same 4 ranks under mpirun);
  2. a time limit with sbatch --signal=B:USR1@SECONDS: the warning leads to a save and a
     requeue the same way.
Stops every daemon it started at the end. Exits 77 (skipped), saying why, where Slurm is not
installed or the cluster cannot start (scripts/setup.sh installs Slurm and munge in CI, or
with FSDPC_SLURM=1), as not root, and in the sanitized build.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

EXE, ROOT = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SBATCH_SCRIPT = os.path.join(ROOT, "scripts", "slurm-train.sbatch")
failures = []
procs = []


T0 = time.time()


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what + "  [%.0f s]" % (time.time() - T0), flush=True)
    if not ok:
        failures.append(what)


def skip(why):
    print("skipped: " + why, flush=True)
    stop()
    sys.exit(77)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def ours():
    """The processes holding a file under TMP: the daemons and job steps of this test's
    cluster alone (a Slurm around the test keeps its own)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            links = [os.readlink("/proc/%s/fd/%s" % (pid, fd))
                     for fd in os.listdir("/proc/%s/fd" % pid)]
        except OSError:
            continue
        if any(link.startswith(TMP) for link in links):
            pids.append(int(pid))
    return pids


def stop():
    """Ends every job, then the daemons, then whatever of the cluster is left."""
    if os.path.exists(ENV["SLURM_CONF"]):
        slurm(["scancel", "--full", "--state=RUNNING"], timeout=30)
        slurm(["scancel", "--state=PENDING"], timeout=30)
        t = time.time()
        while time.time() - t < 30:
            p = slurm(["squeue", "-h"], timeout=30)
            if p.returncode != 0 or not p.stdout.strip():
                break
            time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    for pid in ours():  # munged, and a job step that outlived its daemon
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


TMP = tempfile.mkdtemp(prefix="fsdpc-slurm-")
ENV = dict(os.environ, SLURM_CONF=os.path.join(TMP, "slurm.conf"))
for k in list(ENV):  # a Slurm job around the test would leak into the test's own
    if k.startswith("SLURM_") and k != "SLURM_CONF":
        del ENV[k]


def slurm(cmd, timeout=60):
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def start_cluster():
    if os.environ.get("FSDPC_TEST_SANITIZED"):
        skip("runs in the plain build (plans-operations runs the same signals, saves and "
             "resumes under the sanitizers)")
    if os.getuid() != 0:
        skip("the one-node cluster's daemons run as root (slurmd starts the jobs' tasks)")
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol"):
        if shutil.which(tool) is None and not os.path.exists("/usr/sbin/" + tool):
            skip("%s is not installed (scripts/setup.sh installs slurmctld, slurmd, "
                 "slurm-client and munge in CI, or with FSDPC_SLURM=1)" % tool)
    key = os.path.join(TMP, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(TMP, "munge.socket")
    munged = shutil.which("munged") or "/usr/sbin/munged"
    p = subprocess.run([munged, "--force", "--key-file", key, "--socket", sock,
                        "--pid-file", os.path.join(TMP, "munged.pid"),
                        "--log-file", os.path.join(TMP, "munged.log"),
                        "--seed-file", os.path.join(TMP, "munged.seed")],
                       capture_output=True, text=True)
    if p.returncode != 0:
        skip("munged does not start here: " + (p.stderr or p.stdout).strip()[-300:])
    cpus = os.cpu_count() or 1
    os.makedirs(os.path.join(TMP, "state"))
    os.makedirs(os.path.join(TMP, "spool"))
    conf = """\
ClusterName=fsdpc-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={tmp}/munge.socket,cred_expire=10
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
SlurmctldPort={ctld}
SlurmdPort={slurmd}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=30
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=localhost NodeHostname={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""".format(tmp=TMP, ctld=free_port(), slurmd=free_port(), host=socket.gethostname(),
           cpus=max(4, cpus))
    with open(ENV["SLURM_CONF"], "w") as f:
        f.write(conf)
    for daemon in ("slurmctld", "slurmd"):
        exe = shutil.which(daemon) or "/usr/sbin/" + daemon
        args = [exe, "-D", "-f", ENV["SLURM_CONF"]] + (["-i"] if daemon == "slurmctld" else [])
        procs.append(subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    t = time.time()
    while time.time() - t < 60:
        p = slurm(["sinfo", "-h", "-o", "%t"])
        if p.returncode == 0 and p.stdout.strip() in ("idle", "mix", "alloc"):
            return
        if any(q.poll() is not None for q in procs):
            break
        time.sleep(0.5)
    logs = ""
    for name in ("slurmctld.log", "slurmd.log"):
        path = os.path.join(TMP, name)
        if os.path.exists(path):
            logs += "\n%s: %s" % (name, open(path).read()[-600:])
    skip("the one-node cluster did not come up within 60 s%s" % logs)


def job_state(job):
    p = slurm(["scontrol", "show", "job", str(job)])
    m = re.search(r"JobState=(\S+)", p.stdout)
    r = re.search(r"Restarts=(\d+)", p.stdout)
    return (m.group(1) if m else "?"), (int(r.group(1)) if r else 0)


def submit(name, plan_sets, extra=()):
    out = os.path.join(TMP, name + ".out")
    metrics = os.path.join(TMP, name + ".jsonl")
    args = ["sbatch", "--parsable", "--ntasks=4", "--ntasks-per-node=4", "--cpus-per-task=1",
            "--requeue", "--open-mode=append", "--output=" + out, "--chdir=" + ROOT,
            "--export=ALL,FSDP_REQUEUE=1,OMPI_ALLOW_RUN_AS_ROOT=1,"
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,FSDP_TRAIN=" + EXE] + list(extra) + [
        SBATCH_SCRIPT, os.path.join(ROOT, "configs", "fsdp.yaml"), "--metrics", metrics]
    for kv in plan_sets:
        args += ["--set", kv]
    p = slurm(args)
    check(p.returncode == 0, "%s: sbatch accepts the job (%s)" % (name, p.stderr.strip()[-200:]))
    return int(p.stdout.strip().split(";")[0]) if p.returncode == 0 else None, out, metrics


def steps_in(out):
    if not os.path.exists(out):
        return []
    return [int(x) for x in re.findall(r"^step\s+(\d+)/", open(out).read(), re.M)]


def wait_done(job, limit):
    t = time.time()
    while time.time() - t < limit:
        state, restarts = job_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state, restarts
        time.sleep(1)
    slurm(["scancel", str(job)])
    return "TIMEOUT (test)", job_state(job)[1]


def main():
    start_cluster()
    steps = 200
    common = ["train.steps=%d" % steps, "log.interval=1", "checkpoint.load=auto"]
    # the uninterrupted run, as the reference: the same 4 ranks under mpirun
    ref = os.path.join(TMP, "plain.jsonl")
    p = subprocess.run(["mpirun", "--oversubscribe", "-n", "4", EXE,
                        os.path.join(ROOT, "configs", "fsdp.yaml"), "--set", "train.steps=%d" % steps,
                        "--metrics", ref], capture_output=True, text=True, timeout=300,
                       env=dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    ref_losses = [json.loads(l)["loss"] for l in open(ref)] if os.path.exists(ref) else []
    check(p.returncode == 0 and len(ref_losses) == steps,
          "the uninterrupted run under mpirun (%d steps)" % len(ref_losses))

    # 2 is submitted first: its wait for the time limit overlaps with 1 (the partition shares
    # its CPUs between the two jobs)
    limit_job, limit_out, _ = submit("limit", ["train.steps=100000", "log.interval=100",
                                               "checkpoint.load=auto",
                                               "checkpoint.dir=" + os.path.join(TMP, "ck-limit")],
                                     ["--time=2", "--signal=B:USR1@40"])

    # 1. scancel --signal=USR1 to the batch shell: save, exit 75, requeue, resume
    ck = os.path.join(TMP, "ck-usr1")
    job, out, metrics = submit("usr1", common + ["checkpoint.dir=" + ck])
    t = time.time()
    while job and len(steps_in(out)) < 20 and time.time() - t < 120:
        time.sleep(0.2)
    slurm(["scancel", "--batch", "--signal=USR1", str(job)])
    state, restarts = wait_done(job, 300) if job else ("none", 0)
    text = open(out).read() if os.path.exists(out) else ""
    hit = re.search(r"interrupted by SIGUSR1 at step (\d+); saved \S+", text)
    got = [json.loads(l)["loss"] for l in open(metrics)] if os.path.exists(metrics) else []
    check(hit is not None and "requeueing job" in text and restarts >= 1,
          "scancel --signal=USR1: the job saves at step %s, exits 75 and requeues itself "
          "(restarts %d)" % (hit.group(1) if hit else "?", restarts))
    check(state == "COMPLETED" and got == ref_losses and "resumed from" in text,
          "the requeued job resumes with load: auto and ends with the uninterrupted losses "
          "(%s)" % state)
    if not (hit and state == "COMPLETED"):
        print(text[-3000:])

    # 2. a time limit with a warning signal before it, and a run long enough to reach it.
    # Slurm checks time limits periodically and may send the warning up to 60 s before the
    # time asked for: with --time=1 and @45 it could come as the job started, before the batch
    # shell had its trap, and be lost. --time=2 and @40 put it 20 to 80 s into the job, at
    # least 40 s before the limit.
    job, out = limit_job, limit_out
    t, text = time.time(), ""
    while job and time.time() - t < 240:
        text = open(out).read() if os.path.exists(out) else ""
        if "requeueing job" in text:
            break
        time.sleep(1)
    hit = re.search(r"interrupted by SIGUSR1 at step (\d+); saved (\S+)", text)
    check(hit is not None and os.path.isdir(hit.group(2)) and "requeueing job" in text,
          "a time limit's warning signal (--signal=B:USR1@40): the job saves at step %s and "
          "requeues itself" % (hit.group(1) if hit else "?"))
    if job:
        slurm(["scancel", str(job)])
    if hit is None:
        print(text[-3000:])


# meson's timeout ends the test with SIGTERM: the cluster is stopped all the same
signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
try:
    main()
finally:
    stop()
    if failures:  # what the cluster saw, before its folder goes
        for log in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(TMP, log)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    print("--- the end of %s\n%s" % (log, "".join(f.readlines()[-60:])))
    shutil.rmtree(TMP, ignore_errors=True)
print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
