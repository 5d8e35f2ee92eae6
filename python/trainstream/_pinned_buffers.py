"""Page-locked host buffers, lent one at a time and reused: saved activations (one per saved tensor, step
after step) and the two staging buffers of a new job's seed (_staged_copy.py).

torch.empty(pin_memory=True) takes its memory from cudaHostAlloc, which delivered 1.1 GiB/s on the GPU
machine for a layer's saved sizes (benchmarks/results/pinned_alloc_h200.json): the first step of a 7B
GPT paging 12 GB of activations paid seconds for it. Here a buffer is pageable memory that torch's CPU
threads fill with zeros first (the page faults run in parallel), then page-locked (PinnedHostRange,
portable): 9.1 GiB/s there.

Invariants: a buffer is lent to one tensor at a time, and lent again only once the GPU work that used it
last (the events it was given back with) has completed; sizes round up to a quarter of their power of two
(at most a quarter more bytes), so that sequences of varying length share buffers. The buffers stay cached
until the process ends, as torch's pinned memory does.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from trainstream import _C


def size_class(nbytes: int) -> int:
    """nbytes rounded up to a multiple of a quarter of its power of two (its highest bit / 4)."""
    quarter = max(1, (1 << (max(nbytes, 1).bit_length() - 1)) // 4)
    return -(-nbytes // quarter) * quarter


class Lease:
    """One buffer lent for one tensor: `host` is the tensor's page-locked copy; give back with release()."""

    __slots__ = ("host", "_buffer", "_pool")

    def __init__(self, host: torch.Tensor, buffer, pool: "PinnedBuffers | None"):
        self.host, self._buffer, self._pool = host, buffer, pool

    def release(self, events: list) -> None:
        """The buffer returns to the pool, to be lent again once every event (the GPU work that read or
        wrote it) has completed."""
        if self._pool is not None:
            self._pool._give_back(self._buffer, events)
            self._pool = None


class PinnedBuffers:
    """Buffers by size class. `pin(address, nbytes)` page-locks and returns the handle that keeps the
    range locked while it lives (default: _C.PinnedHostRange on `device_index`)."""

    def __init__(self, pin: Callable[[int, int, int], object] | None = None):
        self._pin = pin or (lambda device_index, address, nbytes: _C.PinnedHostRange(device_index, address, nbytes))
        self._free: dict[int, list[tuple[tuple[torch.Tensor, object], list]]] = {}
        self._lock = threading.Lock()  # backward returns buffers on autograd's device threads
        self._failed = False
        self.allocated_bytes = 0

    def take(self, shape: torch.Size, dtype: torch.dtype, device_index: int) -> Lease:
        """A page-locked host tensor of that shape and dtype (contents undefined)."""
        nbytes = shape.numel() * dtype.itemsize
        size = size_class(nbytes)
        buffer = self._reusable(size) or self._allocate(size, device_index)
        if buffer is None:  # page-locking failed once: torch's pinned memory from then on
            return Lease(torch.empty(shape, dtype=dtype, pin_memory=True), None, None)
        return Lease(buffer[0][:nbytes].view(dtype).view(shape), buffer, self)

    def _reusable(self, size: int):
        with self._lock:
            waiting = self._free.get(size, [])
            for i, (buffer, events) in enumerate(waiting):
                if all(e.query() for e in events):
                    del waiting[i]
                    return buffer
        return None

    def _allocate(self, size: int, device_index: int):
        if self._failed:
            return None
        memory = torch.empty(size, dtype=torch.uint8).zero_()  # populated on torch's threads before locking
        try:
            handle = self._pin(device_index, memory.data_ptr(), size)
        except Exception as e:  # noqa: BLE001 (the driver's refusal, whatever its kind, falls back)
            self._failed = True
            warnings.warn(f"trainstream: page-locking {size} bytes for activation paging failed ({e}); "
                          "torch's pinned memory is used instead", stacklevel=3)
            return None
        with self._lock:
            self.allocated_bytes += size
        return memory, handle

    def _give_back(self, buffer, events: list) -> None:
        with self._lock:
            self._free.setdefault(buffer[0].numel(), []).append((buffer, events))


BUFFERS = PinnedBuffers()  # the process's, as torch's pinned memory is
