"""wrap(distributed="auto") with an initialized torch.distributed group and no torchrun variables: processes
from torch.multiprocessing.spawn with a gloo file-store group, each on its share of every batch, against
one process on the whole batch (test_ranks.reference), with bit-identical replicas. The ranks agree on the
node-local ranks, the job name and the daemon through the group; ranks of two "hosts" form two nodes whose
daemons all-reduce through the peer plane."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from trainstream._connect import SERVICE_SOCKET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_process import worker  # noqa: E402
from test_peers import start_nodes, stop  # noqa: E402
from test_ranks import STEPS, reference  # noqa: E402


def spawn_ranks(tmp_path, addresses, accumulation_steps=1, max_grad_norm=None, hosts=None, timeout=240):
    out = tmp_path / "out"
    out.mkdir()
    world = len(addresses)
    context = mp.start_processes(worker, args=(world, str(tmp_path / "store"), addresses, STEPS, accumulation_steps,
                                               max_grad_norm, str(out), hosts), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the spawned ranks did not finish within {timeout} s")
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_data_parallel(results, ranks_per_node=2, **options):
    first = results[0]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["params"], other["params"])), "replicas differ"
        assert other["job"] == first["job"]
    assert all(r["world_size"] == ranks_per_node for r in results) and first["job"].startswith("dist-")
    assert all(r["dp"] for r in results)  # the optimizer names its data-parallel group, as TrainStream 0.2's did
    expected = reference(**options)
    assert max((a - b).abs().max().item() for a, b in zip(first["params"], expected)) <= 1e-4


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"accumulation_steps": 2}],
                         ids=["plain", "clipping", "accumulation"])
def test_spawned_ranks_of_a_process_group_train_as_one_process(daemon, tmp_path, options):
    results = spawn_ranks(tmp_path, [daemon.socket] * 2, **options)
    assert_data_parallel(results, **options)
    assert results[0]["socket"] == results[1]["socket"] == daemon.socket


@pytest.mark.skipif(os.path.exists(SERVICE_SOCKET), reason="a service daemon would be used instead")
def test_without_a_daemon_the_first_rank_starts_one_for_both(tmp_path):
    results = spawn_ranks(tmp_path, [None, None])
    assert_data_parallel(results)
    assert results[0]["socket"] == results[1]["socket"] and "trainstream-" in results[0]["socket"]  # private


def test_ranks_on_two_hosts_form_two_nodes_joined_through_the_peer_plane(tmp_path):
    """Host names stand in for machines: ranks 0-1 on node0 with its daemon, 2-3 on node1 with another; the
    daemons' peer addresses travel through the group's store."""
    daemons, _ = start_nodes(tmp_path, 2)
    try:
        results = spawn_ranks(tmp_path, [daemons[0].socket] * 2 + [daemons[1].socket] * 2,
                              hosts=["node0", "node0", "node1", "node1"])
        assert_data_parallel(results)
        assert [r["socket"] for r in results] == [d.socket for d in daemons for _ in range(2)]
    finally:
        stop(daemons)
