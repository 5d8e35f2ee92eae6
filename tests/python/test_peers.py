"""Jobs spanning several daemons ("nodes", here on loopback): ranks on every node against one process
training on the whole batch; bit-identical replicas everywhere; a lost peer, a wrong secret and a
daemon without a peer plane each give a clear error on every rank, never a hang."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import Daemon
from test_ranks import HERE, STEPS, reference

SECRET = "a-shared-secret-of-the-test-nodes"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path, count, secrets=None, hosts=None, daemon_args=()):
    """`count` daemons with a peer plane: on loopback, or each in the network namespace of `hosts`
    ((namespace, address) pairs)."""
    daemons, peers = [], []
    for node in range(count):
        secret_file = tmp_path / f"secret{node}"
        secret_file.write_text((secrets or [SECRET] * count)[node] + "\n")
        namespace, host = hosts[node] if hosts else (None, "127.0.0.1")
        address = f"{host}:{free_port()}"
        prefix = ("ip", "netns", "exec", namespace) if namespace else ()
        daemons.append(Daemon("--peer-listen", address, "--peer-secret-file", str(secret_file), "--peer-timeout", "3",
                              *daemon_args, prefix=prefix))
        peers.append(address)
    return daemons, peers


def start_ranks(daemons, peers, tmp_path, ranks_per_node, *extra, steps=STEPS):
    procs = []
    for node, daemon in enumerate(daemons):
        for r in range(ranks_per_node):
            out = tmp_path / f"node{node}-rank{r}.pt"
            procs.append((out, subprocess.Popen(
                [sys.executable, os.path.join(HERE, "rank_process.py"), "--socket", daemon.socket, "--job", "multi",
                 "--rank", str(r), "--world-size", str(ranks_per_node), "--steps", str(steps), "--out", str(out),
                 "--peers", ",".join(peers), "--node-rank", str(node), *extra],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    return procs


def stop(daemons):
    for d in daemons:
        d.stop()


@pytest.mark.parametrize("nodes,ranks,options,daemon_args", [
    (2, 2, {}, ()), (3, 2, {}, ()), (2, 1, {"max_grad_norm": 0.05}, ("--peer-connections", "1"))],
    ids=["2x2", "3x2", "2x1-clipping-one-connection"])
def test_nodes_match_single_process_reference(tmp_path, nodes, ranks, options, daemon_args):
    daemons, peers = start_nodes(tmp_path, nodes, daemon_args=daemon_args)
    try:
        extra = ["--max-grad-norm", str(options["max_grad_norm"])] if options else []
        procs = start_ranks(daemons, peers, tmp_path, ranks, *extra)
        logs = [p.communicate(timeout=180)[0] for _, p in procs]
        assert [p.returncode for _, p in procs] == [0] * len(procs), "\n".join(logs)
        replicas = [torch.load(out) for out, _ in procs]
        for replica in replicas[1:]:
            assert all(torch.equal(a, b) for a, b in zip(replicas[0], replica)), "replicas differ"
        expected = reference(**options)
        assert max((a - b).abs().max().item() for a, b in zip(replicas[0], expected)) <= 1e-5
    finally:
        stop(daemons)


def wait_for_steps(proc, count, timeout=60):
    deadline, seen, lines = time.monotonic() + timeout, 0, []
    while time.monotonic() < deadline and seen < count:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        seen += line.startswith("step")
    assert seen >= count, "".join(lines)


def test_lost_peer_fails_every_rank_within_the_timeout(tmp_path):
    daemons, peers = start_nodes(tmp_path, 2)
    try:
        procs = start_ranks(daemons, peers, tmp_path, 1, steps=100000)
        wait_for_steps(procs[0][1], 3)
        daemons[1].stop(signal.SIGKILL)
        start = time.monotonic()
        survivor = procs[0][1]
        output = survivor.communicate(timeout=20)[0]
        assert survivor.returncode != 0
        assert "all-reduce between daemons failed" in output and peers[1] in output, output
        assert time.monotonic() - start < 3 + 5  # the peer timeout, plus process exit
        procs[1][1].communicate(timeout=20)
        assert procs[1][1].returncode != 0  # its own daemon died
    finally:
        stop(daemons)


def test_wrong_secret_is_refused(tmp_path):
    daemons, peers = start_nodes(tmp_path, 2, secrets=[SECRET, "another-secret-entirely-xyz"])
    try:
        procs = start_ranks(daemons, peers, tmp_path, 1, steps=3)
        logs = [p.communicate(timeout=60)[0] for _, p in procs]
        assert all(p.returncode != 0 for _, p in procs)
        assert any("wrong or missing peer secret" in log for log in logs), "\n".join(logs)
    finally:
        stop(daemons)


def test_job_with_peers_needs_a_peer_plane(daemon, tmp_path):
    procs = start_ranks([daemon], ["127.0.0.1:1", "127.0.0.1:2"], tmp_path, 1, steps=1)
    output = procs[0][1].communicate(timeout=60)[0]
    assert procs[0][1].returncode != 0
    assert "started without --peer-listen" in output, output


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: the project's own test hosts (root only)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    names = [f"ts{os.getpid()}a", f"ts{os.getpid()}b"]
    addresses = ["10.231.0.1", "10.231.0.2"]
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    for name in names:
        run("ip", "netns", "add", name)
    try:
        run("ip", "link", "add", "tsveth0", "netns", names[0], "type", "veth", "peer", "name", "tsveth1", "netns",
            names[1])
        for i, name in enumerate(names):
            run("ip", "-n", name, "addr", "add", f"{addresses[i]}/24", "dev", f"tsveth{i}")
            run("ip", "-n", name, "link", "set", f"tsveth{i}", "up")
            run("ip", "-n", name, "link", "set", "lo", "up")
        yield list(zip(names, addresses)), run
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_link_cut_mid_all_reduce_fails_every_rank(tmp_path, two_hosts):
    hosts, run = two_hosts
    daemons, peers = start_nodes(tmp_path, 2, hosts=hosts)
    try:
        procs = start_ranks(daemons, peers, tmp_path, 1, steps=100000)
        for _, proc in procs:
            wait_for_steps(proc, 3)
        run("ip", "-n", hosts[0][0], "link", "set", "tsveth0", "down")  # the link between the two hosts
        start = time.monotonic()
        outputs = [proc.communicate(timeout=30)[0] for _, proc in procs]
        assert all(proc.returncode != 0 for _, proc in procs), outputs
        assert all("all-reduce between daemons failed" in out for out in outputs), outputs
        assert time.monotonic() - start < 3 * 2 + 5  # a send and a receive may each wait out the timeout
    finally:
        stop(daemons)


def test_rank_killed_on_one_node_fails_the_others_and_the_daemons_stay_healthy(tmp_path):
    daemons, peers = start_nodes(tmp_path, 2)
    try:
        procs = start_ranks(daemons, peers, tmp_path, 1, steps=100000)
        for _, proc in procs:
            wait_for_steps(proc, 3)
        procs[1][1].send_signal(signal.SIGKILL)
        output = procs[0][1].communicate(timeout=20)[0]
        assert procs[0][1].returncode != 0 and "all-reduce between daemons failed" in output, output
        # A rank restarted on the failed node (as torchrun would) must not resume: the nodes may
        # have applied different buckets of the interrupted step.
        restarted = start_ranks(daemons[:1], peers, tmp_path, 1, steps=3)[0][1]
        output = restarted.communicate(timeout=60)[0]
        assert restarted.returncode != 0, output
        assert "cannot resume here" in output and "drop it on every node" in output, output
        for daemon in daemons:  # dropping the job must not wait on an all-reduce that cannot finish
            client = daemon.client()
            start = time.monotonic()
            client.drop_job("multi", force=True)
            assert time.monotonic() - start < 5
            assert client.ping()["pid"] == daemon.process.pid
        # the daemons serve a new multi-node job afterwards
        procs = start_ranks(daemons, peers, tmp_path, 1, steps=3)
        logs = [p.communicate(timeout=60)[0] for _, p in procs]
        assert [p.returncode for _, p in procs] == [0, 0], logs
    finally:
        stop(daemons)
