"""trainstreamd as an operator meets it: flags, config files, signals, one daemon per socket, the health
service, and how trainstream.connect() finds (or starts) a daemon. Real processes throughout; every wait
has a timeout."""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from conftest import Daemon, wait_until

import trainstream
from trainstream import TrainstreamError, _connect
from trainstream._connect import daemon_binary, wait_until_serving

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_CONFIG = os.path.join(REPO, "deploy", "trainstreamd.toml")
FLAGS = ["--help", "--version", "--config", "--socket", "--threads", "--worker-nice", "--reserved-cores", "--log-level",
         "--job-ttl", "--max-jobs", "--max-host-bytes", "--max-jobs-per-uid", "--max-host-bytes-per-uid",
         "--parent-pid"]


def run_daemon(*args: str, timeout: float = 10) -> subprocess.CompletedProcess:
    """Runs trainstreamd to completion (for invocations that must exit by themselves)."""
    return subprocess.run([daemon_binary(), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def tmp(tmp_path_factory):
    # Short paths: a Unix socket path must fit in 107 bytes, and pytest's tmp_path can be long.
    path = tempfile.mkdtemp(prefix="ts-cli-")
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


# ----- flags and config -----

def test_help_lists_every_flag_and_exits_0():
    result = run_daemon("--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    for flag in FLAGS:
        assert flag in result.stdout, f"{flag} missing from --help:\n{result.stdout}"


def test_version_prints_the_package_version():
    result = run_daemon("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == trainstream.__version__


def test_unknown_flag_is_refused_by_name():
    result = run_daemon("--no-such-flag")
    assert result.returncode != 0
    assert "--no-such-flag" in result.stderr


def test_bad_log_level_is_refused_by_name():
    result = run_daemon("--log-level", "loud")
    assert result.returncode != 0
    assert "--log-level" in result.stderr and "loud" in result.stderr


def test_malformed_config_file_is_refused_with_file_and_line(tmp):
    path = os.path.join(tmp, "bad.toml")
    with open(path, "w") as f:
        f.write('threads = 2\nsocket = "unterminated\n')
    result = run_daemon("--config", path)
    assert result.returncode != 0
    assert "cannot parse config file" in result.stderr and path in result.stderr and "line 2" in result.stderr


def test_unknown_config_key_is_refused_by_name(tmp):
    path = os.path.join(tmp, "unknown.toml")
    with open(path, "w") as f:
        f.write("threads = 2\nworker_threads = 4\n")
    result = run_daemon("--config", path)
    assert result.returncode != 0
    assert "unknown key 'worker_threads'" in result.stderr


def test_config_value_of_the_wrong_type_is_refused_by_name(tmp):
    path = os.path.join(tmp, "typed.toml")
    with open(path, "w") as f:
        f.write('max_jobs = "many"\n')
    result = run_daemon("--config", path)
    assert result.returncode != 0
    assert "max_jobs" in result.stderr


def test_missing_config_file_is_refused(tmp):
    path = os.path.join(tmp, "absent.toml")
    result = run_daemon("--config", path)
    assert result.returncode != 0
    assert path in result.stderr


def test_bad_log_level_in_config_file_is_refused_by_name(tmp):
    # The flag is checked against the known levels; the same key in a file must be too (today an unknown
    # level in the file is silently taken as "off" by spdlog, and the daemon runs with no logs).
    path = os.path.join(tmp, "level.toml")
    with open(path, "w") as f:
        f.write('log_level = "loud"\n')
    process = subprocess.Popen([daemon_binary(), "--config", path, "--socket", os.path.join(tmp, "d.sock")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        _, stderr = process.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
        pytest.fail("trainstreamd started with log_level = \"loud\" in its config file")
    assert process.returncode != 0
    assert "log_level" in stderr and "loud" in stderr


def test_example_config_is_accepted(tmp):
    assert os.path.exists(EXAMPLE_CONFIG)
    socket = os.path.join(tmp, "d.sock")
    d = Daemon("--config", EXAMPLE_CONFIG, socket=socket, threads=1)
    try:
        info = trainstream.connect(socket).ping()
        assert info["pid"] == d.process.pid
        assert info["daemon_version"] == trainstream.__version__
        # socket_mode from the example file (0o660) is applied to the socket.
        assert os.stat(socket).st_mode & 0o777 == 0o660
    finally:
        assert d.stop() == 0


def _nice_of_threads_in(task: str) -> int:
    """The nice value of the thread of /proc/PID/task/TID (field 19 of its stat)."""
    with open(f"{task}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _nice_of_threads(pid: int) -> list[int]:
    return [_nice_of_threads_in(task) for task in glob.glob(f"/proc/{pid}/task/*")]


def test_worker_threads_run_at_worker_nice_and_the_others_do_not(tmp):
    own = os.nice(0)
    d = Daemon("--worker-nice", "13", threads=3)
    try:
        nice = _nice_of_threads(d.process.pid)
        assert nice.count(13) == 3, nice  # the three workers
        assert nice.count(own) == len(nice) - 3, nice  # main, gRPC and engine threads keep the process's
    finally:
        assert d.stop() == 0


def _core_of(cpu: int) -> tuple[str, str]:
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
        return package.read().strip(), core.read().strip()


def test_workers_keep_off_the_reserved_cores(tmp):
    allowed = sorted(os.sched_getaffinity(0))
    cores = list(dict.fromkeys(_core_of(cpu) for cpu in allowed))  # in the order of their first CPU
    if len(cores) < 2:
        pytest.skip("one physical core: none can be reserved")
    left = {cpu for cpu in allowed if _core_of(cpu) != cores[-1]}
    d = Daemon("--worker-nice", "13", "--reserved-cores", "1", threads=len(left))
    try:
        workers = [int(os.path.basename(task)) for task in glob.glob(f"/proc/{d.process.pid}/task/*")
                   if _nice_of_threads_in(task) == 13]
        assert len(workers) == len(left)
        assert set().union(*(os.sched_getaffinity(tid) for tid in workers)) == left
    finally:
        assert d.stop() == 0


def test_reserving_every_core_is_refused_by_name(tmp):
    result = run_daemon("--socket", os.path.join(tmp, "d.sock"), "--reserved-cores", "4096")
    assert result.returncode == 2
    assert "reserved_cores is 4096 but this daemon may run on" in result.stderr
    assert not os.path.exists(os.path.join(tmp, "d.sock"))


def test_kubernetes_configmap_config_is_accepted(tmp):
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(REPO, "deploy", "kubernetes", "daemonset.yaml")) as f:
        documents = list(yaml.safe_load_all(f))
    configmap = next(d for d in documents if d and d["kind"] == "ConfigMap")
    path = os.path.join(tmp, "configmap.toml")
    with open(path, "w") as f:
        f.write(configmap["data"]["trainstreamd.toml"])
    d = Daemon("--config", path, socket=os.path.join(tmp, "d.sock"), threads=1)
    assert d.stop() == 0


def test_flags_override_the_config_file(tmp):
    path = os.path.join(tmp, "c.toml")
    with open(path, "w") as f:
        f.write(f'socket = "{os.path.join(tmp, "from-file.sock")}"\nthreads = 3\nsocket_mode = 0o600\n')
    socket = os.path.join(tmp, "from-flag.sock")
    d = Daemon("--config", path, socket=socket, threads=2)
    try:
        assert not os.path.exists(os.path.join(tmp, "from-file.sock"))
        assert trainstream.connect(socket).stats()["worker_threads"] == 2
        assert os.stat(socket).st_mode & 0o777 == 0o600
    finally:
        assert d.stop() == 0


def test_the_daemon_raises_its_open_file_limit_to_the_hard_limit(tmp):
    # Each connection takes a descriptor; at the limit gRPC stops accepting for good.
    d = Daemon(prefix=("prlimit", "--nofile=64:4096"), socket=os.path.join(tmp, "d.sock"), threads=1)
    try:
        with open(f"/proc/{d.process.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
    finally:
        assert d.stop() == 0


# ----- signals, sockets -----

def test_sigterm_shuts_down_cleanly_and_the_trainer_is_told():
    d = Daemon()
    try:
        client = d.client()
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client,
                                      job="cli-sigterm")
        x = torch.ones(4, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        trainstream.synchronize(model)
        key = next(j["job_key"] for j in client.stats()["jobs"] if j["name"] == "cli-sigterm")
        assert glob.glob(f"/dev/shm/trainstream.*.{key}.*"), "the job's segments should exist while it runs"

        model(x).pow(2).mean().backward()
        opt.step()  # weights of step 2 are in flight or ready; the next forward waits for them
        d.process.send_signal(signal.SIGTERM)
        try:
            rc = d.process.wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainstreamd did not exit within 5 s of SIGTERM:\n{d.output()}")
        assert rc == 0, d.output()
        assert not os.path.exists(d.socket), "the socket file was left behind"
        assert not glob.glob(f"/dev/shm/trainstream.*.{key}.*"), "segments of the job were left behind"
        assert "shutting down" in d.output()

        # The trainer hears of it at its next call into the protocol: a forward whose weights are not
        # yet in, or at the latest the next backward's gradient hand-off. Never a hang.
        start = time.monotonic()
        with pytest.raises(TrainstreamError, match="shutting down|trainstreamd"):
            for _ in range(3):
                trainstream.synchronize(model)
                model(x).pow(2).mean().backward()
                opt.step()
        assert time.monotonic() - start < 5
    finally:
        d.stop()


def test_after_sigterm_the_next_synchronize_and_forward_raise():
    # docs/architecture.md, "Failure handling": a client raises at its next hook or step once the daemon is
    # gone. Here the new weights were already in when the daemon stopped, so nothing needs to wait;
    # synchronize() and the forward pre-hook must still report the lost daemon instead of carrying on until
    # the next backward.
    d = Daemon()
    try:
        model = torch.nn.Linear(8, 1)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=d.client(),
                                      job="cli-sigterm-sync")
        model(torch.ones(4, 8)).pow(2).mean().backward()
        opt.step()
        trainstream.synchronize(model)
        d.process.send_signal(signal.SIGTERM)
        assert d.process.wait(5) == 0
        time.sleep(0.3)  # the session's reader thread has heard the shutdown by now
        with pytest.raises(TrainstreamError, match="shutting down"):
            trainstream.synchronize(model)
        with pytest.raises(TrainstreamError, match="shutting down"):
            model(torch.ones(4, 8))  # the forward pre-hook
    finally:
        d.stop()


@pytest.mark.parametrize("where", ["path", "abstract"])
def test_systemd_notify_ready_and_stopping(tmp, where):
    # What Type=notify in deploy/systemd/trainstreamd.service relies on: READY=1 once the socket
    # listens, STOPPING=1 on SIGTERM, sent to $NOTIFY_SOCKET (a path, or "@name": an abstract socket).
    # Every build does it (the wheel's too): daemon/systemd_notify.cpp speaks the protocol itself.
    import socket as sockets
    notify = sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM)
    if where == "path":
        notify_address = os.path.join(tmp, "notify")
        notify.bind(notify_address)
    else:
        notify_address = f"@trainstream-test-notify-{os.getpid()}"
        notify.bind("\0" + notify_address[1:])
    notify.settimeout(10)
    socket = os.path.join(tmp, "d.sock")
    process = subprocess.Popen([daemon_binary(), "--socket", socket, "--threads", "1"],
                               env=dict(os.environ, NOTIFY_SOCKET=notify_address), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        assert notify.recv(4096).decode().split("\n")[0] == "READY=1"
        trainstream.connect(socket).ping()  # listening by the time READY=1 came
        process.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in notify.recv(4096).decode()
        assert process.wait(5) == 0
    finally:
        notify.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_unreachable_notify_socket_is_logged_and_harmless(tmp):
    # A NOTIFY_SOCKET that names nothing (or is no socket address at all) costs a warning, not the daemon.
    for value in (os.path.join(tmp, "nobody-listens"), "relative/path"):
        socket = os.path.join(tmp, "d.sock")
        process = subprocess.Popen([daemon_binary(), "--socket", socket, "--threads", "1"],
                                   env=dict(os.environ, NOTIFY_SOCKET=value), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        try:
            wait_until_serving(process, socket, 20, lambda: "")
            trainstream.connect(socket).ping()
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=10)
            assert process.returncode == 0
            assert f"NOTIFY_SOCKET={value}" in output and "READY=1 not sent" in output, output
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_second_daemon_on_the_same_socket_is_refused(tmp):
    socket = os.path.join(tmp, "d.sock")
    first = Daemon(socket=socket, threads=1)
    try:
        result = run_daemon("--socket", socket, "--threads", "1")
        assert result.returncode != 0
        assert "another trainstreamd is listening" in result.stderr and socket in result.stderr
        # The first one is unharmed.
        assert trainstream.connect(socket).ping()["pid"] == first.process.pid
    finally:
        assert first.stop() == 0


def test_stale_socket_of_a_killed_daemon_is_replaced(tmp):
    socket = os.path.join(tmp, "d.sock")
    first = Daemon(socket=socket, threads=1)
    first.stop(signal.SIGKILL)
    assert os.path.exists(socket), "SIGKILL leaves the socket file behind"
    second = Daemon(socket=socket, threads=1)
    try:
        assert trainstream.connect(socket).ping()["pid"] == second.process.pid
    finally:
        assert second.stop() == 0


@pytest.mark.skipif(importlib.util.find_spec("grpc_health") is None,
                    reason="grpcio-health-checking is not installed")
def test_health_service_reports_serving(daemon):
    # In a separate interpreter: grpcio bundles its own gRPC core, which should not share a process
    # with trainstream._C's.
    code = textwrap.dedent(f"""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel("unix://{daemon.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    # Only the server as a whole ("") is registered; grpc_health_probe asks for "" by default.
    assert result.stdout.strip() == "SERVING"


# ----- trainstream.connect(): address resolution -----

@pytest.fixture
def no_service(monkeypatch, tmp):
    """No service socket and no $TRAINSTREAM_ADDRESS, whatever this machine runs."""
    monkeypatch.delenv("TRAINSTREAM_ADDRESS", raising=False)
    monkeypatch.setattr(_connect, "SERVICE_SOCKET", os.path.join(tmp, "no-service.sock"))


def test_explicit_address_where_nothing_listens_names_the_path(no_service, tmp):
    path = os.path.join(tmp, "nobody.sock")
    with pytest.raises(TrainstreamError, match=path):
        trainstream.connect(path)
    with pytest.raises(TrainstreamError, match=path):
        trainstream.connect("unix:" + path)


def test_explicit_address_of_a_dead_socket_file_fails_fast(no_service, tmp):
    socket = os.path.join(tmp, "d.sock")
    Daemon(socket=socket, threads=1).stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TrainstreamError):
        trainstream.connect(socket, timeout_s=2.0)
    assert time.monotonic() - start < 5


def test_trainstream_address_environment_variable_is_used(no_service, monkeypatch, daemon):
    monkeypatch.setenv("TRAINSTREAM_ADDRESS", "unix:" + daemon.socket)
    client = trainstream.connect()
    assert client.private_daemon is None
    assert client.ping()["pid"] == daemon.process.pid
    monkeypatch.setenv("TRAINSTREAM_ADDRESS", daemon.socket + ".absent")
    with pytest.raises(TrainstreamError, match="TRAINSTREAM_ADDRESS"):
        trainstream.connect()


def test_spawn_false_without_a_service_socket_is_an_error(no_service):
    with pytest.raises(TrainstreamError, match="spawn=False"):
        trainstream.connect(spawn=False)


def test_auto_spawn_starts_a_private_daemon_that_ends_with_its_process(tmp):
    code = textwrap.dedent(f"""
        import trainstream
        from trainstream import _connect
        _connect.SERVICE_SOCKET = {os.path.join(tmp, "no-service.sock")!r}
        client = trainstream.connect()
        assert client.private_daemon is not None, "expected a private daemon"
        info = client.ping()
        assert info["pid"] == client.private_daemon.process.pid
        print("PID", info["pid"], flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTREAM_ADDRESS"}
    env["XDG_RUNTIME_DIR"] = tmp
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    pid = int(result.stdout.split("PID")[1].split()[0])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1].split()[0] == "Z"  # a zombie has exited
        except FileNotFoundError:
            return True

    assert wait_until(gone, timeout=5), f"private trainstreamd (pid {pid}) outlived its process"
    assert not glob.glob(os.path.join(tmp, "trainstream-*", "trainstreamd.sock")), "private socket left behind"


# ----- quotas (the numbers docs/operations.md quotes) -----

def _wrap_small(client, job):
    model = torch.nn.Linear(8, 1)
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job=job)


def test_max_jobs_refuses_one_job_too_many_with_the_numbers():
    d = Daemon("--max-jobs", "1")
    try:
        client = d.client()
        model, _ = _wrap_small(client, "quota-a")
        with pytest.raises(TrainstreamError, match=r"job limit reached: 1 of max_jobs=1"):
            _wrap_small(client, "quota-b")
        trainstream.unwrap(model)
    finally:
        d.stop()


def test_max_host_bytes_refuses_a_job_that_does_not_fit_with_the_numbers():
    d = Daemon("--max-host-bytes", "4096")
    try:
        with pytest.raises(TrainstreamError,
                           match=r"host memory quota exceeded: job 'quota-big' needs \d+ bytes, 0 of "
                                 r"max_host_bytes=4096 in use"):
            _wrap_small(d.client(), "quota-big")
    finally:
        d.stop()
