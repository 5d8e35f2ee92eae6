"""wrap(distributed="auto") with an initialized torch.distributed group and no torchrun variables: two
processes from torch.multiprocessing.spawn with a gloo file-store group, each on its half of every batch,
against one process on the whole batch (test_ranks.reference), with bit-identical replicas. The ranks
agree on the node-local ranks, the job name and the daemon through the group."""

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
from test_ranks import STEPS, reference  # noqa: E402

WORLD = 2


def spawn_ranks(tmp_path, address, accumulation_steps=1, max_grad_norm=None, timeout=240):
    out = tmp_path / "out"
    out.mkdir()
    context = mp.start_processes(worker, args=(WORLD, str(tmp_path / "store"), address, STEPS, accumulation_steps,
                                               max_grad_norm, str(out)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the spawned ranks did not finish within {timeout} s")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def assert_data_parallel(results, **options):
    first = results[0]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["params"], other["params"])), "replicas differ"
        assert other["job"] == first["job"] and other["socket"] == first["socket"]
    assert first["world_size"] == WORLD and first["job"].startswith("dist-")
    expected = reference(**options)
    assert max((a - b).abs().max().item() for a, b in zip(first["params"], expected)) <= 1e-4


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"accumulation_steps": 2}],
                         ids=["plain", "clipping", "accumulation"])
def test_spawned_ranks_of_a_process_group_train_as_one_process(daemon, tmp_path, options):
    assert_data_parallel(spawn_ranks(tmp_path, daemon.socket, **options), **options)


@pytest.mark.skipif(os.path.exists(SERVICE_SOCKET), reason="a service daemon would be used instead")
def test_without_a_daemon_the_first_rank_starts_one_for_both(tmp_path):
    results = spawn_ranks(tmp_path, None)
    assert_data_parallel(results)
    assert "trainstream-" in results[0]["socket"]  # a private daemon's socket
