"""Activation paging: the tensors autograd saves for backward wait in pinned host memory instead of
GPU memory, so that a model whose weights fit but whose activations do not still trains.

    with trainstream.activation_paging():
        loss = model(tokens, targets)
    loss.backward()

Forward: each saved CUDA tensor of at least `min_bytes` is copied to page-locked host memory (a buffer
of _pinned_buffers.BUFFERS, reused step after step) on a side stream (ordered after the kernel that
produced it), and its GPU memory returns to torch's allocator once that copy has run (record_stream).
Backward: the tensor is copied back on the current stream right before the autograd node that needs
it; the CPU never waits.

Not paged: parameters and views of them (Linear saves `weight.t()`; they stay on the GPU anyway),
tensors on other devices, and small tensors, whose copies would cost more in latency than they free.
`max_bytes` pages only the first tensors saved, up to that many bytes: the first layers' activations,
which backward needs last, so their copies back have the most time to hide; the rest stay on the GPU.
`paged_bytes` counts what this context has paged.
"""

from __future__ import annotations

import torch

from trainstream._pinned_buffers import BUFFERS, Lease
from trainstream.paging import pager as _paging


class activation_paging(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (used as a context manager)
    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int | None = None):
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.paged_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "activation_paging":
        super().__enter__()
        return self

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, tensor: torch.Tensor):
        paged = _paging.reference(tensor)  # a paged weight: re-fetched by its pager, never copied out
        if paged is not None:
            return _PagedWeight(*paged)
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_cuda or nbytes < self.min_bytes or is_parameter(tensor):
            return tensor
        if self.max_bytes is not None and self.paged_bytes + nbytes > self.max_bytes:
            return tensor
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been computed
        lease = BUFFERS.take(tensor.shape, tensor.dtype, tensor.device.index or 0)
        with torch.cuda.stream(stream):
            lease.host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # its memory is reused only after the copy has read it
        self.paged_bytes += nbytes
        return _Paged(lease, tensor.device, copied)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _PagedWeight):
            return packed.pager.unpack(packed.ref)
        if not isinstance(packed, _Paged):
            return packed
        stream = torch.cuda.current_stream(packed.device)
        stream.wait_event(packed.copied)
        tensor = packed.lease.host.to(packed.device, non_blocking=True)  # on the current stream, ordered with backward
        read = torch.cuda.Event()
        read.record(stream)
        packed.uses.append(read)  # the host buffer is lent again only after this copy
        return tensor


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one: a leaf that requires grad, at the bottom of the view chain."""
    base = tensor if tensor._base is None else tensor._base
    return base.is_leaf and base.requires_grad


class _PagedWeight:
    __slots__ = ("pager", "ref")

    def __init__(self, pager, ref):
        self.pager, self.ref = pager, ref


class _Paged:
    """A saved tensor's host copy: its buffer goes back to BUFFERS when autograd drops it, with the
    events of every GPU copy that touched it."""

    __slots__ = ("lease", "device", "copied", "uses")

    def __init__(self, lease: Lease, device: torch.device, copied: torch.cuda.Event):
        self.lease, self.device, self.copied = lease, device, copied
        self.uses = [copied]

    def __del__(self):
        self.lease.release(self.uses)
