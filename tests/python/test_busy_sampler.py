"""benchmarks/train_gpt/busy_sampler.py and train_gpt's daemon_busy: a process's running worker
threads, sampled from their states, tell a spinning process from a sleeping one, and a step's phases
get the workers running and the idle time of the samples that fall in them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
from busy_sampler import busy_cores, idle_ns, sampling  # noqa: E402

from train_gpt import Phases, daemon_busy, daemon_cpu_seconds  # noqa: E402

MS = 1_000_000

# 2 workers running over [0, 10) ms, none over [10, 20) ms, sampled every 5 ms
SAMPLES = {"t_ns": [0, 5 * MS, 10 * MS, 15 * MS, 20 * MS], "busy": [2, 2, 0, 0, 0]}


def test_busy_workers_and_idle_time_of_a_window():
    assert busy_cores(SAMPLES, 0, 10 * MS) == pytest.approx(2.0)
    assert busy_cores(SAMPLES, 5 * MS, 15 * MS) == pytest.approx(1.0)
    assert busy_cores(SAMPLES, 2 * MS, 4 * MS) == pytest.approx(2.0)  # inside one sample's interval
    assert idle_ns(SAMPLES, 0, 20 * MS) == 10 * MS
    assert idle_ns(SAMPLES, 8 * MS, 12 * MS) == 2 * MS  # the part of the window in the idle interval
    assert idle_ns(SAMPLES, 30 * MS, 40 * MS) == 0  # past the samples


def test_daemon_busy_gives_each_phase_its_cores_and_idle_time_and_the_step_its_idle_time():
    steps = [[("forward", 0, 10 * MS), ("backward", 10 * MS, 20 * MS)]] * 3
    report = daemon_busy(SAMPLES, steps)
    assert report["cores_by_gpu_phase"] == pytest.approx({"forward": 2.0, "backward": 0.0})
    assert report["idle_ms_by_gpu_phase"] == pytest.approx({"step": 10.0, "forward": 0.0, "backward": 10.0})
    assert report["idle_ms_per_step"] == pytest.approx([10.0] * 3)
    assert report["last_steps"] == {"gpu_phases_ns": steps, "t_ns": SAMPLES["t_ns"], "busy": SAMPLES["busy"]}


# A sleeping main thread beside a spinning one: the worker is the thread that ran longest.
SPINNING = "import threading, time\ndef spin():\n    while True:\n        pass\n" \
           "threading.Thread(target=spin, daemon=True).start()\ntime.sleep(60)"


class FakeEvent:
    """A completed timing event at `ms` on the GPU's clock."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.ms - self.ms


def test_gpu_phases_become_windows_from_each_steps_start_and_a_repeated_phase_sums():
    phases = Phases()
    for step in range(3):
        phases.start_ns.append(step * 100 * MS)
        events = [("start", 0), ("forward", 5), ("backward", 20), ("backward", 21)]
        phases.gpu_steps.append([(phase, FakeEvent(ms)) for phase, ms in events])
    windows = phases.gpu_windows_ns(skip=1)
    assert windows[0] == [("forward", 100 * MS, 105 * MS), ("backward", 105 * MS, 120 * MS),
                          ("backward", 120 * MS, 121 * MS)]
    assert len(windows) == 2 and windows[1][0] == ("forward", 200 * MS, 205 * MS)
    assert phases.gpu_medians_ms(skip=1) == pytest.approx({"forward": 5.0, "backward": 16.0})


@pytest.mark.parametrize("code,busy", [(SPINNING, True), ("import time; time.sleep(60)", False)])
def test_a_spinning_worker_shows_busy_and_a_sleeping_process_does_not(code, busy):
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)
        with sampling(proc.pid, workers=1, period_us=1000) as samples:
            time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    cores = busy_cores(samples, samples["t_ns"][0], samples["t_ns"][-1])
    assert samples["pid"] == proc.pid and len(samples["t_ns"]) > 50
    # A spinning thread is in state R whether it has a core or waits for one (a loaded CI machine).
    assert (cores > 0.9) if busy else (cores < 0.02), cores


def test_a_process_that_ends_while_sampled_keeps_its_samples_and_is_sampled_no_more():
    """offload="auto"'s switch stops its private daemon while train_gpt samples it (--modes auto
    --daemon-busy): what was seen of the process until then stays, its busy worker included."""
    proc = subprocess.Popen([sys.executable, "-c", SPINNING])
    try:
        time.sleep(0.2)
        with sampling(proc.pid, workers=1, period_us=1000) as samples:
            time.sleep(0.5)
            killed = time.monotonic_ns()
            proc.kill()
            proc.wait()
            ended = time.monotonic_ns()
            time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    before = [t for t in samples["t_ns"] if t < killed]
    assert len(before) > 50 and busy_cores(samples, before[0], before[-1]) > 0.9
    # The sample that finds no thread left, then none: not 500 more samples of nothing.
    assert sum(t > ended for t in samples["t_ns"]) <= 2, samples["t_ns"][-1] - ended


def test_the_cpu_time_of_a_daemon_that_ended_is_none():
    """train_gpt --modes auto read the CPU time of the daemon auto's switch had stopped (FileNotFoundError,
    H100 2026-12-07)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert daemon_cpu_seconds(proc.pid) is None
    assert daemon_cpu_seconds(None) is None
    assert daemon_cpu_seconds(os.getpid()) > 0


def test_no_pid_samples_nothing():
    with sampling(None, workers=1) as samples:
        pass
    assert samples == {}
