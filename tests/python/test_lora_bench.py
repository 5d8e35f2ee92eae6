"""benchmarks/lora/lora_bench.py end to end on a tiny base, against a real daemon: each mode in its own
process gives steps and finite losses (trainstream paged, the stock Trainer, the stock Trainer with the base
offloaded by accelerate, DeepSpeed skipped with its reason where it cannot run), the modes compute the same
losses, a mode that runs past its timeout is recorded as that mode's error while the run goes on, and the
bound's fields appear only where CUDA measured them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "lora", "lora_bench.py")
BOUND_FIELDS = ("pinned_h2d_gbs", "paging_bound_s", "bound_s")


def bench(daemon, tmp_path, *args: str) -> dict:
    out = tmp_path / "lora.json"
    env = dict(os.environ, TRAINSTREAM_ADDRESS=daemon.socket)
    result = subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--seq", "32", "--steps", "2", "--warmup", "1",
                             "--json", str(out), *args], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert json.loads(result.stdout.splitlines()[-1]) == report
    return report


def test_each_mode_trains_in_its_own_process(daemon, tmp_path):
    report = bench(daemon, tmp_path, "--modes", "trainstream,gpu-only,accelerate,deepspeed-zero3")
    modes = report["modes"]
    for name in ("trainstream", "gpu-only", "accelerate"):
        mode = modes[name]
        assert "error" not in mode, (name, mode)
        assert len(mode["step_times_s"]) == 3 and mode["step_s"] > 0
        assert len(mode["losses"]) == 3 and all(math.isfinite(x) for x in mode["losses"])
        assert mode["host_rss_gib"] > 0
        assert mode["losses"] == pytest.approx(modes["gpu-only"]["losses"], abs=1e-3)
    assert modes["trainstream"]["paged_blocks"] == 4 and modes["trainstream"]["daemon_host_gib"] > 0
    assert modes["accelerate"]["offloaded_gib"] > 0
    if not torch.cuda.is_available():
        assert "needs CUDA" in modes["deepspeed-zero3"]["skipped"]
    assert report["base_bytes"] > 0
    assert all((field in report) == torch.cuda.is_available() for field in BOUND_FIELDS)


def test_a_mode_past_its_timeout_is_that_modes_error(daemon, tmp_path):
    report = bench(daemon, tmp_path, "--modes", "gpu-only", "--mode-timeout", "60,gpu-only=0.5")
    assert report["modes"]["gpu-only"]["error"] == "timed out after 0.5 s"
    assert "step_s" not in report["modes"]["gpu-only"]


def test_unknown_modes_are_refused(tmp_path):
    result = subprocess.run([sys.executable, BENCH, "--modes", "trainstream,zero9"], capture_output=True, text=True)
    assert result.returncode == 2 and "zero9" in result.stderr and "deepspeed-zero3" in result.stderr
