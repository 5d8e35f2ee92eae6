"""trainstream.activation_paging: saved activations wait in pinned host memory. The CUDA cases run
on the GPU machine (scripts/device_run.sh); the CPU case checks that nothing but CUDA tensors is
touched."""

from __future__ import annotations

import copy

import pytest
import torch

import trainstream
from trainstream import _pinned_buffers
from trainstream.activations import paging as _activations

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Wide(torch.nn.Module):
    """Large activations, few parameters; the transposed product saves a non-contiguous view."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 4096)
        self.down = torch.nn.Linear(4096, 256)
        self.mix = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        y = self.down(h)
        return (y.view(-1, 64, 4).transpose(1, 2) @ self.mix).square().mean()


def grads(model, x, paging: bool):
    model.zero_grad(set_to_none=True)
    if paging:
        with trainstream.activation_paging():
            loss = model(x)
    else:
        loss = model(x)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def wide_on_gpu():
    """Wide and a batch whose two saved 4096-wide activations take 128 MiB each."""
    torch.manual_seed(0)
    return Wide().cuda(), torch.randn(8192, 256, device="cuda")


def test_parameters_and_their_views_are_recognized():
    layer = torch.nn.Linear(8, 8)
    assert _activations.is_parameter(layer.weight) and _activations.is_parameter(layer.weight.t())
    x = torch.randn(4, 8)
    assert not _activations.is_parameter(x) and not _activations.is_parameter(layer(x))
    assert not _activations.is_parameter(layer.weight.detach() * 2)


def test_cpu_tensors_pass_through():
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(512, 256)
    assert all(torch.equal(a, b) for a, b in zip(grads(model, x, True), grads(model, x, False)))


@cuda
@pytest.mark.cuda
def test_gradients_unchanged_and_memory_freed():
    model, x = wide_on_gpu()
    expected = grads(model, x, paging=False)
    peaks = {}
    for paging in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated()
        if paging:
            with trainstream.activation_paging():
                loss = model(x)
        else:
            loss = model(x)
        torch.cuda.synchronize()
        peaks[paging] = torch.cuda.memory_allocated() - base  # what the graph holds between forward and backward
        loss.backward()
    got = grads(model, x, paging=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    saved = 2 * 8192 * 4096 * 4  # the up projection's output (GELU's input) and the GELU's output
    assert peaks[False] >= saved
    assert peaks[True] < peaks[False] - saved // 2, peaks


@cuda
@pytest.mark.cuda
def test_host_buffers_are_reused_step_after_step():
    model, x = wide_on_gpu()
    first = grads(model, x, paging=True)
    torch.cuda.synchronize()
    allocated = _pinned_buffers.BUFFERS.allocated_bytes
    assert allocated >= 2 * 8192 * 4096 * 4  # at least the two saved 128 MiB activations
    for _ in range(3):
        again = grads(model, x, paging=True)
        torch.cuda.synchronize()
    assert _pinned_buffers.BUFFERS.allocated_bytes == allocated  # no new page-locked memory after the first step
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@cuda
@pytest.mark.cuda
def test_weights_are_not_paged():
    layer = torch.nn.Linear(2048, 2048, bias=False).cuda()  # a 16 MiB weight, saved as weight.t()
    with trainstream.activation_paging() as paging:
        layer(torch.randn(16, 2048, device="cuda")).sum().backward()  # a 128 KiB input: too small
    assert paging.paged_bytes == 0


@cuda
@pytest.mark.cuda
def test_max_bytes_pages_the_first_tensors_only():
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    x = torch.randn(1024, 1024, device="cuda")  # every saved input: 4 MiB
    with trainstream.activation_paging(max_bytes=9 << 20) as paging:
        layers(x).sum().backward()
    assert paging.paged_bytes == 8 << 20  # the first two inputs; a third would exceed 9 MiB


@cuda
@pytest.mark.cuda
def test_training_with_paging_matches_torch(client):
    torch.manual_seed(0)
    model = Wide().cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), client=client)
    for step in range(10):
        x = torch.randn(4096, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        with trainstream.activation_paging():
            model(x).backward()
        opt.step()
        reference(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    trainstream.synchronize(model)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    assert diff <= 1e-6
