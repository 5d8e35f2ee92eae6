"""What used to be accepted and then went silently wrong (issue 21, "Unclear or silently different
from torch"): each is now refused at the call, naming the argument and what is allowed, and a refused
optimizer state load changes nothing."""

from __future__ import annotations

import pytest
import torch

import trainstream
from trainstream import TrainstreamError


def two_layers():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(model, opt, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def same_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in ("step", "exp_avg", "exp_avg_sq"))


def test_a_refused_state_load_changes_nothing(client):
    model = two_layers()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client)
    train(model, opt, 2)
    before = opt.state_dict()
    weights = [p.detach().clone() for p in model.parameters()]
    other = two_layers()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    train(other, other_opt, 5)  # moments and steps unlike the wrapped job's
    bad = other_opt.state_dict()
    last = max(bad["state"])
    bad["state"][last]["exp_avg_sq"] = torch.zeros(3)  # only the last parameter's is wrong
    with pytest.raises(TrainstreamError, match=f"state of parameter {last}: exp_avg_sq has shape \\(3,\\)"):
        opt.load_state_dict(bad)
    assert same_state(opt.state_dict(), before)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_an_sgd_state_dict_is_named_as_such(client):
    model = two_layers()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    sgd = torch.optim.SGD(two_layers().parameters(), lr=0.1, momentum=0.9)
    for p in sgd.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    sgd.step()
    with pytest.raises(TrainstreamError, match="has \\['momentum_buffer'\\] but no "
                       "\\['step', 'exp_avg', 'exp_avg_sq'\\]: not the state of torch.optim.AdamW or Adam"):
        opt.load_state_dict(sgd.state_dict())


def test_step_twice_after_one_backward_is_refused(client):
    model = two_layers()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    opt.step()  # before any backward: nothing to do, as in torch
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(TrainstreamError, match="optimizer.step\\(\\) ran again with no backward\\(\\) since the last"):
        opt.step()
    model(torch.randn(2, 4)).sum().backward()  # and training goes on
    opt.step()


class OwnStep(torch.optim.AdamW):
    def step(self, closure=None):  # would clip, log, ... and never run
        return super().step(closure)


class SameStep(torch.optim.AdamW):
    pass


def test_an_adamw_subclass_with_its_own_step_is_refused(client):
    model = two_layers()
    with pytest.raises(TrainstreamError, match="OwnStep overrides step\\(\\) \\(in OwnStep\\), which would never run"):
        trainstream.wrap(model, OwnStep(model.parameters()), client=client)
    model, opt = trainstream.wrap(model, SameStep(model.parameters()), client=client)  # torch's own step: fine
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_an_optimizer_over_another_models_parameters_is_refused(client):
    model, other = two_layers(), two_layers()
    with pytest.raises(TrainstreamError, match="param group 0 holds a parameter of shape \\(8, 4\\) that is not a "
                                               "parameter of the model"):
        trainstream.wrap(model, torch.optim.AdamW(other.parameters()), client=client)


def test_two_wrapped_models_sharing_a_parameter_are_refused(client):
    shared = torch.nn.Linear(4, 4)
    first, second = torch.nn.Sequential(shared, torch.nn.Linear(4, 2)), torch.nn.Sequential(shared)
    trainstream.wrap(first, torch.optim.AdamW(first.parameters()), client=client, job="first")
    with pytest.raises(TrainstreamError, match="already trained by another wrapped model \\(job 'first'\\)"):
        trainstream.wrap(second, torch.optim.AdamW(second.parameters()), client=client)
    trainstream.unwrap(first)
    client.drop_job("first")


@pytest.mark.parametrize("bucket_mb", [float("inf"), float("nan"), -1, 0, 1e18, "32"])
def test_bucket_mb_outside_its_range_is_refused(client, bucket_mb):
    model = two_layers()
    with pytest.raises(TrainstreamError, match="bucket_mb must be a number of MiB in \\[0.00390625, 1048576\\]"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, bucket_mb=bucket_mb)


def test_world_size_zero_and_an_empty_job_name_are_refused(client):
    model = two_layers()
    with pytest.raises(TrainstreamError, match="world_size must be an integer >= 1"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, world_size=0, job="zero")
    with pytest.raises(TrainstreamError, match="job must be a non-empty string"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job="")


@pytest.mark.parametrize("option, value, named", [
    ("page_prefetch", 1.5, "page_prefetch must be an integer"), ("page_prefetch", float("nan"), "page_prefetch"),
    ("page_prefetch", "2", "page_prefetch"), ("page_prefetch", None, "page_prefetch"),
    ("page_prefetch", 10**9, "page_prefetch"), ("page_prefetch", True, "page_prefetch"),
    ("page_pool_mb", float("nan"), "page_pool_mb"), ("page_pool_mb", float("inf"), "page_pool_mb"),
    ("page_pool_mb", "x", "page_pool_mb"), ("page_pool_mb", 0, "page_pool_mb"),
    ("wait_timeout", "10", "wait_timeout"), ("wait_timeout", float("nan"), "wait_timeout"),
    ("seed", -1, "seed"), ("seed", 2**64, "seed"), ("seed", "x", "seed"),
    ("param_offload", [], "param_offload"),
])
def test_odd_option_values_are_refused_naming_the_option(client, option, value, named):
    """Issue 46's odd values: refused at wrap(), with or without paging, naming the option; nothing is sized
    from them first."""
    model = two_layers()
    with pytest.raises(TrainstreamError, match=named):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, **{option: value})


def test_page_prefetch_zero_without_a_pool_names_page_prefetch(client):
    model = two_layers()
    with pytest.raises(TrainstreamError, match="raise page_prefetch"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu",
                         param_offload=True, blocks=[model[0], model[2]], page_prefetch=0)


def test_a_pool_bigger_than_the_paged_blocks_holds_them_all(client):
    model = two_layers()
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu",
                                param_offload=True, blocks=[model[0], model[2]], page_prefetch=1024)
    assert len(trainstream._wrap._rank_of(model).pager.in_slot) == 2
