"""Snapshot files a client controls, against a real root daemon, restored as a second uid where the
scenario is a user's (issue 46): a FIFO as the path, a file truncated while the daemon reads it,
forged metadata (uid out of range, steps that disagree, numbers that are no numbers), non-finite
weights, headers nested or sized to exhaust the daemon. Every one is refused with an error naming
what is wrong; the daemon stays up, answers, and keeps nothing of the failed restore."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import uuid

import pytest
from conftest import OTHER_UID, Daemon, ctl, ctl_binary, ctl_json, wait_until

FORMAT = "trainstream.snapshot.v1"
# In every job name here: a state segment whose header names it is this run's (other tests, of other
# engineers too, may hold segments of the same uids meanwhile).
RUN = f"t{uuid.uuid4().hex[:12]}"


def layout(numel: int, state_halves: int = 1) -> dict:
    """One fp32 parameter of `numel` elements: one bucket, whatever its size."""
    return {"params": [{"name": "w", "shape": [numel], "dtype": "float32", "group": 0, "partition": 0}],
            "frozen": [], "num_groups": 1, "bucket_bytes": 1 << 25, "moment_dtype": "float32",
            "optimizer": "adamw", "accumulation_steps": 1, "world_size": 1, "max_grad_norm": 0.0, "peers": [],
            "node_rank": 0, "state_halves": state_halves, "speculative_clipping": False}


def header_bytes(numel: int, metadata: dict) -> bytes:
    """A snapshot's header for one parameter of `numel` elements: length word and JSON, 8-aligned."""
    tensors, offset = {}, 0
    for name, dtype, count, size in (("master.0", "F32", numel, 4), ("exp_avg.0", "F32", numel, 4),
                                     ("exp_avg_sq.0", "F32", numel, 4), ("step", "I64", 1, 8),
                                     ("bucket_step", "I64", 1, 8)):
        tensors[name] = {"dtype": dtype, "shape": [count], "data_offsets": [offset, offset + count * size]}
        offset += count * size
    text = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode()


def forge(path: str, numel: int = 8, *, uid: int | str = OTHER_UID, job: str = f"forged-{RUN}", step: int | str = 3,
          bucket_step: int = 3, param_step: int = 3, master: list[float] | None = None,
          exp_avg_sq: list[float] | None = None, owner: int | None = OTHER_UID, sparse: bool = False,
          **metadata: str) -> str:
    """Writes a trainstream snapshot of one parameter as `owner`'s file; what is not given is
    consistent (every step 3, zero weights). `sparse`: the tensors are a hole (a large file, fast)."""
    meta = {"format": FORMAT, "job": job, "uid": str(uid), "seed": "7", "step": str(step),
            "layout": json.dumps(layout(numel)), "hparams": "[]", "daemon_version": "0.1.0", **metadata}
    with open(path, "wb") as f:
        f.write(header_bytes(numel, meta))
        if sparse:
            f.seek(3 * 4 * numel, os.SEEK_CUR)
        else:
            for values in (master, None, exp_avg_sq):
                f.write(struct.pack(f"<{numel}f", *(values or [0.0] * numel)))
        f.write(struct.pack("<qq", param_step, bucket_step))
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def restore(daemon: Daemon, path: str, *args: str, user: int | None = OTHER_UID, timeout: float = 30):
    return ctl(daemon.socket, "restore", path, *args, user=user, check=False, timeout=timeout)


def segments_of(uid: int) -> set[str]:
    """This run's segments of `uid` in /dev/shm: those whose first page names one of its jobs."""
    mine = set()
    for path in glob.glob(f"/dev/shm/trainstream.{uid}.*"):
        try:
            with open(path, "rb") as segment:
                if RUN.encode() in segment.read(4096):
                    mine.add(path)
        except FileNotFoundError:
            pass
    return mine


def assert_refused(result, *phrases: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr)


def assert_serving_with_nothing_left(daemon: Daemon, uid: int = OTHER_UID) -> None:
    assert daemon.process.poll() is None, daemon.output()[-3000:]
    assert [j for j in ctl_json(daemon.socket, "jobs") if j["uid"] == uid] == []
    assert segments_of(uid) == set(), "a segment of the failed restore stayed"


@pytest.fixture
def shared(shared_daemon):
    return shared_daemon


def test_a_fifo_as_the_snapshot_path_is_refused_at_once_and_shutdown_still_works(shared):
    """On main each restore blocked a daemon thread in open() forever, and SIGTERM no longer ended it."""
    fifo = os.path.join(shared.shared_dir, "fifo.safetensors")
    os.mkfifo(fifo)
    os.chown(fifo, OTHER_UID, OTHER_UID)
    for _ in range(20):
        assert_refused(restore(shared, fifo, timeout=20), f"snapshot '{fifo}'", "is not a regular file")
    directory = os.path.join(shared.shared_dir, "a-directory")
    os.mkdir(directory)
    assert_refused(restore(shared, directory), "is not a regular file")
    assert_refused(restore(shared, "/dev/zero"), "is not a regular file")
    assert_serving_with_nothing_left(shared)
    assert shared.stop(timeout=15) == 0, shared.output()[-3000:]  # SIGTERM, not the SIGKILL after 15 s


def test_a_snapshot_truncated_while_it_is_restored_is_refused_and_leaves_no_segment(shared):
    """The file is truncated by its owner once the daemon has begun to make the job (its state
    segment appears): on main the copy from the mapped file died of SIGBUS, and the segment stayed."""
    numel = 24 << 20  # 288 MiB of tensors: the restore is still under way when the segment appears
    path = forge(os.path.join(shared.shared_dir, "shrinking.safetensors"), numel, sparse=True)
    size = os.path.getsize(path)
    for attempt in range(5):
        restorer = subprocess.Popen([ctl_binary(), "--socket", shared.socket, "restore", path, "--job",
                                     f"shrinking{attempt}-{RUN}"], user=OTHER_UID, group=OTHER_UID, extra_groups=[],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = wait_until(lambda: segments_of(OTHER_UID) or restorer.poll() is not None, 30, interval=0.0005)
        os.truncate(path, size // 2)
        _, stderr = restorer.communicate(timeout=60)
        if seen and restorer.returncode != 0:
            break
        ctl(shared.socket, "drop", f"shrinking{attempt}-{RUN}", "--uid", str(OTHER_UID))  # it finished first: again
        forge(path, numel, sparse=True)
    else:
        pytest.skip("every restore finished before the truncation landed")
    assert shared.process.poll() is None, f"the daemon died: {shared.output()[-3000:]}"
    assert restorer.returncode == 1 and f"snapshot '{path}'" in stderr, stderr
    assert "was truncated while trainstreamd read it" in stderr or "is not valid" in stderr, stderr
    assert_serving_with_nothing_left(shared)
    forge(path, numel, sparse=True)  # whole again: the same file restores
    assert ctl_json(shared.socket, "restore", path, "--job", f"whole-{RUN}", user=OTHER_UID)["step"] == 3
    ctl(shared.socket, "drop", f"whole-{RUN}", user=OTHER_UID)


@pytest.mark.parametrize("uid", ["-1", "4294967296", "4294967295", "18446744073709551615", "+5", " 5", "5x", ""])
def test_a_uid_out_of_range_or_not_a_number_is_refused(shared, uid):
    """On main root restoring uid -1 made a job of uid 4294967295 whose segment stayed root's (and
    was never reclaimed), and 4294967296 made a job of uid 0."""
    path = forge(os.path.join(shared.shared_dir, "uid.safetensors"), uid=uid, owner=None)
    assert_refused(restore(shared, path, user=None), "is not valid",
                   f"its uid metadata '{uid}' is not a number from 0 to 4294967294")
    assert ctl_json(shared.socket, "jobs") == []
    assert segments_of(0) == set() and segments_of(4294967295) == set()


@pytest.mark.parametrize("fields, why", [
    ({"step": "-5"}, "its step metadata '-5' is not a number from 0 to"),
    ({"step": 1, "bucket_step": 3}, "bucket 0 holds step 3, but the snapshot's step is 1"),
    ({"step": 2, "bucket_step": 3}, "no bucket holds the snapshot's step 2"),
    ({"step": 3, "bucket_step": 1 << 61}, f"bucket 0 holds step {1 << 61}, but the snapshot's step is 3"),
    ({"step": 1 << 62, "bucket_step": 1 << 62}, "is not a number from 0 to"),
    ({"param_step": -1}, "parameter 0 (w) has AdamW step -1"),
    ({"seed": "0x10"}, "its seed metadata '0x10' is not a number"),
    ({"hparams": "[[0.1, 0.9, 0.999, 1e-8, 0.0], [0.1, 0.9, 0.999, 1e-8, 0.0]]"},
     "hparams metadata has 2 groups, its layout 1"),
])
def test_steps_and_counts_that_disagree_are_refused(shared, fields, why):
    path = forge(os.path.join(shared.shared_dir, "steps.safetensors"), **fields)
    assert_refused(restore(shared, path), "is not valid", why)
    assert_serving_with_nothing_left(shared)


def test_nonfinite_weights_are_refused_naming_the_tensor_unless_allowed(shared):
    """A daemon writes NaN into a snapshot only if training diverged; such a job trains NaN from its
    first step. Refused by default, naming the tensor and element; --allow-nonfinite restores it
    (to repair a few parameters by hand, with load_state_dict)."""
    nan = forge(os.path.join(shared.shared_dir, "nan.safetensors"), master=[0.0] * 5 + [float("nan")] + [0.0] * 2)
    assert_refused(restore(shared, nan), "tensor 'master.0' holds a non-finite value (nan) at element 5",
                   "--allow-nonfinite")
    inf = forge(os.path.join(shared.shared_dir, "inf.safetensors"), exp_avg_sq=[float("inf")] + [0.0] * 7)
    assert_refused(restore(shared, inf), "tensor 'exp_avg_sq.0' holds a non-finite value (inf) at element 0")
    assert_serving_with_nothing_left(shared)
    restored = ctl_json(shared.socket, "restore", nan, "--job", "diverged", "--allow-nonfinite", user=OTHER_UID)
    assert restored["job"] == "diverged" and restored["step"] == 3
    ctl(shared.socket, "drop", "diverged", user=OTHER_UID)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where, why", [("shape", "tensor 'a' has dimension an array"),
                                        ("metadata", "__metadata__ must be an object of strings, not an array"),
                                        ("layout", "its layout metadata is nested deeper than 8 levels")])
def test_a_deeply_nested_header_is_refused(shared, where, why):
    """100k levels (200 KB): on main the recursive dump() of an error message overflowed the stack."""
    path = os.path.join(shared.shared_dir, f"nested-{where}.safetensors")
    if where == "layout":
        forge(path, layout=nested(100_000))
    else:
        entry = {"dtype": "F32", "shape": "@", "data_offsets": [0, 4]}
        document = {"__metadata__": {"format": FORMAT}, "a": entry} if where == "shape" else {"__metadata__": "@"}
        text = json.dumps(document).replace('"@"', nested(100_000))
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text.encode() + b"\0" * 4)
        os.chown(path, OTHER_UID, OTHER_UID)
    assert_refused(restore(shared, path), "is not valid", why)
    assert_serving_with_nothing_left(shared)


def resident_peak_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def test_a_header_beyond_the_limit_is_refused_before_it_is_read(shared):
    """A 44 MiB header of 700k entries took 632 MB of the daemon to refuse on main."""
    path = os.path.join(shared.shared_dir, "huge-header.safetensors")
    entry = '"t{}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}'
    text = "{" + ",".join(entry.format(i, 4 * i, 4 * i + 4) for i in range(700_000)) + "}"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode() + b"\0" * 4 * 700_000)
    os.chown(path, OTHER_UID, OTHER_UID)
    before = resident_peak_bytes(shared.process.pid)
    for _ in range(4):
        assert_refused(restore(shared, path), "is not valid", f"its header is {len(text)} bytes",
                       "the limit is 16777216")
    assert resident_peak_bytes(shared.process.pid) - before < 32 << 20  # it was never read
    assert_serving_with_nothing_left(shared)


def test_a_restore_by_a_user_of_a_file_they_may_not_read_is_refused(shared):
    path = forge(os.path.join(shared.shared_dir, "roots.safetensors"), owner=None)
    os.chmod(path, 0o600)
    assert_refused(restore(shared, path), "Permission denied")
    assert_serving_with_nothing_left(shared)
