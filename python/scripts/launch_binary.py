#!/usr/bin/env python3
"""`trainstreamd` and `trainstreamctl` on PATH after `pip install trainstream`: this script, installed under
both names, runs the binary of its own name from the installed package (trainstream/_bin/).

The binaries live in the package rather than in the scripts directory because their bundled libraries
(trainstream.libs/) sit at a fixed path relative to the package wherever pip puts it (venv, --user,
--target), and not relative to the scripts directory. The package is located without importing it:
importing it imports torch, seconds that a daemon's or an operator command's start should not pay.
The binary replaces this process (same pid: systemd's Type=notify and signals reach it directly).
"""

import importlib.util
import os
import sys

BINARIES = ("trainstreamd", "trainstreamctl")


def main() -> None:
    name = os.path.basename(sys.argv[0])
    if name not in BINARIES:
        sys.exit(f"{name}: this launcher runs {' or '.join(BINARIES)}, by the name it is called by")
    spec = importlib.util.find_spec("trainstream")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{name}: the trainstream package is not importable by {sys.executable}")
    binary = os.path.join(list(spec.submodule_search_locations)[0], "_bin", name)
    try:
        os.execv(binary, [sys.argv[0], *sys.argv[1:]])
    except OSError as e:
        sys.exit(f"{name}: cannot run {binary}: {e.strerror} (reinstall trainstream: pip install trainstream)")


if __name__ == "__main__":
    main()
