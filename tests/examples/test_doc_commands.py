#!/usr/bin/env python3
"""Every shell command and YAML block of README.md and docs/, run or checked as written.

  test_doc_commands.py BUILD_ROOT MPIRUN SOURCE_ROOT

Each line of a ```sh block runs with bash in a fresh folder holding build/ (this build),
configs/, examples/, data/ and scripts/ (the source tree's), so its relative paths mean what
they mean in a checkout and what it writes stays there. What a test cannot run as written is
bounded, and the table below says how:
  - mpirun also gets --oversubscribe --bind-to none (this machine may have fewer cores);
  - fsdp-train runs 2 steps (--set train.steps=2), and a plan too large for a test machine
    (LARGE) runs as --dry-run, which builds its whole plan on the meta device;
  - the benchmarks run a few steps;
  - a placeholder plan (plan.yaml) is configs/fsdp.yaml;
  - the set-up, build and test scripts are what CI runs on every change (.ci/run), and sbatch
    needs Slurm (the slurm suite runs scripts/slurm-train.sbatch): for these the script must
    exist and be executable.
Every command must exit 0; a line the table does not know fails the test, so a new command in
the docs gets run here or a row of its own. In the sanitized build (FSDPC_TEST_SANITIZED) it
skips (77): the plain build runs the same lines.

A ```yaml block is a file of the tree or a part of a plan, and is checked as one:
  - one whose opening comment names a file ("# examples/mlp_tp.yaml: ...", or the command that
    trains it, as README's plan), holds that file's settings, line for line (comments aside);
  - one that another file writes out (docs/plan.md's built-in tensor-parallel plan, which
    "configs/tp.yaml writes out"): each of its settings is a line of that file;
  - a plan's sections (docs/getting-started.md's data and eval of llm.c shards): they replace
    those sections of configs/debug.yaml, and that plan trains 2 steps and evaluates, on
    shards this test writes where the paths say (tokens 0-255 in llm.c's format), the model's
    max_seq_len raised to the block's seq_len and 2 evaluation batches.

A plain ``` block that states how a program is called ("fsdp-ckpt inspect DIR") holds forms the
program's --help prints, each one of them (spaces aside).
"""
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile
import time

BUILD, MPIRUN, ROOT = sys.argv[1:4]
MPI_ARGS = "--oversubscribe --bind-to none"
LARGE = ["configs/llama-520m.yaml"]
PAGES = ["README.md"] + ["docs/" + f for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                         if f.endswith(".md")]
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def commands(page):
    """The command lines of page's ```sh blocks (comments and continuations joined)."""
    out, block, line = [], False, ""
    for raw in open(os.path.join(ROOT, page)).read().splitlines():
        if raw.startswith("```"):
            block = raw.strip() == "```sh" and not block
            continue
        if not block:
            continue
        text = raw.split("  #")[0].rstrip() if "  #" in raw else raw.rstrip()
        if text.endswith("\\"):
            line += text[:-1] + " "
            continue
        line += text
        if line.strip():
            out.append(line.strip())
        line = ""
    return out


def yaml_blocks(page):
    """The ```yaml blocks of page: (line number, lines)."""
    out, cur, start = [], None, 0
    for i, raw in enumerate(open(os.path.join(ROOT, page)).read().splitlines(), 1):
        if cur is None and raw.strip() == "```yaml":
            cur, start = [], i
        elif cur is not None and raw.startswith("```"):
            out.append((start, cur))
            cur = None
        elif cur is not None:
            cur.append(raw)
    return out


def settings(lines):
    """The lines of a YAML text without comments and blank lines, spaces at the end removed."""
    out = []
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
        if line.strip():
            out.append(line.rstrip())
    return out


def write_llmc(path, n):
    """An llm.c token shard: its 256-int header (magic, version 1, count), then uint16 tokens."""
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack("<%dH" % n, *((i * 7 + i // 5) % 256 for i in range(n))))


def check_yaml(page, line, lines, env):
    where = "%s:%d: the yaml block" % (page, line)
    head = []  # the comment lines it starts with
    for x in lines:
        if not x.startswith("#"):
            break
        head.append(x)
    names = re.findall(r"(?:configs|examples)/[\w.-]+\.yaml", " ".join(head))
    if names:
        want = settings(open(os.path.join(ROOT, names[0])).read().splitlines())
        check(settings(lines) == want, "%s holds %s's settings" % (where, names[0]))
        return
    text = open(os.path.join(ROOT, page)).read()
    before = text[:text.find("```yaml", sum(len(x) + 1 for x in text.splitlines()[:line - 1]) - 1)]
    writes = re.findall(r"`((?:configs|examples)/[\w.-]+\.yaml)` writes it out", before[-300:])
    if writes:
        have = [x.strip() for x in settings(open(os.path.join(ROOT, writes[0])).read().splitlines())]
        missing = [x for x in settings(lines) if x.strip() not in have]
        check(not missing, "%s: each setting is a line of %s%s" % (
            where, writes[0], " (not: %s)" % missing if missing else ""))
        return
    tops = [re.match(r"(\w+):", x).group(1) for x in settings(lines) if re.match(r"\w+:", x)]
    check(tops == ["data", "eval"], "%s is a plan's data and eval sections (%s)" % (where, tops))
    if tops != ["data", "eval"]:
        return
    base, skip = [], False
    for raw in open(os.path.join(ROOT, "configs", "debug.yaml")).read().splitlines():
        top = re.match(r"(\w+):", raw)
        if top:
            skip = top.group(1) in tops
        if not skip:
            base.append(raw)
    with tempfile.TemporaryDirectory(prefix="fsdpc-doc-") as d:
        os.mkdir(os.path.join(d, "fineweb10B"))
        for name, n in (("fineweb_train_000001.bin", 40000), ("fineweb_train_000002.bin", 40000),
                        ("fineweb_val_000000.bin", 200000)):
            write_llmc(os.path.join(d, "fineweb10B", name), n)
        plan = os.path.join(d, "plan.yaml")
        with open(plan, "w") as f:
            f.write("\n".join(base + lines) + "\n")
        os.symlink(BUILD, os.path.join(d, "build"))
        p = subprocess.run(["build/tools/fsdp-train", "plan.yaml", "--set", "train.steps=2",
                            "--set", "model.max_seq_len=1024", "--set", "eval.batches=2"],
                           cwd=d, env=env,
                           capture_output=True, text=True, timeout=300)
    evals = re.findall(r"^eval after step 2: loss \d", p.stdout, re.M)
    check(p.returncode == 0 and evals, "%s: configs/debug.yaml with these sections trains "
          "2 steps on llm.c shards and evaluates (exit %d)" % (where, p.returncode))
    if p.returncode != 0 or not evals:
        print(p.stdout[-1500:], p.stderr[-1500:])


def synopses(lines):
    """The call forms of a synopsis: each starts 'fsdp-NAME ', indented lines continue it."""
    out = []
    for line in lines:
        line = re.sub(r"^usage:\s*", "", line)
        if re.match(r"fsdp-[a-z]+ [^:]*$", line.strip()) and not line.startswith("   " * 4):
            out.append(line.strip())
        elif out and line.startswith(" ") and line.strip().startswith("["):
            out[-1] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return [" ".join(x.split()) for x in out]


def check_synopsis(page, line, lines, env):
    tool = lines[0].split()[0]
    p = subprocess.run([os.path.join(BUILD, "tools", tool), "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    forms = synopses(p.stdout.splitlines())
    for form in synopses(lines):
        check(form in forms, "%s:%d: '%s' is a form %s --help prints" % (page, line, form, tool))


def plain_blocks(page):
    """The ``` blocks of page with no language whose first line calls a program: (line, lines)."""
    out, cur, start = [], None, 0
    for i, raw in enumerate(open(os.path.join(ROOT, page)).read().splitlines(), 1):
        if cur is None and raw.startswith("```"):
            cur, start, kind = [], i, raw.strip()
        elif cur is not None and raw.startswith("```"):
            if kind == "```" and cur and re.match(r"fsdp-[a-z]+ [^:]*$", cur[0]):
                out.append((start, cur))
            cur = None
        elif cur is not None:
            cur.append(raw)
    return out


def script_only(cmd):
    """The scripts a set-up, build, test or sbatch line runs: they must exist, executable."""
    return [w for w in shlex.split(cmd) if w.startswith("scripts/")]


def bounded(cmd):
    """cmd as this test runs it, or None for a line that is checked, not run."""
    if cmd.startswith("scripts/") or " sbatch " in " " + cmd + " ":
        return None
    cmd = re.sub(r"^mpirun ", "%s %s " % (shlex.quote(MPIRUN), MPI_ARGS), cmd)
    cmd = re.sub(r"(?<=\s)plan\.yaml(?=\s|$)", "configs/fsdp.yaml", cmd)
    if "build/tools/fsdp-train " in cmd and "--dry-run" not in cmd:
        cmd += " --dry-run" if any(p in cmd for p in LARGE) else " --set train.steps=2"
    if "build/bench/bench-train-tiny" in cmd:
        cmd = re.sub(r"--steps \d+", "--steps 3", cmd)
    return cmd


def main():
    if os.environ.get("FSDPC_TEST_SANITIZED"):  # the plain build's run covers the same lines
        print("doc-commands runs in the plain build (the docs' commands, not the build, are "
              "under test)")
        return 77
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    known = ("scripts/", "mpirun ", "build/", "FSDP_REQUEUE=1 sbatch ")
    total, seen = 0, set()
    for page in PAGES:
        for cmd in commands(page):
            total += 1
            if cmd in seen:  # README's quick start is getting-started's too
                print("ok    %s: %s (as above)" % (page, cmd))
                continue
            seen.add(cmd)
            if not cmd.startswith(known):
                check(False, "%s: '%s' is a command this test does not know" % (page, cmd))
                continue
            run = bounded(cmd)
            if run is None:
                names = script_only(cmd)
                ok = names and all(os.access(os.path.join(ROOT, n), os.X_OK) for n in names)
                check(ok, "%s: %s: %s executable (CI runs it)" % (page, cmd, ", ".join(names)))
                continue
            with tempfile.TemporaryDirectory(prefix="fsdpc-doc-") as d:
                os.symlink(BUILD, os.path.join(d, "build"))
                for sub in ("configs", "examples", "data", "scripts"):
                    os.symlink(os.path.join(ROOT, sub), os.path.join(d, sub))
                t = time.time()
                p = subprocess.run(["bash", "-c", run], cwd=d, env=env, capture_output=True,
                                   text=True, timeout=300)
            check(p.returncode == 0, "%s: %s (exit %d, %.1f s)" % (page, cmd, p.returncode,
                                                                  time.time() - t))
            if p.returncode != 0:
                print(p.stdout[-1500:], p.stderr[-1500:])
    check(total >= 10, "%d command lines found in README.md and docs/" % total)
    for page in PAGES:
        for line, lines in yaml_blocks(page):
            total += 1
            check_yaml(page, line, lines, env)
        for line, lines in plain_blocks(page):
            total += 1
            check_synopsis(page, line, lines, env)
    print("%d of %d checks failed" % (len(failures), total + 1) if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
