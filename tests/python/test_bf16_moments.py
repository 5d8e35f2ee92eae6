"""moment_dtype="bfloat16": moments stored in bf16 with stochastic rounding track fp32 moments."""

from __future__ import annotations

import copy

import torch

import trainstream


def train(client, model, moment_dtype, steps=200):
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  client=client, moment_dtype=moment_dtype, seed=1234)
    target = torch.nn.Linear(16, 4)
    torch.nn.init.normal_(target.weight)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    trainstream.unwrap(model)
    return losses, opt


def test_bf16_moments_track_fp32_loss(client):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    torch.manual_seed(1)
    fp32, _ = train(client, copy.deepcopy(model), "float32")
    torch.manual_seed(1)
    bf16, opt = train(client, copy.deepcopy(model), "bfloat16")
    tail32, tail16 = sum(fp32[-20:]) / 20, sum(bf16[-20:]) / 20
    assert tail32 < 0.5 * fp32[0]  # it learned
    assert abs(tail16 - tail32) <= 0.01 * tail32


def test_bf16_moments_state_dict_round_trip(client):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, moment_dtype="bfloat16")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert state["state"][0]["exp_avg"].dtype == torch.float32  # in the parameter's dtype, as torch keeps it
    assert state["state"][0]["exp_avg"].abs().sum() > 0
    opt.load_state_dict(state)
    again = opt.state_dict()
    assert torch.equal(again["state"][0]["exp_avg_sq"], state["state"][0]["exp_avg_sq"])
