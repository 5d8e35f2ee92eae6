"""Trains a GPT whose weights do not fit under a GPU memory cap, by paging its blocks from host memory.

The model is built on the CPU (it never exists whole on the GPU), the cap is set with
torch.cuda.set_per_process_memory_fraction, and trainstream.wrap(..., device="cuda",
param_offload=True) keeps the block stack's weights in the daemon's host memory, bringing them to the
GPU a few blocks at a time. At the end it prints where the memory lives.

    python3 examples/train_bigger_than_vram.py                      # 1.86B GPT, 4 GiB cap
    python3 examples/train_bigger_than_vram.py --layers 12 --width 768 --cap-gib 0.5 --steps 20
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream
from trainstream._losses import chunked_cross_entropy  # trainstream.chunked_cross_entropy

GIB = 1 << 30


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int = 50304, context: int = 1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight"))
                                else 0.02)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:  # activations recomputed in backward: only each block's input is kept
            x = checkpoint(block, x, use_reentrant=False)
        # The tied output projection and the loss in chunks of tokens: the logits never exist whole.
        return chunked_cross_entropy(self.ln(x), self.wte.weight, targets, chunk_size=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=35)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="GPU memory this process may use (torch's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU (see examples/train_cpu.py for the CPU)")
    from tqdm import tqdm

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    torch.manual_seed(0)
    model = GPT(args.layers, args.width, args.heads)  # on the CPU
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {weights / GIB:.1f} GiB of fp32 "
          f"weights, under a {args.cap_gib:g} GiB GPU cap")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = trainstream.wrap(model, optimizer, device="cuda", param_offload=True,
                                        moment_dtype="bfloat16", max_grad_norm=1.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    bar = tqdm(range(args.steps), unit="step")
    start = time.perf_counter()
    for step in bar:
        tokens = torch.randint(0, 50304, (args.batch, args.seq + 1), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", steps_per_s=f"{(step + 1) / (time.perf_counter() - start):.2f}",
                        gpu_gib=f"{torch.cuda.max_memory_allocated() / GIB:.2f}")
    trainstream.synchronize(model)

    rank = trainstream._wrap._rank_of(model)
    stats = trainstream.connect().stats()
    free, device_total = torch.cuda.mem_get_info()
    print("where the memory lives:")
    print(f"  GPU, torch's allocator (peak): {torch.cuda.max_memory_allocated() / GIB:.2f} GiB "
          f"(of it the paging pool: {rank.pager.pool.numel() / GIB:.2f} GiB, {len(rank.pager.in_slot)} blocks)")
    print(f"  GPU, buffers outside torch:    {getattr(rank.transport, 'device_bytes', 0) / GIB:.2f} GiB")
    print(f"  GPU, whole device now:         {(device_total - free) / GIB:.2f} GiB (every process, CUDA contexts "
          "included)")
    print(f"  host, page-locked by this process for paging: {rank.pager.pins.bytes / GIB:.2f} GiB"
          if rank.pager.pins else "  host, page-locked for paging: none")
    print(f"  host, the daemon's segments (weights, moments, gradients): {stats['host_bytes'] / GIB:.2f} GiB "
          f"(daemon RSS {stats['rss_bytes'] / GIB:.2f} GiB)")
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(f"  this process's RSS: {rss / GIB:.2f} GiB")
    trainstream.unwrap(model)


if __name__ == "__main__":
    main()
