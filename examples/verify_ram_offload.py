"""Trains a model through trainstream and proves where its training memory lives: on the GPU only the
weights and the activations; the gradients and the optimizer state (fp32 master weights, both Adam
moments) in host RAM, in trainstreamd's shared-memory segments. Ends with PASS or FAIL (exit code 0 / 1).

    python3 examples/verify_ram_offload.py [--device cuda] [--width 2048] [--layers 8] [--steps 5]

The figures come from the driver (torch.cuda.mem_get_info: device memory in use), torch's allocator, and
the daemon (Client.stats(): the bytes of the job's segments). Checked:
  1. gradients go to host RAM: after every backward no parameter holds p.grad, and the job's gradient
     region in host RAM holds a slot for every one of them;
  2. the optimizer state is in host RAM: the job's state segment holds fp32 master weights and both
     moments of every parameter, and the optimizer holds no state tensor in this process;
  3. between steps the GPU holds the weights and nothing else of training's: torch's allocated memory plus
     trainstream's own GPU buffers (cuda-ipc's parameter buffer and gradient staging slots) stay within
     what was allocated before training (the weights, and the workspaces CUDA libraries keep after a
     first step of plain torch), the staging slots and 16 MiB;
  4. the driver agrees: the device memory in use grows during training by less than half of what stock
     AdamW keeps there on top of the weights (gradients + moments).
On the CPU there is no GPU to measure: only 1 and 2 are checked, and the output says so.
"""

from __future__ import annotations

import argparse
import sys

import torch

import trainstream

MIB = 1 << 20


def build(width: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).to(device)


def gpu_in_use() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")

    model = build(args.width, args.layers, args.device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    # A step of plain torch first: CUDA loads its kernels and libraries (cuBLAS's workspace) on first use,
    # which the driver's figures would otherwise count as training memory.
    model(torch.randn(args.batch, args.width, device=args.device)).pow(2).mean().backward()
    for p in params:
        p.grad = None
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()  # the weights and what CUDA libraries keep (cuBLAS workspaces)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    model, optimizer = trainstream.wrap(model, optimizer)
    rank = trainstream._wrap._rank_of(model)
    outside_torch = getattr(rank.transport, "device_bytes", 0)  # cuda-ipc: parameters and staging slots
    if cuda:
        torch.cuda.synchronize()
        used_before = gpu_in_use()
    checks: list[tuple[str, bool, str]] = []

    grads_left, between_steps = True, 0
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, device=args.device)
        model(x).pow(2).mean().backward()
        with trainstream._watched.internal():  # what p.grad holds (read after backward, trainstream refuses it)
            grads_left &= all(p.grad is None for p in params)
        optimizer.step()
        optimizer.synchronize()
        if cuda:
            torch.cuda.synchronize()
            between_steps = max(between_steps, torch.cuda.memory_allocated() + outside_torch)
    job = next(j for j in rank.client.stats()["jobs"] if j["name"] == rank.job)

    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    checks.append(("gradients go to host RAM", grads_left and job["rank_bytes"] >= grad_bytes,
                   f"p.grad empty after every backward: {grads_left}; the job's gradient region "
                   f"{job['rank_bytes'] / MIB:.1f} MiB >= the gradients' {grad_bytes / MIB:.1f} MiB"))
    state = 12 * numel  # fp32 master weights + exp_avg + exp_avg_sq
    in_process = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t))
    checks.append(("optimizer state in host RAM", job["state_bytes"] >= state and in_process == 0,
                   f"the job's state segment {job['state_bytes'] / MIB:.1f} MiB >= master weights + moments "
                   f"{state / MIB:.1f} MiB; optimizer state in this process: {in_process} bytes"))
    if cuda:
        staging = max(outside_torch - weights, 0)  # cuda-ipc: its buffers beyond the parameters themselves
        limit = resident + staging + 16 * MIB
        checks.append(("between steps the GPU holds the weights only", between_steps <= limit,
                       f"torch allocated + trainstream's GPU buffers {between_steps / MIB:.1f} MiB <= weights and "
                       f"CUDA's own before training {resident / MIB:.1f} (weights {weights / MIB:.1f}) + staging "
                       f"{staging / MIB:.1f} + 16 MiB"))
        grown, stock_extra = gpu_in_use() - used_before, grad_bytes + 8 * numel
        checks.append(("the driver agrees", grown < stock_extra / 2,
                       f"device memory in use grew by {grown / MIB:.1f} MiB during training (torch's cache of "
                       f"activations included); stock AdamW adds gradients + moments {stock_extra / MIB:.1f} MiB"))
    else:
        print("CPU run: there is no GPU to measure; checking the daemon's figures only")

    print(f"model: {numel / 1e6:.1f}M parameters, {weights / MIB:.1f} MiB of weights on {args.device}; "
          f"transport {rank.transport.name}; daemon host bytes {rank.client.stats()['host_bytes'] / MIB:.1f} MiB")
    for name, ok, detail in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}: {detail}")
    passed = all(ok for _, ok, _ in checks)
    trainstream.unwrap(model)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
