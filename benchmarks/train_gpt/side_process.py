"""A process run beside a benchmark's steps (neighbor.py's load, busy_sampler.py's sampler): it is
ready once it prints "ready", it is stopped with SIGTERM when the body is done, and what it prints
last, one JSON line, is its report."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess


@contextlib.contextmanager
def side_process(argv: list[str], what: str):
    """Runs `argv` while the body runs; yields a dict that holds the process's last JSON line once the
    body is done. `what` names it where it does not start."""
    report: dict = {}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"{what} did not start (exit status {proc.wait()})")
        yield report
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        if out.strip():
            report.update(json.loads(out.strip().splitlines()[-1]))
