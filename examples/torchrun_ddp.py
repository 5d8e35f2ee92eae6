"""Data-parallel training of one node's ranks through one trainstreamd, started with torchrun:

    trainstreamd --socket /tmp/ts.sock &            # one daemon for the node
    TRAINSTREAM_ADDRESS=/tmp/ts.sock torchrun --standalone --nproc-per-node=4 examples/torchrun_ddp.py

Each rank trains on its shard of every batch; the daemon sums the ranks' gradients inside the update,
keeps one copy of the optimizer state for the node, and sends the new weights to every rank. Do not
wrap the model in DistributedDataParallel: trainstream does the averaging. Ranks and the job name come
from torchrun's environment (LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID). Rank 0 shows a tqdm
progress bar with the loss, steps/s and its memory (`pip install tqdm`, or the package's `examples` extra).
"""

import os

import torch
from tqdm import tqdm

import trainstream


def memory(device: str) -> str:
    """This rank's memory: the GPU's allocated bytes on CUDA, the resident set on the CPU."""
    if device.startswith("cuda"):
        return f"{torch.cuda.memory_allocated(device) / 2**20:.0f} MiB GPU"
    return f"{int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB RSS"


def main() -> None:
    rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(rank)  # different on purpose: every rank starts from rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).to(device)
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    bar = tqdm(range(100), unit=" steps", desc=f"rank 0 of {world}", disable=rank != 0)
    for step in bar:
        g = torch.Generator().manual_seed(step)  # every rank draws the same global batch...
        x = torch.randn(256, 64, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        shard = slice(rank * 256 // world, (rank + 1) * 256 // world)  # ...and trains on its shard
        loss = torch.nn.functional.mse_loss(model(x[shard].to(device)), y[shard].to(device))
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == 99):  # loss.item() waits for the step: not every one
            bar.set_postfix(loss=f"{loss.item():.4f}", mem=memory(device))
    bar.close()
    trainstream.synchronize()
    if rank == 0:
        print("done; optimizer state lives once in trainstreamd for all", world, "ranks")


if __name__ == "__main__":
    main()
