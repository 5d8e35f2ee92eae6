"""benchmarks/train_gpt/busy_sampler.py and train_gpt's daemon_busy: a process's busy cores sampled
from its threads' schedstat tell a spinning process from a sleeping one, and a step's phases get the
cores and idle time of the samples that fall in them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
from busy_sampler import busy_cores, idle_ns, run_at, sampling  # noqa: E402

from train_gpt import daemon_busy  # noqa: E402

MS = 1_000_000

# 2 cores' worth of run time over [0, 10) ms, then none over [10, 20) ms, sampled every 5 ms
SAMPLES = {"t_ns": [0, 5 * MS, 10 * MS, 15 * MS, 20 * MS], "run_ns": [0, 10 * MS, 20 * MS, 20 * MS, 20 * MS]}


def test_run_time_is_linear_between_samples_and_clamped_outside():
    assert run_at(SAMPLES, int(2.5 * MS)) == 5 * MS
    assert run_at(SAMPLES, -MS) == 0 and run_at(SAMPLES, 30 * MS) == 20 * MS


def test_busy_cores_and_idle_time_of_a_window():
    assert busy_cores(SAMPLES, 0, 10 * MS) == pytest.approx(2.0)
    assert busy_cores(SAMPLES, 5 * MS, 15 * MS) == pytest.approx(1.0)
    assert idle_ns(SAMPLES, 0, 20 * MS) == 10 * MS
    assert idle_ns(SAMPLES, 8 * MS, 12 * MS) == 2 * MS  # the part of the window in the idle interval
    assert idle_ns(SAMPLES, 0, 20 * MS, below=2.5) == 20 * MS


def test_daemon_busy_gives_each_phase_its_cores_and_idle_time_and_the_step_its_idle_time():
    steps = [[("forward", 0, 10 * MS), ("backward", 10 * MS, 20 * MS)]] * 3
    report = daemon_busy(SAMPLES, steps)
    assert report["cores_by_gpu_phase"] == pytest.approx({"forward": 2.0, "backward": 0.0})
    assert report["idle_ms_by_gpu_phase"] == pytest.approx({"step": 10.0, "forward": 0.0, "backward": 10.0})
    assert report["idle_ms_per_step"] == pytest.approx([10.0] * 3)
    assert report["last_steps"] == {"gpu_phases_ns": steps, "t_ns": SAMPLES["t_ns"], "run_ns": SAMPLES["run_ns"]}


@pytest.mark.parametrize("code,busy", [("while True: pass", True), ("import time; time.sleep(60)", False)])
def test_a_spinning_process_shows_busy_and_a_sleeping_one_does_not(code, busy):
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)
        with sampling(proc.pid, period_us=1000) as samples:
            time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    cores = busy_cores(samples, samples["t_ns"][0], samples["t_ns"][-1])
    assert samples["pid"] == proc.pid and len(samples["t_ns"]) > 50
    # Wide bounds: a loaded 2-core CI machine may give the spinning process a small share of a core.
    assert (cores > 0.1) if busy else (cores < 0.02), cores


def test_no_pid_samples_nothing():
    with sampling(None) as samples:
        pass
    assert samples == {}
