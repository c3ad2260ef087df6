"""What the benchmark scripts answer --version with: the project's version, from meson.build."""
import os
import re


def version():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with open(os.path.join(root, "meson.build")) as f:
        m = re.search(r"version:\s*'([^']+)'", f.read())
    return "%(prog)s (fsdpc) " + (m.group(1) if m else "unknown")
