"""The Python cost of trainstream's hooks on the trainer's thread: a GPT of nanoGPT's shape whose compute
is negligible (width 32, a 256-token vocabulary, one sequence of 16 tokens, CPU), so that a step's
forward and backward time is the framework's, wrapped and not. The 124M GPT's forward on the H200
took 8.4 ms on the trainer's clock under trainstream (its waits for weights left out) against 4.9 ms
GPU-only (benchmarks/results/train_gpt.md, 2026-12-02): this separates the hooks' share.

Modes, alternated --rounds times in one process (each its own model, optimizer and private daemon):

  plain      the model and torch.optim.AdamW, unwrapped
  wrapped    trainstream.wrap(model, optimizer), the host transport
  no-guard   wrapped, with the StaleReadGuard's TorchFunctionMode never entered: not a setting (a
             forward may then read a stale weight), the measure of what the mode costs
  no-copies  wrapped, the host transport's copies of new weights into the parameters skipped: not a
             setting either (the weights stay the first step's), the measure of what those copies
             cost; the cuda-ipc transport on a GPU has none (the daemon writes the weights in place)

Prints the median forward and backward per mode and what wrapping adds; --json writes them.

    python3 benchmarks/hooks/hook_overhead.py --layers 12 --json hooks_devbox-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train_gpt"))
import gpt  # noqa: E402
import trainstream  # noqa: E402
from trainstream import _guards, _transport  # noqa: E402

MODES = ("plain", "wrapped", "no-guard", "no-copies")


def timed_steps(layers: int, mode: str, steps: int, warmup: int) -> dict[str, float]:
    """Median forward and backward milliseconds of `steps` steps after `warmup`."""
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(layers, 2, 32, vocab=256, block=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode != "plain":
        model, optimizer = trainstream.wrap(model, optimizer)
    guard_starts, weights_in = _guards.StaleReadGuard._forward_starts, _transport.HostTransport.weights_in
    if mode == "no-guard":
        _guards.StaleReadGuard._forward_starts = lambda self: None
    if mode == "no-copies":
        _transport.HostTransport.weights_in = lambda self, i: None
    tokens, targets = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16))
    forward, backward = [], []
    try:
        for i in range(warmup + steps):
            started = time.perf_counter()
            loss = model(tokens, targets)
            forwarded = time.perf_counter()
            loss.backward()
            if i >= warmup:
                forward.append(forwarded - started)
                backward.append(time.perf_counter() - forwarded)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        _guards.StaleReadGuard._forward_starts, _transport.HostTransport.weights_in = guard_starts, weights_in
        if mode != "plain":
            trainstream.unwrap(model)
    return {"forward_ms": 1e3 * statistics.median(forward), "backward_ms": 1e3 * statistics.median(backward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ops are tiny: threads would only add their own overhead
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(timed_steps(args.layers, mode, args.steps, args.warmup))
    result = {"layers": args.layers, "steps": args.steps, "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "torch": torch.__version__, "modes": {}}
    for mode in MODES:
        result["modes"][mode] = {key: statistics.median(run[key] for run in runs[mode])
                                 for key in ("forward_ms", "backward_ms")}
        print(f"{mode:9s} forward {result['modes'][mode]['forward_ms']:.2f} ms, "
              f"backward {result['modes'][mode]['backward_ms']:.2f} ms")
    plain, wrapped, unguarded, uncopied = (result["modes"][mode] for mode in MODES)
    result["added_forward_ms"] = wrapped["forward_ms"] - plain["forward_ms"]
    result["guard_forward_ms"] = wrapped["forward_ms"] - unguarded["forward_ms"]
    result["weight_copies_forward_ms"] = wrapped["forward_ms"] - uncopied["forward_ms"]
    result["added_backward_ms"] = wrapped["backward_ms"] - plain["backward_ms"]
    print(f"wrapping adds {result['added_forward_ms']:.2f} ms to a forward (of it the guard's mode "
          f"{result['guard_forward_ms']:.2f} ms, the host transport's weight copies "
          f"{result['weight_copies_forward_ms']:.2f} ms) and {result['added_backward_ms']:.2f} ms to a backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
