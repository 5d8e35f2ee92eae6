"""How far a trainer's thread can queue kernels behind a GPU wait before its launches block.

cuda-ipc's forward queues a `cuStreamWaitValue32` per bucket and goes on launching (the GPU waits for
the daemon's weights, not the thread). That only frees the thread if the stream takes the launches
behind the unmet wait; once its queue is full, each launch blocks until the GPU drains some. This
program measures both halves:

1. tiny kernels (`x.add_(1)`) launched behind a wait that a timer releases after --hold-ms: how many
   go in before a launch takes longer than 1 ms, and how long the thread then blocked;
2. the 124M GPT's forward and backward under bf16 autocast (benchmarks/train_gpt/gpt.py) on the
   trainer's clock, alone and behind a wait released after --hold-ms: if the queue holds a whole
   forward, its clock does not grow by the hold.

  python3 benchmarks/transfer/launch_queue.py --hold-ms 10 --json launch_queue.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train_gpt"))
from gpt import build  # noqa: E402
from trainstream import _C  # noqa: E402


class HeldStream:
    """The current stream waiting on a host-mapped word until a timer sets it, `hold_s` after hold()."""

    def __init__(self):
        self.words = _C.HostMappedWords(torch.cuda.current_device(), 1)
        self.value = memoryview(self.words)
        self.target = 0

    def hold(self, hold_s: float) -> threading.Timer:
        self.target += 1
        self.words.queue_wait(torch.cuda.current_stream().cuda_stream, 0, self.target)
        timer = threading.Timer(hold_s, self.value.__setitem__, (0, self.target))
        timer.start()
        return timer


def tiny_launches(held: HeldStream, hold_s: float, count: int) -> dict:
    x = torch.zeros(1, device="cuda")
    x.add_(1)  # loads the kernel: a first launch under lazy loading blocked 19 ms behind the wait (H200)
    torch.cuda.synchronize()
    timer = held.hold(hold_s)
    started = time.perf_counter()
    first_blocked, blocked_s = None, 0.0
    for n in range(count):
        t = time.perf_counter()
        x.add_(1)
        took = time.perf_counter() - t
        if took > 1e-3 and first_blocked is None:
            first_blocked, blocked_s = n, took
    queued_s = time.perf_counter() - started
    torch.cuda.synchronize()
    timer.join()
    assert x.item() == count + 1
    return {"launches": count, "first_blocked_launch": first_blocked, "blocked_ms": 1000 * blocked_s,
            "all_queued_ms": 1000 * queued_s}


def gpt_step_clock(model, tokens, held: HeldStream | None, hold_s: float) -> tuple[float, float]:
    """Forward and backward on the trainer's clock (no synchronize between them)."""
    torch.cuda.synchronize()
    timer = held.hold(hold_s) if held else None
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    forward = time.perf_counter() - start
    loss.backward()
    backward = time.perf_counter() - start - forward
    torch.cuda.synchronize()
    if timer:
        timer.join()
    model.zero_grad(set_to_none=True)
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-ms", type=float, default=10.0)
    parser.add_argument("--launches", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    hold_s = args.hold_ms / 1000
    held = HeldStream()
    result = {"device": torch.cuda.get_device_name(), "hold_ms": args.hold_ms,
              "tiny": tiny_launches(held, hold_s, args.launches)}
    model = build("124m", "cuda", torch.float32)
    tokens = torch.randint(0, 50257, (8, 512), device="cuda")
    for _ in range(3):
        gpt_step_clock(model, tokens, None, 0)
    for name, h in (("free", None), ("held", held)):
        runs = [gpt_step_clock(model, tokens, h, hold_s) for _ in range(args.steps)]
        result[f"gpt_124m_{name}"] = {"forward_ms": 1000 * statistics.median(f for f, _ in runs),
                                      "backward_ms": 1000 * statistics.median(b for _, b in runs)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
