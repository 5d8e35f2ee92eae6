"""What trainstream refuses, and that it says so clearly, at wrap time or at the faulty call."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

import trainstream
from trainstream import TrainstreamError


def model_and_adamw(**kw):
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)


def backward(model):
    model(torch.randn(2, 4)).sum().backward()


def test_unsupported_optimizer(client):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TrainstreamError, match="AdamW and Adam; got SGD"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), client=client)


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_unsupported_flags(client, flag):
    model, opt = model_and_adamw(**{flag: True})
    with pytest.raises(TrainstreamError, match=f"{flag}=True is not supported"):
        trainstream.wrap(model, opt, client=client)


def test_bad_options(client):
    model, opt = model_and_adamw()
    with pytest.raises(TrainstreamError, match="accumulation_steps must be 'auto'"):
        trainstream.wrap(model, opt, client=client, accumulation_steps=0)
    with pytest.raises(TrainstreamError, match="moment_dtype must be one of"):
        trainstream.wrap(model, opt, client=client, moment_dtype="float16")
    with pytest.raises(TrainstreamError, match="max_grad_norm must be None"):
        trainstream.wrap(model, opt, client=client, max_grad_norm=-1.0)
    with pytest.raises(TrainstreamError, match="must pass the same job name"):
        trainstream.wrap(model, opt, client=client, world_size=2)


def test_add_param_group_refused(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client)
    with pytest.raises(TrainstreamError, match="add_param_group is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_two_backward_passes_without_step_beyond_a_fixed_count(client):
    """accumulation_steps=1 says every step has one backward pass (counting them is the default)."""
    model, opt = trainstream.wrap(*model_and_adamw(), client=client, accumulation_steps=1)
    backward(model)
    with pytest.raises(Exception, match="backward\\(\\) ran again before optimizer.step\\(\\)"):
        backward(model)


def test_step_before_all_micro_batches(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client, accumulation_steps=4)
    backward(model)
    backward(model)
    with pytest.raises(TrainstreamError, match="after 2 of accumulation_steps=4"):
        opt.step()


def test_step_without_backward_is_a_no_op(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    trainstream.synchronize(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_wrapping_twice(client):
    model, opt = model_and_adamw()
    trainstream.wrap(model, opt, client=client)
    with pytest.raises(TrainstreamError, match="already wrapped"):
        trainstream.wrap(model, opt, client=client)


def test_unwrap_returns_trained_model(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client)
    before = [p.detach().clone() for p in model.parameters()]
    backward(model)
    opt.step()
    plain = trainstream.unwrap(model)
    assert plain is model
    assert any(not torch.equal(a, b) for a, b in zip(before, plain.parameters()))
    backward(plain)  # hooks are gone: gradients stay on the parameters
    assert all(p.grad is not None for p in plain.parameters())
    assert client.stats()["jobs"] == []  # an auto-named job is dropped with its last rank


def test_stats_name_each_ranks_transport(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client, job="transport-shown")
    job = next(j for j in client.stats()["jobs"] if j["name"] == "transport-shown")
    assert job["transports"] == {0: "host on cpu"}
    trainstream.unwrap(model)
    client.drop_job("transport-shown")


def test_gradients_leave_the_parameters(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client)
    backward(model)
    with trainstream._watched.internal():  # what p.grad holds
        assert all(p.grad is None for p in model.parameters())
    with pytest.raises(trainstream.TrainstreamError, match="read after backward"):  # not a silent None
        model.weight.grad  # noqa: B018


def test_nonfinite_gradients_are_reported_without_clipping(client):
    model, opt = trainstream.wrap(*model_and_adamw(), client=client)
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # may already report it, if the update was that fast
        deadline = time.monotonic() + 5
        while not caught and time.monotonic() < deadline:  # warnings travel on the session stream
            trainstream.synchronize(model)
            time.sleep(0.02)
    assert any("step 1: the update of bucket" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert client.stats()["jobs"][0]["nonfinite_steps"] == 1


def test_converting_a_wrapped_model_into_a_layout_it_cannot_take_is_refused_before_anything_changes(client):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    backward(model)
    opt.step()
    model.to("cpu").float().cpu()  # no change for the wrapped parameters: fine, once the update landed
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TrainstreamError, match="'0.weight' from torch.float32 on cpu into torch.float64 on cpu, but "
                                               "trainstream takes float32, bfloat16 and float16"):
        model.double()
    with pytest.raises(TrainstreamError, match="'weight' from torch.float32 on cpu into torch.float64"):
        model[1].double()  # through a submodule too
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # nothing changed
    backward(model)  # and it still trains
    opt.step()
    ema = copy.deepcopy(model)  # a copy is not wrapped: it converts freely, and alone
    assert ema.double()[0].weight.dtype == torch.float64 and model[0].weight.dtype == torch.float32
    trainstream.unwrap(model)
    assert model.double()[0].weight.dtype == torch.float64
