"""Speculative clipping through a real daemon (issue 18): with max_grad_norm and two state halves each
bucket's update starts before the global norm is known and is redone from the committed half when
the step clips. Results must equal clip_grad_norm_ + AdamW as without speculation, bit for bit."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import trainstream
from trainstream import TrainstreamError

STEPS = 20
MAX_NORM = 1.0


def mlp():
    """Several buckets of 4 KiB (the least bucket_mb allows)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 8))


def adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, **kw)


def loss_of(model, step: int) -> torch.Tensor:
    """Steps 0, 3, 6, ... have gradients about 30 times larger: their norm is over MAX_NORM."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), y) * (30.0 if step % 3 == 0 else 0.3)


def bits(model) -> list[torch.Tensor]:
    return [p.detach().clone().view(torch.int32) for p in model.parameters()]


def job(client, name):
    return next(j for j in client.stats()["jobs"] if j["name"] == name)


def train(client, name, model, steps=range(STEPS), loss=loss_of, **options):
    """One backward pass a step, said (counted, the first step's update would wait for its optimizer.step())."""
    model, opt = trainstream.wrap(model, adamw(model), client=client, job=name, max_grad_norm=MAX_NORM,
                                  bucket_mb=4096 / (1 << 20), accumulation_steps=1, **options)
    for step in steps:
        loss(model, step).backward()
        opt.step()
    trainstream.synchronize(model)
    return model


def test_speculation_equals_clip_grad_norm_and_adamw_bit_for_bit(client):
    start = mlp()
    reference, clipped = copy.deepcopy(start), 0
    ref_opt = adamw(reference, foreach=False)
    for step in range(STEPS):
        loss_of(reference, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        clipped += MAX_NORM / (float(norm) + 1e-6) < 1
        ref_opt.step()
        ref_opt.zero_grad()
    assert 0 < clipped < STEPS  # clipping triggers on some steps and not on others

    speculating = train(client, "speculating", copy.deepcopy(start), speculative_clipping=True)
    waiting = train(client, "waiting", copy.deepcopy(start), speculative_clipping=False)
    assert all(torch.equal(a, b) for a, b in zip(bits(speculating), bits(waiting)))
    assert max((p - q).abs().max().item() for p, q in zip(speculating.parameters(), reference.parameters())) <= 1e-6

    spec, wait = job(client, "speculating"), job(client, "waiting")
    assert spec["state_halves"] == 2 and spec["speculative_clipping"]
    assert spec["speculative_steps"] == STEPS and spec["redone_steps"] == clipped
    assert not wait["speculative_clipping"] and wait["speculative_steps"] == wait["redone_steps"] == 0


def test_nonfinite_gradients_under_speculation_behave_as_without(client):
    def loss(model, step):
        value = loss_of(model, step)
        return value * math.nan if step == 2 else value

    start = mlp()
    speculating = train(client, "nan-speculating", copy.deepcopy(start), range(5), loss, speculative_clipping=True)
    waiting = train(client, "nan-waiting", copy.deepcopy(start), range(5), loss, speculative_clipping=False)
    assert all(torch.equal(a, b) for a, b in zip(bits(speculating), bits(waiting)))
    # As torch: a NaN norm makes every weight NaN, so every later step's gradients are NaN too.
    assert job(client, "nan-speculating")["nonfinite_steps"] == job(client, "nan-waiting")["nonfinite_steps"] == 3
    assert job(client, "nan-speculating")["redone_steps"] >= 1  # the step was not committed as speculated


def test_auto_speculates_where_the_job_has_two_halves_and_clips(client):
    train(client, "auto-clipping", mlp(), range(2))
    assert job(client, "auto-clipping")["speculative_clipping"]
    model = mlp()  # the loop's clip_grad_norm_ may clip any step: its updates run before it says
    model, opt = trainstream.wrap(model, adamw(model), client=client, job="auto-plain")
    assert job(client, "auto-plain")["state_halves"] == 2 and job(client, "auto-plain")["speculative_clipping"]
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model), client=client, job="one-half", max_grad_norm=MAX_NORM,
                                  state_halves=1)
    assert job(client, "one-half")["state_halves"] == 1 and not job(client, "one-half")["speculative_clipping"]


@pytest.mark.parametrize("options, match", [
    ({"speculative_clipping": True, "state_halves": 1}, "speculative_clipping=True needs state_halves=2"),
    ({"speculative_clipping": "yes"}, "speculative_clipping must be 'auto', True or False, not 'yes'"),
    ({"state_halves": 3}, "state_halves must be 'auto', 1 or 2, not 3"),
    ({"state_halves": True}, "state_halves must be 'auto', 1 or 2, not True"),
])
def test_bad_options_are_refused_naming_them(client, options, match):
    model = mlp()
    options = {"max_grad_norm": MAX_NORM, **options}
    with pytest.raises(TrainstreamError, match=match):
        trainstream.wrap(model, adamw(model), client=client, **options)
