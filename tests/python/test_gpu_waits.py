"""Weights waited for on the GPU (cuda-ipc): the session mirrors each bucket's PARAMS_READY into words
a GPU stream waits on, and releases every word when waiting could last for good (a dead daemon, a
wait past the timeout, a closed session). With real daemons: first with plain host memory for the
words, then (on a GPU) with torch's stream waiting on HostMappedWords."""

from __future__ import annotations

import array
import copy
import os
import signal
import time

import pytest
import torch
from conftest import Daemon, raw_spec, wait_until

import trainstream
from trainstream import _C, TrainstreamError
from trainstream._guards import StaleReadGuard

RELEASED = _C.RankSession.words_released
LAYOUT = [("w", [4, 4], 0, 0), ("b", [4], 0, 0)]  # one bucket


def attach(client, job, wait_timeout_s=None):
    session = client.attach(job, 0, raw_spec(LAYOUT), 7, transport="host", wait_timeout_s=wait_timeout_s)
    session.set_hparams(1, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    return session


def mirrored(session):
    words = array.array("I", [0])
    session.mirror_params_ready(words)
    return words


def test_words_follow_params_ready_without_the_trainer_calling_in(client):
    session = attach(client, "mirror")
    assert session.expect_params_ready(0, 0) is None  # not mirrored: the caller waits on the host
    words = mirrored(session)
    session.send_load_state(0)
    assert wait_until(lambda: words[0] == 1, timeout=5), words[0]  # the watcher drained PARAMS_READY of step 0
    assert session.expect_params_ready(0, 0) == 0  # published: nothing to wait for
    assert session.expect_params_ready(0, 1) == 2  # the GPU waits until the word reaches 2
    session.send_grad_ready(0, 1, 0, True)
    assert wait_until(lambda: words[0] == 2, timeout=5), words[0]
    assert session.expect_params_ready(0, 1) == 0
    session.check_healthy()
    session.close()
    assert words[0] == RELEASED  # nothing may wait on a word nobody writes any more


def test_a_load_resets_the_words_as_it_resets_params_ready(client):
    session = attach(client, "mirror-load")
    words = mirrored(session)
    session.send_load_state(0)
    session.wait_params_ready(0, 0)
    session.send_grad_ready(0, 1, 0, True)
    session.wait_params_ready(0, 1)
    assert wait_until(lambda: words[0] == 2, timeout=5)
    session.send_load_state(0)  # back to step 0: the word must drop, a wait for step 1 must wait again
    assert wait_until(lambda: words[0] == 1, timeout=5), words[0]
    assert session.expect_params_ready(0, 1) == 2


def test_the_words_are_released_when_the_daemon_dies():
    d = Daemon()
    try:
        session = attach(d.client(), "mirror-dies")
        words = mirrored(session)
        session.send_load_state(0)
        session.wait_params_ready(0, 0)
        d.process.send_signal(signal.SIGSTOP)  # step 1's weights can never come...
        assert session.expect_params_ready(0, 1) == 2
        os.kill(d.process.pid, signal.SIGKILL)  # ...and the daemon dies while the GPU would wait
        assert wait_until(lambda: words[0] == RELEASED, timeout=2), words[0]
        with pytest.raises(TrainstreamError, match="is gone|lost the session"):
            session.check_healthy()
    finally:
        d.stop()


def test_a_gpu_wait_past_the_timeout_releases_the_words_and_fails_the_session(client):
    session = attach(client, "mirror-timeout", wait_timeout_s=1.0)
    words = mirrored(session)
    session.send_load_state(0)
    session.wait_params_ready(0, 0)
    assert session.expect_params_ready(0, 1) == 2  # no gradients are ever sent: step 1 never comes
    assert wait_until(lambda: words[0] == RELEASED, timeout=5), words[0]
    with pytest.raises(TrainstreamError, match=r"bucket 0's weights of step 1 \(the GPU waits for them\) after 1 s"):
        session.check_healthy()


def test_words_that_do_not_fit_are_refused_and_the_session_goes_on(client):
    session = attach(client, "mirror-bad")
    with pytest.raises(TrainstreamError, match="2 words for 1 buckets"):
        session.mirror_params_ready(array.array("I", [0, 0]))
    with pytest.raises(TrainstreamError, match="32-bit unsigned integers"):
        session.mirror_params_ready(array.array("H", [0]))
    words = mirrored(session)
    with pytest.raises(TrainstreamError, match="mirrors PARAMS_READY already"):
        session.mirror_params_ready(array.array("I", [0]))
    session.send_load_state(0)
    assert wait_until(lambda: words[0] == 1, timeout=5)
    session.check_healthy()


# ----- the GPU's side: torch's stream waits on HostMappedWords (skipped without CUDA) -----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def wrapped_mlp(daemon, monkeypatch):
    """An MLP wrapped through cuda-ipc, trained one step beside its reference, the daemon then stopped
    (SIGSTOP) with the step's gradients sent: its weights cannot come until it resumes."""
    monkeypatch.setenv("TRAINSTREAM_TRANSPORT", "cuda-ipc")
    monkeypatch.setenv("TRAINSTREAM_GPU_WAITS", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), client=daemon.client())
    x = torch.randn(32, 64, device="cuda")
    for m, o in ((model, opt), (reference, ref_opt)):
        m(x).square().mean().backward()
        if o is opt:
            trainstream._wrap._rank_of(model).transport.flush()  # every gradient copied out: the update may start
            daemon.process.send_signal(signal.SIGSTOP)
        o.step()
        o.zero_grad()
    return model, reference, x


def queued_forward(model, x):
    """The forward's output and an event recorded after it, once the call returned."""
    out = model(x)
    done = torch.cuda.Event()
    done.record()
    return out, done


def released_within(done, seconds):
    deadline = time.monotonic() + seconds
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done.query()


@needs_cuda
def test_the_forward_is_queued_while_the_gpu_waits_for_its_weights(daemon, monkeypatch):
    model, reference, x = wrapped_mlp(daemon, monkeypatch)
    try:
        out, done = queued_forward(model, x)  # returns: the host did not wait for the stopped daemon
        time.sleep(0.5)
        assert not done.query(), "the GPU ran the forward before its weights came"
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert released_within(done, 10)
    expected = reference(x)
    assert (out - expected).abs().max().item() <= 1e-6  # the updated weights, not the old ones


@needs_cuda
def test_the_forward_queues_every_wait_at_its_start_and_runs_outside_the_guards_mode(daemon, monkeypatch):
    model, reference, x = wrapped_mlp(daemon, monkeypatch)
    rank = trainstream._wrap._rank_of(model)
    entered = []
    monkeypatch.setattr(StaleReadGuard, "__enter__", lambda mode: entered.append(mode))
    try:
        assert rank.reads.stale, "the step's weights are not in yet (the daemon is stopped)"
        out, done = queued_forward(model, x)
        assert not rank.reads.stale and not entered, "the forward waited in the guard's mode"
        assert not done.query()
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert released_within(done, 10)
    assert (out - reference(x)).abs().max().item() <= 1e-6


@needs_cuda
def test_a_daemon_that_dies_while_the_gpu_waits_lets_the_gpu_go(daemon, monkeypatch):
    model, _, x = wrapped_mlp(daemon, monkeypatch)
    _, done = queued_forward(model, x)
    words = memoryview(trainstream._wrap._rank_of(model).transport._ready_words)
    daemon.process.send_signal(signal.SIGKILL)
    released = released_within(done, 5)
    if not released:  # let this process's GPU go before failing, or every later test hangs with it
        for b in range(len(words)):
            words[b] = RELEASED
    assert released, "the GPU still waits for a dead daemon's weights"
    with pytest.raises(TrainstreamError, match="is gone|lost the session"):
        model(x).square().mean().backward()  # its gradients find no daemon to take them


@needs_cuda
@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.1}, {"accumulation_steps": 4}])
def test_training_with_gpu_waits_matches_torch(client, monkeypatch, options):
    """test_cuda.py's race-exposing model (few FLOPs, many bytes: a kernel that ran before its weights
    came would show as divergence), its weights waited for on the GPU."""
    from test_cuda import train_pair

    monkeypatch.setenv("TRAINSTREAM_TRANSPORT", "cuda-ipc")
    monkeypatch.setenv("TRAINSTREAM_GPU_WAITS", "1")

    def wide():
        return torch.nn.Sequential(torch.nn.Linear(32, 131072), torch.nn.Linear(131072, 64)).cuda()

    assert train_pair(client, wide, steps=30, width=32, bucket_mb=4, **options) <= 1e-5
