"""Probe: gradient-sized D2H copies made by a second process from memory it imported by CUDA IPC (what
trainstreamd does for the cuda-ipc transport), against the same copies made by the memory's owner,
with the owner's GPU idle and with the owner running kernels all the while (two CUDA contexts on one
GPU share its engines by time-slicing).

    python3 benchmarks/transfer/context_probe.py --mib 32 --copies 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp


def copy_rate(source: torch.Tensor, pinned: torch.Tensor, copies: int) -> float:
    """GB/s of `copies` back-to-back copies of `source` into page-locked host memory."""
    pinned.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(copies):
        pinned.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return copies * source.numel() * source.element_size() / (time.perf_counter() - start) / 1e9


def importer(shared: torch.Tensor, copies: int, commands, results) -> None:
    torch.cuda.set_device(shared.device)
    pinned = torch.empty(shared.numel(), dtype=shared.dtype, pin_memory=True)
    while (phase := commands.get()) is not None:
        results.put((phase, copy_rate(shared, pinned, copies)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--copies", type=int, default=64)
    args = parser.parse_args()
    numel = args.mib * 2**20 // 4
    tensor = torch.randn(numel, device="cuda")
    pinned = torch.empty(numel, pin_memory=True)
    report = {"owner": copy_rate(tensor, pinned, args.copies)}
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=importer, args=(tensor, args.copies, commands, results))
    child.start()
    for phase in ("owner idle", "owner busy"):
        commands.put(phase)
        while phase == "owner busy" and results.empty():
            torch.cuda._sleep(1_000_000)  # ~0.5 ms kernels, back to back, on the owner's stream
            torch.cuda.synchronize()
        name, rate = results.get(timeout=60)
        report["importer, " + name] = rate
    commands.put(None)
    child.join()
    print(json.dumps({k: round(v, 1) for k, v in report.items()}))


if __name__ == "__main__":
    main()
