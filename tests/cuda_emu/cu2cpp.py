"""Rewrites a CUDA source of backends/cuda/ for a host C++ compiler (the CUDA emulator's
build, tests/cuda_emu/meson.build):

    python3 cu2cpp.py SOURCE.cu OUT.cpp

Each launch KERNEL<<<GRID, BLOCK[, SHARED[, STREAM]]>>>(ARGS) becomes
emu_cfg(GRID, BLOCK, ...) << [&]() { KERNEL(ARGS); }, a call the emulator makes once for every
thread of the grid (runtime.cpp); a project header with launches of its own is rewritten the same
way in place of its #include; the device's global timer (inline PTX) reads the host's clock."""
import os
import re
import sys


def match(s, i, step, here, there):
    """Index of the bracket `there` that pairs with s[i] == here, scanning by step (1 forward,
    -1 backward)."""
    depth = 0
    while 0 <= i < len(s):
        if s[i] == here:
            depth += 1
        elif s[i] == there:
            depth -= 1
            if depth == 0:
                return i
        i += step
    raise ValueError("unbalanced '%s'" % here)


def launches(src, where):
    out, pos = [], 0
    while True:
        k = src.find("<<<", pos)
        if k < 0:
            out.append(src[pos:])
            return "".join(out)
        j = k - 1
        while src[j].isspace():
            j -= 1
        if src[j] == ">":  # the kernel's template arguments
            j = match(src, j, -1, ">", "<") - 1
        while j >= 0 and (src[j].isalnum() or src[j] in "_:"):
            j -= 1
        start = j + 1
        kernel = src[start:k].strip()
        e = src.find(">>>", k)
        a = e + 3
        while src[a].isspace():
            a += 1
        if not kernel or src[a] != "(":
            sys.exit("%s:%d: a launch cu2cpp.py cannot read" % (where, src.count("\n", 0, k) + 1))
        b = match(src, a, 1, "(", ")")
        out.append(src[pos:start])
        out.append("emu_cfg(%s) << [&]() { %s(%s); }" % (src[k + 3:e], kernel, src[a + 1:b]))
        pos = b + 1


TIMER = re.compile(r'asm volatile\("mov\.u64 %0, %%globaltimer;" : "=l"\((\w+)\)\)')
INCLUDE = re.compile(r'^#include "(backends/cuda/\w+\.h)"$', re.M)


def rewrite(path, root):
    src = open(path).read()
    src = TIMER.sub(r"\1 = emu_globaltimer()", src)

    def inline(m):
        header = os.path.join(root, m.group(1))
        text = open(header).read()
        if "<<<" not in text:
            return m.group(0)
        line = src.count("\n", 0, m.end()) + 2  # the line after the #include
        return '#line 1 "%s"\n%s\n#line %d "%s"' % (header, rewrite(header, root), line, path)

    return launches(INCLUDE.sub(inline, src), path)


def main():
    path = os.path.abspath(sys.argv[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(path)))  # above backends/cuda/
    text = '#line 1 "%s"\n%s' % (path, rewrite(path, root))
    with open(sys.argv[2], "w") as f:
        f.write(text)


main()
