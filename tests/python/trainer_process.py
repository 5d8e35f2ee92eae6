"""A training process for the fault tests: trains a small model through trainstreamd, printing
"step N" after each step, until killed (or for --steps steps). --die-behind-gpu-work: after the
given steps, queue a backward pass behind seconds of GPU work and SIGKILL itself before the GPU gets
there, so the daemon holds gradient-ready events that will never be reached."""

import argparse
import os
import signal
import sys

import torch

import trainstream


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--die-behind-gpu-work", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Linear(args.width, 1)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, client=trainstream.connect(args.socket), job=args.job, bucket_mb=0.1)
    for step in range(args.steps):
        model(torch.randn(32, args.width, device=args.device)).pow(2).mean().backward()
        opt.step()
        print(f"step {step}", flush=True)
    if args.die_behind_gpu_work:
        loss = model(torch.randn(32, args.width, device=args.device)).pow(2).mean()
        torch.cuda._sleep(20 * 10**9)  # ~10 s of GPU clock cycles ahead of the backward kernels
        loss.backward()  # the hooks queue the staging copies and announce them without waiting
        print("queued", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    trainstream.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
