"""How many cores a process keeps busy, moment by moment: its threads' run time (schedstat, in ns)
sampled every PERIOD microseconds by a process of its own, on the clock train_gpt marks its steps
with (CLOCK_MONOTONIC). Why: on the 124M's forced offload the daemon is the limit, and the step is
its update plus the time it has nothing to do (H100s, benchmarks/results/train_gpt.md, 2026-12-06,
third session); per-second CPU counters cannot say where in a 40 ms step that time lies.

  python3 benchmarks/train_gpt/busy_sampler.py PID PERIOD_US   # until SIGTERM, then one JSON line

The sampler itself runs on some core and wakes every period (about 20 us of work a sample for a
process of 20 threads).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

RESCAN_NS = 50_000_000  # threads that start later are picked up within this


def open_threads(pid: int, fds: dict[int, int]) -> None:
    """Adds the schedstat of every thread of `pid` not in `fds` (tid -> fd)."""
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        if tid not in fds:
            with contextlib.suppress(OSError):  # a thread that just ended
                fds[tid] = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)


def run_ns(fds: dict[int, int], ended: dict[int, int], last: dict[int, int]) -> int:
    """The threads' run time so far; an ended thread keeps its last reading (in `ended`)."""
    total = 0
    for tid, fd in list(fds.items()):
        try:
            last[tid] = int(os.pread(fd, 64, 0).split()[0])
        except (OSError, IndexError, ValueError):
            ended[tid] = last.get(tid, 0)
            os.close(fds.pop(tid))
            continue
        total += last[tid]
    return total + sum(ended.values())


def sample(pid: int, period_us: int) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    fds: dict[int, int] = {}
    ended: dict[int, int] = {}
    last: dict[int, int] = {}
    times, runs = [], []
    rescanned = 0
    print("ready", flush=True)
    while not stop:
        now = time.monotonic_ns()
        if now - rescanned > RESCAN_NS:
            with contextlib.suppress(FileNotFoundError):  # the process is gone: its last readings stay
                open_threads(pid, fds)
            rescanned = now
        runs.append(run_ns(fds, ended, last))
        times.append(now)
        time.sleep(max(0.0, period_us / 1e6 - (time.monotonic_ns() - now) / 1e9))
    print(json.dumps({"pid": pid, "period_us": period_us, "t_ns": times, "run_ns": runs}), flush=True)


@contextlib.contextmanager
def sampling(pid: int | None, period_us: int = 500):
    """Samples `pid` while the body runs; yields a dict that holds the samples (t_ns, run_ns) once the
    body is done (empty without a pid)."""
    report: dict = {}
    if not pid:
        yield report
        return
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(pid), str(period_us)],
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the sampler of process {pid} did not start (exit status {proc.wait()})")
        yield report
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        if out.strip():
            report.update(json.loads(out.strip().splitlines()[-1]))


def run_at(report: dict, t_ns: int) -> float:
    """The sampled run time at `t_ns`, linear between samples (clamped to the first and last)."""
    times, runs = report["t_ns"], report["run_ns"]
    i = bisect.bisect_right(times, t_ns)
    if i == 0:
        return runs[0]
    if i == len(times):
        return runs[-1]
    t0, t1 = times[i - 1], times[i]
    return runs[i - 1] + (runs[i] - runs[i - 1]) * (t_ns - t0) / (t1 - t0)


def busy_cores(report: dict, start_ns: int, end_ns: int) -> float:
    """The cores the process kept busy on average over [start_ns, end_ns)."""
    return (run_at(report, end_ns) - run_at(report, start_ns)) / max(1, end_ns - start_ns)


def idle_ns(report: dict, start_ns: int, end_ns: int, below: float = 1.0) -> float:
    """How much of [start_ns, end_ns) fell in sample intervals where the process kept fewer than
    `below` cores busy."""
    times, runs = report["t_ns"], report["run_ns"]
    total = 0.0
    first = max(1, bisect.bisect_right(times, start_ns))
    for i in range(first, len(times)):
        t0, t1 = times[i - 1], times[i]
        if t0 >= end_ns:
            break
        overlap = min(t1, end_ns) - max(t0, start_ns)
        if overlap > 0 and (runs[i] - runs[i - 1]) / (t1 - t0) < below:
            total += overlap
    return total


if __name__ == "__main__":
    sample(int(sys.argv[1]), int(sys.argv[2]))
