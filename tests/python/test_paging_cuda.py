"""Weight paging on the GPU, through both transports: paged training equals unpaged bit for bit, and
the paged blocks' weights are never all on the GPU. Skipped without CUDA; these run on the GPU machine
(scripts/device_run.sh). The CPU suite (test_paging.py) covers the planning and the mechanism."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 256


@pytest.fixture(autouse=True, params=["cuda-ipc", "cuda-client-copy"])
def transport(request, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_TRANSPORT", request.param)
    return request.param


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class GPT(nn.Module):
    def __init__(self, width=64, layers=6, dtype=torch.float32, ckpt=False):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.ckpt = ckpt
        self.to(dtype)

    def forward(self, tokens):
        x = self.wte(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return F.cross_entropy(F.linear(self.ln(x), self.wte.weight).float().flatten(0, 1), tokens.flatten())


def tokens(step):
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randint(0, VOCAB, (4, 32), device="cuda", generator=g)


def train(client, make, paged, steps=10, autocast=False, accumulation_steps=1, **options):
    torch.manual_seed(0)
    model = make()  # on the CPU: wrap's device= moves what stays resident
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = trainstream.wrap(model, opt, client=client, device="cuda", param_offload=paged, seed=1,
                                  accumulation_steps=accumulation_steps, **options)
    losses = []
    for step in range(steps):
        for micro in range(accumulation_steps):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(tokens(step * accumulation_steps + micro))
            loss.backward()
            losses.append(loss.item())
        opt.step()
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    trainstream.unwrap(model)
    return losses, weights


@pytest.mark.parametrize("case", [
    dict(make=GPT, autocast=True),
    dict(make=lambda: GPT(dtype=torch.bfloat16), moment_dtype="bfloat16"),
    dict(make=GPT, max_grad_norm=0.05),
    dict(make=GPT, accumulation_steps=4),
    dict(make=lambda: GPT(ckpt=True), autocast=True),
], ids=["fp32-autocast", "bf16-bf16moments", "clipping", "accumulation", "checkpoint"])
def test_paged_equals_unpaged_on_the_gpu(client, case):
    case = dict(case)
    make = case.pop("make")
    unpaged = train(client, make, False, **case)
    paged = train(client, make, True, **case)
    assert paged[0] == unpaged[0]
    for k in unpaged[1]:
        assert torch.equal(paged[1][k], unpaged[1][k]), k


@pytest.mark.parametrize("case", [dict(make=GPT), dict(make=GPT, max_grad_norm=0.05),
                                  dict(make=lambda: GPT(ckpt=True))], ids=["plain", "clipping", "checkpoint"])
def test_fp32_linears_paged_in_bf16_equal_unpaged_fp32_under_autocast(client, case):
    """page_dtype="bfloat16": the blocks' Linear weights cross PCIe in bf16, as autocast computes with them."""
    case = dict(case)
    make = case.pop("make")
    unpaged = train(client, make, False, autocast=True, **case)
    paged = train(client, make, True, autocast=True, page_dtype="bfloat16", **case)
    assert paged[0] == unpaged[0]
    for k in unpaged[1]:
        assert paged[1][k].dtype == torch.float32 and torch.equal(paged[1][k], unpaged[1][k]), k


def test_activation_paging_and_weight_paging_together(client):
    def step_with_activation_paging(model, opt, step):
        with trainstream.activation_paging(min_bytes=1024):
            loss = model(tokens(step))
        loss.backward()
        opt.step()
        return loss.item()

    results = []
    for paged in (False, True):
        torch.manual_seed(0)
        model = GPT()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), client=client,
                                      device="cuda", param_offload=paged, seed=1)
        results.append([step_with_activation_paging(model, opt, s) for s in range(5)])
        trainstream.unwrap(model)
    assert results[0] == results[1]


def test_paged_blocks_never_fill_the_gpu(client, transport):
    """Eight blocks of 25 MB, three slots: what wrap() allocates on the GPU is the pool of three block
    slots, the resident weights and the placeholders, not eight blocks; unwrap() gives the pool back.
    Measured from what the process held before wrap(), which says nothing about paging: earlier tests
    leave memory torch keeps for the process (71 MB before this test on the H200, cuBLAS's workspaces
    likely among it)."""
    torch.manual_seed(0)
    model = GPT(width=1024, layers=8)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    resident_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                         if not name.startswith("blocks."))  # the embedding (tied head) and the last LayerNorm
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), client=client,
                                  device="cuda", param_offload=True, page_prefetch=2)
    try:
        torch.cuda.synchronize()
        pager = trainstream._wrap._rank_of(model).pager
        pool_bytes = pager.pool.numel()
        assert pager.slot_bytes == block_bytes and pool_bytes == 3 * block_bytes  # prefetch 2: 3 slots
        del pager  # the test keeps no reference to the pool (unwrap must free it)
        # The resident weights are in torch's memory with cuda-client-copy; cuda-ipc moves them into its
        # flat buffer, allocated outside torch (as are its staging slots). One placeholder (one element,
        # 512 bytes as the allocator rounds it) stands for every paged fp32 parameter that is not loaded.
        # The allocator may hand the pool a cached block up to 1 MiB larger than asked (it splits only
        # a larger rest), hence the tolerance.
        expected = pool_bytes + (resident_bytes if transport == "cuda-client-copy" else 0) + 512
        base = torch.cuda.memory_allocated()
        assert 0 <= base - before - expected < 1 << 20, (before, base, expected)
        torch.cuda.reset_peak_memory_stats()
        for step in range(2):
            model(tokens(step)).backward()
            opt.step()
        torch.cuda.synchronize()
        # beyond the pool: a block's gradients in flight (two with cuda-client-copy, whose copies
        # release them later), activations, the embedding's gradient
        assert torch.cuda.max_memory_allocated() - base < 3 * block_bytes
    finally:
        gc.disable()  # what unwrap() releases it releases itself, not a garbage collection
        try:
            trainstream.unwrap(model)
            torch.cuda.synchronize()
            left = torch.cuda.memory_allocated() - before
        finally:
            gc.enable()
    # Left after unwrap(): the resident weights, now in torch's memory, and the optimizer's moments of
    # them (two of their size); the paged weights came back on the CPU.
    assert left <= 3 * resident_bytes + (1 << 20), (left, resident_bytes)


def test_a_model_on_the_gpu_releases_its_paged_blocks(client):
    torch.manual_seed(0)
    model = GPT(width=1024, layers=8).cuda()
    blocks_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), client=client,
                                  param_offload=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before - 0.5 * blocks_bytes
    model(tokens(0)).backward()
    opt.step()
    trainstream.unwrap(model, device="cuda")
    assert all(p.is_cuda and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
