"""Fixtures that run real trainstreamd processes on private sockets.

The daemon binary is connect()'s: $TRAINSTREAMD (scripts/test.sh points it at the build tree), else the
installed wheel's (scripts/test_wheel.sh), else PATH; trainstreamctl from $TRAINSTREAMCTL, else the build
tree beside that daemon, else beside it, else PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import torch

import trainstream
from trainstream._connect import daemon_binary, wait_until_serving


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def raw_spec(params: list[tuple], world_size: int = 1) -> trainstream._C.LayoutSpec:
    """A job of (name, shape, dtype code, group) parameters, one param group, 1 MiB buckets, for tests that
    attach with client.attach: the daemon decides its state halves and speculation."""
    return trainstream._C.LayoutSpec(params=[trainstream._C.ParamSpec(*p) for p in params], bucket_bytes=1 << 20,
                                     world_size=world_size, state_halves=0, speculative_clipping=2)


def ctl_binary() -> str:
    explicit = os.environ.get("TRAINSTREAMCTL")
    if explicit:
        return explicit
    daemon_dir = os.path.dirname(daemon_binary())
    for candidate in (os.path.join(daemon_dir, "..", "client", "trainstreamctl", "trainstreamctl"),
                      os.path.join(daemon_dir, "trainstreamctl")):
        if os.access(candidate, os.X_OK):
            return os.path.normpath(candidate)
    found = shutil.which("trainstreamctl")
    assert found, "trainstreamctl not found: set TRAINSTREAMCTL or build it"
    return found


def ctl(socket: str | None, *args: str, check: bool = True, env: dict | None = None, user: int | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs trainstreamctl (as `user`, if given) and returns it; with `check`, asserts exit code 0."""
    command = [ctl_binary(), *(["--socket", socket] if socket else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, user=user,
                            group=user, extra_groups=[] if user is not None else None, stdin=subprocess.DEVNULL)
    if check:
        assert result.returncode == 0, f"{command} exited {result.returncode}: {result.stderr}"
    return result


def ctl_json(socket: str | None, *args: str, **kwargs):
    """trainstreamctl --json ARGS, parsed (one JSON document per output line: a list if several)."""
    lines = [json.loads(line) for line in ctl(socket, "--json", *args, **kwargs).stdout.splitlines() if line]
    return lines[0] if len(lines) == 1 else lines


_DAEMON_DIRS: list[str] = []  # removed when the session ends: a successor daemon may reuse one's socket
# Sockets of test daemons that ended holding jobs, or died under their test: a shared daemon's jobs stay
# in /dev/shm for its successor (on the same socket), which the session's end starts to drop them.
_LEFT_JOBS: set[str] = set()


def pytest_sessionfinish(session, exitstatus):
    for socket in sorted(_LEFT_JOBS):
        _drop_jobs_left_on(socket)
    for folder in _DAEMON_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


def _drop_jobs_left_on(socket: str) -> None:
    os.makedirs(os.path.dirname(socket), exist_ok=True)  # its fixture may have removed the folder
    _DAEMON_DIRS.append(os.path.dirname(socket))
    try:
        successor = Daemon(socket=socket)  # adopts what its predecessor left
        try:
            client = successor.client()
            for job in client.stats()["jobs"]:
                client.drop_job(job["name"], force=True)
        finally:
            successor.stop()
    except Exception as e:  # cleaning up must not fail the session
        print(f"jobs left by the test daemon on {socket} not dropped: {e}")


class Daemon:
    """A trainstreamd on its own socket, stopped (SIGTERM, then SIGKILL) at teardown."""

    def __init__(self, *extra: str, threads: int = 2, prefix: tuple[str, ...] = (), socket: str | None = None):
        """`prefix` wraps the command, e.g. ("ip", "netns", "exec", NAME) to run it in a namespace;
        `socket` defaults to a new one (a daemon restarted on an old one is its successor)."""
        self.dir = tempfile.mkdtemp(prefix="ts-test-")
        _DAEMON_DIRS.append(self.dir)
        self.socket = socket or os.path.join(self.dir, "d.sock")
        self.log = open(os.path.join(self.dir, "log"), "w+b")
        self.process = subprocess.Popen([*prefix, daemon_binary(), "--socket", self.socket, "--threads", str(threads),
                                         "--log-level", "debug", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_serving(self.process, self.socket, 20, self.output)

    def client(self) -> trainstream.Client:
        return trainstream.connect(self.socket)

    def _holds_jobs(self) -> bool:
        try:
            return bool(self.client().stats()["jobs"])
        except trainstream.TrainstreamError:
            return True

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.process.poll() is not None or self._holds_jobs():
            _LEFT_JOBS.add(self.socket)
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.stop()


OTHER_UID = 65534  # "nobody": tests that run as root run clients as this uid


def start_shared_daemon(*extra: str, prefix: tuple[str, ...] = ()) -> Daemon:
    """A daemon every uid may reach: socket 0666 in `shared_dir`, a directory every uid may write
    (sticky, as /tmp); `extra` flags and `prefix` as for Daemon. Stop it and remove `shared_dir` after."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run clients as another uid")
    shared_dir = tempfile.mkdtemp(prefix="ts-shared-")
    os.chmod(shared_dir, 0o1777)
    config = os.path.join(shared_dir, "open.toml")
    with open(config, "w") as f:
        f.write("socket_mode = 0o666\n")
    d = Daemon("--config", config, *extra, prefix=prefix, socket=os.path.join(shared_dir, "d.sock"))
    d.shared_dir = shared_dir
    return d


@pytest.fixture
def shared_daemon():
    d = start_shared_daemon()
    yield d
    d.stop()
    shutil.rmtree(d.shared_dir, ignore_errors=True)


@pytest.fixture
def client(daemon):
    return daemon.client()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def memory_budget(monkeypatch):
    """Sets the memory budget (MiB) that wrap's automatic modes decide against ($TRAINSTREAM_MEMORY_BUDGET_MB)."""
    def set_mib(mib: float):
        monkeypatch.setenv("TRAINSTREAM_MEMORY_BUDGET_MB", str(mib))
    return set_mib
