"""Probe: how fast page-locked host memory for saved activations can be had, torch's way and ours.

Activation paging asks for one pinned host buffer per saved tensor the first time a step saves it
(torch.empty(pin_memory=True), torch's caching host allocator; later steps reuse them). Measured on
an H200 machine, that allocator gave 2.1-2.8 GiB/s for one 1-8 GiB allocation (cudaHostAlloc,
host_register_h200.json), so the first step of a 7B GPT
whose step saves about 12 GB pays seconds for it. Each mode runs in its own process and allocates
the same sequence of sizes (a transformer layer's saved tensors: 16, 48, 64, 64 MiB over and over)
up to --total-gib:

  torch            torch.empty(pin_memory=True), torch's defaults
  torch-register   the same with PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
                   pinned_num_register_threads:N (torch maps the pages on N threads, then registers)
  populate-register  pageable torch.empty, zero_() on torch's CPU threads (the page faults in
                   parallel), then cudaHostRegister of each buffer

Prints GiB/s per mode; --json writes them.

    python3 benchmarks/transfer/pinned_alloc.py --total-gib 8 --json pinned_alloc.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30
MIB = 1 << 20
LAYER_MIB = (16, 48, 64, 64)


def sizes(total_gib: float) -> list[int]:
    out, total = [], 0
    while total < total_gib * GIB:
        size = LAYER_MIB[len(out) % len(LAYER_MIB)] * MIB
        out.append(size)
        total += size
    return out


def allocate(mode: str, total_gib: float) -> dict:
    import torch  # in the child: the allocator's settings come from its environment

    torch.cuda.init()
    torch.empty(1, pin_memory=True)  # the CUDA context and the allocator exist before the clock starts
    buffers = []
    started = time.perf_counter()
    for size in sizes(total_gib):
        if mode == "populate-register":
            buffer = torch.empty(size, dtype=torch.uint8).zero_()
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
            if status != 0:
                raise RuntimeError(f"cudaHostRegister: {status}")
        else:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buffers.append(buffer)
    seconds = time.perf_counter() - started
    total = sum(b.numel() for b in buffers)
    return {"mode": mode, "bytes": total, "seconds": seconds, "gibs": total / GIB / seconds,
            "torch_threads": torch.get_num_threads()}


def run_child(mode: str, total_gib: float, threads: int) -> dict:
    env = dict(os.environ)
    if mode == "torch-register":
        env["PYTORCH_CUDA_ALLOC_CONF"] = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--total-gib", str(total_gib)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": mode, "threads": threads, "error": proc.stderr.strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["threads"] = threads
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=8.0)
    parser.add_argument("--threads", default="8,16", help="torch-register's pinned_num_register_threads values")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(allocate(args.child, args.total_gib)))
        return
    runs = [run_child("torch", args.total_gib, 0), run_child("populate-register", args.total_gib, 0)]
    runs += [run_child("torch-register", args.total_gib, int(t)) for t in args.threads.split(",")]
    for r in runs:
        shown = f"{r['gibs']:.2f} GiB/s ({r['seconds']:.2f} s)" if "gibs" in r else f"error: {r['error']}"
        print(f"{r['mode']:<18} threads {r['threads']:>2}: {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_gib": args.total_gib, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
