"""How many of a process's worker threads are running, moment by moment: each thread's state
(/proc/<pid>/task/<tid>/stat) sampled every PERIOD microseconds by a process of its own, on the clock
train_gpt marks its steps with (CLOCK_MONOTONIC). The workers are the `workers` threads that ran
longest (schedstat at the end): the daemon's pool, not its engine, copy-queue or gRPC threads. Why:
on the 124M's forced offload the daemon is the limit, and the step is its update plus the time it has
nothing to do (H100s, benchmarks/results/train_gpt.md, 2026-12-06, third session); per-second CPU
counters cannot say where in a 40 ms step that time lies, and a thread's run time in schedstat only
advances at the scheduler's ticks (bursts every 4 ms on an H100 machine).

  python3 benchmarks/train_gpt/busy_sampler.py PID PERIOD_US   # until SIGTERM, then one JSON line

A state of R counts as running (or waiting for a core). The sampler itself runs on some core and
wakes every period (about 0.1 ms of work a sample for a process of 20 threads). A process that ends
while sampled (offload="auto"'s switch stops its private daemon: train_gpt --modes auto --daemon-busy)
is sampled no more, and its report is what the sampler saw until then, the threads' run times included.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_process import side_process  # noqa: E402

RESCAN_NS = 50_000_000  # threads that start later are picked up within this


def open_threads(pid: int, fds: dict[int, int]) -> None:
    """Adds the stat file of every thread of `pid` not in `fds` (tid -> fd)."""
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        if tid not in fds:
            with contextlib.suppress(OSError):  # a thread that just ended
                fds[tid] = os.open(f"/proc/{pid}/task/{tid}/stat", os.O_RDONLY)


def running(fds: dict[int, int]) -> list[int]:
    """The threads whose state is R; a thread that ended is dropped."""
    tids = []
    for tid, fd in list(fds.items()):
        try:
            state = os.pread(fd, 512, 0).rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            os.close(fds.pop(tid))
            continue
        if state == b"R":
            tids.append(tid)
    return tids


def run_times(pid: int) -> dict[int, int]:
    """Each live thread's run time so far (ns)."""
    times = {}
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                times[int(tid)] = int(f.read().split()[0])
    return times


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None once it is gone: beside the pid, which
    process it is (an ended daemon's pid may be given to another)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def sample(pid: int, period_us: int) -> None:
    """Samples `pid` until SIGTERM or until it is gone, then prints the report. The threads' run times
    are read at each rescan too: those of a process that ended are the last read before it did."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    fds: dict[int, int] = {}
    times, states = [], []
    run_ns: dict[int, int] = {}
    started = start_time(pid)
    rescanned = 0
    print("ready", flush=True)
    while not stop:
        now = time.monotonic_ns()
        if not fds or now - rescanned > RESCAN_NS:  # and as soon as no thread is left: is it still there?
            if started is None or start_time(pid) != started:
                break
            with contextlib.suppress(FileNotFoundError):  # it ended after start_time read it
                open_threads(pid, fds)
            run_ns.update(run_times(pid))
            rescanned = now
        states.append(running(fds))
        times.append(now)
        time.sleep(max(0.0, period_us / 1e6 - (time.monotonic_ns() - now) / 1e9))
    if started is not None and start_time(pid) == started:
        run_ns.update(run_times(pid))
    for fd in fds.values():
        os.close(fd)
    print(json.dumps({"pid": pid, "period_us": period_us, "t_ns": times, "running": states,
                      "run_ns": run_ns}), flush=True)


@contextlib.contextmanager
def sampling(pid: int | None, workers: int, period_us: int = 500):
    """Samples `pid` while the body runs; yields a dict that holds, once the body is done, the sample
    times (t_ns) and how many of its `workers` longest-running threads ran at each (busy); empty
    without a pid."""
    report: dict = {}
    if not pid:
        yield report
        return
    raw: dict = {}
    try:
        with side_process([sys.executable, os.path.abspath(__file__), str(pid), str(period_us)],
                          f"the sampler of process {pid}") as raw:
            yield report
    finally:
        if raw:
            by_run_time = sorted(raw["run_ns"], key=lambda tid: raw["run_ns"][tid], reverse=True)
            pool = {int(tid) for tid in by_run_time[:workers]}
            report.update(pid=pid, period_us=period_us, t_ns=raw["t_ns"],
                          busy=[len(pool.intersection(tids)) for tids in raw["running"]])


def overlaps(report: dict, start_ns: int, end_ns: int):
    """(busy, ns) for each sample's share of [start_ns, end_ns): a sample's count holds until the next."""
    times, busy = report["t_ns"], report["busy"]
    for i in range(max(0, bisect.bisect_right(times, start_ns) - 1), len(times) - 1):
        if times[i] >= end_ns:
            break
        overlap = min(times[i + 1], end_ns) - max(times[i], start_ns)
        if overlap > 0:
            yield busy[i], overlap


def busy_cores(report: dict, start_ns: int, end_ns: int) -> float:
    """The workers running on average over [start_ns, end_ns) (as far as samples cover it)."""
    parts = list(overlaps(report, start_ns, end_ns))
    return sum(b * ns for b, ns in parts) / max(1, sum(ns for _, ns in parts))


def idle_ns(report: dict, start_ns: int, end_ns: int) -> int:
    """How much of [start_ns, end_ns) no worker ran."""
    return sum(ns for b, ns in overlaps(report, start_ns, end_ns) if b == 0)


if __name__ == "__main__":
    sample(int(sys.argv[1]), int(sys.argv[2]))
