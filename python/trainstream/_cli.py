"""`trainstream` on PATH (pyproject.toml's [project.scripts]).

`trainstream --version` prints the package's version and that of the trainstreamd it would start
(`connect()`'s private daemon: `_connect.daemon_binary()`), and exits 1 when they differ or no daemon is
found: what an install that mixes two versions needs to see. The version's one home is shm/version.h.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def version_report() -> tuple[str, bool]:
    """The lines `--version` prints, and whether the package and its daemon agree."""
    import trainstream  # imports torch: only here, so that `trainstream --help` stays quick
    from trainstream._connect import TrainstreamError, daemon_binary

    lines = [f"trainstream {trainstream.__version__} ({Path(trainstream.__file__).parent})"]
    try:
        binary = daemon_binary()
    except TrainstreamError as e:
        return "\n".join([*lines, f"trainstreamd: {e}"]), False
    try:
        answer = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "\n".join([*lines, f"trainstreamd ({binary}) did not run: {e}"]), False
    version = answer.stdout.strip()
    agree = answer.returncode == 0 and version == trainstream.__version__
    note = "" if agree else f", which differs from the package's {trainstream.__version__}"
    if answer.returncode != 0:
        note = f", exit code {answer.returncode}: {answer.stderr.strip()[-500:]}"
    return "\n".join([*lines, f"trainstreamd {version} ({binary}{note})"]), agree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainstream",
        description="trainstream: PyTorch optimizer state in host RAM, updated by trainstreamd. "
                    "The daemon is `trainstreamd`, the operator's command `trainstreamctl`.")
    parser.add_argument("--version", action="store_true",
                        help="print the package's version and that of the trainstreamd it starts; "
                             "exit 1 when they differ")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        return 0
    report, agree = version_report()
    print(report)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
