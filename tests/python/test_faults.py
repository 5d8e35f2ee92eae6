"""Faults with real processes: a trainer killed mid-step, a daemon killed mid-step, and malformed
input from a client. The daemon must survive clients; clients must never hang on a dead daemon."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import raw_spec, wait_until

import trainstream
from trainstream import TrainstreamError

HERE = os.path.dirname(os.path.abspath(__file__))


def start_trainer(daemon, job, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, os.path.join(HERE, "trainer_process.py"), "--socket", daemon.socket, "--job", job, *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def wait_for_line(process, prefix, count=1, timeout=60):
    deadline, seen, lines = time.monotonic() + timeout, 0, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            seen += 1
            if seen == count:
                return
    raise AssertionError(f"trainer did not print {count} x {prefix!r}:\n{''.join(lines)}")


def job_stats(client, name):
    return next(j for j in client.stats()["jobs"] if j["name"] == name)


def small_training(client, steps=3):
    """A second job training alongside; returns its loss trajectory."""
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client)
    losses = []
    for _ in range(steps):
        loss = model(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    trainstream.unwrap(model)
    return losses


def test_trainer_killed_mid_step_releases_its_rank_and_state_survives(daemon):
    client = daemon.client()
    trainer = start_trainer(daemon, "victim")
    wait_for_line(trainer, "step", count=5)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert wait_until(lambda: job_stats(client, "victim")["attached_ranks"] == []), "the dead rank was not released"
    key = job_stats(client, "victim")["job_key"]
    assert wait_until(lambda: not glob.glob(f"/dev/shm/trainstream.*.{key}.rank*")), "rank segment left behind"
    assert glob.glob(f"/dev/shm/trainstream.*.{key}.state"), "the job's state must survive its trainer"
    completed = job_stats(client, "victim")["completed_step"]
    assert completed >= 5

    # other jobs are served as before
    losses = small_training(client)
    assert losses[-1] < losses[0]

    # a restarted trainer re-attaches the same rank and resumes where the job was
    restarted = start_trainer(daemon, "victim", "--steps", "2")
    wait_for_line(restarted, "done")
    assert restarted.wait(10) == 0
    assert job_stats(client, "victim")["completed_step"] >= completed + 2


def test_daemon_killed_mid_step_raises_within_two_seconds(daemon):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=daemon.client())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    model(torch.randn(4, 64)).sum().backward()  # grads of step 2 are out; the daemon dies before step()
    daemon.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TrainstreamError, match="trainstreamd|session"):
        opt.step()
        model(torch.randn(4, 64))  # waits for step 2's weights
    assert time.monotonic() - start < 2.0


def test_daemon_killed_while_waiting_raises_within_two_seconds(daemon):
    model = torch.nn.Linear(16, 1)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=daemon.client())
    rank = trainstream._wrap._rank_of(model)
    daemon.process.send_signal(signal.SIGSTOP)  # the update can never arrive...
    time.sleep(0.2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    start = time.monotonic()
    os.kill(daemon.process.pid, signal.SIGKILL)  # ...and then the daemon dies during the wait
    with pytest.raises(TrainstreamError):
        rank.synchronize()
    assert time.monotonic() - start < 2.0


# ----- malformed input: each is refused clearly, and the daemon stays healthy -----

LAYOUT = [("w", [4, 4], 0, 0), ("b", [4], 0, 0)]


def attach(client, job="raw", rank=0, params=LAYOUT, world_size=1, transport="host"):
    return client.attach(job, rank, raw_spec(params, world_size), 7, transport=transport)


def assert_daemon_healthy(client):
    assert client.ping()["pid"] > 0
    assert small_training(client, steps=2)


def expect_session_failure(session, match):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            session.check_healthy()
        except TrainstreamError as e:
            assert match in str(e), str(e)
            return
        time.sleep(0.02)
    raise AssertionError("the daemon did not end the session")


@pytest.mark.parametrize("kind,bucket,step,micro,match", [
    (999, 0, 1, 0, "unknown ring message kind 999"),
    (1, 7, 1, 0, "bucket 7, but the job has 1 buckets"),
    (1, 0, 5, 0, "of step 5, but that bucket expects step 1"),
    (1, 0, 1, 3, "micro-batch 3"),
    (16, 0, 0, 0, "unknown ring message kind 16"),
])
def test_garbage_ring_messages(client, kind, bucket, step, micro, match):
    session = attach(client)
    session.send_load_state(0)
    session.wait_params_ready(0, 0)
    session.send_raw(kind, 1, bucket, step, micro)
    expect_session_failure(session, match)
    assert_daemon_healthy(client)
    session.close()
    # the rank was released: it can attach again
    attach(client).close()


def test_unknown_transport_is_refused_before_the_job_exists(client):
    with pytest.raises(TrainstreamError, match="unknown transport 'carrier-pigeon'"):
        attach(client, job="pigeon", transport="carrier-pigeon")
    assert "pigeon" not in {job["name"] for job in client.stats()["jobs"]}
    assert_daemon_healthy(client)


def register_fake_cuda_ipc(session, params_bytes=1 << 20):
    handle = b"\0" * 64
    return session.register_cuda_ipc(b"\0" * 16, handle, params_bytes, handle, 1 << 20, [handle], [handle, handle])


def test_refused_cuda_ipc_registration_leaves_a_working_session(client):
    session = attach(client, job="ipc-refused", transport="cuda-ipc")
    # No driver here; on a GPU machine no GPU has this UUID. Either way: refused, with the reason.
    assert register_fake_cuda_ipc(session)
    session.check_healthy()
    job = next(j for j in client.stats()["jobs"] if j["name"] == "ipc-refused")
    assert job["transports"][0].startswith("cuda-client-copy (cuda-ipc refused)")
    session.send_load_state(0)  # the rank goes on copying its own data
    session.wait_params_ready(0, 0)
    with pytest.raises(TrainstreamError, match="unexpected message"):  # only one registration per session
        register_fake_cuda_ipc(session)
    assert_daemon_healthy(client)


def test_cuda_ipc_buffers_too_small_for_the_job_are_refused(client):
    session = attach(client, job="ipc-small", transport="cuda-ipc")
    assert "the parameter buffer has 8 bytes, the job's buckets need" in register_fake_cuda_ipc(session, params_bytes=8)
    session.check_healthy()


def test_duplicate_delivery(client):
    session = attach(client, world_size=2, job="dup")
    session.set_hparams(1, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    session.send_raw(1, 1, 0, 1, 0)
    session.send_raw(1, 1, 0, 1, 0)
    expect_session_failure(session, "delivered bucket 0 of step 1 micro-batch 0 twice")
    assert_daemon_healthy(client)


def test_invalid_hyperparameters(client):
    session = attach(client)
    session.send_load_state(0)
    session.wait_params_ready(0, 0)
    session.set_hparams(1, 0, -1.0, 0.9, 0.999, 1e-8, 0.0)
    session.send_grad_ready(0, 1, 0, True)
    expect_session_failure(session, "invalid hyperparameters for group 0: lr=-1")
    assert_daemon_healthy(client)


def test_second_client_claiming_the_same_rank(client):
    first = attach(client)
    with pytest.raises(TrainstreamError, match="rank 0 of job 'raw' is already attached"):
        attach(client)
    first.check_healthy()
    assert_daemon_healthy(client)


def test_layout_mismatch_names_the_difference(client):
    attach(client, world_size=2)
    with pytest.raises(TrainstreamError, match="parameter 0 differs: job has 'w' 4x4"):
        attach(client, rank=1, params=[("w", [4, 5], 0, 0), ("b", [4], 0, 0)], world_size=2)
    assert_daemon_healthy(client)


@pytest.mark.parametrize("params,match", [
    ([], "layout has no parameters"),
    ([("w", [-1], 0, 0)], "has dimension -1"),
    ([("w", [2], 0, 3)], "is in group 3 of 1"),
    ([("w", [2], 9, 0)], "unknown dtype code 9"),
])
def test_invalid_layouts(client, params, match):
    with pytest.raises(TrainstreamError, match=match):
        attach(client, params=params)
    assert_daemon_healthy(client)


def test_rank_out_of_range(client):
    with pytest.raises(TrainstreamError, match="rank 3 out of range"):
        attach(client, rank=3, world_size=2)


def test_unknown_job(client):
    with pytest.raises(TrainstreamError, match="no job named 'nope'"):
        client.drop_job("nope")
    assert_daemon_healthy(client)


def test_an_error_quoting_a_huge_name_still_reaches_the_client(client):
    # A status message travels in a header gRPC limits to 16 KiB: the daemon cuts its messages.
    with pytest.raises(TrainstreamError, match=r"no job named 'x{100}.*\(\d+ more bytes\)"):
        client.drop_job("x" * 100_000)
    assert_daemon_healthy(client)


def test_drop_job_with_attached_rank_needs_force(client):
    session = attach(client, job="busy")
    with pytest.raises(TrainstreamError, match="has 1 attached rank"):
        client.drop_job("busy")
    client.drop_job("busy", force=True)
    expect_session_failure(session, "job 'busy' was dropped")
