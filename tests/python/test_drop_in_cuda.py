"""The one line on the GPU: a small GPT trained the nanoGPT way (micro-batches, clip_grad_norm_, autocast in
bf16, or in fp16 with a GradScaler whose first scale overflows, compiled or not), wrapped with nothing but
`trainstream.wrap(model, optimizer)`, against the same loop with torch.optim.AdamW on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import trainstream

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 20
MICRO = 2


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=128, width=64, heads=4, layers=2, block=32):
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(block, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"ln1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
                                 "proj": torch.nn.Linear(width, width), "ln2": torch.nn.LayerNorm(width),
                                 "up": torch.nn.Linear(width, 4 * width), "down": torch.nn.Linear(4 * width, width)})
            for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, tokens, targets):
        b, t = tokens.shape
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + blk["proj"](y)
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        logits = F.linear(self.ln(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, 128, (4, 33), generator=g).cuda()
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizer, dtype, scaler, forward):
    losses, scales = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            with torch.autocast("cuda", dtype=dtype):
                loss = forward(*batch(step, micro)) / MICRO
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-scaler"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_nanogpt_loop_on_the_gpu(dtype, compiled):
    torch.manual_seed(0)
    plain = TinyGPT().cuda()
    wrapped = copy.deepcopy(plain)
    fp16 = dtype == torch.float16

    def scaler():  # 2^24 overflows fp16 in the first steps: skipped steps and backoff, then growth
        return torch.amp.GradScaler("cuda", init_scale=2.0 ** 24, growth_interval=4) if fp16 else None

    torch._dynamo.reset()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    losses, scales = train(plain, plain_opt, dtype, scaler(), torch.compile(plain) if compiled else plain)
    wrapped, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3))
    torch._dynamo.reset()
    losses_wrapped, scales_wrapped = train(wrapped, optimizer, dtype, scaler(),
                                           torch.compile(wrapped) if compiled else wrapped)
    trainstream.synchronize(wrapped)
    if fp16:
        assert scales_wrapped == scales and min(scales) < 2.0 ** 24  # the same skips and backoffs
    assert losses_wrapped == pytest.approx(losses, rel=1e-4)
    difference = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), wrapped.parameters()))
    assert difference < 1e-5
    trainstream.unwrap(wrapped)
