#!/usr/bin/env python3
"""A model larger than one rank: every rank's peak resident memory against the model's size.

  bench/big_model.py [--exe build/tools/fsdp-train] [--config configs/llama-520m.yaml]
                     [--world 8] [--keep DIR]

Trains the plan's model for its steps on WORLD ranks three ways, each rank under
/usr/bin/time (peak resident set size, %M):
  seed       deferred initialisation from the seed, saving a checkpoint at the last step;
  init_from  the same model read from a Hugging Face folder (fsdp-ckpt export-hf of that
             checkpoint);
  resume     checkpoint.load of that checkpoint, two more steps.
For each it prints every rank's peak RSS, its ratio to the whole model in f32, and the
per-rank figures --dry-run estimates: the sharded state (parameters, gradients, AdamW moments),
the largest unit gathered at once and the peak of a step (the accounting layer's
peak_mem_bytes, which RSS exceeds by the process's own code, MPI and the allocator's slack). A run is a PASS when every rank stays below 0.9x the
model's f32 bytes. Needs disk for one checkpoint (model + AdamW: 3x the model) and the export.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from fsdpc_version import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]


def mpirun(world, exe, args, env, work):
    """Runs exe under mpirun with /usr/bin/time per rank; returns (output, {rank: KiB})."""
    stem = os.path.join(work, "rss")
    cmd = MPI + ["-n", str(world), "sh", "-c",
                 '/usr/bin/time -f %%M -o "%s.$OMPI_COMM_WORLD_RANK" "$0" "$@"' % stem, exe] + args
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit("%s failed:\n%s" % (" ".join(cmd), out[-3000:]))
    rss = {}
    for r in range(world):
        with open("%s.%d" % (stem, r)) as f:
            rss[r] = int(f.read().split()[-1])
        os.unlink("%s.%d" % (stem, r))
    return out, rss


def model_section(text, replacement):
    """The plan text with its model: section replaced (or removed when replacement is '')."""
    out, skip = [], False
    for line in text.splitlines():
        if re.match(r"^model:\s*$", line):
            skip = True
            out.append(replacement)
            continue
        if skip and (line.startswith(" ") or not line.strip()):
            continue
        skip = False
        out.append(line)
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "fsdp-train"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-520m.yaml"))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--keep", help="folder for the checkpoint and export (kept)")
    a = ap.parse_args()
    tool = os.path.join(os.path.dirname(a.exe), "fsdp-ckpt")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    work = a.keep or tempfile.mkdtemp(prefix="fsdpc-big-")
    os.makedirs(work, exist_ok=True)
    try:
        text = open(a.config).read()
        config_dir = os.path.dirname(os.path.abspath(a.config))
        text = text.replace("../data/", os.path.join(os.path.dirname(config_dir), "data") + "/")

        out, _ = mpirun(a.world, a.exe, [a.config, "--dry-run"], env, work)
        params = int(re.search(r"; (\d+) parameters", out).group(1))
        state = float(re.search(r"state_bytes (\d+)", out).group(1))
        largest = float(re.search(r"largest_unit_bytes (\d+)", out).group(1))
        peak = float(re.search(r"peak_bytes (\d+)", out).group(1))
        steps = int(re.search(r"grad_accum \d+ .*?; (\d+) steps", out).group(1))
        model_bytes = 4.0 * params
        print("model: %d parameters, %.2f GB in f32; %d ranks; per rank (--dry-run): sharded "
              "state %.0f MB (parameters, gradients, AdamW), largest unit %.0f MB, a step's peak "
              "%.0f MB" % (params, model_bytes / 1e9, a.world, state / 1e6, largest / 1e6,
                           peak / 1e6))

        ckpt = os.path.join(work, "ckpt")
        hf = os.path.join(work, "hf")
        runs = [("seed", a.config, ["--set", "checkpoint.dir=" + ckpt,
                                     "--set", "checkpoint.interval=%d" % steps])]
        verdict = True
        for name, plan, extra in runs + [("init_from", None, []), ("resume", None, [])]:
            if name == "init_from":
                if not os.path.isdir(hf):
                    p = subprocess.run([tool, "export-hf", os.path.join(ckpt, "step-%08d" % steps),
                                        hf], capture_output=True, text=True)
                    if p.returncode != 0:
                        sys.exit("export-hf failed:\n" + p.stdout + p.stderr)
                plan = os.path.join(work, "init_from.yaml")
                with open(plan, "w") as f:
                    f.write(model_section(text, "model:\n  init_from: " + hf))
            if name == "resume":
                plan = a.config
                extra = ["--set", "checkpoint.load=" + os.path.join(ckpt, "step-%08d" % steps),
                         "--set", "train.steps=%d" % (steps + 2)]
            t = time.time()
            out, rss = mpirun(a.world, a.exe, [plan] + extra, env, work)
            dt = time.time() - t
            worst = max(rss.values()) * 1024.0
            ok = len(rss) == a.world and worst < 0.9 * model_bytes
            verdict = verdict and ok
            done = re.search(r"done: .*", out)
            print("\n%s: %s (%.0f s)" % (name, done.group(0) if done else "", dt))
            print("  rank  peak RSS    / model f32   / estimated peak")
            for r in sorted(rss):
                b = rss[r] * 1024.0
                print("  %4d  %7.0f MB  %6.3f       %6.3f" % (r, b / 1e6, b / model_bytes,
                                                            b / peak))
            print("  %s: worst rank %.0f MB = %.3fx the model's %.0f MB (limit 0.9x)"
                  % ("PASS" if ok else "FAIL", worst / 1e6, worst / model_bytes,
                     model_bytes / 1e6))
        return 0 if verdict else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
