#!/usr/bin/env python3
"""The installed library as an application uses it: `meson install` into a temporary folder,
then examples/dtensor_basics.c compiled against the installed headers with the flags
`pkg-config fsdpc` gives, three ways (as it is; with its includes as <fsdpc/...>; with
<fsdpc/fsdpc.h> alone), each linked twice (the shared library with `--libs`, the static
archive with `--static --libs`), and every program run on 2 ranks. Every -l of the static flags must
name a library found in the -L folders or the linker's own (a CUDA build lists -lcudart).
Every C fragment of README.md and docs/ that is not a whole program (those are the examples,
compared with them by the examples test) compiles against the same headers: its includes,
then its lines as a function's body after the declarations its `<!-- compiled with: ... -->`
line gives. A C++ program including <fsdpc/fsdpc.h> compiles (-Wall -Wextra -Werror), links
against the shared library and runs: every public header is valid C++ with C linkage.

  test_install.py BUILD_DIR SOURCE_DIR MPIRUN
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

BUILD, ROOT, MPIRUN = sys.argv[1:4]

# The whole API from C++: a few calls through it, printing a tensor's size and a shard's.
CXX_PROGRAM = r"""#include <fsdpc/fsdpc.h>

#include <cstdio>

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) return 1;
  int64_t shape[2] = {6, 4};
  fsdpc_tensor_t t;
  fsdpc_status_t st = tensor_zeros(&t, DTYPE_F32, device_cpu(), 2, shape);
  if (st == STATUS_OK) {
    std::printf("rank %d of %d: %lld elements\n", world_rank(), world_size(),
                (long long)tensor_numel(&t));
    tensor_free(&t);
  } else {
    std::fprintf(stderr, "%s\n", err_detail());
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
"""
failed = 0


def check(ok, what):
    global failed
    print("%s %s" % ("ok  " if ok else "FAIL", what))
    if not ok:
        failed += 1


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def linker_dirs():
    """The folders the linker searches without -L."""
    p = run(["cc", "-print-search-dirs"])
    m = re.search(r"^libraries: =(.*)$", p.stdout, re.M)
    return [os.path.normpath(d) for d in m.group(1).split(":")] if m else []


def fragments():
    """(page, line, source) of each C fragment of README.md and docs/ without a main."""
    pages = ["README.md"] + ["docs/" + f for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    out = []
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for m in re.finditer(r"(?:<!-- compiled with: (.*?) -->\n)?```c\n(.*?)```", text, re.S):
            block = m.group(2)
            if re.search(r"\bint main\(", block):
                continue
            line = text[:m.start()].count("\n") + 1
            lines = block.splitlines()
            incl = [l for l in lines if l.startswith("#include")]
            body = [l for l in lines if not l.startswith("#include")]
            src = None
            if m.group(1) is not None:
                src = ("\n".join(incl) + "\n\nvoid fragment(void);\nvoid fragment(void) {\n" +
                       m.group(1) + "\n" + "\n".join(body) + "\n}\n")
            out.append((page, line, src))
    return out


def compile_fragments(tmp, cflags):
    """Each C fragment of the documentation compiles (-Wall -Wextra -Werror)."""
    frags = fragments()
    check(len(frags) > 0, "the documentation has C fragments to compile")
    for k, (page, line, src) in enumerate(frags):
        check(src is not None, "%s:%d: the C fragment says what it is compiled with" %
              (page, line))
        if src is None:
            continue
        path = os.path.join(tmp, "fragment%d.c" % k)
        with open(path, "w") as f:
            f.write(src)
        q = run(["cc", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wno-unused-variable",
                 "-Wno-unused-but-set-variable", "-Wno-uninitialized",
                 "-Wno-maybe-uninitialized", path] + cflags)
        check(q.returncode == 0, "%s:%d: the C fragment compiles against the installed headers "
              "(%s)" % (page, line, q.stderr.strip()[-600:]))


def main():
    # with the dependencies unpacked under a pkg-config sysroot, pkg-config puts it before every
    # path it prints: the installed tree goes under it too, its prefix given relative to it
    sysroot = os.environ.get("PKG_CONFIG_SYSROOT_DIR", "").rstrip("/")
    tmp = tempfile.mkdtemp(prefix="fsdpc-install-", dir=sysroot or None)
    try:
        p = run(["meson", "install", "-C", BUILD, "--destdir", tmp, "--no-rebuild", "--quiet"])
        check(p.returncode == 0, "meson install --destdir runs (%s)" % p.stderr.strip()[-300:])
        if p.returncode != 0:
            return
        pcs = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f == "fsdpc.pc"]
        check(len(pcs) == 1, "one fsdpc.pc is installed")
        if len(pcs) != 1:
            return
        prefix = re.search(r"^prefix=(.*)$", open(pcs[0]).read(), re.M).group(1)
        search = [os.path.dirname(pcs[0])] + [d for d in os.environ.get(
            "PKG_CONFIG_PATH", "").split(os.pathsep) if d]  # its own, then the dependencies'
        env = dict(os.environ, PKG_CONFIG_PATH=os.pathsep.join(search))
        define = ["--define-variable=prefix=" + tmp[len(sysroot):] + prefix]

        def flags(*what):
            q = run(["pkg-config"] + define + list(what) + ["fsdpc"], env=env)
            check(q.returncode == 0, "pkg-config %s fsdpc (%s)" % (" ".join(what), q.stderr.strip()))
            return q.stdout.split()

        cflags = flags("--cflags")
        static = flags("--static", "--libs")
        shared = flags("--libs")
        dirs = [f[2:] for f in static if f.startswith("-L")] + linker_dirs()
        for lib in [f[2:] for f in static if f.startswith("-l")]:
            found = [d for d in dirs for ext in (".so", ".a")
                     if os.path.exists(os.path.join(d, "lib%s%s" % (lib, ext)))]
            check(bool(found), "pkg-config --static --libs: -l%s is in a folder it names or the "
                  "linker's (%s)" % (lib, found[0] if found else "in none of " + " ".join(dirs)))
        compile_fragments(tmp, cflags)
        src = os.path.join(ROOT, "examples", "dtensor_basics.c")
        text = open(src).read()
        sources = {"": src}
        for form, sub in (("prefixed", lambda m: "#include <fsdpc/%s>" % m.group(1)),
                          ("umbrella", lambda m: "#include <fsdpc/fsdpc.h>")):
            path = os.path.join(tmp, "basics-%s.c" % form)
            with open(path, "w") as f:
                f.write(re.sub(r'#include "([a-z_/]+\.h)"', sub, text))
            sources["-" + form] = path
        libdir = [f[2:] for f in shared if f.startswith("-L")][0]
        archive = os.path.join(libdir, "libfsdpc.a")
        check(os.path.exists(archive), "the static archive is installed beside the shared library")
        exes = {}
        for form, path in sources.items():
            for kind, libs in (("shared", shared),
                               ("static", [archive if f == "-lfsdpc" else f for f in static])):
                exe = os.path.join(tmp, "basics-" + kind + form)
                # a sanitized build's library needs the sanitizers' runtimes in the program
                san = (["-fsanitize=address,undefined"] if os.environ.get("FSDPC_TEST_SANITIZED")
                       else [])
                q = run(["cc", "-o", exe, path] + san + cflags + libs)
                check(q.returncode == 0, "examples/dtensor_basics.c%s compiles and links against "
                      "the installed %s library (%s)" % (form and " (%s includes)" % form[1:],
                                                         kind, q.stderr.strip()[-400:]))
                if q.returncode == 0:
                    exes[kind + form] = exe
        cxx = shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            print("skip the C++ program: no C++ compiler (c++ or g++) on the PATH")
        else:
            path = os.path.join(tmp, "basics.cpp")
            with open(path, "w") as f:
                f.write(CXX_PROGRAM)
            exe = os.path.join(tmp, "basics-cxx")
            san = (["-fsanitize=address,undefined"] if os.environ.get("FSDPC_TEST_SANITIZED")
                   else [])
            q = run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-o", exe, path] + san +
                    cflags + shared)
            check(q.returncode == 0, "a C++ program including <fsdpc/fsdpc.h> compiles and links "
                  "(%s)" % q.stderr.strip()[-400:])
            if q.returncode == 0:
                exes["shared-cxx"] = exe
        for kind, exe in exes.items():
            q = run([MPIRUN, "--oversubscribe", "-n", "2", exe],
                    env=dict(os.environ, LD_LIBRARY_PATH=libdir))
            check(q.returncode == 0 and q.stdout.strip() != "",
                  "the program linked against the %s library runs on 2 ranks (rc %d%s)"
                  % (kind, q.returncode, (", " + q.stderr.strip()[-300:]) if q.returncode else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


main()
print("%s" % ("install: all checks passed" if failed == 0 else "install: %d failed" % failed))
sys.exit(1 if failed else 0)
