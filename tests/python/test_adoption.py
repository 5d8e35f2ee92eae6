"""A daemon that dies leaves its jobs' state in /dev/shm; the next daemon on the same socket re-adopts
a job when a rank attaches with its name and layout, and drops it after the TTL otherwise (at once if
its owner truncated it meanwhile). Daemons on other sockets never touch it."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import Daemon, wait_until

import trainstream
from trainstream import TrainstreamError


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(model, opt, steps: range):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def wrap(model, daemon, job):
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                            client=daemon.client(), job=job)


def segments_of(key: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("trainstream.") and f".{key}." in f]


def crashed_daemon_with_job(tmp_path, job: str, steps: int = 4, extra: tuple[str, ...] = ()):
    """A daemon on tmp_path/d.sock (started with `extra` arguments) that trained `job` for `steps` steps
    and was then SIGKILLed."""
    socket = str(tmp_path / "d.sock")
    first = Daemon(*extra, socket=socket)
    torch.manual_seed(0)
    model, opt = wrap(make_model(), first, job)
    train(model, opt, range(steps))
    trainstream.synchronize(model)
    key = next(j["job_key"] for j in first.client().stats()["jobs"] if j["name"] == job)
    first.stop(signal.SIGKILL)
    with pytest.raises(TrainstreamError):
        trainstream.unwrap(model)  # its daemon is gone
    return socket, key


def test_job_survives_a_daemon_crash(tmp_path):
    socket, key = crashed_daemon_with_job(tmp_path, "survivor")
    assert segments_of(key)  # the state outlived its daemon
    second = Daemon(socket=socket)
    try:
        assert "job 'survivor' (uid" in second.output() and "left by a dead trainstreamd" in second.output()
        orphan = next(j for j in second.client().stats()["jobs"] if j["name"] == "survivor")
        assert orphan["orphaned"] and orphan["completed_step"] == 4 and orphan["job_key"] == key
        torch.manual_seed(123)  # other initial weights: the job's must win
        model, opt = wrap(make_model(), second, "survivor")
        train(model, opt, range(4, 8))
        trainstream.synchronize(model)
        assert "re-adopted at step 4" in second.output()
        assert not next(j for j in second.client().stats()["jobs"] if j["name"] == "survivor")["orphaned"]
        torch.manual_seed(0)
        reference = make_model()
        train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False),
              range(8))
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        assert diff <= 1e-6
        trainstream.unwrap(model)
    finally:
        second.stop()
    assert not segments_of(key)  # a clean shutdown removes what it adopted


def test_an_orphan_with_another_layout_is_refused_until_dropped(tmp_path):
    socket, key = crashed_daemon_with_job(tmp_path, "changed")
    second = Daemon(socket=socket)
    try:
        other = torch.nn.Linear(16, 4)
        with pytest.raises(TrainstreamError, match="left by a trainstreamd that died, with another layout"):
            wrap(other, second, "changed")
        second.client().drop_job("changed")
        assert not segments_of(key)
        model, _ = wrap(other, second, "changed")  # a new job of that name
        trainstream.unwrap(model)
    finally:
        second.stop()


def test_an_orphan_its_owner_truncated_is_refused_and_removed(tmp_path):
    """Its owner may cut its state while no daemon holds it: the next daemon claims it without a fault, the
    attach is refused naming the truncation, and the job's segments go at once (not at the TTL)."""
    socket, key = crashed_daemon_with_job(tmp_path, "cut")
    [state] = [f for f in segments_of(key) if f.endswith(".state")]
    os.truncate(f"/dev/shm/{state}", 4096)  # its header stays: it is still this socket's orphan
    second = Daemon(socket=socket)
    try:
        refusal = (rf"job 'cut' cannot resume: its state segment {state} holds 4096 bytes of the \d+ its layout "
                   rf"needs \(its owner, uid {os.getuid()}, truncated it\).* Its segments were removed")
        with pytest.raises(TrainstreamError, match=refusal):
            wrap(make_model(), second, "cut")
        assert not segments_of(key)
        model, opt = wrap(make_model(), second, "cut")  # a new job of that name
        train(model, opt, range(2))
        trainstream.unwrap(model)
        assert second.process.poll() is None
    finally:
        second.stop()


def test_orphans_are_dropped_after_the_ttl(tmp_path):
    socket, key = crashed_daemon_with_job(tmp_path, "forgotten")
    second = Daemon("--job-ttl", "1", socket=socket)
    try:
        assert wait_until(lambda: not segments_of(key))
        assert "'forgotten' left by a dead trainstreamd was not re-adopted" in second.output()
    finally:
        second.stop()


def test_other_sockets_and_live_daemons_are_left_alone(tmp_path, daemon):
    socket, key = crashed_daemon_with_job(tmp_path, "elsewhere")
    model, opt = wrap(make_model(), daemon, "alive")  # `daemon`: another socket, started before the crash
    other = Daemon()  # a third daemon, on a socket of its own
    try:
        assert "left by a dead trainstreamd" not in other.output() + daemon.output()
        assert segments_of(key)
        train(model, opt, range(3))  # the live daemon's job is untouched
        trainstream.unwrap(model)
    finally:
        other.stop()
        Daemon(socket=socket).stop()  # the crashed daemon's successor takes its orphan; a clean stop...
    assert segments_of(key)  # ...leaves it for the next one (the TTL or a drop removes it)
    successor = Daemon(socket=socket)
    successor.client().drop_job("elsewhere")
    successor.stop()
    assert not segments_of(key)


def test_a_killed_private_daemons_jobs_are_removed_by_the_next_daemon(tmp_path):
    """A private daemon (wrap()'s, --parent-pid) has no successor: one that was killed (the OOM killer)
    leaves its jobs' segments behind, and the next daemon of any kind, on any socket, removes them."""
    _, key = crashed_daemon_with_job(tmp_path, "private", extra=("--parent-pid", str(os.getpid())))
    assert segments_of(key)
    other = Daemon()
    try:
        assert not segments_of(key)
        assert "left by a private trainstreamd" in other.output()
    finally:
        other.stop()
