"""Snapshots of a job's state to safetensors files and their restore, against real daemons: what
`safetensors` reads from them, resume equal to uninterrupted training, a daemon SIGKILLed while
writing one, periodic snapshots, refusals of other uids and of corrupt or truncated files."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import threading

import pytest
import torch
from conftest import OTHER_UID, Daemon, ctl, ctl_binary, ctl_json, start_shared_daemon, wait_until

import trainstream

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402


def make_model(width: int = 32):
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def train(model, opt, steps: range):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def wrapped(daemon, job: str, seed: int = 0, width: int = 32):
    torch.manual_seed(seed)
    model = make_model(width)
    return trainstream.wrap(model, optimizer(model), client=daemon.client(), job=job)


def reference(steps: int, width: int = 32):
    """The model torch's own AdamW trains for `steps` steps from the same start."""
    torch.manual_seed(0)
    model = make_model(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    train(model, opt, range(steps))
    return model, opt


def max_diff(a, b) -> float:
    return max((torch.as_tensor(p) - torch.as_tensor(q)).abs().max().item() for p, q in zip(a, b))


def trained_then_idle(daemon, job: str, steps: int, width: int = 32):
    model, opt = wrapped(daemon, job, width=width)
    train(model, opt, range(steps))
    trainstream.unwrap(model)


def test_a_snapshot_is_a_safetensors_file_of_master_weights_moments_and_steps(daemon, tmp_path):
    trained_then_idle(daemon, "readable", 3)
    path = str(tmp_path / "readable.safetensors")
    written = ctl_json(daemon.socket, "snapshot", "readable", path)
    assert written == {"job": "readable", "path": path, "step": 3, "bytes": os.path.getsize(path)}
    tensors = load_file(path)
    with safetensors.safe_open(path, framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["format"] == "trainstream.snapshot.v1" and metadata["job"] == "readable"
    assert metadata["step"] == "3" and metadata["uid"] == str(os.getuid())
    layout = json.loads(metadata["layout"])
    assert [p["shape"] for p in layout["params"]] == [[32, 16], [32], [4, 32], [4]]
    assert json.loads(metadata["hparams"]) == []  # no rank was attached to say
    model, opt = reference(3)
    params = list(model.parameters())
    assert max_diff([tensors[f"master.{i}"] for i in range(4)], [p.detach() for p in params]) <= 1e-6
    state = opt.state_dict()["state"]
    assert max_diff([tensors[f"exp_avg.{i}"] for i in range(4)], [state[i]["exp_avg"] for i in range(4)]) <= 1e-6
    assert max_diff([tensors[f"exp_avg_sq.{i}"] for i in range(4)], [state[i]["exp_avg_sq"] for i in range(4)]) <= 1e-6
    assert tensors["step"].tolist() == [3, 3, 3, 3] and set(tensors["bucket_step"].tolist()) == {3}
    assert ctl_json(daemon.socket, "jobs")[0]["last_snapshot"] == path


def test_resume_from_a_snapshot_equals_uninterrupted_training(tmp_path):
    path = str(tmp_path / "resume.safetensors")
    first = Daemon()
    try:
        trained_then_idle(first, "resume", 4)
        ctl(first.socket, "snapshot", "resume", path)
    finally:
        first.stop()  # SIGTERM: the job's state in /dev/shm is gone with it
    second = Daemon()
    try:
        assert ctl_json(second.socket, "restore", path) == {"job": "resume", "step": 4, "path": path}
        assert "restored from" in second.output()
        model, opt = wrapped(second, "resume", seed=123)  # other initial weights: the snapshot's must win
        train(model, opt, range(4, 8))
        trainstream.synchronize(model)
        expected, _ = reference(8)
        assert max_diff([p.detach() for p in model.parameters()], [p.detach() for p in expected.parameters()]) <= 1e-6
        trainstream.unwrap(model)
    finally:
        second.stop()


def test_a_snapshot_of_a_job_between_steps_is_taken_at_once(daemon, tmp_path):
    """Its trainer is attached but idle (evaluating, checkpointing, waiting for data): on main the
    snapshot waited for a next step that did not come, up to --timeout (600 s)."""
    model, opt = wrapped(daemon, "between")
    train(model, opt, range(2))
    trainstream.synchronize(model)
    path = str(tmp_path / "between.safetensors")
    written = ctl_json(daemon.socket, "snapshot", "between", path, timeout=60)  # returns: no step comes
    assert written["step"] == 2
    assert "snapshot of its current state requested (every bucket holds step 2" in daemon.output()
    tensors = load_file(path)
    expected, _ = reference(2)
    assert max_diff([tensors[f"master.{i}"] for i in range(4)], [p.detach() for p in expected.parameters()]) <= 1e-6
    train(model, opt, range(2, 4))  # the trainer goes on as if nothing happened
    trainstream.synchronize(model)
    expected, _ = reference(4)
    assert max_diff([p.detach() for p in model.parameters()], [p.detach() for p in expected.parameters()]) <= 1e-6
    trainstream.unwrap(model)


def test_snapshots_taken_while_a_job_trains_hold_one_step_in_every_bucket(daemon, tmp_path):
    """Requested while steps are under way (two buckets: one may commit a step before the other): each
    file holds one step in every bucket, the weights of that step."""
    torch.manual_seed(0)
    model = make_model(64)
    model, opt = trainstream.wrap(model, optimizer(model), client=daemon.client(), job="live", bucket_mb=0.004)
    trainer = threading.Thread(target=train, args=(model, opt, range(60)))
    trainer.start()
    paths = []
    try:
        for i in range(4):
            paths.append(str(tmp_path / f"live{i}.safetensors"))
            ctl(daemon.socket, "snapshot", "live", paths[-1], timeout=60)
    finally:
        trainer.join()
    trainstream.synchronize(model)
    for path in paths:
        tensors = load_file(path)
        [step] = set(tensors["bucket_step"].tolist())  # every bucket at the same step
        assert len(tensors["bucket_step"]) == 2
        expected, _ = reference(step, width=64)
        assert max_diff([tensors[f"master.{i}"] for i in range(4)], [p.detach() for p in expected.parameters()]) <= 1e-6
    trainstream.unwrap(model)


def test_periodic_snapshots_are_written_every_n_steps(tmp_path):
    d = Daemon("--snapshot-dir", str(tmp_path / "snaps"), "--snapshot-every", "2")
    try:
        model, opt = wrapped(d, "every/2")  # a name with a slash: escaped in the file name
        train(model, opt, range(5))
        trainstream.synchronize(model)
        path = str(tmp_path / "snaps" / f"every%2F2.uid{os.getuid()}.safetensors")
        assert wait_until(lambda: ctl_json(d.socket, "jobs")[0]["last_snapshot_step"] == 4, 10)
        assert ctl_json(d.socket, "jobs")[0]["last_snapshot"] == path
        tensors = load_file(path)
        expected, _ = reference(4)
        assert max_diff([tensors[f"master.{i}"] for i in range(4)], [p.detach() for p in expected.parameters()]) <= 1e-6
        assert os.stat(path).st_mode & 0o777 == 0o600
        # Without a path, a requested snapshot goes there too.
        trainstream.unwrap(model)
        assert ctl_json(d.socket, "snapshot", "every/2")["path"] == path
        assert load_file(path)["step"].tolist() == [5] * 4
    finally:
        d.stop()


def test_a_daemon_killed_while_writing_a_snapshot_leaves_the_previous_one_intact(tmp_path):
    path = str(tmp_path / "big.safetensors")
    for _ in range(3):  # the kill must land between the temporary file's creation and its rename
        d = Daemon()
        trained_then_idle(d, "big", 1, width=2048)
        ctl(d.socket, "snapshot", "big", path)
        previous = open(path, "rb").read()
        model, opt = wrapped(d, "big", width=2048)
        train(model, opt, range(1, 2))
        trainstream.unwrap(model)
        key = ctl_json(d.socket, "jobs")[0]["job_key"]
        writer = subprocess.Popen([ctl_binary(), "--socket", d.socket, "snapshot", "big", path],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The temporary file, or a writer that finished between two looks (a loaded machine: a CI run
        # once saw no temporary file in 20 s of looking every millisecond); then the snapshot must have
        # succeeded, renamed before any kill could land, as below, and the next round tries again.
        # Whether the file was seen is kept from the look itself: a second glob may come after the
        # rename, while the writer has not exited yet (returncode None), as a CI run once did.
        temporary = str(tmp_path / ".big.safetensors.tmp-*")
        seen = False

        def temporary_seen_or_writer_done() -> bool:
            nonlocal seen
            seen = seen or bool(glob.glob(temporary))
            return seen or writer.poll() is not None

        assert wait_until(temporary_seen_or_writer_done, 20, interval=0.001)
        assert seen or writer.returncode == 0, "the snapshot failed before its file was seen"
        d.stop(signal.SIGKILL)
        writer.wait(30)
        leftovers = glob.glob(temporary)
        for segment in glob.glob(f"/dev/shm/trainstream.*.{key}.*"):  # what the killed daemon left
            os.unlink(segment)
        if leftovers:
            break
    else:
        pytest.skip("the snapshot was always renamed before the kill landed")
    assert open(path, "rb").read() == previous  # the old file, whole
    assert load_file(path)["step"].tolist() == [1] * 4
    restorer = Daemon()
    try:
        assert ctl_json(restorer.socket, "restore", path, "--job", "again")["step"] == 1
    finally:
        restorer.stop()


def test_corrupt_truncated_and_foreign_files_are_refused_by_name(daemon, tmp_path):
    trained_then_idle(daemon, "good", 1)
    good = str(tmp_path / "good.safetensors")
    ctl(daemon.socket, "snapshot", "good", good)
    data = open(good, "rb").read()
    header = int.from_bytes(data[:8], "little")
    cases = {
        "truncated": (data[: len(data) // 2], "truncated"),
        "empty": (b"", "fewer than a safetensors header needs"),
        "bad-length": (b"\xff" * 8 + data[8:], "the limit is"),
        "not-json": (data[:8] + b"{" * header + data[8 + header:], "not a JSON object"),
    }
    for name, (content, why) in cases.items():
        path = str(tmp_path / f"{name}.safetensors")
        with open(path, "wb") as f:
            f.write(content)
        refused = ctl(daemon.socket, "restore", path, "--job", name, check=False)
        assert refused.returncode == 1 and f"snapshot '{path}' is not valid" in refused.stderr, (name, refused.stderr)
        assert why in refused.stderr, (name, refused.stderr)
    foreign = str(tmp_path / "foreign.safetensors")
    save_file({"w": load_file(good)["master.0"]}, foreign)
    refused = ctl(daemon.socket, "restore", foreign, check=False)
    assert refused.returncode == 1 and "not a trainstream snapshot" in refused.stderr
    exists = ctl(daemon.socket, "restore", good, check=False)
    assert exists.returncode == 1 and "a job named 'good' exists already" in exists.stderr
    missing = ctl(daemon.socket, "restore", str(tmp_path / "none.safetensors"), check=False)
    assert missing.returncode == 1 and "No such file" in missing.stderr
    assert [j["name"] for j in ctl_json(daemon.socket, "jobs")] == ["good"]  # nothing half-restored


def test_a_job_that_never_held_weights_cannot_be_snapshotted(daemon, tmp_path):
    result = ctl(daemon.socket, "snapshot", "nothing", str(tmp_path / "x.safetensors"), check=False)
    assert result.returncode == 1 and "no job named 'nothing'" in result.stderr
    no_dir = ctl(daemon.socket, "snapshot", "nothing", check=False)
    assert no_dir.returncode == 1


def as_job_of(snapshot: str, path: str, uid: int, job: str) -> str:
    """A copy of `snapshot` at `path` that names `uid` and `job` as its owner (what that uid's snapshot
    holds); returns `path`."""
    with safetensors.safe_open(snapshot, framework="numpy") as f:
        metadata = {**f.metadata(), "uid": str(uid), "job": job}
    save_file(load_file(snapshot), path, metadata=metadata)
    return path


def test_the_daemons_supplementary_groups_give_another_uid_nothing():
    """Issue 46, 9: a root daemon with supplementary groups (a container's root: 0 and 4242 here) used
    them for the files a client named, though it acted as the client's uid and gid: uid 65534 restored
    a 0640 root:root file it cannot read, and snapshotted into a 0770 root:4242 directory."""
    d = start_shared_daemon(prefix=("setpriv", "--groups=0,4242", "--"))
    try:
        shared = d.shared_dir
        trained_then_idle(d, "mine", 2)
        rootfile = os.path.join(shared, "root.safetensors")
        ctl(d.socket, "snapshot", "mine", rootfile)
        theirs = as_job_of(rootfile, os.path.join(shared, "theirs.safetensors"), OTHER_UID, "theirs")
        ctl(d.socket, "restore", theirs)  # root: uid 65534's job "theirs"
        group_readable = as_job_of(rootfile, os.path.join(shared, "group.safetensors"), OTHER_UID, "read")
        os.chmod(group_readable, 0o640)  # root:root: not for 65534
        refused = ctl(d.socket, "restore", group_readable, user=OTHER_UID, check=False)
        assert refused.returncode == 1 and "Permission denied" in refused.stderr, refused.stderr
        group_dir = os.path.join(shared, "group-dir")
        os.mkdir(group_dir)
        os.chown(group_dir, 0, 4242)
        os.chmod(group_dir, 0o770)
        refused = ctl(d.socket, "snapshot", "theirs", os.path.join(group_dir, "x.safetensors"), user=OTHER_UID,
                      check=False)
        assert refused.returncode == 1 and "Permission denied" in refused.stderr, refused.stderr
        assert not os.listdir(group_dir)
        assert sorted(j["name"] for j in ctl_json(d.socket, "jobs")) == ["mine", "theirs"]
        # What 65534 may touch it still may, and root's own files are root's as before.
        ctl(d.socket, "snapshot", "theirs", os.path.join(shared, "own.safetensors"), user=OTHER_UID)
        ctl(d.socket, "snapshot", "mine", os.path.join(group_dir, "root.safetensors"))
    finally:
        d.stop()
        shutil.rmtree(d.shared_dir, ignore_errors=True)


def test_snapshots_belong_to_their_owner_and_root(shared_daemon):
    """uid 65534's job (restored by root from a snapshot naming that uid): 65534 may snapshot it, to a
    file created as 65534; another uid may neither snapshot nor drop it (job names are per uid: it has
    no such job) nor read 65534's file; root may snapshot and drop it, naming its owner."""
    shared = shared_daemon.shared_dir
    trained_then_idle(shared_daemon, "mine", 2)
    rootfile = os.path.join(shared, "root.safetensors")
    ctl(shared_daemon.socket, "snapshot", "mine", rootfile)
    assert os.stat(rootfile).st_uid == 0 and os.stat(rootfile).st_mode & 0o777 == 0o600
    theirs = as_job_of(rootfile, os.path.join(shared, "theirs.safetensors"), OTHER_UID, "theirs")
    refused = ctl(shared_daemon.socket, "restore", rootfile, "--job", "x", user=OTHER_UID, check=False)
    assert refused.returncode == 1 and "Permission denied" in refused.stderr  # read as 65534: a 0600 root file

    ctl(shared_daemon.socket, "restore", theirs)  # root: the job is the snapshot's uid's
    [job] = [j for j in ctl_json(shared_daemon.socket, "jobs") if j["name"] == "theirs"]
    assert job["uid"] == OTHER_UID and job["completed_step"] == 2
    own = os.path.join(shared, "own.safetensors")
    ctl(shared_daemon.socket, "snapshot", "theirs", own, user=OTHER_UID)
    assert os.stat(own).st_uid == OTHER_UID  # written with the caller's file permissions
    closed = os.path.join(shared, "closed")
    os.mkdir(closed, 0o755)  # root's: 65534 may not create files in it, though the daemon (root) could
    refused = ctl(shared_daemon.socket, "snapshot", "theirs", os.path.join(closed, "x.safetensors"), user=OTHER_UID,
                  check=False)
    assert refused.returncode == 1 and "Permission denied" in refused.stderr and not os.listdir(closed)
    for command in (["snapshot", "theirs", os.path.join(shared, "stolen.safetensors")], ["drop", "theirs"],
                    ["restore", own, "--job", "copy"]):
        other = ctl(shared_daemon.socket, *command, user=OTHER_UID - 1, check=False)
        assert other.returncode == 1, command
        assert "has no job named 'theirs'" in other.stderr or "Permission denied" in other.stderr, other.stderr
    assert not os.path.exists(os.path.join(shared, "stolen.safetensors"))
    ctl(shared_daemon.socket, "snapshot", "theirs", os.path.join(shared, "by-root.safetensors"), "--uid",
        str(OTHER_UID))  # root may
    ctl(shared_daemon.socket, "drop", "theirs", "--uid", str(OTHER_UID))
    assert [j["name"] for j in ctl_json(shared_daemon.socket, "jobs")] == ["mine"]
