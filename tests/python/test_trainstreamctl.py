"""trainstreamctl as an operator runs it: a real daemon, the command as a subprocess, its text and
JSON checked, and the refusals other uids get (as root, the command runs as an unprivileged uid)."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest
import torch
from conftest import OTHER_UID, ctl, ctl_binary, ctl_json

import trainstream


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(model, opt, steps: int):
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        opt.step()
        opt.zero_grad()


def wrapped(daemon, job: str):
    model = make_model()
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=daemon.client(), job=job)


def test_status_names_the_daemon_and_its_limits(daemon):
    status = ctl_json(daemon.socket, "status")
    assert status["pid"] == daemon.process.pid
    assert status["daemon_version"] == trainstream.__version__
    assert status["worker_threads"] == 2 and status["max_jobs"] == 64 and status["max_host_bytes"] == 0
    assert status["uptime_seconds"] > 0 and status["kernel"] and status["jobs"] == 0
    text = ctl(daemon.socket, "status").stdout
    assert f"trainstreamd {trainstream.__version__} (pid {daemon.process.pid})" in text
    assert "0 of max_jobs=64" in text and "pinned memory" in text


def test_jobs_shows_owner_ranks_step_and_memory(daemon):
    model, opt = wrapped(daemon, "shown")
    train(model, opt, 3)
    trainstream.synchronize(model)
    [job] = ctl_json(daemon.socket, "jobs")
    assert job["name"] == "shown" and job["uid"] == os.getuid() and not job["orphaned"]
    assert job["ranks"] == [{"rank": 0, "transport": "host on cpu"}]
    assert job["completed_step"] == 3 and job["steps"] == 3 and job["updates"] >= 3
    assert job["host_bytes"] == job["state_bytes"] + job["rank_bytes"] and job["pinned_bytes"] == 0
    assert job["last_step_unix_ms"] > 0 and job["last_update_unix_ms"] >= job["last_step_unix_ms"]
    text = ctl(daemon.socket, "jobs").stdout
    assert "shown" in text and "1/1" in text and "attached" in text and "rank 0: host on cpu" in text
    trainstream.unwrap(model)
    [job] = ctl_json(daemon.socket, "jobs")
    assert job["ranks"] == [] and job["host_bytes"] == job["state_bytes"]
    assert "idle" in ctl(daemon.socket, "jobs").stdout


def test_python_stats_report_what_trainstreamctl_shows(daemon):
    model, opt = wrapped(daemon, "both")
    train(model, opt, 2)
    trainstream.synchronize(model)
    stats = daemon.client().stats()
    [job] = stats["jobs"]
    [shown] = ctl_json(daemon.socket, "jobs")
    for key in ("steps", "host_bytes", "pinned_bytes", "last_step_unix_ms", "last_update_unix_ms",
                "last_snapshot_step"):
        assert job[key] == shown[key], key
    assert job["steps"] == 2 and job["update_seconds"] > 0 and job["last_snapshot"] == ""
    assert stats["pid"] == daemon.process.pid and stats["daemon_version"] == trainstream.__version__
    assert stats["max_jobs"] == 64 and stats["uptime_seconds"] > 0 and stats["gpus"] == []
    trainstream.unwrap(model)


def test_the_socket_comes_from_the_environment_with_or_without_unix_prefix(daemon):
    for address in (daemon.socket, "unix:" + daemon.socket):
        env = {**os.environ, "TRAINSTREAM_ADDRESS": address}
        assert ctl_json(None, "status", env=env)["pid"] == daemon.process.pid


def test_top_reports_steps_per_second_while_a_job_trains(daemon):
    model, opt = wrapped(daemon, "busy")
    stop = threading.Event()

    def keep_training():
        while not stop.is_set():
            train(model, opt, 1)

    trainer = threading.Thread(target=keep_training)
    trainer.start()
    try:
        refreshes = ctl_json(daemon.socket, "top", "--interval", "0.3", "--iterations", "3")
    finally:
        stop.set()
        trainer.join()
    assert len(refreshes) == 3
    rates = [job for refresh in refreshes for job in refresh["jobs"] if job["name"] == "busy"]
    assert any(r["steps_per_second"] > 0 and r["update_ms"] > 0 for r in rates), refreshes
    assert all(refresh["interval_seconds"] > 0.2 for refresh in refreshes)
    text = ctl(daemon.socket, "top", "--interval", "0.1", "--iterations", "1").stdout
    assert "STEPS/S" in text and "busy" in text
    trainstream.unwrap(model)


def test_drop_removes_a_job_and_names_what_is_missing(daemon):
    model, opt = wrapped(daemon, "doomed")
    train(model, opt, 1)
    trainstream.unwrap(model)
    assert ctl_json(daemon.socket, "drop", "doomed") == {"dropped": "doomed"}
    assert ctl_json(daemon.socket, "jobs") == []
    missing = ctl(daemon.socket, "drop", "doomed", check=False)
    assert missing.returncode == 1 and "trainstreamctl: error:" in missing.stderr
    assert "no job named 'doomed'" in missing.stderr


def test_a_job_with_attached_ranks_is_dropped_only_with_force(daemon):
    model, opt = wrapped(daemon, "held")
    refused = ctl(daemon.socket, "drop", "held", check=False)
    assert refused.returncode == 1 and "attached rank" in refused.stderr
    ctl(daemon.socket, "drop", "held", "--force")
    with pytest.raises(trainstream.TrainstreamError):
        train(model, opt, 2)


def test_the_global_options_may_follow_the_subcommand(daemon):
    """Issue 46: `trainstreamctl jobs --json` was refused ("The following argument was not expected:
    --json"); --socket and --json are accepted before or after the subcommand and its own options."""
    model, opt = wrapped(daemon, "anywhere")
    train(model, opt, 1)
    trainstream.unwrap(model)

    def run(*args: str):
        result = subprocess.run([ctl_binary(), *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (args, result.stderr)
        return json.loads(result.stdout)

    socket = daemon.socket
    assert [j["name"] for j in run("jobs", "--json", "--socket", socket)] == ["anywhere"]
    assert run("--socket", socket, "status", "--json")["pid"] == daemon.process.pid
    assert run("--json", "top", "--socket", socket, "--interval", "0.1", "--iterations", "1")["jobs"]
    assert run("drop", "anywhere", "--json", "--socket", socket) == {"dropped": "anywhere"}
    unknown = subprocess.run([ctl_binary(), "jobs", "--bogus", "--socket", socket], capture_output=True, text=True)
    assert unknown.returncode == 2 and "--bogus" in unknown.stderr  # still a bad command line


def test_no_daemon_and_bad_command_lines_fail_clearly(tmp_path):
    gone = ctl(str(tmp_path / "none.sock"), "status", check=False)
    assert gone.returncode == 1 and "cannot reach trainstreamd" in gone.stderr
    assert subprocess.run([ctl_binary(), "frobnicate"], capture_output=True).returncode == 2
    assert subprocess.run([ctl_binary(), "snapshot"], capture_output=True).returncode == 2  # JOB is required


def test_other_uids_may_neither_see_drop_nor_snapshot_a_job(shared_daemon, tmp_path):
    """Job names are per uid: another uid's "roots" is its own (none here); naming root's with --uid is
    refused."""
    model, opt = wrapped(shared_daemon, "roots")
    train(model, opt, 1)
    trainstream.unwrap(model)
    out = os.path.join(shared_daemon.shared_dir, "stolen.safetensors")
    for command in (["drop", "roots", "--force"], ["snapshot", "roots", out]):
        refused = ctl(shared_daemon.socket, *command, user=OTHER_UID, check=False)
        assert refused.returncode == 1, refused
        assert f"uid {OTHER_UID} has no job named 'roots'" in refused.stderr, refused.stderr
        refused = ctl(shared_daemon.socket, *command, "--uid", "0", user=OTHER_UID, check=False)
        assert refused.returncode == 1 and "only root may name another owner_uid" in refused.stderr, refused.stderr
    assert not os.path.exists(out)
    assert ctl_json(shared_daemon.socket, "jobs", user=OTHER_UID) == []  # a non-root uid sees its own jobs only
