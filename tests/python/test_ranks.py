"""Data-parallel ranks of one job sharing one daemon (CPU mode): N processes, each on its shard of
the batch, against one process training on the whole batch with torch.optim.AdamW."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import trainstream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_process import batch, make_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 20


def reference(accumulation_steps=1, max_grad_norm=None):
    model = make_model(seed=100)  # rank 0's initial weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(STEPS):
        for micro in range(accumulation_steps):
            x, y = batch(step * accumulation_steps + micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def run_ranks(daemon, tmp_path, world_size, *extra):
    job = f"ddp{world_size}-{os.getpid()}-{len(os.listdir(tmp_path))}"
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "rank_process.py"), "--socket", daemon.socket,
                               "--job", job, "--rank", str(r), "--world-size", str(world_size), "--steps", str(STEPS),
                               "--out", outs[r], *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world_size, "\n".join(logs)
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"accumulation_steps": 3}],
                         ids=["plain", "clipping", "accumulation"])
def test_ranks_match_single_process_reference(daemon, tmp_path, world_size, options):
    extra = []
    if "max_grad_norm" in options:
        extra += ["--max-grad-norm", str(options["max_grad_norm"])]
    if "accumulation_steps" in options:
        extra += ["--accumulation-steps", str(options["accumulation_steps"])]
    replicas = run_ranks(daemon, tmp_path, world_size, *extra)
    expected = reference(**options)
    for replica in replicas[1:]:  # bit-identical replicas
        assert all(torch.equal(a, b) for a, b in zip(replicas[0], replica))
    assert max((a - b).abs().max().item() for a, b in zip(replicas[0], expected)) <= 1e-5
    stats = next(j for j in daemon.client().stats()["jobs"] if j["world_size"] == world_size)
    assert stats["completed_step"] == STEPS  # one update per step for all ranks together


def test_ranks_from_torchrun_environment(daemon, tmp_path):
    """examples/torchrun_ddp.py under torchrun's variables: ranks and the job name come from them."""
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "torchrun_ddp.py")
    procs = []
    for r in range(2):
        env = dict(os.environ, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", RANK=str(r),
                   TORCHELASTIC_RUN_ID="test-run", TRAINSTREAM_ADDRESS=daemon.socket)
        procs.append(subprocess.Popen([sys.executable, example], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    assert "done" in logs[0]
    job = next(j for j in daemon.client().stats()["jobs"] if j["name"] == "torchrun-test-run")
    assert job["world_size"] == 2 and job["completed_step"] == 100


def test_torchruns_default_run_id_is_refused(client, monkeypatch):
    """torchrun without --rdzv-id names every run 'none': a new run would resume the last one's job."""
    for name, value in dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none").items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(trainstream.TrainstreamError, match="run id is 'none'.*--rdzv-id"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    assert client.stats()["jobs"] == []
