"""wrap's automatic modes and conversions on the GPU, through both transports (test_cuda's fixture):
offload="auto" switching to torch's fused CUDA AdamW (and not, under a per-process memory cap), .half() and
.cuda() after wrap, activation_offload="auto" and param_offload="auto" deciding from torch's counters and
the driver's figures, and examples/verify_ram_offload.py. Skipped without CUDA; these run on the GPU
machine."""

from __future__ import annotations

import copy
import gc
import logging
import os
import subprocess
import sys
import weakref

import pytest
import torch
from test_cuda import HERE, batch, mlp, transport  # noqa: F401  (transport: the autouse fixture)

import trainstream

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)


def train(model, opt, steps, first=0, dtype=torch.float32):
    for step in range(first, first + steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def max_difference(a, b):
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_offload_auto_switches_to_fused_cuda_adamw(client, caplog):
    caplog.set_level(logging.INFO, logger="trainstream")
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    ref_opt = adamw(reference.parameters(), foreach=False)
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, offload="auto")
    rank = weakref.ref(trainstream._wrap._rank_of(model))
    train(model, opt, 20)
    train(reference, ref_opt, 20)
    assert not opt.offloaded and all(g["fused"] for g in opt.param_groups)
    assert all(t.is_cuda for s in opt.stock.state.values() for t in s.values())  # step tensors too (fused)
    assert max_difference(model, reference) <= 1e-5
    assert client.stats()["jobs"] == []
    gc.collect()
    assert rank() is None  # the Rank and its transport's GPU buffers are gone
    assert any("switches to torch.optim.AdamW(fused=True) on cuda:0" in r.getMessage() for r in caplog.records)
    trainstream.unwrap(model)


def test_offload_auto_keeps_offloading_under_a_cap(client, caplog):
    caplog.set_level(logging.INFO, logger="trainstream")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(200 * 2**20 / total)  # below the 256 MiB reserve of the decision
    try:
        model = mlp()
        model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, offload="auto")
        train(model, opt, 3)
        assert opt.offloaded
        assert any("keeps offloading" in r.getMessage() and "per-process memory fraction" in r.getMessage()
                   for r in caplog.records)
        trainstream.unwrap(model)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_half_after_wrap_keeps_the_fp32_master_weights(client):
    torch.manual_seed(0)
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client)
    train(model, opt, 3)
    # The third update may still be running (cuda-ipc waits for nothing after optimizer.step()): the
    # committed state read now can be the second step's, while .half() waits for the third.
    trainstream.synchronize(model)
    rank = trainstream._wrap._rank_of(model)
    master = [rank.regions.master_view(i).clone() for i in range(len(rank.params))]
    model.half()
    rank = trainstream._wrap._rank_of(model)
    for i, p in enumerate(rank.params):
        assert p.dtype == torch.float16 and p.is_cuda
        assert torch.equal(rank.regions.master_view(i), master[i])
        assert torch.equal(p.detach().cpu(), master[i].half())
        assert rank.regions.param_step(i) == 3  # no update lost or added by the conversion
    train(model, opt, 3, first=3, dtype=torch.float16)
    trainstream.unwrap(model)


def test_a_cpu_model_moved_to_the_gpu_after_wrap(client):
    torch.manual_seed(0)
    model = mlp().cpu()
    reference = copy.deepcopy(model).cuda()
    ref_opt = adamw(reference.parameters(), foreach=False)
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client)
    model.cuda()
    assert trainstream._wrap._rank_of(model).transport.name == os.environ["TRAINSTREAM_TRANSPORT"]
    train(model, opt, 5)
    train(reference, ref_opt, 5)
    # The fifth step's weights reach the parameters at the next forward or synchronize(): with
    # cuda-client-copy this process copies them in, so until then they hold the fourth step's (cuda-ipc's
    # daemon pushes them on its own, and had by the time it was read).
    trainstream.synchronize(model)
    assert max_difference(model, reference) <= 1e-5
    trainstream.unwrap(model)


def test_activation_offload_auto_pages_none_with_room_and_all_without(client, memory_budget):
    def run(mib):
        memory_budget(mib)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, activation_offload="auto")
        for step in range(3):
            model(torch.randn(512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))) \
                .pow(2).mean().backward()
            opt.step()
        watch = trainstream._wrap._wrapped_of(model).activations
        trainstream.unwrap(model)
        return watch, [p.detach().clone() for p in model.parameters()]

    roomy, tight = run(1 << 20), run(1)
    assert roomy[0].saved > 0 and roomy[0].max_bytes == 0
    assert tight[0].max_bytes == tight[0].saved
    assert all(torch.equal(a, b) for a, b in zip(roomy[1], tight[1]))  # activation paging is exact


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(6))
        self.head = torch.nn.Linear(512, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_param_offload_auto_pages_the_first_blocks_beyond_half_the_budget(client, memory_budget):
    def gpt():
        torch.manual_seed(0)
        return Stack()

    block = 512 * 513 * 4
    memory_budget(2 * 2 * block / 2**20)  # half of it holds 2 blocks: the first 4 page

    def run(**options):
        model = gpt()
        model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, device="cuda", **options)
        paged = trainstream._wrap._rank_of(model).paging
        for step in range(3):
            model(torch.randn(8, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(step))) \
                .pow(2).mean().backward()
            opt.step()
        trainstream.unwrap(model, device="cuda")
        return paged, [p.detach().clone() for p in model.parameters()]

    paged, weights = run(param_offload="auto")
    assert [b.index for b in paged.blocks] == [0, 1, 2, 3]
    assert all(torch.equal(a, b) for a, b in zip(weights, run()[1]))


def test_verify_ram_offload_passes_on_the_gpu(daemon):
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "verify_ram_offload.py")
    run = subprocess.run([sys.executable, example, "--device", "cuda"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRAINSTREAM_ADDRESS=daemon.socket))
    assert run.returncode == 0 and run.stdout.splitlines()[-1] == "PASS", run.stdout + run.stderr
    assert sum(line.startswith("[ok]") for line in run.stdout.splitlines()) == 4
