"""benchmarks/train_gpt/hook_times.py against a real daemon: it times the hooks a trainstream step runs
on the trainer's thread (one gradient hook per parameter, a pre-hook per module with parameters, one
optimizer.step()), from the first timed step on, and leaves the training itself as it was."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import trainstream

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
from hook_times import HookTimes  # noqa: E402


def test_every_hook_of_a_step_is_timed_and_counted_from_the_reset(client):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    hooks = HookTimes(trainstream._wrap._rank_of(model))
    stock = torch.optim.AdamW(reference.parameters())
    x = torch.randn(4, 8)
    try:
        for step in range(5):
            if step == 2:
                hooks.reset()
            model(x).sum().backward()
            opt.step()
            reference(x).sum().backward()
            stock.step()
            stock.zero_grad()
    finally:
        hooks.close()
    times = hooks.per_step(3)
    assert times["gradient hooks"]["calls"] == 4  # two weights, two biases
    assert times["module pre-hooks"]["calls"] == 2  # the two Linear layers
    assert times["optimizer.step()"]["calls"] == 1
    assert times["take_published (at the forward's start)"]["calls"] == 1
    assert all(t["ms"] > 0 for t in times.values() if "ms" in t and t["calls"])
    assert times["gradient hooks"]["ms"] >= times["bucket_done (in the gradient hooks)"]["ms"]
    opt.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    trainstream.unwrap(model)
