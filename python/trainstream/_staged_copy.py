"""Copies from the GPU into host memory that is not page-locked, through two page-locked staging buffers.

A new job's seed copies the model's weights into the job's master weights. Copied directly, that memory
had to be page-locked first: 0.58 s of the 1.86B's wrap() on the GPU machine for 7.5 GB (about 19 GiB/s
whatever the number of registering threads, benchmarks/results/host_register_h200.json); pageable
copies ran at about 7 GB/s. Here each piece goes from the GPU into one staging buffer while the CPU
copies the previous piece out of the other (torch's copy, on its threads, converting the dtype).

Invariants: a staging buffer is written from the GPU only once the CPU has copied its previous piece
out, and read by the CPU only once its copy from the GPU has completed (its event); every destination
holds its source when copy_to_host returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainstream._pinned_buffers import BUFFERS, PinnedBuffers

STAGE_BYTES = 64 << 20  # a piece: its GPU copy (about 1.2 ms at 55 GB/s) hides behind the CPU's of the last


def copy_to_host(copies: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 stage_bytes: int = STAGE_BYTES, buffers: PinnedBuffers = BUFFERS,
                 record: Callable[[], object] | None = None) -> None:
    """Copies each (host destination, GPU source) pair, contiguous and of the same numel, dtypes
    converted. `record` returns an event recorded on the current stream (default: torch.cuda's)."""
    if not copies:
        return
    record = record or (lambda: _recorded(device))
    leases = [buffers.take(torch.Size([stage_bytes]), torch.uint8, device.index or 0) for _ in range(2)]
    pending = None  # (destination piece, staging view, event): the piece the CPU copies out next
    used = 0
    try:
        for destination, source in copies:
            flat_destination, flat_source = destination.view(-1), source.reshape(-1)
            per_piece = stage_bytes // flat_source.element_size()
            for at in range(0, flat_source.numel(), per_piece):
                piece = flat_source[at:at + per_piece]
                stage = leases[used % 2].host[:piece.numel() * piece.element_size()].view(piece.dtype)
                stage.copy_(piece, non_blocking=True)
                issued = (flat_destination[at:at + piece.numel()], stage, record())
                if pending is not None:
                    _copy_out(*pending)
                pending, used = issued, used + 1
        if pending is not None:
            _copy_out(*pending)
    finally:
        for lease in leases:
            lease.release([record()])  # lent again only once every copy issued into it has run


def _recorded(device: torch.device):
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _copy_out(destination: torch.Tensor, stage: torch.Tensor, event) -> None:
    event.synchronize()
    destination.copy_(stage)
