"""Reads and edits of a wrapped model's weights outside its forward, and reads of p.grad (_watched.py,
issue 48): each loop must see what torch shows it (compared with the same loop on a plain model and
torch's AdamW), or raise at the call that cannot be honoured. The model spans several buckets
(bucket_mb=1/64: each Linear of 64x64 in its own), so a module's pre-hook never brings another's
weights in."""

from __future__ import annotations

import copy
import io
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from test_stale_read_guard import Recording  # a mode of the user's own

import trainstream

STEPS = 6
TOLERANCE = 1e-6
BUCKET_MB = 1 / 64


class Model(torch.nn.Module):
    """A body and a head in buckets of their own; a model of the script's own class (Dynamo compiles it)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                        torch.nn.GELU())
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def make_model():
    torch.manual_seed(0)
    return Model()


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g) * 3, torch.randn(8, 4, generator=g) * 3


def wrap(model, client, **kwargs):
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client,
                            bucket_mb=BUCKET_MB, **kwargs)


def loop(model, optimizer, after_step=None, forward=None):
    """A plain loop; `after_step(model, step)` runs right after optimizer.step() and may return what it saw."""
    forward = forward if forward is not None else model
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(forward(x), y).backward()
        optimizer.step()
        if after_step is not None:
            seen.append(after_step(model, step))
        optimizer.zero_grad()
    return seen


def both(client, after_step, compiled=False) -> tuple[float, list, list, torch.nn.Module]:
    """The loop on a plain model and on its copy wrapped with the one line: the largest parameter
    difference after it, what after_step saw in each, and the wrapped model (still wrapped)."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    seen_plain = loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False), after_step)
    model, optimizer = wrap(wrapped, client)
    seen = loop(model, optimizer, after_step, torch.compile(model) if compiled else None)
    trainstream.synchronize(model)
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
    return diff, seen_plain, seen, model


def largest(a, b) -> float:
    """The largest difference between two nested lists of tensors (or numbers)."""
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((largest(x, y) for x, y in zip(a, b)), default=0.0)
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


# ----- reads after optimizer.step() see the step's weights -----

def test_an_ema_updated_right_after_the_step_averages_the_new_weights(client):
    emas = {}

    def ema(model, step):
        decay = 0.9
        averaged = emas.setdefault(id(model), [p.detach().clone() for p in model.parameters()])
        with torch.no_grad():
            for e, p in zip(averaged, model.parameters()):
                e.mul_(decay).add_(p, alpha=1 - decay)
        return [e.clone() for e in averaged]

    diff, seen_plain, seen, model = both(client, ema)
    assert diff <= TOLERANCE
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)


def test_a_weight_norm_logged_after_the_step_is_the_new_weights(client):
    diff, seen_plain, seen, model = both(client, lambda m, step: sum(p.norm() for p in m.parameters()).item())
    assert diff <= TOLERANCE
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)


def test_a_deepcopy_after_the_step_holds_the_new_weights_and_is_not_watched(client):
    best = {}

    def keep_best(model, step):
        if step == 2:
            best[id(model)] = copy.deepcopy(model)
            return [p.detach().clone() for p in best[id(model)].parameters()]
        return None

    diff, seen_plain, seen, model = both(client, keep_best)
    assert diff <= TOLERANCE
    assert largest(seen_plain[2], seen[2]) <= TOLERANCE
    copied = best[id(model)]
    assert all(type(p) is torch.nn.Parameter for p in copied.parameters())
    assert largest(seen[2], list(copied.parameters())) == 0  # training the model on left the copy alone
    x, _ = batch(0)
    copied(x)  # the copy runs on its own weights
    trainstream.unwrap(model)


def test_a_weight_used_outside_its_module_after_calling_the_one_before_is_the_new_one(client):
    """The first layer's pre-hook brings its own bucket in; the second layer's weight is in another."""
    def second_by_hand(model, step):
        x, _ = batch(100 + step)
        with torch.no_grad():
            return F.linear(F.gelu(model.body[0](x)), model.body[2].weight, model.body[2].bias)

    diff, seen_plain, seen, model = both(client, second_by_hand)
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)


def test_a_weight_read_on_another_thread_after_the_step_is_the_new_one(client):
    def on_a_thread(model, step):
        out = {}
        thread = threading.Thread(target=lambda: out.setdefault("sum", model.head.weight.sum().item()))
        thread.start()
        thread.join()
        return out["sum"]

    diff, seen_plain, seen, model = both(client, on_a_thread)
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)


# ----- edits through p.data -----

def test_a_wgan_clamp_through_p_data_after_the_step_is_trained_on(client):
    def clamp(model, step):
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)

    diff, _, _, model = both(client, clamp)
    assert diff <= TOLERANCE
    trainstream.unwrap(model)


def test_a_pruning_mask_through_p_data_after_synchronize_is_trained_on(client):
    def prune(model, step):
        if trainstream._wrap.current_rank(model) is not None:
            trainstream.synchronize(model)
        for p in model.parameters():
            p.data[p.data.abs() < 0.05] = 0

    diff, _, _, model = both(client, prune)
    assert diff <= TOLERANCE
    trainstream.unwrap(model)


def test_a_p_data_edit_between_backward_and_step_is_refused_at_the_step(client):
    model, optimizer = wrap(make_model(), client)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    model.head.weight.data.add_(1e-3)
    with pytest.raises(trainstream.TrainstreamError, match=r"parameter 'head.weight' was changed in place between "
                                                           r"backward\(\) and optimizer.step\(\)"):
        optimizer.step()
    trainstream.unwrap(model)


def test_p_data_assigned_after_the_step_is_copied_in_and_another_layout_is_refused(client):
    def restart_head(model, step):
        if step == 2:
            model.head.weight.data = torch.zeros_like(model.head.weight)

    diff, _, _, model = both(client, restart_head)
    assert diff <= TOLERANCE
    with pytest.raises(trainstream.TrainstreamError, match=r"p.data = a tensor of torch.float16 .* for wrapped "
                                                           r"parameter 'head.weight'.*trainstream.unwrap\(model\)"):
        model.head.weight.data = model.head.weight.detach().half()
    assert model.head.weight.dtype == torch.float32
    trainstream.unwrap(model)


def test_p_data_between_a_forward_and_its_backward_is_torchs_own(client):
    """An edit through the detached alias of a weight saved for backward would make autograd raise its
    version error where torch trains on: in that window p.data is torch's (docs/porting.md, "Not caught yet")."""
    model, optimizer = wrap(make_model(), client)
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    version = model.head.weight._version
    model.head.weight.data.mul_(1.0)
    assert model.head.weight._version == version
    loss.backward()
    optimizer.step()
    trainstream.unwrap(model)


def test_p_data_after_a_forward_refused_at_its_start_is_still_watched(client):
    """The forward's end hook runs however it ends: one refused before it began opens no window."""
    model, optimizer = wrap(make_model(), client)
    alias = model.head.weight.detach()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    alias.add_(1.0)
    with pytest.raises(trainstream.TrainstreamError, match="changed in place while it still showed"):
        model(x)
    version = model.head.weight._version
    model.head.weight.data.mul_(1.0)
    assert model.head.weight._version != version
    trainstream.unwrap(model)


# ----- p.grad -----

def test_p_grad_is_refused_where_torch_would_hold_a_gradient_and_none_elsewhere(client):
    model, optimizer = wrap(make_model(), client)
    p = model.head.weight
    assert p.grad is None  # no backward yet
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(trainstream.TrainstreamError, match=r"p.grad of wrapped parameter 'head.weight' read after "
                                                           r"backward\(\).*clip_grad_norm_.*trainstream.unwrap"):
        p.grad  # noqa: B018
    optimizer.step()
    assert p.grad is None  # the step emptied it (wrap's contract)
    F.mse_loss(model(x), y).backward()
    optimizer.zero_grad()
    assert p.grad is None
    p.grad = None  # allowed, as in torch
    trainstream.unwrap(model)


def test_module_zero_grad_between_backward_and_step_drops_the_steps_gradients(client):
    """torch's Module.zero_grad reads p.grad; on the wrapped model, or a module around it (a framework's
    wrapper), it drops the step's gradients as torch does; on a part of the model, it is refused."""
    holder = torch.nn.ModuleDict({"model": make_model()})
    model, optimizer = wrap(holder["model"], client)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    for zero in (model.zero_grad, holder.zero_grad):
        F.mse_loss(model(x), y).backward()
        zero()
        optimizer.step()  # nothing to apply, as in torch
        trainstream.synchronize(model)
        assert largest(before, list(model.parameters())) == 0
    F.mse_loss(model(x), y).backward()
    with pytest.raises(trainstream.TrainstreamError, match=r"zero_grad\(\) of a module holding 2 of the 6 "
                                                           r"parameters of a wrapped model"):
        model.head.zero_grad()
    optimizer.step()
    trainstream.unwrap(model)


# ----- what must stay as it was -----

def test_a_compiled_model_compiles_once_with_an_ema_between_its_steps(client):
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    emas = {}

    def ema(model, step):
        averaged = emas.setdefault(id(model), [p.detach().clone() for p in model.parameters()])
        with torch.no_grad():
            for e, p in zip(averaged, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        return [e.clone() for e in averaged]

    plain = make_model()
    wrapped = copy.deepcopy(plain)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    seen_plain = loop(plain, plain_optimizer, ema)
    model, optimizer = wrap(wrapped, client)
    seen = loop(model, optimizer, ema, forward=torch.compile(model, backend=counter))
    assert counter.frame_count == 1
    assert largest(seen_plain, seen) <= TOLERANCE

    torch._dynamo.reset()
    caller = CompileCounter()
    seen = loop(model, optimizer, ema, forward=torch.compile(lambda x: model(x) * 1.0, backend=caller))
    assert caller.frame_count <= 2
    seen_plain = loop(plain, plain_optimizer, ema)
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)


def test_a_users_torch_function_mode_around_the_step_stays_on_top_and_sees_its_ops(client):
    model, optimizer = wrap(make_model(), client)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    depth = torch._C._len_torch_function_stack()
    mode = Recording()
    mode.__enter__()
    optimizer.step()
    model(x)
    mode.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth
    assert torch.nn.functional.linear in mode.functions
    trainstream.unwrap(model)


def test_parameters_are_plain_again_after_unwrap_or_once_their_rank_is_gone(client):
    from trainstream import _watched
    model, optimizer = wrap(make_model(), client)
    loop(model, optimizer)
    assert all(type(p) is _watched.WatchedParameter for p in model.parameters())
    trainstream.unwrap(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())

    model, optimizer = wrap(make_model(), client)
    optimizer.release_rank().close(drop=True)  # detached without unwrap
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())

    class Gone:
        pass

    rank = Gone()
    p = torch.nn.Parameter(torch.ones(3))
    p.__class__ = _watched.WatchedParameter
    _watched._owners[id(p)] = weakref.ref(rank)
    del rank  # a rank collected while its parameter was watched
    assert (p * 2).sum().item() == 6
    assert type(p) is torch.nn.Parameter


def test_torch_save_and_repr_after_the_step_show_the_new_weights(client):
    saved = {}

    def save(model, step):
        buffer = io.BytesIO()
        torch.save(list(model.parameters()), buffer)  # (a wrapped model's hooks do not pickle)
        buffer.seek(0)
        saved.setdefault(id(model), []).append(torch.load(buffer, weights_only=False))
        return repr(model.head.bias)

    diff, seen_plain, seen, model = both(client, save)
    assert seen == seen_plain
    assert seen[0].startswith("Parameter containing")
    plain_copies, copies = saved.values()
    for a, b in zip(plain_copies, copies):
        assert all(type(p) is torch.nn.Parameter for p in b)
        assert largest(a, b) <= TOLERANCE
    trainstream.unwrap(model)


def test_backward_through_watched_parameters_runs_the_users_gradient_hooks(client):
    model, optimizer = wrap(make_model(), client)
    fired = []
    p = model.head.weight
    p.register_post_accumulate_grad_hook(lambda param: fired.append(param is p))
    plain = make_model()

    def weights(m, step):
        if m is model:
            trainstream.synchronize(model)
        return [q.detach().clone() for q in m.parameters()]

    seen_plain = loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False), weights)
    seen = loop(model, optimizer, weights)
    assert fired == [True] * STEPS
    assert largest(seen_plain, seen) <= TOLERANCE
    trainstream.unwrap(model)
