"""A GPT of nanoGPT's shape (pre-norm blocks, tied embeddings, no biases), for the training benchmark.

`checkpoint_blocks` recomputes each block's activations in backward (torch.utils.checkpoint,
non-reentrant); `chunked_loss` computes the output projection and the loss in chunks of tokens
(trainstream.chunked_cross_entropy), so that the logits of a 50k vocabulary never exist whole.
`detached_lookup` is a probe, not training: the token lookup reads the tied weight detached, so that
the weight's gradient is the output projection's alone (train_gpt --probe-detached-lookup)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CONFIGS = {  # name: (layers, heads, width)
    "124m": (12, 12, 768),
    "1.3b": (24, 16, 2048),
    "1.86b": (35, 16, 2048),
    "3b": (32, 32, 2560),
    "5b": (40, 32, 3200),
    "7b": (32, 32, 4096),  # 6.66B parameters: LLaMA-7B's shape
    "7.05b": (34, 32, 4096),  # the smallest of this family at or above 7.0B
    "10b": (48, 40, 4096),  # 9.87B parameters
    "10.1b": (49, 32, 4096),  # 10.08B: its job (12 B/param, bf16 weights and moments) fits a 125 GiB host
    "10.3b": (50, 32, 4096),  # 10.28B: the smallest of the 4096-wide family above 10B
}


@dataclass
class GPTConfig:
    layers: int
    heads: int
    width: int
    vocab: int = 50304
    block: int = 2048


TINY = GPTConfig(layers=2, heads=4, width=128, vocab=512, block=128)  # 0.46M parameters: for the CPU


def config_of(name: str) -> GPTConfig:
    """A config by name: one of CONFIGS, or "tiny"."""
    return TINY if name == "tiny" else GPTConfig(*CONFIGS[name])


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width, bias=False)
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.proj = nn.Linear(c.width, c.width, bias=False)
        self.ln2 = nn.LayerNorm(c.width, bias=False)
        self.up = nn.Linear(c.width, 4 * c.width, bias=False)
        self.down = nn.Linear(4 * c.width, c.width, bias=False)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _init(module: nn.Module, layers: int) -> nn.Module:
    for name, p in module.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)
    return module


def lookup_without_gradient(embedding: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """The token lookup outside autograd's view of the embedding's weight: no gradient reaches it."""
    return F.embedding(tokens, embedding.weight.detach())


class GPT(nn.Module):
    def __init__(self, c: GPTConfig, dtype: torch.dtype = torch.float32, checkpoint_blocks: bool = False,
                 chunked_loss: bool = False, detached_lookup: bool = False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.chunked_loss = chunked_loss
        self.wte = nn.Embedding(c.vocab, c.width)
        self.wpe = nn.Embedding(c.block, c.width)
        # One block at a time in fp32, so that a 16-bit model never exists whole in fp32 (a 7B model
        # in fp32 would not fit under a 24 GiB cap while it is being built).
        self.blocks = nn.ModuleList(_init(Block(c), c.layers).to(dtype) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width, bias=False)
        _init(self.wte, c.layers), _init(self.wpe, c.layers)
        self.to(dtype)
        if detached_lookup:  # a probe, not training: the tied weight's gradient is the projection's alone
            self.wte.forward = functools.partial(lookup_without_gradient, self.wte)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        if self.chunked_loss:
            from trainstream._losses import chunked_cross_entropy

            return chunked_cross_entropy(self.ln(x), self.wte.weight, targets, chunk_size=1024)
        logits = F.linear(self.ln(x), self.wte.weight)  # tied output projection
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build(name: str, device: str, dtype: torch.dtype, **options) -> GPT:
    with torch.device(device):
        return GPT(config_of(name), dtype, **options)
