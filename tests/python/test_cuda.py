"""The GPU path (parameters on CUDA), against torch on the same GPU, through both transports: cuda-ipc
(the daemon copies) and cuda-client-copy (the fallback). Skipped without CUDA; these run on the GPU
machine (scripts/device_run.sh)."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import trainstream
from trainstream import TrainstreamError

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True, params=["cuda-ipc", "cuda-client-copy"])
def transport(request, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_TRANSPORT", request.param)  # trainer subprocesses inherit it
    return request.param


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()


def batch(step, width=64, rows=32):
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randn(rows, width, device="cuda", generator=g), torch.randn(rows, 64, device="cuda", generator=g)


def train_pair(client, make_model, steps=20, accumulation_steps=1, max_grad_norm=None, width=64, **wrap):
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                                  client=client, accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm,
                                  **wrap)
    for step in range(steps):
        for m, o in ((model, opt), (reference, ref_opt)):
            for micro in range(accumulation_steps):
                x, y = batch(step * accumulation_steps + micro, width)
                torch.nn.functional.mse_loss(m(x), y).backward()
            if o is ref_opt and max_grad_norm:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm)
            o.step()
            o.zero_grad()
    trainstream.synchronize(model)
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def test_parity_fp32(client):
    assert train_pair(client, mlp) <= 1e-6


def test_parity_with_clipping(client):
    assert train_pair(client, mlp, max_grad_norm=0.1) <= 1e-6


def test_parity_with_accumulation(client):
    assert train_pair(client, mlp, accumulation_steps=4) <= 1e-6


def test_buckets_larger_than_a_staging_slot(client, monkeypatch):
    """cuda-ipc stages a bucket larger than a slot (a large embedding) piece by piece."""
    monkeypatch.setattr(trainstream._transport.CudaIpcTransport, "_SLOT_CAP", 4096)  # 64 KiB weights: 16 pieces
    assert train_pair(client, mlp, steps=5) <= 1e-6


def test_race_exposing_model(client):
    """Few FLOPs, many bytes: weights must be in place before each forward, gradients complete
    before they are sent. Any ordering bug shows up as divergence."""
    def wide():
        return torch.nn.Sequential(torch.nn.Linear(32, 131072), torch.nn.Linear(131072, 64)).cuda()

    assert train_pair(client, wide, steps=50, width=32, bucket_mb=4) <= 1e-5


def test_gpu_memory_holds_no_gradients_or_optimizer_state(client):
    gc.collect()  # what earlier tests left in reference cycles would count below
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()  # 134 MB of fp32 weights
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # What any forward and backward of this model allocate on first use, before the window measured below:
    # cuBLAS workspaces for the forward's thread and for autograd's (32 MiB each on an H100: the driver saw
    # 69-302 MB beyond the weights there without this, 2026-12-07), the caching allocator's blocks for the
    # activations. The gradients go as they come, as trainstream's hooks make them go.
    drop = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    for _ in range(2):
        model(torch.randn(16, 2048, device="cuda")).sum().backward()
    for handle in drop:
        handle.remove()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    for step in range(3):
        model(torch.randn(16, 2048, device="cuda")).sum().backward()
        opt.step()
    trainstream.synchronize(model)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert all(p.grad is None for p in model.parameters())
    # weights plus cuBLAS workspaces; torch's AdamW would hold 4x the weights (weights, gradients,
    # two moments)
    assert torch.cuda.memory_allocated() < param_bytes * 2
    assert free_before - free_after < param_bytes * 0.5, "the driver sees memory beyond weights and activations"


def test_bf16_parameters_under_autocast(client):
    torch.manual_seed(0)
    model = mlp().to(torch.bfloat16)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client)
    losses = []
    for step in range(30):
        x, y = batch(step % 4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    state = opt.state_dict()["state"][0]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].device.type == "cuda"


def test_job_reports_its_transport(client, transport):
    model = mlp()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job="cuda-transport")
    shown = next(j for j in client.stats()["jobs"] if j["name"] == "cuda-transport")["transports"][0]
    assert shown.startswith(f"{transport} on cuda") and torch.cuda.get_device_name() in shown
    trainstream.unwrap(model)
    client.drop_job("cuda-transport")


def test_gradient_memory_is_page_locked_before_the_first_backward(client, transport):
    if transport != "cuda-ipc":
        pytest.skip("with cuda-client-copy the trainer page-locks what it copies, in wrap()")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job="pin-ahead")
    deadline = time.monotonic() + 20
    pinned = 0
    while time.monotonic() < deadline and pinned < 2 * param_bytes:
        pinned = next(j for j in client.stats()["jobs"] if j["name"] == "pin-ahead")["pinned_bytes"]
        time.sleep(0.05)
    # the master weights (the initial weights' copies lock them too) and, ahead of any backward, the gradients
    assert pinned >= 2 * param_bytes, (pinned, param_bytes)
    trainstream.unwrap(model)
    client.drop_job("pin-ahead")


def test_two_processes_one_gpu_two_jobs(daemon):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    script = os.path.join(HERE, "trainer_process.py")
    argv = [sys.executable, script, "--socket", daemon.socket, "--steps", "20", "--device", "cuda"]
    procs = [subprocess.Popen([*argv, "--job", f"gpu{i}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    jobs = {j["name"]: j for j in daemon.client().stats()["jobs"]}
    assert jobs["gpu0"]["completed_step"] == 20 and jobs["gpu1"]["completed_step"] == 20


def test_daemon_exits_cleanly_after_gpu_jobs(daemon):
    """SIGTERM after a job that copied through the daemon's GPU streams: the daemon exits 0 (its copy
    queues were once released after the driver had gone, and the throw aborted it)."""
    trainer = subprocess.run([sys.executable, os.path.join(HERE, "trainer_process.py"), "--socket", daemon.socket,
                              "--steps", "3", "--device", "cuda", "--job", "exits"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=120)
    assert trainer.returncode == 0, trainer.stdout
    assert daemon.stop() == 0, daemon.output()[-2000:]
    assert "terminate called" not in daemon.output()


def test_trainer_killed_before_its_gradients_were_ready(daemon):
    """A trainer dies with GRAD_READY sent for gradients its GPU never computed: the daemon's copies
    for other trainers on the same GPU must not wait for them."""
    script = os.path.join(HERE, "trainer_process.py")
    argv = [sys.executable, script, "--socket", daemon.socket, "--device", "cuda"]
    dying = subprocess.run([*argv, "--job", "dies", "--steps", "2", "--die-behind-gpu-work"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
    assert dying.returncode == -signal.SIGKILL and "queued" in dying.stdout, dying.stdout
    survivor = subprocess.run([*argv, "--job", "lives", "--steps", "5"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60)
    assert survivor.returncode == 0 and "done" in survivor.stdout, survivor.stdout
    assert daemon.process.poll() is None, daemon.output()


def test_daemon_killed_mid_step(daemon):
    model = mlp()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=daemon.client())
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    daemon.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TrainstreamError):
        opt.step()
        model(x)
    assert time.monotonic() - start < 2.0
