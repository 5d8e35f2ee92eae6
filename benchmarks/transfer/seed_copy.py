"""Probe: where a new job's seed goes (wrap()'s "seed" phase: the model's weights from the GPU into the
job's master weights, _staged_copy.copy_to_host). The 1.86B's 7.4 GB took 0.6-0.9 s on warm GPU
machines (benchmarks/results/train_gpt.md, 2026-12-05, night), where its GPU copies alone would take
about 0.15 s.

A shared-memory file is created and backed by another process, with huge pages asked for, as the daemon
backs a job's segments; this process then maps it afresh, as a trainer does at attach, and times:
  copy (fresh mapping)        copy_to_host into it: the trainer's first touch of each page included
  populate + copy             MADV_POPULATE_WRITE of the fresh mapping on THREADS threads, then the copy
  copy (mapped before)        the same copy again into a mapping already faulted in
  copy beside registering     the copy into a fresh mapping while another process page-locks
                              (cudaHostRegister, 64 MiB at a time) REGISTER_GIB more of the file, as
                              the daemon's PinAhead does during a seed (the gradients and the other
                              state half's master weights)
and, to compare, the GPU copies alone (into one page-locked buffer, over and over) and the CPU's copy of
one page-locked piece into the mapped file. Each measurement twice, on a fresh mapping each time.

    python3 benchmarks/transfer/seed_copy.py --gib 7 --register-gib 14 --json seed_copy.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time

import torch
from host_register import split_range
from populate import address_of
from populate import timed as populate_at_once

from trainstream._staged_copy import STAGE_BYTES, copy_to_host

GIB = 1 << 30
PIN_PIECE = 64 << 20  # PinAhead's (daemon/gpu/pin_ahead.cpp)
PATH = "/dev/shm/trainstream-seed-probe"


def back(path: str, nbytes: int) -> None:
    """Another process creates the file and backs every page, huge pages asked for (the daemon's way)."""
    code = (f"import mmap, os, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"from seed_copy import populate; fd = os.open({path!r}, os.O_CREAT | os.O_RDWR, 0o600); "
            f"os.ftruncate(fd, {nbytes}); m = mmap.mmap(fd, {nbytes}); m.madvise(mmap.MADV_HUGEPAGE); populate(m, 16)")
    subprocess.run([sys.executable, "-c", code], check=True)


def populate(m: mmap.mmap, threads: int) -> None:
    """MADV_POPULATE_WRITE over the mapping, a share on each of `threads` threads (populate.py's)."""
    base = address_of(m)
    populate_at_once([(base + offset, length) for offset, length in split_range(len(m), threads, 4096)])


def registering(seed_bytes: int, nbytes: int) -> subprocess.Popen:
    """Another process maps the file, faults it in and, on a line from us, page-locks [seed_bytes, nbytes)
    of it 64 MiB at a time (PinAhead's pieces), then prints how long that took."""
    code = (f"import mmap, os, sys, time; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"from host_register import Cudart; from populate import address_of; from seed_copy import populate; "
            f"c = Cudart(); c.set_device(0); fd = os.open({PATH!r}, os.O_RDWR); m = mmap.mmap(fd, {nbytes}); "
            f"m.madvise(mmap.MADV_HUGEPAGE); populate(m, 16); base = address_of(m); print('ready', flush=True); "
            f"sys.stdin.readline(); t = time.perf_counter(); "
            f"[c.register(base + at, min({PIN_PIECE}, {nbytes} - at)) "
            f"for at in range({seed_bytes}, {nbytes}, {PIN_PIECE})]; "
            f"print(time.perf_counter() - t, flush=True); sys.stdin.readline()")
    helper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if helper.stdout.readline().strip() != "ready":
        helper.kill()
        raise RuntimeError("the registering process did not start")
    return helper


def copy_beside_registering(source: torch.Tensor, nbytes: int) -> dict[str, float]:
    """The seed's copy into a fresh mapping while another process page-locks the rest of the file."""
    seed_bytes = source.numel() * 4
    helper = registering(seed_bytes, nbytes)
    try:
        m = mapped(nbytes)
        helper.stdin.write("go\n")
        helper.stdin.flush()
        copy_s = copy_into(m, source)
        register_s = float(helper.stdout.readline())
        m.close()
    finally:
        helper.kill()
        helper.wait()
    return {"copy_beside_registering_s": copy_s, "registering_beside_s": register_s}


def copy_into(m: mmap.mmap, source: torch.Tensor) -> float:
    """copy_to_host of `source` into the start of the mapping, timed (its view gone on return)."""
    host = torch.frombuffer(m, dtype=torch.float32, count=source.numel())
    return timed(lambda: copy_to_host([(host, source)], source.device))


def mapped(nbytes: int) -> mmap.mmap:
    """The file mapped afresh, as a trainer maps a job's segment."""
    fd = os.open(PATH, os.O_RDWR)
    m = mmap.mmap(fd, nbytes)
    os.close(fd)
    m.madvise(mmap.MADV_HUGEPAGE)
    return m


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(m: mmap.mmap, source: torch.Tensor, populated: bool, threads: int) -> dict[str, float]:
    if not populated:
        return {"copy_fresh_mapping_s": copy_into(m, source), "copy_mapped_before_s": copy_into(m, source)}
    run = {"populate_s": timed(lambda: populate(m, threads)), "copy_after_populate_s": copy_into(m, source)}
    host = torch.frombuffer(m, dtype=torch.float32, count=source.numel())  # gone on return: the mapping may close
    stage = torch.empty(STAGE_BYTES // 4, pin_memory=True)
    pieces = [slice(i, i + stage.numel()) for i in range(0, source.numel() - stage.numel() + 1, stage.numel())]
    run["gpu_copies_alone_s"] = timed(lambda: [stage.copy_(source[s], non_blocking=True) for s in pieces])
    run["cpu_copies_alone_s"] = timed(lambda: [host[s].copy_(stage) for s in pieces])
    return run


def one_run(source: torch.Tensor, threads: int, nbytes: int) -> dict[str, float]:
    run: dict[str, float] = {}
    for populated in (False, True):
        m = mapped(nbytes)
        run.update(measure(m, source, populated, threads))
        m.close()
    if nbytes > source.numel() * 4:
        run.update(copy_beside_registering(source, nbytes))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=7.0)
    parser.add_argument("--register-gib", type=float, default=14.0,
                        help="page-locked by another process beside the copy (0: not measured)")
    parser.add_argument("--threads", type=int, default=16, help="populating threads")
    parser.add_argument("--json")
    args = parser.parse_args()
    seed_bytes = int(args.gib * GIB) // 4096 * 4096
    nbytes = seed_bytes + int(args.register_gib * GIB) // 4096 * 4096
    source = torch.randn(seed_bytes // 4, device="cuda")
    results: dict = {"gib": seed_bytes / GIB, "register_gib": (nbytes - seed_bytes) / GIB,
                     "torch_threads": torch.get_num_threads(), "runs": []}
    try:
        started = time.perf_counter()
        back(PATH, nbytes)
        results["backed_s"] = time.perf_counter() - started
        for _ in range(2):
            results["runs"].append(one_run(source, args.threads, nbytes))
            print({k: round(v, 3) for k, v in results["runs"][-1].items()}, flush=True)
    finally:
        if os.path.exists(PATH):
            os.unlink(PATH)
    for key in results["runs"][0]:
        moved = nbytes - seed_bytes if key == "registering_beside_s" else seed_bytes
        results[key[:-2] + "_gb_per_s"] = [round(moved / r[key] / 1e9, 1) for r in results["runs"]]
    print({k: v for k, v in results.items() if k != "runs"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
