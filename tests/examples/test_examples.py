#!/usr/bin/env python3
"""The examples under examples/, run as a user runs them.

  test_examples.py BUILD_EXAMPLES MPIRUN SOURCE_ROOT

mlp-fsdp (an MLP of nn/layers.h, fully_shard per linear in code) on 1, 2 and 4 ranks, and
mlp-plan (the same MLP, parallelised by YAML plans: fully_shard units; tensor parallelism,
colwise then rowwise on its linears, under fully_shard; HSDP x TP) at the plans' world sizes:
mlp-pipeline (the same MLP in two pipeline stages, 1F1B over 4 microbatches; on 4 ranks each
stage fully sharded over 2) on 2 and 4 ranks: every run's losses equal the single-rank run's
within 1e-5 relative, and the loss goes down.
docs/your-model.md's program is examples/mlp_fsdp.c, character for character, and
docs/library.md's first program examples/dtensor_basics.c (run on 2, 3 and 4 ranks).
"""
import os
import re
import subprocess
import sys

EX, MPIRUN, ROOT = sys.argv[1:4]
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
STEPS = 20
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def losses(n, args):
    cmd = [MPIRUN] + MPI_ARGS + ["-n", str(n)] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
        return None
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", p.stdout, re.M)]


def main():
    fsdp = os.path.join(EX, "mlp-fsdp")
    plan = os.path.join(EX, "mlp-plan")
    ref = losses(1, [fsdp, str(STEPS)])
    check(ref is not None and len(ref) == STEPS, "mlp-fsdp on 1 rank prints %d losses" % STEPS)
    if ref is None:
        return 1
    check(ref[-1] < 0.5 * ref[0], "the loss goes down (%.4f -> %.4f)" % (ref[0], ref[-1]))
    # the documented program run alone, without a launcher (one process, MPI as a singleton)
    p = subprocess.run([fsdp, str(STEPS)], capture_output=True, text=True, timeout=240)
    alone = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", p.stdout, re.M)]
    check(p.returncode == 0 and alone == ref,
          "mlp-fsdp alone (no mpirun) prints the same %d losses" % STEPS)
    pipe = os.path.join(EX, "mlp-pipeline")
    runs = [("mlp-fsdp", 2, [fsdp, str(STEPS)]), ("mlp-fsdp", 4, [fsdp, str(STEPS)]),
            ("mlp-pipeline", 2, [pipe, str(STEPS)]), ("mlp-pipeline", 4, [pipe, str(STEPS)])]
    for name, n in [("mlp_fsdp", 4), ("mlp_tp", 2), ("mlp_tp", 4), ("mlp_hsdp_tp", 8)]:
        runs.append(("mlp-plan " + name + ".yaml", n,
                     [plan, os.path.join(ROOT, "examples", name + ".yaml"), str(STEPS)]))
    for what, n, args in runs:
        got = losses(n, args)
        ok = got is not None and len(got) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if ok else float("inf")
        check(ok and worst <= 1e-5,
              "%s on %d ranks: the single-rank losses within 1e-5 (worst %.2e)" % (what, n, worst))
    # plans that cannot apply to the MLP: every rank reports the plan's place and the reason
    bad = [("model:\n  dim: 8\n", r"model: unknown key"),
           ("parallelize:\n  fully_shard:\n    units: [\"layers.*\"]\n",
            r"units\[0\]: 'layers\.\*' matches no module \(modules here: fc1, act1, fc2"),
           ("mesh:\n  tp: 2\nparallelize:\n  tensor_parallel:\n    plan:\n      act1: colwise\n",
            r"tensor parallel: act1: colwise applies to linear, conv1d and embedding layers"),
           ("mesh:\n  tp: 2\n", r"mesh.tp is 2, but no rule says which modules to split")]
    for i, (text, want) in enumerate(bad):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "fsdpc-bad-plan-%d-%d.yaml" % (os.getpid(), i))
        with open(path, "w") as f:
            f.write(text)
        p = subprocess.run([MPIRUN] + MPI_ARGS + ["-n", "2", plan, path, "2"],
                           capture_output=True, text=True, timeout=120)
        os.unlink(path)
        hits = len(re.findall(want, p.stderr))
        check(p.returncode != 0 and hits == 2,
              "a bad plan is refused on both ranks: %s" % want.replace("\\", ""))
        if hits != 2:
            print(p.stderr[-1500:])
    # the documentation's programs are the examples, unchanged
    doc = open(os.path.join(ROOT, "docs", "your-model.md")).read()
    m = re.search(r"# Shard your own model.*?```c\n(.*?)```", doc, re.S)
    source = open(os.path.join(ROOT, "examples", "mlp_fsdp.c")).read()
    check(m is not None and m.group(1) == source,
          "docs/your-model.md's program is examples/mlp_fsdp.c")
    # README links every page of docs/, and every relative link of the documentation resolves
    pages = ["README.md", "tests/README.md"] + ["docs/" + f for f in
                                                 sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                 if f.endswith(".md")]
    readme_links = set()
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            check(os.path.exists(path), "%s links to %s, which exists" % (page, target))
            if page == "README.md":
                readme_links.add(os.path.relpath(path, ROOT))
    for page in pages[2:]:
        check(page in readme_links, "README.md links to %s" % page)
    check(len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 250,
          "README.md is at most 250 lines")
    # README's plan is configs/hsdp.yaml, unchanged (plans-configs trains it)
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"this is\s+`configs/hsdp.yaml`.*?```yaml\n(.*?)```", readme, re.S)
    plan = open(os.path.join(ROOT, "configs", "hsdp.yaml")).read()
    check(m is not None and m.group(1) == plan, "README's plan is configs/hsdp.yaml")
    # docs/library.md's DTensor program is examples/dtensor_basics.c: every rank holds the
    # whole tensor on 2 and 4 ranks; on 3 (not divisible by the mesh's 2 replicas) every rank
    # names the error and exits non-zero, no crash
    doc = open(os.path.join(ROOT, "docs", "library.md")).read()
    m = re.search(r"# Using the library\n\n```c\n(.*?)```", doc, re.S)
    source = open(os.path.join(ROOT, "examples", "dtensor_basics.c")).read()
    check(m is not None and m.group(1) == source,
          "docs/library.md's first program is examples/dtensor_basics.c")
    basics = os.path.join(EX, "dtensor-basics")
    for n in (2, 3, 4):
        p = subprocess.run([MPIRUN] + MPI_ARGS + ["-n", str(n), basics], capture_output=True,
                           text=True, timeout=120)
        whole = set(re.findall(r"^rank (\d+): 16 x 15$", p.stdout, re.M))
        said = set(re.findall(r"^rank (\d+): invalid device mesh: .*world size 3 is not "
                              r"divisible by 2", p.stderr, re.M))
        want = {str(r) for r in range(n)}
        check((p.returncode == 0 and whole == want) if n != 3 else
              (p.returncode != 0 and said == want and "Segmentation" not in p.stderr),
              "dtensor-basics on %d ranks: %s" % (n, "every rank says why the mesh cannot be "
                                                  "made" if n == 3 else "every rank holds the "
                                                  "whole tensor"))
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
