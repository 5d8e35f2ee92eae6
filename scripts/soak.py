"""Soak test: many jobs and ranks on one trainstreamd (loopback only), with random SIGKILLs of trainers
and of the daemon, for a bounded time. Every job that finishes is checked against torch.optim.AdamW
on the same data; at the end the daemon's leaks are reported (descriptors, threads, RSS, /dev/shm).

    TRAINSTREAMD=build/daemon/trainstreamd PYTHONPATH=python python3 scripts/soak.py --duration 300 \
        --out benchmarks/results/soak.md

A trainer resumes where the daemon's job is (`optimizer.resume_step`), as a restarted training loop
does; a rank whose job partner died fails and is restarted with it. The jobs have two state halves, so
every finished job must match torch however the kills fell (docs/operations.md, "Crash consistency of
the optimizer state"). It exits non-zero for a job that does not, a trainer failing without a kill, a
job that never finishes, a crashed daemon.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 400           # per job: a trainer's life is mostly training, so kills fall mid-step
TOLERANCE = 1e-4      # max |w - torch| of a job that matches torch (fp32 AdamW differs by ~1e-6)
WAIT_TIMEOUT_S = "30"  # a rank whose partner vanished between steps ends instead of waiting


# ----- the trainer (a subprocess of this script) -----

def make_model(seed: int):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))


def batch(job_seed: int, step: int):
    import torch
    g = torch.Generator().manual_seed(job_seed * 100003 + step)
    return torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)


def trainer(args) -> int:
    import torch

    import trainstream
    client = trainstream.connect(args.socket)
    model = make_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = trainstream.wrap(model, opt, client=client, job=args.job, rank=args.rank, world_size=args.world_size,
                                  bucket_mb=0.004)  # a bucket per parameter: crashes can fall between buckets
    start = opt.resume_step
    open(args.out + f".rank{args.rank}.training", "w").close()  # the driver kills only trainers that train
    for step in range(start, STEPS):
        x, y = batch(args.seed, step)
        shard = slice(args.rank * len(x) // args.world_size, (args.rank + 1) * len(x) // args.world_size)
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
    trainstream.synchronize()
    if args.rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], args.out)
    return 0


def reference(seed: int):
    """The job's weights after STEPS steps of torch.optim.AdamW on the whole batch (the mean of the ranks'
    shard gradients is the whole batch's gradient: the shards are equal)."""
    import torch
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        x, y = batch(seed, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


# ----- the driver -----

class Daemon:
    def __init__(self, socket: str, log: str):
        self.socket, self.log = socket, log
        self.process = None
        self.instances = 0
        self.start()

    def start(self) -> None:
        from trainstream._connect import daemon_binary, wait_until_serving
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([daemon_binary(), "--socket", self.socket, "--threads", "2", "--job-ttl",
                                             "3600", "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT)
        wait_until_serving(self.process, self.socket, 30, lambda: "see " + self.log)
        self.instances += 1
        self.started = time.monotonic()
        self.baseline = self.resources()  # leaks are measured against this instance's start

    def proc(self, name: str) -> str:
        return f"/proc/{self.process.pid}/{name}"

    def resources(self) -> dict:
        with open(self.proc("status")) as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"fds": len(os.listdir(self.proc("fd"))), "threads": int(status["Threads"]),
                "rss_kib": int(status["VmRSS"].split()[0])}


class Job:
    def __init__(self, index: int, world_size: int, workdir: str):
        self.name, self.seed, self.world_size = f"soak{index}", 1000 + index, world_size
        self.out = os.path.join(workdir, f"{self.name}.pt")
        self.ranks: list[subprocess.Popen | None] = [None] * world_size
        self.kills = self.restarts = 0
        self.started = time.monotonic()

    def training(self, rank: int) -> bool:
        return os.path.exists(self.out + f".rank{rank}.training")

    def launch(self, socket: str, workdir: str) -> None:
        env = dict(os.environ, TRAINSTREAM_WAIT_TIMEOUT=WAIT_TIMEOUT_S)
        for r in range(self.world_size):
            if self.training(r):
                os.unlink(self.out + f".rank{r}.training")
            with open(os.path.join(workdir, f"{self.name}.rank{r}.log"), "ab") as log:
                self.ranks[r] = subprocess.Popen([sys.executable, __file__, "--trainer", "--socket", socket, "--job",
                                                  self.name, "--rank", str(r), "--world-size", str(self.world_size),
                                                  "--seed", str(self.seed), "--out", self.out],
                                                 stdout=log, stderr=subprocess.STDOUT, env=env)

    def running(self) -> bool:
        return any(p is not None and p.poll() is None for p in self.ranks)

    def finished(self) -> bool:
        return all(p is not None and p.poll() == 0 for p in self.ranks)

    def failed(self) -> bool:
        """A rank was killed or failed (its partner died, its daemon died): as under torchrun, the job's
        ranks restart together."""
        return any(p is not None and p.poll() not in (None, 0) for p in self.ranks)

    def stop(self) -> None:
        for p in self.ranks:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def soak_segments(keys: set[str]) -> list[str]:
    """The segments in /dev/shm of the soak's jobs (`keys`, as Stats showed them): other processes on
    the machine may have segments of the same uid."""
    return sorted(name for name in os.listdir("/dev/shm")
                  if name.startswith(f"trainstream.{os.getuid()}.") and name.split(".")[2] in keys)


def note_keys(socket: str, keys: set[str]) -> None:
    import trainstream
    try:
        keys.update(j["job_key"] for j in trainstream.connect(socket, timeout_s=1).stats()["jobs"])
    except trainstream.TrainstreamError:
        pass  # between a kill and the restart


def deviation(job: Job) -> float:
    import torch
    got = torch.load(job.out)
    return max((a - b).abs().max().item() for a, b in zip(got, reference(job.seed)))


def drive(args) -> int:
    import trainstream
    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="ts-soak-")
    socket = os.path.join(workdir, "d.sock")
    keys: set[str] = set()
    daemon = Daemon(socket, os.path.join(workdir, "daemon.log"))
    jobs: list[Job] = []
    done: list[tuple[Job, float]] = []
    unexpected: list[str] = []
    kills = {"trainer": 0, "daemon": 0}
    next_kill = time.monotonic() + rng.uniform(*args.kill_every)
    deadline = time.monotonic() + args.duration
    give_up = deadline + args.grace  # after the kills stop, the jobs left get this long to finish
    index = ticks = 0
    while jobs or time.monotonic() < deadline:
        stopping = time.monotonic() >= deadline
        ticks += 1
        if ticks % 10 == 0:
            note_keys(socket, keys)
        while not stopping and len(jobs) < args.jobs:
            job = Job(index, rng.choice([1, 2]), workdir)
            index += 1
            job.launch(socket, workdir)
            jobs.append(job)
        for job in list(jobs):
            if job.finished():
                done.append((job, deviation(job)))
                if done[-1][1] > TOLERANCE:
                    unexpected.append(f"{job.name}: differs from torch by {done[-1][1]:.2e} after {job.kills} kills")
                trainstream.connect(socket).drop_job(job.name)
                jobs.remove(job)
            elif job.failed():
                job.stop()
                if job.kills == 0 and daemon.process.poll() is None:
                    unexpected.append(f"{job.name}: a rank failed without a kill (see {workdir})")
                job.restarts += 1
                job.launch(socket, workdir)
            elif time.monotonic() > give_up:
                unexpected.append(f"{job.name}: did not finish {args.grace:g} s after the kills stopped")
                job.stop()
                jobs.remove(job)
        if daemon.process.poll() is not None:
            unexpected.append(f"trainstreamd exited with {daemon.process.returncode} without a kill")
            daemon.start()
        if not stopping and time.monotonic() >= next_kill:
            next_kill = time.monotonic() + rng.uniform(*args.kill_every)
            live = [(job, p) for job in jobs for r, p in enumerate(job.ranks)
                    if p is not None and p.poll() is None and job.training(r)]
            if not live:
                next_kill = time.monotonic() + 0.2  # nothing trains yet: try again soon
            elif rng.random() < args.daemon_share:
                daemon.process.kill()
                daemon.process.wait()
                kills["daemon"] += 1
                for job in jobs:
                    job.kills += job.running()  # a job whose ranks had all exited did not see it
                daemon.start()  # on the same socket: it re-adopts the jobs the dead one left
            else:
                job, p = rng.choice(live)
                p.kill()
                kills["trainer"] += 1
                job.kills += 1
        time.sleep(0.05)
    for job in jobs:
        job.stop()
    time.sleep(1)  # the daemon notices the last sessions end
    final = daemon.resources()
    lifetime = time.monotonic() - daemon.started
    note_keys(socket, keys)
    leftover = soak_segments(keys)
    still_listed = [j["name"] for j in trainstream.connect(socket).stats()["jobs"]]
    daemon.process.send_signal(signal.SIGTERM)
    daemon.process.wait(timeout=30)
    after_stop = soak_segments(keys)
    report = render(args, done, kills, (daemon.instances, lifetime, daemon.baseline, final), leftover, still_listed,
                    after_stop, unexpected)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 1 if unexpected or after_stop else 0


def render(args, done, kills, daemon, leftover, still_listed, after_stop, unexpected) -> str:
    instances, lifetime, baseline, final = daemon
    lines = [f"# Soak: {args.duration:.0f} s, up to {args.jobs} jobs of 1-2 ranks, kills every "
             f"{args.kill_every[0]:g}-{args.kill_every[1]:g} s ({args.daemon_share:.0%} of them the daemon's)", "",
             f"`{' '.join(sys.argv)}` (seed {args.seed}) on {os.uname().nodename}, {os.cpu_count()} CPUs.", "",
             f"- SIGKILLs: {kills['trainer']} of trainers, {kills['daemon']} of trainstreamd (restarted on its socket "
             "each time: it re-adopts the jobs)",
             f"- jobs finished: {len(done)}; matching torch.optim.AdamW within {TOLERANCE:g}: "
             f"{sum(d <= TOLERANCE for _, d in done)}", "",
             "| job | ranks | kills it saw | restarts | max abs diff to torch | |", "|---|---|---|---|---|---|"]
    for job, d in done:
        verdict = "matches" if d <= TOLERANCE else "**differs**"
        lines.append(f"| {job.name} | {job.world_size} | {job.kills} | {job.restarts} | {d:.2e} | {verdict} |")
    lines += ["", f"Daemon resources of the last of its {instances} instances ({lifetime:.0f} s old at the end): "
              "at its start and at the end (every job dropped, every trainer gone):", "",
              "| | descriptors | threads | RSS (KiB) |", "|---|---|---|---|",
              f"| start | {baseline['fds']} | {baseline['threads']} | {baseline['rss_kib']} |",
              f"| end | {final['fds']} | {final['threads']} | {final['rss_kib']} |", "",
              f"- `/dev/shm` segments left while the daemon ran: {len(leftover)} (jobs it still lists: "
              f"{still_listed or 'none'})",
              f"- `/dev/shm` segments left after its SIGTERM: {len(after_stop)} {after_stop or ''}",
              f"- unexpected: {unexpected or 'none'}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket")
    parser.add_argument("--job")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--out", help="trainer: where rank 0 saves the weights; driver: the markdown report")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=180, help="seconds of kills and new jobs")
    parser.add_argument("--jobs", type=int, default=3, help="jobs at once")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"))
    parser.add_argument("--grace", type=float, default=240, help="seconds the jobs get to finish after the kills")
    parser.add_argument("--daemon-share", type=float, default=0.25, help="share of the kills that hit the daemon")
    args = parser.parse_args()
    return trainer(args) if args.trainer else drive(args)


if __name__ == "__main__":
    sys.exit(main())
