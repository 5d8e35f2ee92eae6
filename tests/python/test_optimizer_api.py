"""The optimizer `wrap` returns, as a torch optimizer, through the public API against real daemons (CPU):
torch's optimizer hooks (step, state_dict, load_state_dict; per optimizer and global) run once per call,
offloaded and after offload="auto" switched; optimizer.synchronize(); after trainstream.unwrap() it is a
working torch optimizer holding the state; model.to() / .half() after wrap keep the fp32 master weights
and moments exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import trainstream
from trainstream import TrainstreamError


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def loss_of(model, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, **kw)


def train(model, opt, steps, first=0, dtype=torch.float32):
    for step in range(first, first + steps):
        loss_of(model, step, dtype).backward()
        opt.step()
        opt.zero_grad()


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("offload", [True, "auto"])
def test_step_hooks_run_once_per_step(client, memory_budget, offload):
    memory_budget(1 << 20)  # "auto" switches after 2 steps
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, offload=offload)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o.offloaded)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.offloaded)))
    everywhere = register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append("all"))
    try:
        train(model, opt, 4)
    finally:
        everywhere.remove()
    offloaded = [True] * 4 if offload is True else [True, True, False, False]
    # The post hook of the step that switched sees the optimizer already in torch.
    after = offloaded if offload is True else [True, False, False, False]
    assert calls == [c for pre, post_ in zip(offloaded, after) for c in (("pre", pre), ("post", post_), "all")]
    post.remove()
    calls.clear()
    train(model, opt, 1, first=10)
    assert calls == [("pre", offload is True)]
    trainstream.unwrap(model)


@pytest.mark.parametrize("offload", [True, "auto"])
def test_state_dict_hooks(client, memory_budget, offload):
    memory_budget(1 << 20)
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, offload=offload)
    train(model, opt, 3)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(sd.pop("extra")))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    state = opt.state_dict()
    assert state["extra"] == 1 and seen == ["sd-pre"]
    opt.load_state_dict(state)
    assert seen == ["sd-pre", 1, "load-post"]
    trainstream.unwrap(model)


def test_optimizer_synchronize_shows_the_latest_weights(client):
    model = mlp()
    reference = copy.deepcopy(model)
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client)
    ref_opt = adamw(reference.parameters(), foreach=False)
    train(model, opt, 3)
    train(reference, ref_opt, 3)
    opt.synchronize()
    assert not trainstream._wrap._rank_of(model).reads.stale
    assert max_difference(model, reference) <= 1e-6
    trainstream.unwrap(model)


@pytest.mark.parametrize("offload", [True, "auto", False])
def test_unwrap_leaves_a_working_torch_optimizer_holding_the_state(client, memory_budget, offload):
    memory_budget(1 << 20)
    model = mlp()
    reference = copy.deepcopy(model)
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, offload=offload, job="kept")
    ref_opt = adamw(reference.parameters(), foreach=False)
    train(model, opt, 4)
    train(reference, ref_opt, 4)
    trainstream.unwrap(model)
    assert not opt.offloaded and isinstance(opt.stock, torch.optim.AdamW)
    train(model, opt, 4, first=4)  # torch's own semantics now: zero_grad() clears the gradients
    train(reference, ref_opt, 4, first=4)
    assert max_difference(model, reference) <= 1e-6
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {8.0}
    if offload is True:  # a named job stays in the daemon for resuming
        assert [j["name"] for j in client.stats()["jobs"]] == ["kept"]
        client.drop_job("kept")


def test_a_job_can_be_dropped_as_soon_as_unwrap_returns(client):
    """unwrap() returns once the daemon has detached the rank: a drop right after it used to find the
    rank still attached, now and then."""
    for _ in range(50):
        model = mlp()
        model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, job="unwrapped")
        train(model, opt, 1)
        trainstream.unwrap(model)
        client.drop_job("unwrapped")


def test_half_after_wrap_keeps_the_fp32_master_weights_and_moments(client):
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, job="converted")
    train(model, opt, 3)
    opt.synchronize()  # the third update may still be running: read the state after it
    rank = trainstream._wrap._rank_of(model)
    master = [rank.regions.master_view(i).clone() for i in range(len(rank.params))]
    moments = [torch.stack(rank.regions.moment_views(i)).clone() for i in range(len(rank.params))]
    params = list(model.parameters())
    assert model.half() is model
    assert all(p is q and p.dtype == torch.float16 for p, q in zip(model.parameters(), params))  # same objects
    rank = trainstream._wrap._rank_of(model)
    for i, p in enumerate(rank.params):
        assert torch.equal(rank.regions.master_view(i), master[i])  # fp32, unchanged
        assert torch.equal(torch.stack(rank.regions.moment_views(i)), moments[i])
        assert torch.equal(p.detach(), master[i].half())
        assert rank.regions.param_step(i) == 3
    train(model, opt, 2, first=3, dtype=torch.float16)  # trains on in fp16, from the fp32 master weights
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {5.0}
    model.float()
    rank = trainstream._wrap._rank_of(model)
    assert all(torch.equal(p.detach(), rank.regions.master_view(i)) for i, p in enumerate(rank.params))
    assert [j["name"] for j in client.stats()["jobs"]] == ["converted"]
    trainstream.unwrap(model)
    client.drop_job("converted")


def test_to_half_through_a_submodule_trains_like_an_fp16_layer(client):
    """Converting part of the model: the job takes mixed dtypes, as wrapping such a model would (its
    weights are fp16 values from the start, so that both jobs' fp32 master weights agree)."""
    model = mlp()
    with torch.no_grad():
        for p in model[2].parameters():
            p.copy_(p.half())
    reference = copy.deepcopy(model)
    reference[2].half()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client)
    model[2].to(torch.float16)
    assert [p.dtype for p in model.parameters()] == [torch.float32, torch.float32, torch.float16, torch.float16]
    plain, plain_opt = trainstream.wrap(reference, adamw(reference.parameters()), client=client)
    for step in range(3):
        for m, o in ((model, opt), (plain, plain_opt)):
            m[2](m[1](m[0](torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))).half()).float().sum() \
                .backward()
            o.step()
    trainstream.synchronize(model)
    trainstream.synchronize(plain)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    trainstream.unwrap(model)
    trainstream.unwrap(plain)


def test_converting_paged_weights_is_refused(client):
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client, device="cpu", param_offload=True,
                                  blocks=[model[0], model[2]])
    with pytest.raises(TrainstreamError, match="cannot convert a model whose weights page"):
        model.half()
    trainstream.unwrap(model)


def test_one_process_has_no_data_parallel_group(client):
    """TrainStream 0.2's `_dp`: the data-parallel group, None for one process (test_distributed: a group)."""
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model.parameters()), client=client)
    assert opt._dp is None
