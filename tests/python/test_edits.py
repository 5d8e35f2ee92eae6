"""Weights a training loop changes itself around a wrapped model's steps, and gradients torch would keep
(_edits.py, _kept_grads.py): each loop must train the same model as without trainstream (every
parameter within 1e-6 after the loop, fp32), or raise at the call that cannot be honoured."""

from __future__ import annotations

import copy

import pytest
import torch

import trainstream

STEPS = 8
TOLERANCE = 1e-6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g) * 3, torch.randn(8, 4, generator=g) * 3


def loop(model, optimizer, after_step=None, before=None):
    """A plain loop; `after_step(model)` runs right after optimizer.step(), as a WGAN's clamp does."""
    if before is not None:
        before(model)
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if after_step is not None:
            after_step(model, step)
        optimizer.zero_grad()


def both(client, **hooks) -> float:
    """The loop on a plain model and on its copy wrapped with the one line: the largest parameter
    difference after it."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False), **hooks)
    model, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    loop(model, optimizer, **hooks)
    trainstream.synchronize(model)
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
    trainstream.unwrap(model)
    return diff


def clamp_in_place(model, step):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def synchronize_then_clamp(model, step):
    if trainstream._wrap.current_rank(model) is not None:  # not the plain loop's model
        trainstream.synchronize(model)
    clamp_in_place(model, step)


def test_weights_changed_after_each_step_train_as_in_torch(client):
    """A WGAN critic's clamp, after the step's weights are in."""
    diff = both(client, after_step=synchronize_then_clamp)
    assert diff <= TOLERANCE


def test_weights_changed_right_after_the_step_change_the_steps_weights_as_in_torch(client):
    """The clamp reads the parameters before the step's weights are in: they come in first (_watched.py)."""
    diff = both(client, after_step=clamp_in_place)
    assert diff <= TOLERANCE


def test_weights_changed_through_an_alias_before_the_steps_weights_are_in_are_refused_at_the_next_forward(client):
    """An alias taken before the step (a detach() kept aside) changes the parameter without reading it."""
    wrapped = make_model()
    model, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    alias = model[0].weight.detach()
    loop(model, optimizer)
    alias.clamp_(-0.05, 0.05)
    x, _ = batch(0)
    with pytest.raises(trainstream.TrainstreamError, match=r"parameter '0.weight' was changed in place while it "
                                                           r"still showed the weights before the last "
                                                           r"optimizer.step\(\).*trainstream.synchronize\(model\)"):
        model(x)
    model(x)  # the refused change is gone: the model goes on with the step's weights
    trainstream.unwrap(model)


def test_weights_initialized_again_after_wrap_are_the_ones_trained(client):
    def init(model):
        torch.manual_seed(1)
        model.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.1) if isinstance(m, torch.nn.Linear) else None)

    plain = make_model()
    init(plain)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    loop(plain, optimizer)
    wrapped = make_model()
    model, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    loop(model, optimizer, before=init)
    trainstream.synchronize(model)
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters())) <= TOLERANCE


def test_a_state_dict_loaded_right_after_the_step_is_the_one_trained(client):
    """The step's new weights, taken in later, would overwrite what loads."""
    def load(model, step):
        if step == 3:
            torch.manual_seed(2)
            model.load_state_dict({k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()})

    diff = both(client, after_step=load)
    assert diff <= TOLERANCE


def test_weights_changed_between_backward_and_step_are_refused_at_the_step(client):
    wrapped = make_model()
    model, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    with pytest.raises(trainstream.TrainstreamError, match=r"parameter '2.weight' was changed in place between "
                                                           r"backward\(\) and optimizer.step\(\)"):
        optimizer.step()
    optimizer.step()  # the refused change is not kept, and not refused again
    trainstream.unwrap(model)


def kept_gradients_loop(model, optimizer, zero):
    """Half the steps do not use the last layer (its parameters get no gradient); zero_grad keeps p.grad
    as zero tensors (`set_to_none=False`) or sets it to None by hand."""
    for step in range(STEPS):
        x, y = batch(step)
        h = model[3](model[2](model[1](model[0](x))))
        out = model[4](h) if step % 2 == 0 else h[:, :4]
        torch.nn.functional.mse_loss(out, y).backward()
        optimizer.step()
        zero(model, optimizer)


def zero_keeping(model, optimizer):
    optimizer.zero_grad(set_to_none=False)


def zero_by_hand(model, optimizer):
    for p in model.parameters():
        p.grad = None


@pytest.mark.parametrize("zero", [zero_keeping, zero_by_hand])
def test_parameters_without_a_gradient_are_updated_as_torch_updates_them(client, zero):
    """After zero_grad(set_to_none=False) torch's AdamW updates the unused layer with a zero gradient
    (moments decay, weight decay applies); after `p.grad = None` it skips it."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    kept_gradients_loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False), zero)
    model, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    kept_gradients_loop(model, optimizer, zero)
    trainstream.synchronize(model)
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters())) <= TOLERANCE

