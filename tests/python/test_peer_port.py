"""The peer port under abuse, with real daemons on loopback: a flood of plain TCP connections and of
connections that speak HTTP/2 without the secret, against a daemon limited to 256 descriptors (issue 46),
leaves local training and the control socket working, and a multi-node job through that port works
after it; a peer secret file other users can read is warned about."""

from __future__ import annotations

import os
import socket
import stat

import torch
from conftest import Daemon, wait_until
from test_peers import SECRET, free_port, start_ranks, stop
from test_ranks import reference

import trainstream

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def start_node(tmp_path, node, *prefix):
    secret_file = tmp_path / f"secret{node}"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"
    daemon = Daemon("--peer-listen", address, "--peer-secret-file", str(secret_file), "--peer-timeout", "3",
                    prefix=prefix)
    return daemon, address


def flood(address: str, plain: int, speaking: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    connections = []
    for i in range(plain + speaking):
        connection = socket.create_connection((host, int(port)), timeout=5)
        if i >= plain:
            connection.sendall(PREFACE)
        connections.append(connection)
    return connections


def train_locally(daemon: Daemon, steps: int = 3) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 1))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=daemon.client(), job="local")
    for _ in range(steps):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    trainstream.synchronize(model)
    trainstream.unwrap(model)
    daemon.client().drop_job("local")


def test_a_flood_of_the_peer_port_leaves_local_training_and_later_peers_working(tmp_path):
    flooded, flooded_address = start_node(tmp_path, 0, "prlimit", "--nofile=256", "--")
    other, other_address = start_node(tmp_path, 1)
    try:
        connections = flood(flooded_address, plain=400, speaking=100)  # 500 connections, 256 descriptors
        try:
            assert flooded.client().ping()["peer_address"] == flooded_address
            train_locally(flooded)
        finally:
            for connection in connections:
                connection.close()
        assert wait_until(lambda: "peer port:" in flooded.output() and "connections closed without" in
                          flooded.output(), 10), flooded.output()
        procs = start_ranks([flooded, other], [flooded_address, other_address], tmp_path, 1)
        logs = [p.communicate(timeout=180)[0] for _, p in procs]
        assert [p.returncode for _, p in procs] == [0, 0], "\n".join(logs)
        replicas = [torch.load(out) for out, _ in procs]
        assert all(torch.equal(a, b) for a, b in zip(*replicas)), "replicas differ"
        assert max((a - b).abs().max().item() for a, b in zip(replicas[0], reference())) <= 1e-5
        assert "Too many open files" not in flooded.output()
    finally:
        stop([flooded, other])


def test_a_secret_file_others_can_read_is_warned_about(tmp_path):
    daemon, _ = start_node(tmp_path, 0)
    shared = tmp_path / "shared-secret"
    shared.write_text(SECRET)
    shared.chmod(0o644)
    readable = Daemon("--peer-listen", "127.0.0.1:0", "--peer-secret-file", str(shared))
    try:
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o644
        assert f"the peer secret file '{shared}' has mode 0644" in readable.output()
        assert "chmod 600" in readable.output()
        assert "has mode" not in daemon.output()  # 0600
    finally:
        stop([daemon, readable])
