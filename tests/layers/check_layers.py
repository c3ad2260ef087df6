#!/usr/bin/env python3
"""The layer rule: a library folder includes project headers only from itself and the folders
below it (docs/design.md section 2).

  check_layers.py SOURCE_ROOT

Prints every include that breaks the rule with its file and line; exits 1 if there is one.
"""
import os
import re
import sys

# folder -> the folders it may include from (itself included)
BELOW = {
    "base": {"base"},
    "mesh": {"base", "mesh"},
    "dtensor": {"base", "mesh", "dtensor"},
    "nn": {"base", "mesh", "dtensor", "nn"},
    "fully_shard": {"base", "mesh", "dtensor", "nn", "fully_shard"},
    "parallel": {"base", "mesh", "dtensor", "nn", "fully_shard", "parallel"},
    "checkpoint": {"base", "mesh", "dtensor", "nn", "checkpoint"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def scan(root):
    bad = []
    for folder, allowed in BELOW.items():
        d = os.path.join(root, folder)
        for name in sorted(os.listdir(d)):
            if not name.endswith((".c", ".h", ".cu")):
                continue
            path = os.path.join(d, name)
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


def main():
    root = sys.argv[1]
    bad = scan(root)
    for b in bad:
        print(b)
    files = sum(1 for f in BELOW for n in os.listdir(os.path.join(root, f))
                if n.endswith((".c", ".h", ".cu")))
    print("layer rule: %d files of %d folders, %d includes against it" % (files, len(BELOW),
                                                                          len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
