"""The one line in training loops written for torch.optim.AdamW: `trainstream.wrap(model, optimizer)` and
nothing else, against the same loop without it, through a real daemon.

Each loop is the usual shape (micro-batches summed by backward, torch.nn.utils.clip_grad_norm_,
zero_grad, a GradScaler, torch.compile) and must train the same model: every parameter within 1e-6
after 20+ steps in fp32, on steps where clipping changes the update. What trainstream cannot honour
raises at the call."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import trainstream

STEPS = 20
TOLERANCE = 1e-6
MAX_NORM = 0.5  # the gradients' norm is 2-10: every step clips


class MLP(torch.nn.Module):
    """A model of the training script's own (Dynamo compiles its forward; torch.nn's own classes it runs eagerly)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(16, 64)
        self.hidden = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.hidden(torch.nn.functional.gelu(self.inner(x)))))


def make_model():
    torch.manual_seed(0)
    return MLP()


def batch(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 16, generator=g) * 3, torch.randn(8, 4, generator=g) * 3


def nanogpt_loop(model, optimizer, *, micro_batches=lambda step: 1, clip=MAX_NORM, scaler=None, unscale=False,
                 zero_grad_after=None, model_zero_grad=False, steps=STEPS, forward=None):
    """nanoGPT's train loop: the loss of each micro-batch divided by their count, backward (scaled), the
    gradients unscaled and clipped, the step, zero_grad. Returns the norms clip_grad_norm_ returned."""
    forward = forward if forward is not None else model
    norms = []
    for step in range(steps):
        k = micro_batches(step)
        for micro in range(k):
            x, y = batch(step, micro)
            loss = torch.nn.functional.mse_loss(forward(x), y) / k
            (scaler.scale(loss) if scaler else loss).backward()
            if zero_grad_after == (step, micro):  # a loop that drops what it summed so far
                (model if model_zero_grad else optimizer).zero_grad()
        if unscale:
            scaler.unscale_(optimizer)
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        (model if model_zero_grad else optimizer).zero_grad(set_to_none=True)
    return [float(n) for n in norms]


def both(client, loop=nanogpt_loop, make_scaler=None, wrap_options=None, **kwargs):
    """The loop on a plain model and on the same model wrapped with no argument but the client (and
    `wrap_options`); returns (largest parameter difference, the plain run's norms, the wrapped run's, the
    scalers)."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    scalers = [make_scaler() if make_scaler else None for _ in range(2)]
    norms_plain = loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, foreach=False),
                       scaler=scalers[0], **kwargs)
    wrapped, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2,
                                                                     weight_decay=0.1), client=client,
                                          **(wrap_options or {}))
    norms_wrapped = loop(wrapped, optimizer, scaler=scalers[1], **kwargs)
    trainstream.synchronize(wrapped)
    difference = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), wrapped.parameters()))
    trainstream.unwrap(wrapped)
    return difference, norms_plain, norms_wrapped, scalers


@pytest.mark.parametrize("counts", [[1], [4], [1, 3, 3, 2, 4]], ids=["one", "four", "varying"])
def test_micro_batches_are_counted_and_clipping_is_taken_over(client, counts):
    difference, norms, norms_wrapped, _ = both(client, micro_batches=lambda step: counts[step % len(counts)])
    assert difference < TOLERANCE
    assert all(n > MAX_NORM for n in norms)  # clipping changed every update
    assert norms_wrapped == pytest.approx(norms, rel=1e-6)


def test_a_loop_that_never_clips_and_reads_no_norm(client):
    difference, *_ = both(client, micro_batches=lambda step: 2, clip=None)
    assert difference < TOLERANCE


@pytest.mark.parametrize("model_zero_grad", [False, True], ids=["optimizer", "model"])
def test_zero_grad_before_step_drops_what_was_summed(client, model_zero_grad):
    """zero_grad() after the first of two micro-batches: torch drops p.grad, trainstream the step's
    gradients in the daemon (the Hugging Face Trainer zeroes through the model)."""
    difference, *_ = both(client, micro_batches=lambda step: 2, zero_grad_after=(3, 0),
                          model_zero_grad=model_zero_grad)
    assert difference < TOLERANCE


@pytest.mark.parametrize("unscale, clip, options",
                         [(False, None, {}), (True, None, {}), (True, MAX_NORM, {}),
                          (True, MAX_NORM, {"accumulation_steps": 2, "max_grad_norm": MAX_NORM})],
                         ids=["step-unscales", "unscale_", "unscale_-clip", "unscale_-clip-explicit"])
def test_grad_scaler_skips_and_backs_off_as_in_torch(client, unscale, clip, options):
    """A scale of 2^126 overflows fp32 gradients: some steps are skipped and the scale backs off, then
    grows every 3 good steps; the scales and the weights follow torch's step for step. With wrap's
    max_grad_norm the scaler's inf check clips too, and the loop's clip_grad_norm_ after it is no second
    clipping."""
    def make_scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=3)
    difference, _, _, (plain, wrapped) = both(client, make_scaler=make_scaler, unscale=unscale, clip=clip,
                                              wrap_options=options, micro_batches=lambda step: 2)
    assert difference < TOLERANCE
    assert wrapped.get_scale() == plain.get_scale()
    assert wrapped._growth_tracker.item() == plain._growth_tracker.item()


def test_the_returned_norm_waits_for_the_daemon_and_is_a_tensor(client):
    model = make_model()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    x, y = batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # the norm, nothing clipped
    optimizer.step()
    assert isinstance(norm, torch.Tensor) and norm.shape == () and norm.dtype == torch.float32
    assert math.isfinite(norm.item()) and norm.item() > 0
    assert f"{norm:.3f}" == f"{norm.item():.3f}" and torch.isfinite(norm) and float(norm * 2) == 2 * norm.item()
    assert optimizer.last_grad_norm is norm


def test_a_scheduler_made_before_wrap_steps_without_warnings(client):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, wrapped = trainstream.wrap(model, optimizer, client=client)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(4):
            x, y = batch(step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            wrapped.step()
            scheduler.step()
    assert wrapped.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def _graphs_and_breaks(client, wrap: bool, how: str) -> tuple[int, int, list[float]]:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "compile() before wrap":
        model.compile()
    if wrap:
        model, optimizer = trainstream.wrap(model, optimizer, client=client)
    forward = model
    if how == "torch.compile(model)":
        forward = torch.compile(model)
    elif how == "model.compile()":
        model.compile()
    norms = nanogpt_loop(model, optimizer, forward=forward, steps=6, micro_batches=lambda step: 2)
    if wrap:
        trainstream.synchronize(model)
        trainstream.unwrap(model)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), norms


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "compile() before wrap"])
def test_compile_makes_the_graphs_it_makes_without_trainstream(client, how):
    graphs, breaks, norms = _graphs_and_breaks(client, False, how)
    graphs_wrapped, breaks_wrapped, norms_wrapped = _graphs_and_breaks(client, True, how)
    assert (graphs_wrapped, breaks_wrapped) == (graphs, breaks) == (1, 0)
    assert norms_wrapped == pytest.approx(norms, rel=1e-6)


def test_a_compiled_function_calling_the_model_still_sees_the_new_weights(client):
    """Compiled code that calls the wrapped model without going through torch.compile(model) gets its
    weights taken in by the model's first hook, outside the graph."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    norms = nanogpt_loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), steps=6)
    wrapped, optimizer = trainstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), client=client)
    torch._dynamo.reset()
    norms_wrapped = nanogpt_loop(wrapped, optimizer, forward=torch.compile(lambda x: wrapped(x) * 1.0), steps=6)
    assert norms_wrapped == pytest.approx(norms, rel=1e-6)


# ----- refused at the call, naming what to do -----

@pytest.fixture
def stepped(client):
    """A wrapped model after one backward pass, before its step."""
    model = make_model()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    x, y = batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return model, optimizer


@pytest.mark.parametrize("call, says", [
    (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1.0), "clip_grad_value_"),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=math.inf), "norm_type"),
    (lambda m: torch.nn.utils.clip_grad_norm_(list(m.parameters())[:2], 1.0), "2 of the wrapped model's 6"),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.0), "max_norm"),
    (lambda m: torch.nn.utils.clip_grads_with_norm_(m.parameters(), 1.0, torch.tensor(3.0)), "clip_grads_with_norm_"),
])
def test_clipping_trainstream_cannot_honour_raises(stepped, call, says):
    model, optimizer = stepped
    with pytest.raises(trainstream.TrainstreamError, match=says):
        call(model)
    optimizer.step()  # nothing was changed by the refused call


def test_clipping_a_wrapped_model_with_other_gradients_raises(stepped):
    model, _ = stepped
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    with pytest.raises(trainstream.TrainstreamError, match="2 other parameter"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)


def test_backward_after_clipping_raises(stepped):
    model, _ = stepped
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    x, y = batch(0, 1)
    with pytest.raises(trainstream.TrainstreamError, match="backward\\(\\) after clip_grad_norm_"):
        torch.nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("second", [2.0, 1.0])
def test_two_clippings_of_a_step_raise(stepped, second):
    """With the same max_norm too: torch's second call returns the clipped gradients' norm."""
    model, _ = stepped
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(trainstream.TrainstreamError, match="twice in one step"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), second)


def test_the_norm_read_twice_without_clipping_is_the_same(stepped):
    model, _ = stepped
    first = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)) == float(first)


def test_plain_parameters_clip_in_torch(client):
    plain = torch.nn.Linear(4, 4)
    plain(torch.ones(2, 4)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
    assert type(norm) is torch.Tensor
    assert torch.cat([p.grad.flatten() for p in plain.parameters()]).norm() <= 0.0101


@pytest.mark.parametrize("value", [0, 1.5, float("nan"), 2 ** 40, "2", True, None])
def test_odd_accumulation_steps_are_refused_naming_the_argument(client, value):
    model = make_model()
    with pytest.raises(trainstream.TrainstreamError, match="accumulation_steps must be 'auto'"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, accumulation_steps=value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1", True])
def test_odd_max_grad_norm_is_refused_naming_the_argument(client, value):
    model = make_model()
    with pytest.raises(trainstream.TrainstreamError, match="max_grad_norm must be None"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, max_grad_norm=value)


def test_one_state_half_refuses_a_backward_pass_beyond_the_most_a_step_had(client):
    """With one state half an update cannot be taken back: once steps had two micro-batches, the second
    one's update runs as its gradients come, and a third backward pass is refused, naming the fix."""
    model = make_model()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, state_halves=1)
    nanogpt_loop(model, optimizer, micro_batches=lambda step: 2, clip=None, steps=2)
    with pytest.raises(trainstream.TrainstreamError, match="accumulation_steps=3"):
        nanogpt_loop(model, optimizer, micro_batches=lambda step: 3, clip=None, steps=1)


def test_a_learning_rate_changed_between_backward_and_step_is_refused(client):
    """The daemon reads the hyperparameters at the step's first backward (its update may start before
    optimizer.step()): a later change cannot apply to the step as torch would apply it."""
    model = make_model()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), client=client)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.param_groups[0]["lr"] = 5e-4
    with pytest.raises(trainstream.TrainstreamError, match="lr changed from 0.001 to 0.0005 after this step's first"):
        optimizer.step()


def test_gradients_put_into_p_grad_by_hand_are_refused(client):
    model = make_model()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    loss = model(torch.randn(4, 16)).sum()
    for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
        p.grad = g
    with pytest.raises(trainstream.TrainstreamError, match="no backward\\(\\) of a wrapped model produced"):
        optimizer.step()


def test_a_step_after_zero_grad_without_backward_does_nothing_as_in_torch(client):
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client)
    for m, o in ((model, optimizer), (reference, ref_opt)):
        for step in range(4):
            o.zero_grad()
            if step != 2:  # a batch skipped: step() with no gradients
                m(torch.ones(4, 16) * step).sum().backward()
            o.step()
    trainstream.synchronize(model)
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())) <= 1e-6
