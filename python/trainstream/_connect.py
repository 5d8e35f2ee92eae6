"""Finding or starting trainstreamd, and the Python face of a connection to it.

Address resolution (connect(address=None, spawn="auto")):
  1. the `address` argument, else 2. $TRAINSTREAM_ADDRESS, else 3. the service socket
     /run/trainstream/trainstreamd.sock.
Only when neither 1 nor 2 is given and nothing listens on 3 does spawn="auto" start a private daemon
for this process (it exits with the process). An explicit address where nothing listens is an error.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from trainstream import _C
from trainstream._C import TrainstreamError

SERVICE_SOCKET = "/run/trainstream/trainstreamd.sock"
# Where a wheel puts trainstreamd and trainstreamctl (python/CMakeLists.txt); absent in a source tree.
PACKAGED_BINARIES = Path(__file__).resolve().parent / "_bin"
DEFAULT_WAIT_TIMEOUT_S = 300.0
_private_daemon: "PrivateDaemon | None" = None


def check_wait_timeout(value, what: str) -> float:
    """A wait timeout in seconds: a finite number > 0 (`what` names where it came from)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise TrainstreamError(f"{what} must be a number of seconds > 0, not {value!r}") from None
    if not 0 < seconds <= 1e9:  # also refuses nan and inf
        raise TrainstreamError(f"{what} must be a number of seconds in (0, 1e9], not {value!r}")
    return seconds


def wait_timeout_s() -> float:
    """How long a native wait (for other ranks, for the daemon) may go without progress before it
    raises TrainstreamError: $TRAINSTREAM_WAIT_TIMEOUT seconds, else 300."""
    value = os.environ.get("TRAINSTREAM_WAIT_TIMEOUT")
    return DEFAULT_WAIT_TIMEOUT_S if value is None else check_wait_timeout(value, "TRAINSTREAM_WAIT_TIMEOUT")


def _native_connect(path: str, timeout_s: float) -> _C.Client:
    return _C.Client.connect(path, timeout_s, wait_timeout_s())


def _socket_path(address: str) -> str:
    return address[len("unix:"):] if address.startswith("unix:") else address


def daemon_binary() -> str:
    """The trainstreamd executable: $TRAINSTREAMD, else the one a wheel installed inside this package
    (PACKAGED_BINARIES: found even when the environment's bin/ is not on PATH, and of this package's
    version), else the one on PATH."""
    explicit = os.environ.get("TRAINSTREAMD")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise TrainstreamError(f"TRAINSTREAMD={explicit} is not an executable file")
        return explicit
    packaged = PACKAGED_BINARIES / "trainstreamd"
    if os.access(packaged, os.X_OK):
        return str(packaged)
    found = shutil.which("trainstreamd")
    if found is None:
        raise TrainstreamError("trainstreamd not found: install trainstream with pip, or set TRAINSTREAMD")
    return found


def wait_until_serving(process: subprocess.Popen, socket_path: str, timeout_s: float, log_tail) -> None:
    """Waits until the trainstreamd `process` answers a handshake on `socket_path`; raises
    TrainstreamError (with `log_tail()`) if it exits or does not answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise TrainstreamError(f"trainstreamd exited with code {process.returncode}: {log_tail()}")
        if os.path.exists(socket_path):
            try:
                _C.Client.connect(socket_path, 1.0)
                return
            except TrainstreamError:
                pass
        time.sleep(0.02)
    raise TrainstreamError(f"trainstreamd did not start within {timeout_s} s: {log_tail()}")


class PrivateDaemon:
    """A trainstreamd started for this process only; it exits when this process does. With `trace_dir`
    each job writes its step timeline there when the daemon stops (benchmarks: trainstreamd --trace-dir)."""

    def __init__(self, threads: int | None = None, log_level: str = "warn", startup_timeout_s: float = 20.0,
                 worker_nice: int | None = None, trace_dir: str | None = None, worker_policy: str | None = None):
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = runtime if runtime and os.access(runtime, os.W_OK) else tempfile.gettempdir()
        self._dir = tempfile.mkdtemp(prefix="trainstream-", dir=base)
        self.socket_path = os.path.join(self._dir, "trainstreamd.sock")
        self._log_path = os.path.join(self._dir, "trainstreamd.log")
        args = [daemon_binary(), "--socket", self.socket_path, "--log-level", log_level,
                "--parent-pid", str(os.getpid())]
        if threads:
            args += ["--threads", str(threads)]
        if worker_nice is not None:
            args += ["--worker-nice", str(worker_nice)]
        if trace_dir:
            args += ["--trace-dir", trace_dir]
        if worker_policy:
            args += ["--worker-policy", worker_policy]
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)
        atexit.register(self.stop)

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            wait_until_serving(self.process, self.socket_path, timeout_s, self.log_tail)
        except TrainstreamError:
            self.stop()
            raise

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self._log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


class Client:
    """A connection to trainstreamd."""

    def __init__(self, native: _C.Client, private: PrivateDaemon | None = None):
        self._native = native
        self.private_daemon = private

    @property
    def socket_path(self) -> str:
        return self._native.socket_path

    @property
    def peer_address(self) -> str:
        """The "host:port" at which the other nodes' daemons reach this daemon's peer plane
        (--peer-advertise, or derived from --peer-listen); "" when it has none."""
        return self._native.info["peer_address"]

    def ping(self) -> dict:
        """The daemon's version and pid: {'daemon_version', 'protocol_version', 'pid', 'kernel',
        'peer_address'}."""
        return self._native.ping()

    def stats(self) -> dict:
        """Jobs and memory figures of the daemon."""
        return self._native.stats()

    def drop_job(self, job: str, force: bool = False, uid: int | None = None) -> None:
        """Removes a job of this user and its state from the daemon (root: of the user `uid`)."""
        self._native.drop_job(job, force, uid)

    def attach(self, job: str, rank: int, spec: _C.LayoutSpec, seed: int, transport: str = "host",
               device: str = "cpu", wait_timeout_s: float | None = None) -> _C.RankSession:
        """Attaches rank `rank` of job `job` (made in the layout `spec` if new) and returns its session: the
        rank's view of the job's shared memory and its line to the daemon. `trainstream.wrap` attaches for
        you; this is the layer below it, for tools that drive the ring protocol themselves."""
        return self._native.attach(job, rank, spec, seed, transport, device, wait_timeout_s=wait_timeout_s)

    def __repr__(self) -> str:
        kind = "private" if self.private_daemon else "shared"
        return f"trainstream.Client({self.socket_path!r}, {kind})"


def connect(address: str | None = None, spawn: str | bool = "auto", timeout_s: float = 5.0) -> Client:
    """Connects to trainstreamd; see the module docstring for how the address is found."""
    global _private_daemon
    if spawn not in ("auto", False, True):
        raise ValueError(f"spawn must be 'auto', True or False, not {spawn!r}")
    explicit = address or os.environ.get("TRAINSTREAM_ADDRESS")
    if explicit:
        path = _socket_path(explicit)
        if not os.path.exists(path):
            raise TrainstreamError(f"nothing listens at {path} (from "
                                   f"{'the address argument' if address else '$TRAINSTREAM_ADDRESS'})")
        return Client(_native_connect(path, timeout_s))
    if spawn is not True and os.path.exists(SERVICE_SOCKET):
        try:
            return Client(_native_connect(SERVICE_SOCKET, timeout_s))
        except TrainstreamError:
            if spawn is False:
                raise
    if spawn is False:
        raise TrainstreamError(f"no trainstreamd listens on {SERVICE_SOCKET} and spawn=False")
    if _private_daemon is None or _private_daemon.process.poll() is not None:
        _private_daemon = PrivateDaemon()
    return Client(_native_connect(_private_daemon.socket_path, timeout_s), _private_daemon)
