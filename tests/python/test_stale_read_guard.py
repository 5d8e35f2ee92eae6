"""The StaleReadGuard's TorchFunctionMode is active only while some bucket is stale: a forward starting
after the daemon published every bucket runs without it, one that took in the last stale bucket leaves
it, a module whose weights are in place refreshes nothing, a weight read ahead of its module after
another module's refresh is still refreshed, and a mode the forward entered itself is never popped in
its place. The updates stay AdamW's."""

from __future__ import annotations

import copy
import time

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

import trainstream
from trainstream import _guards, _wrap

WIDTH = 64  # a Linear's weight, 16 KiB, fills a bucket of bucket_mb=1/64: no bucket spans both Linears


class Probe(torch.nn.Module):
    """Records whether the StaleReadGuard's mode is active when the forward reaches it."""

    def __init__(self):
        super().__init__()
        self.saw_guard: list[bool] = []

    def forward(self, x):
        self.saw_guard.append(isinstance(_get_current_function_mode(), _guards.StaleReadGuard))
        return x


class Recording(TorchFunctionMode):
    """A mode of the user's own, entered inside the forward."""

    def __init__(self):
        super().__init__()
        self.functions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.functions.append(func)
        return func(*args, **(kwargs or {}))


class ModeAroundFirstLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.recording = Recording()

    def forward(self, x):
        with self.recording:
            h = torch.tanh(self.first(x))
        return self.second(h)


class ReadsAheadAfterARefresh(torch.nn.Module):
    """Reads the second Linear's weight after the first's pre-hook refreshed (the mode paused and, the
    second's bucket still stale, entered again) and before the second's own pre-hook."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = torch.tanh(self.first(x)) * self.second.weight.sum(dim=0)
        return self.second(h)


def probed_mlp():
    return torch.nn.Sequential(Probe(), torch.nn.Linear(WIDTH, WIDTH), Probe(), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, WIDTH), Probe())


def train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def wrapped(client, model):
    """The model wrapped in small buckets, and a plain copy."""
    reference = copy.deepcopy(model)
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client,
                                        bucket_mb=1 / 64)
    return model, optimizer, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)


def wait_until_published(rank, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not all(rank.reads.published(b) for b in rank.reads.stale):
        assert time.monotonic() < deadline, f"buckets {sorted(rank.reads.stale)} not published in {timeout} s"
        time.sleep(0.001)


def test_a_forward_after_every_bucket_was_published_runs_without_the_mode(client):
    model, optimizer, reference, ref_optimizer = wrapped(client, probed_mlp())
    rank = _wrap._rank_of(model)
    for step in range(3):
        train_step(model, optimizer, step)
        train_step(reference, ref_optimizer, step)
        assert rank.reads.stale  # taken in by the next forward, not before
        wait_until_published(rank)
        x = torch.randn(4, WIDTH)
        assert (model(x) - reference(x)).abs().max() <= 1e-6
        assert [model[k].saw_guard[-1] for k in (0, 2, 5)] == [False, False, False]
        assert not rank.reads.stale


def test_a_module_whose_weights_are_in_place_neither_refreshes_nor_pauses_the_mode(client, monkeypatch):
    model, optimizer, reference, ref_optimizer = wrapped(client, probed_mlp())
    rank = _wrap._rank_of(model)
    train_step(model, optimizer, 0)
    train_step(reference, ref_optimizer, 0)
    wait_until_published(rank)
    refreshed, paused = [], []
    refresh, pause = rank.reads.refresh, _guards.StaleReadGuard.pause

    def recorded_refresh(buckets, on_gpu=False):
        refreshed.append(sorted(buckets))
        refresh(buckets, on_gpu)

    def recorded_pause(guard):
        paused.append(guard)
        return pause(guard)

    monkeypatch.setattr(rank.reads, "refresh", recorded_refresh)
    monkeypatch.setattr(_guards.StaleReadGuard, "pause", recorded_pause)
    x = torch.randn(4, WIDTH)
    assert (model(x) - reference(x)).abs().max() <= 1e-6
    assert refreshed == [sorted(set(rank.regions.bucket_of))]  # the forward's start took every bucket in
    assert paused == []


def test_the_forward_leaves_the_mode_once_nothing_is_stale(client):
    model, optimizer, reference, ref_optimizer = wrapped(client, probed_mlp())
    rank = _wrap._rank_of(model)
    assert {rank.regions.bucket_of[i] for i in (0, 1)}.isdisjoint({rank.regions.bucket_of[i] for i in (2, 3)})
    rank.transport.weights_in_early = False  # as cuda-client-copy: stale buckets are taken in by their pre-hooks
    for step in range(3):
        train_step(model, optimizer, step)
        train_step(reference, ref_optimizer, step)
        x = torch.randn(4, WIDTH)
        assert (model(x) - reference(x)).abs().max() <= 1e-6
        # The mode is paused for each Linear's refresh, entered again while the second's bucket is
        # stale, and left after the second's refresh.
        assert [model[k].saw_guard[-1] for k in (0, 2, 5)] == [True, True, False]
    assert _get_current_function_mode() is None


def test_a_mode_entered_inside_the_forward_is_not_popped_in_the_guards_place(client):
    model, optimizer, reference, ref_optimizer = wrapped(client, ModeAroundFirstLayer())
    rank = _wrap._rank_of(model)
    rank.transport.weights_in_early = False
    for step in range(3):
        train_step(model, optimizer, step)
        train_step(reference, ref_optimizer, step)
        model.recording.functions.clear()
        x = torch.randn(4, WIDTH)
        assert (model(x) - reference(x)).abs().max() <= 1e-6
        # The first Linear's pre-hook took in the last stale bucket inside the user's mode: the guard
        # stayed below it, and the user's mode still saw the Linear.
        assert torch.nn.functional.linear in model.recording.functions
        assert _get_current_function_mode() is None


def test_a_weight_read_ahead_after_a_paused_refresh_is_fresh(client):
    model, optimizer, reference, ref_optimizer = wrapped(client, ReadsAheadAfterARefresh())
    _wrap._rank_of(model).transport.weights_in_early = False
    for step in range(3):
        train_step(model, optimizer, step)
        train_step(reference, ref_optimizer, step)
    x = torch.randn(4, WIDTH)
    assert (model(x) - reference(x)).abs().max() <= 1e-6
