#!/usr/bin/env python3
"""The layer rule and the communication boundary (docs/design.md, "Layers and folders"):

- a library folder includes project headers only from itself and the folders below it: the
  model-agnostic library (core to checkpoint) never includes models/ or train/;
- the headers `meson install` puts in place include no MPI, NCCL or CUDA header and no project
  header that is not installed with them (BUILD_ROOT: the build folder to install from, into a
  temporary folder);
- no source outside mesh/ (the library, the tools, the benchmarks, the examples) names an MPI
  or NCCL function, type or constant: communication goes through pg_t and mesh_t;
- the shared library exports exactly the functions and variables the installed headers
  declare (it builds with hidden visibility), each with a prefix docs/conventions.md lists;
- a header of a library folder outside backends/ is installed, or says it is private by its
  name (NAME_impl.h); fsdpc/fsdpc.h includes every installed header.

  check_layers.py SOURCE_ROOT [BUILD_ROOT [MESON]]

Prints every violation with its file and line; exits 1 if there is one.
"""
import os
import re
import subprocess
import sys
import tempfile

# folder -> the folders it may include from (itself included)
BELOW = {
    "core": {"core"},
    "backends": {"core", "backends"},
    "mesh": {"core", "backends", "mesh"},
    "dtensor": {"core", "mesh", "dtensor"},
    "nn": {"core", "mesh", "dtensor", "nn"},
    "fully_shard": {"core", "mesh", "dtensor", "nn", "fully_shard"},
    "parallel": {"core", "mesh", "dtensor", "nn", "fully_shard", "parallel"},
    "checkpoint": {"core", "mesh", "dtensor", "nn", "checkpoint"},
    # above the model-agnostic library: the models, then training jobs
    "models": {"core", "mesh", "dtensor", "nn", "fully_shard", "parallel", "checkpoint",
               "models"},
    "train": {"core", "mesh", "dtensor", "nn", "fully_shard", "parallel", "checkpoint", "models",
              "train"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def source_files(d):
    """The C and CUDA sources under folder d, its subfolders included, in a fixed order."""
    return sorted(os.path.join(p, n) for p, _, names in os.walk(d) for n in names
                  if n.endswith((".c", ".h", ".cu")))


def scan(root):
    bad = []
    for folder, allowed in BELOW.items():
        for path in source_files(os.path.join(root, folder)):
            name = os.path.relpath(path, os.path.join(root, folder))
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m or "/" not in m.group(1):
                        continue
                    top = m.group(1).split("/")[0]
                    if top in BELOW and top not in allowed:
                        bad.append("%s/%s:%d: includes %s (%s may include only %s)"
                                   % (folder, name, n, m.group(1), folder,
                                      ", ".join(sorted(allowed))))
    return bad


VENDOR = re.compile(r"^(mpi|nccl|cuda|cuda_runtime|cuda_runtime_api|cublas\w*|cudnn\w*)\.h$")
# outside mesh/: no MPI or NCCL name (comments and strings aside)
COMM_NAME = re.compile(r"\b(MPI_\w+|PMPI_\w+|nccl[A-Z]\w*)")
COMM_FREE = sorted(BELOW) + ["tools", "bench", "examples"]


def code_only(text):
    """text with C comments and string literals blanked (line breaks kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def scan_comm(root):
    bad, files = [], 0
    for folder in COMM_FREE:
        d = os.path.join(root, folder)
        if folder == "mesh" or not os.path.isdir(d):
            continue
        for dirpath, _, names in os.walk(d):
            for name in sorted(names):
                if not name.endswith((".c", ".h", ".cu")):
                    continue
                files += 1
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    text = code_only(f.read())
                for n, line in enumerate(text.split("\n"), 1):
                    m = COMM_NAME.search(line)
                    if m:
                        bad.append("%s:%d: names %s outside mesh/ (use pg_t / mesh_t)"
                                   % (os.path.relpath(path, root), n, m.group(1)))
    return bad, files


def scan_installed(build, meson, root):
    """Installs the headers into a temporary folder and checks what they include, and the
    shared library's symbols against them."""
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([meson, "install", "-C", build, "--destdir", tmp, "--no-rebuild",
                            "--tags", "devel"], capture_output=True, text=True)
        if p.returncode != 0:
            return ["meson install failed: " + (p.stderr or p.stdout)[-2000:]], 0
        headers = {}
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                if name.endswith(".h"):
                    full = os.path.join(dirpath, name)
                    i = full.find(os.sep + "fsdpc" + os.sep)
                    if i >= 0:
                        headers[full[i + len("/fsdpc/"):]] = full
        for rel, full in sorted(headers.items()):
            with open(full, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    if VENDOR.match(os.path.basename(inc)):
                        bad.append("installed %s:%d: includes %s" % (rel, n, inc))
                    elif "/" in inc and inc.split("/")[0] in BELOW and inc not in headers:
                        bad.append("installed %s:%d: includes %s, which is not installed"
                                   % (rel, n, inc))
        umbrella = headers.pop("fsdpc.h", None)
        if umbrella is None:
            bad.append("fsdpc/fsdpc.h, the header of the whole API, is not installed")
        else:
            with open(umbrella, encoding="utf-8") as f:
                has = {m.group(1) for m in map(INCLUDE.match, f) if m}
            bad += ["fsdpc/fsdpc.h does not include %s" % h for h in sorted(headers) if h not in has]
        for folder in BELOW:
            if folder == "backends":
                continue
            for path in source_files(os.path.join(root, folder)):
                rel = os.path.relpath(path, root)
                if rel.endswith(".h") and not rel.endswith("_impl.h") and rel not in headers:
                    bad.append("%s is neither installed nor named private (_impl.h)" % rel)
        exports, n_exported = scan_exports(root, build, headers.values())
        print("exported symbols: %d, %d against the installed headers or the prefixes"
              % (n_exported, len(exports)))
        bad += exports
    return bad, len(headers)


def declared_names(paths):
    """The functions and variables declared at file scope by the headers at paths."""
    names = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = code_only(f.read())
        text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)
        text = re.sub(r"\bextern\s+\{", " ", text)  # extern "C" {, its string blanked
        depth, top = 0, []
        for ch in text:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth <= 0:
                    top.append(";")
            elif depth <= 0:
                top.append(ch)
        for stmt in "".join(top).split(";"):
            st = " ".join(stmt.split())
            if not st or st.startswith(("typedef", "static")):
                continue
            m = re.match(r"^(?:extern\s+)?(?:const\s+)?[\w\s*]*?\b([A-Za-z_]\w*)\s*\(", st)
            if m:
                names.add(m.group(1))
            elif st.startswith("extern"):
                m = re.search(r"\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?$", st)
                if m:
                    names.add(m.group(1))
    return names


def documented_prefixes(root):
    """The prefixes of docs/conventions.md's "Prefixes" section (`xxx_` in backquotes)."""
    with open(os.path.join(root, "docs", "conventions.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Prefixes\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return set(re.findall(r"`([a-z][a-z0-9]*_)`", m.group(1))) if m else set()


def scan_exports(root, build, headers):
    """The shared library's dynamic symbols against the installed headers' declarations."""
    lib = os.path.join(build, "libfsdpc.so")
    if not os.path.exists(lib):
        return ["%s: no shared library to check" % lib], 0
    p = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True)
    if p.returncode != 0:
        return ["nm -D %s failed: %s" % (lib, p.stderr.strip())], 0
    exported = {f[-1] for f in (line.split() for line in p.stdout.splitlines())
                if len(f) >= 3 and not f[-1].startswith("_")}
    declared = declared_names(headers)
    prefixes = documented_prefixes(root)
    bad = ["libfsdpc.so exports %s, which no installed header declares" % s
           for s in sorted(exported - declared)]
    bad += ["%s is declared by an installed header but not exported by libfsdpc.so" % s
            for s in sorted(declared - exported)]
    if not prefixes:
        bad.append("docs/conventions.md lists no prefix under \"## Prefixes\"")
    bad += ["libfsdpc.so exports %s, whose prefix docs/conventions.md does not list" % s
            for s in sorted(exported) if prefixes and not any(s.startswith(x) for x in prefixes)]
    return bad, len(exported)


def main():
    root = sys.argv[1]
    bad = scan(root)
    files = sum(len(source_files(os.path.join(root, f))) for f in BELOW)
    print("layer rule: %d files of %d folders, %d includes against it" % (files, len(BELOW),
                                                                          len(bad)))
    comm, comm_files = scan_comm(root)
    print("communication: %d files outside mesh/, %d MPI or NCCL names in them"
          % (comm_files, len(comm)))
    bad += comm
    if len(sys.argv) > 2:
        inst, n = scan_installed(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "meson", root)
        print("installed headers: %d, %d vendor or private includes" % (n, len(inst)))
        bad += inst
        if n == 0 and not inst:
            bad.append("meson install put no header in place")
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
