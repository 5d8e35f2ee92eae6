"""A process that keeps the host busy beside a training run, to see what the trainer's thread loses to
it without trainstream's daemon: `triad` streams host memory as the daemon's AdamW does (a + s*c on
three 1 GiB tensors, torch's threads), `compute` keeps the same threads on arithmetic that stays in
cache (128 KiB a thread), `adamw` runs torch's fused CPU AdamW over 125M fp32 parameters (the 124M GPT's
update, 28 B a parameter); all at the daemon's workers' default nice (10). `copies` is another CUDA
context copying between the GPU and pinned host memory, N GB/s each way (32 MiB pieces on two
streams), as the daemon's own context does. Why: beside the daemon, the 124M's forward and backward
took twice as long on the trainer's clock, with the trainer on a core of its own
(benchmarks/results/train_gpt.md, 2026-12-06); the kinds tell memory bandwidth, CPU time and a second
context's copies apart.

  python3 benchmarks/train_gpt/neighbor.py triad 12   # until SIGTERM, then a JSON line: its rate
  python3 benchmarks/train_gpt/neighbor.py copies 11  # 11 GB/s to and from the GPU
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_process import side_process  # noqa: E402

GIB = 1 << 30


def copies(gbs: int):
    """One round of 32 MiB to the GPU and 32 MiB back on two streams, paced to `gbs` GB/s each way."""
    n = 32 << 20
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def work():
        start = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            device[0].copy_(host[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host[1].copy_(device[1], non_blocking=True)
        for stream in streams:
            stream.synchronize()
        time.sleep(max(0.0, n / (gbs * 1e9) - (time.perf_counter() - start)))

    return work, 2 * n / 1e9  # GB moved per call, both ways


def run(kind: str, threads: int) -> None:
    os.nice(10)
    torch.set_num_threads(threads)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    if kind == "copies":
        work, unit = copies(threads)
    elif kind == "adamw":
        n = 125_000_000
        param = torch.zeros(n, requires_grad=True)
        param.grad = torch.rand(n)
        opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
        opt.step()  # the moments allocated and touched
        work, unit = opt.step, 28 * n / 1e9  # GB moved per call: gradient, weights and moments read, the three written
    elif kind == "triad":
        n = GIB // 4
        a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
        work, unit = (lambda: torch.add(b, c, alpha=3.0, out=a)), 3 * n * 4 / 1e9  # GB moved per call
    else:
        n = threads * 32768  # 128 KiB a tensor and thread: stays in each core's L2
        a, b = torch.empty(n), torch.rand(n)
        work, unit = (lambda: torch.add(b, b, alpha=3.0, out=a)), 2 * n * 4 / 1e9  # GB moved in cache per call
    print("ready", flush=True)
    start, calls = time.perf_counter(), 0
    while not stop:
        work()
        calls += 1
    rate = calls * unit / (time.perf_counter() - start)
    print(json.dumps({"kind": kind, "n": threads, "rate": rate,
                      "unit": "GB/s in cache" if kind == "compute" else "GB/s"}), flush=True)


@contextlib.contextmanager
def neighbor(spec: str | None):
    """Runs `kind:n` (e.g. "triad:12": n threads; "copies:11": n GB/s) beside the body; yields a dict
    that holds the neighbor's rate once the body is done (empty without a spec)."""
    if not spec:
        yield {}
        return
    kind, _, threads = spec.partition(":")
    if kind not in ("triad", "compute", "adamw", "copies") or not threads.isdigit() or int(threads) < 1:
        raise SystemExit(f"--beside takes triad:N, compute:N, adamw:N or copies:N (N >= 1), not {spec!r}")
    # ready once its tensors are allocated and touched
    with side_process([sys.executable, os.path.abspath(__file__), kind, threads], f"the neighbor {spec}") as report:
        yield report


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
