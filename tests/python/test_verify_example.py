"""examples/verify_ram_offload.py on the CPU: it trains through a real daemon and ends with PASS, having
checked the daemon's figures (the GPU run is in test_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "verify_ram_offload.py")


def test_verify_ram_offload_passes_on_the_cpu(daemon):
    env = dict(os.environ, TRAINSTREAM_ADDRESS=daemon.socket)
    run = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--width", "256", "--layers", "3"], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "PASS" and "checking the daemon's figures only" in run.stdout
    assert sum(line.startswith("[ok]") for line in lines) == 2
