"""Peer addresses of a multi-node job from the job's torch.distributed store instead of
TRAINSTREAM_PEERS: the daemons' advertised addresses, ranks on 2 loopback "nodes" that find each
other through a gloo process group's store or a torchrun-style agent store and train against the
single-process reference; and the clear errors of a daemon without a peer plane, a node that never
publishes, and a multi-node job with no store at all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from conftest import Daemon
from test_peers import free_port, start_nodes, stop
from test_ranks import HERE, STEPS, reference

import trainstream
from trainstream.distributed import peers as _peers


def start_env_ranks(daemons, tmp_path, ranks_per_node, store_env, *extra, steps=STEPS):
    """One rank process per (node, local rank) with torchrun's environment and no TRAINSTREAM_PEERS."""
    procs, world = [], len(daemons) * ranks_per_node
    for node, daemon in enumerate(daemons):
        for r in range(ranks_per_node):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINSTREAM_PEERS", "TRAINSTREAM_NODE"))}
            env.update(RANK=str(node * ranks_per_node + r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(ranks_per_node), GROUP_RANK=str(node), **store_env)
            out = tmp_path / f"node{node}-rank{r}.pt"
            procs.append((out, subprocess.Popen(
                [sys.executable, os.path.join(HERE, "rank_process.py"), "--socket", daemon.socket, "--job", "stored",
                 "--rank", str(r), "--world-size", "0", "--steps", str(steps), "--out", str(out), "--from-env",
                 *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    return procs


def finish(procs, timeout=180):
    logs = [p.communicate(timeout=timeout)[0] for _, p in procs]
    return [p.returncode for _, p in procs], logs


def assert_matches_reference(procs):
    codes, logs = finish(procs)
    assert codes == [0] * len(procs), "\n".join(logs)
    replicas = [torch.load(out) for out, _ in procs]
    for replica in replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replicas[0], replica)), "replicas differ"
    assert max((a - b).abs().max().item() for a, b in zip(replicas[0], reference())) <= 1e-5


def test_daemons_report_their_advertised_peer_address(tmp_path, daemon):
    daemons, peers = start_nodes(tmp_path, 1)
    secret = str(tmp_path / "secret0")
    port = free_port()
    wildcard = Daemon("--peer-listen", f"0.0.0.0:{port}", "--peer-secret-file", secret)
    explicit = Daemon("--peer-listen", "127.0.0.1:0", "--peer-secret-file", secret, "--peer-advertise", "node7:7150")
    any_port = Daemon("--peer-listen", "127.0.0.1:0", "--peer-secret-file", secret)
    try:
        assert daemons[0].client().peer_address == peers[0]  # a concrete listen host is advertised as is
        assert daemons[0].client().ping()["peer_address"] == peers[0]
        assert wildcard.client().peer_address == f"{socket.gethostname()}:{port}"
        assert explicit.client().peer_address == "node7:7150"
        host, bound = any_port.client().peer_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(bound) > 0  # port 0: the port the daemon was given
        assert daemon.client().peer_address == ""  # no peer plane
    finally:
        stop(daemons + [wildcard, explicit, any_port])


def test_peers_from_the_process_group_store_2x2(tmp_path):
    daemons, _ = start_nodes(tmp_path, 2)
    try:
        init = f"tcp://127.0.0.1:{free_port()}"
        assert_matches_reference(start_env_ranks(daemons, tmp_path, 2, {}, "--dist-init", init))
    finally:
        stop(daemons)


def test_peers_from_the_torchrun_agent_store(tmp_path):
    agent_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                             timeout=timedelta(seconds=60))
    daemons, _ = start_nodes(tmp_path, 2)
    try:
        env = dict(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent_store.port))
        assert_matches_reference(start_env_ranks(daemons, tmp_path, 1, env))
        assert agent_store.get("trainstream/stored/peer/1").decode() == daemons[1].client().peer_address
    finally:
        stop(daemons)


def test_a_daemon_without_peer_plane_fails_every_node_clearly(tmp_path):
    with_plane, _ = start_nodes(tmp_path, 1)
    daemons = with_plane + [Daemon()]  # node 1's daemon was started without --peer-listen
    try:
        init = f"tcp://127.0.0.1:{free_port()}"
        codes, logs = finish(start_env_ranks(daemons, tmp_path, 2, {}, "--dist-init", init, steps=1), timeout=60)
        assert all(code != 0 for code in codes), logs
        for log in logs[:2]:
            assert "node 1's trainstreamd has no peer plane (started without --peer-listen)" in log, log
        for log in logs[2:]:
            assert "this node's trainstreamd" in log and "has no peer plane" in log, log
    finally:
        stop(daemons)


def test_a_node_that_never_publishes_is_named_after_the_store_timeout(tmp_path):
    daemons, peers = start_nodes(tmp_path, 1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=1))
    try:
        with pytest.raises(trainstream.TrainstreamError, match="node 1 did not publish its trainstreamd peer address"):
            _peers.exchange(store, daemons[0].client(), "lonely", node_rank=0, nodes=2, local_rank=0)
        assert store.get("trainstream/lonely/peer/0").decode() == peers[0]
    finally:
        stop(daemons)


def test_several_nodes_without_peers_or_store_is_a_clear_error(client, monkeypatch):
    for name in ("TRAINSTREAM_PEERS", "TRAINSTREAM_NODE_RANK", "TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(trainstream.TrainstreamError, match="no torch.distributed store.*pass peers="):
        trainstream.wrap(model, opt, client=client, job="nostore")
