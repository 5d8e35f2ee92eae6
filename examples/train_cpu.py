"""Trains a small MLP on the CPU through trainstreamd, with a progress bar of loss, steps/s and memory.

    python3 examples/train_cpu.py [--steps 200] [--device cpu|cuda]

With no daemon running, trainstream.wrap() starts a private one for this process. The progress bar is
tqdm's (`pip install tqdm`, or the package's `examples` extra).
"""

import argparse
import os

import torch
from tqdm import tqdm

import trainstream


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(device: str) -> str:
    """This process's memory: the GPU's allocated bytes on CUDA, the resident set on the CPU."""
    if device.startswith("cuda"):
        return f"{torch.cuda.memory_allocated(device) / 2**20:.0f} MiB GPU"
    return f"{rss_bytes() / 2**20:.0f} MiB RSS"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, 1)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = trainstream.wrap(model, optimizer, max_grad_norm=1.0)
    # Schedulers go on the optimizer wrap() returns (it shares the param groups).
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    target = torch.nn.Sequential(torch.nn.Linear(64, 1)).to(args.device)  # a function to learn
    bar = tqdm(range(1, args.steps + 1), unit=" steps", desc="train")  # tqdm's rate: steps/s
    for step in bar:
        x = torch.randn(256, 64, device=args.device)
        with torch.no_grad():
            y = torch.sin(target(x))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or step == args.steps:  # loss.item() waits for the step: not every one
            bar.set_postfix(loss=f"{loss.item():.5f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", mem=memory(args.device))
    bar.close()
    trainstream.synchronize()

    client = trainstream.connect()
    stats = client.stats()
    params = sum(p.numel() for p in model.parameters())
    rss = rss_bytes()
    print(f"final loss {loss.item():.5f}; {params / 1e6:.2f}M parameters; "
          f"optimizer state in trainstreamd: {stats['host_bytes'] / 2**20:.1f} MiB "
          f"(daemon RSS {stats['rss_bytes'] / 2**20:.1f} MiB, kernel {stats['kernel']}); "
          f"this process RSS {rss / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
