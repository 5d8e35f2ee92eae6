"""Fixtures that run real trainstreamd processes on private sockets.

The daemon binary comes from $TRAINSTREAMD (scripts/test.sh points it at the build tree) or PATH.
"""

from __future__ import annotations

import os
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


class Daemon:
    """A trainstreamd on its own socket, stopped (SIGTERM, then SIGKILL) at teardown."""

    def __init__(self, *extra: str, threads: int = 2, prefix: tuple[str, ...] = (), socket: str | None = None):
        """`prefix` wraps the command, e.g. ("ip", "netns", "exec", NAME) to run it in a namespace;
        `socket` defaults to a new one (a daemon restarted on an old one is its successor)."""
        self.dir = tempfile.mkdtemp(prefix="ts-test-")
        self.socket = socket or os.path.join(self.dir, "d.sock")
        self.log = open(os.path.join(self.dir, "log"), "w+b")
        self.process = subprocess.Popen([*prefix, daemon_binary(), "--socket", self.socket, "--threads", str(threads),
                                         "--log-level", "debug", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_serving(self.process, self.socket, 20, self.output)

    def client(self) -> trainstream.Client:
        return trainstream.connect(self.socket)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
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
