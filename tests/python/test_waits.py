"""Bounded waits (issue 21, item 3): a rank whose peer never attaches, a daemon that stops answering,
and Ctrl-C during a native wait, each with real daemons and real trainer processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import Daemon, wait_until

import trainstream

HERE = os.path.dirname(__file__)


def start_waiting_rank(socket: str, job: str, *extra: str) -> subprocess.Popen:
    """tests/python/waiting_rank.py, once it printed "waiting" (it is in its wait then)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, os.path.join(HERE, "waiting_rank.py"), "--socket", socket, "--job",
                                job, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.strip() == "waiting":
            return process
    process.wait()
    raise AssertionError(f"the rank never got to its wait: {''.join(lines)}")


def test_rank_whose_peer_never_attaches_times_out_naming_it(daemon):
    process = start_waiting_rank(daemon.socket, "lonely", "--wait-timeout", "3")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    assert "TrainstreamError" in out
    assert "gave up waiting for bucket 0's weights of step 1" in out
    assert "rank 1 of job 'lonely' (world_size 2) is not attached" in out
    assert "still waiting for bucket 0's weights of step 1" in out  # the progress messages came first


def test_wait_timeout_comes_from_the_environment(daemon):
    env_before = os.environ.get("TRAINSTREAM_WAIT_TIMEOUT")
    os.environ["TRAINSTREAM_WAIT_TIMEOUT"] = "2"
    try:
        process = start_waiting_rank(daemon.socket, "from-env")
    finally:
        if env_before is None:
            del os.environ["TRAINSTREAM_WAIT_TIMEOUT"]
        else:
            os.environ["TRAINSTREAM_WAIT_TIMEOUT"] = env_before
    out, _ = process.communicate(timeout=60)
    assert "(wait timeout 2 s)" in out, out


def test_sigint_ends_a_waiting_trainer_with_keyboard_interrupt(daemon):
    process = start_waiting_rank(daemon.socket, "interrupted", "--wait-timeout", "600")
    time.sleep(0.5)  # well inside the native wait
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=30)  # far less than the 600 s the wait would take
    assert process.returncode == 130, out
    assert "KeyboardInterrupt at" in out
    noticed = float(out.split("KeyboardInterrupt at ")[1].split()[0])
    print(f"SIGINT noticed by the native wait after {noticed - sent:.3f} s, process gone after "
          f"{time.monotonic() - sent:.3f} s")


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_stopped_daemon_ends_the_wait_with_an_error(tmp_path):
    d = Daemon()
    try:
        model = torch.nn.Linear(4, 4)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=d.client(),
                                      job="stopped", wait_timeout=3)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        trainstream.synchronize(model)
        d.process.send_signal(signal.SIGSTOP)
        try:
            assert wait_until(lambda: stopped(d.process.pid))  # every thread of it, not just the signal sent
            model(torch.randn(2, 4)).sum().backward()  # the gradients go into the ring: nothing to wait for
            opt.step()
            with pytest.raises(trainstream.TrainstreamError, match="does not answer .*SIGSTOP"):
                trainstream.synchronize(model)
        finally:
            d.process.send_signal(signal.SIGCONT)
    finally:
        d.stop()


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "soon"])
def test_bad_wait_timeouts_are_refused(client, value):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(trainstream.TrainstreamError, match="wait_timeout must be a number of seconds"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job="bad-timeout",
                         wait_timeout=value)


def test_backward_counts_its_wait_for_a_buckets_earlier_gradients_to_be_consumed():
    """rank.region_wait_s (train_gpt reports it per step): a micro-batch's backward opens each bucket only
    once the daemon has consumed the previous micro-batch's gradients there; stopped, it cannot."""
    d = Daemon()
    try:
        model = torch.nn.Linear(4, 4)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=d.client(),
                                      job="region-wait", accumulation_steps=2, wait_timeout=60)
        rank = trainstream._wrap._rank_of(model)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
        opt.step()
        trainstream.synchronize(model)
        d.process.send_signal(signal.SIGSTOP)
        resume = threading.Timer(1.0, lambda: d.process.send_signal(signal.SIGCONT))
        try:
            assert wait_until(lambda: stopped(d.process.pid))
            before = rank.region_wait_s
            model(torch.randn(2, 4)).sum().backward()  # the step's first gradients: their region was consumed
            first = rank.region_wait_s - before
            resume.start()
            model(torch.randn(2, 4)).sum().backward()  # the second's must wait for the daemon to take the first's
            second = rank.region_wait_s - before - first
        finally:
            resume.cancel()
            d.process.send_signal(signal.SIGCONT)
        assert first < 0.5 <= second
        opt.step()
        trainstream.synchronize(model)
    finally:
        d.stop()
