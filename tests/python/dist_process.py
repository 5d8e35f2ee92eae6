"""One data-parallel rank started by torch.multiprocessing.spawn for test_distributed.py: a gloo process
group over a file store and no torchrun variables; trainstream.wrap finds the ranks, the job name and the
daemon through the group. Trains its half of each batch and saves what it ended with."""

import os
import socket

import torch
from rank_process import batch, make_model

import trainstream


def worker(rank: int, world: int, store: str, addresses: list[str | None], steps: int, accumulation_steps: int,
           max_grad_norm: float | None, out: str, hosts: list[str] | None = None) -> None:
    """`addresses`: each rank's daemon ($TRAINSTREAM_ADDRESS; None: find or start one); `hosts`: each
    rank's host name, standing in for separate machines (the ranks then form nodes by them)."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK",
                 "TRAINSTREAM_PEERS", "TRAINSTREAM_NODE_RANK"):
        os.environ.pop(name, None)
    if addresses[rank]:
        os.environ["TRAINSTREAM_ADDRESS"] = addresses[rank]
    if hosts:
        socket.gethostname = lambda: hosts[rank]
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = make_model(seed=100 + rank)  # every rank starts elsewhere: rank 0's weights must win
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    model, opt = trainstream.wrap(model, opt, accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
    r = trainstream._wrap._rank_of(model)
    for step in range(steps):
        for micro in range(accumulation_steps):
            x, y = batch(step * accumulation_steps + micro)
            shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
    opt.synchronize()
    job = next(j for j in r.client.stats()["jobs"] if j["name"] == r.job)
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "job": r.job,
                "world_size": job["world_size"], "socket": r.client.socket_path, "dp": opt._dp is not None},
               os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
