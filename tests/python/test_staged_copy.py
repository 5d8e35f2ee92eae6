"""_staged_copy: the seed's copies into a job's master weights through two staging buffers, with CPU
tensors standing for the GPU's and events that record the order the CPU waits in (the real copies from
the GPU run in every GPU test's wrap() on the GPU machine)."""

from __future__ import annotations

import torch

from trainstream._pinned_buffers import PinnedBuffers
from trainstream._staged_copy import copy_to_host


class Events:
    """Each recorded event is numbered; `waited` lists those the CPU waited for, in order."""

    def __init__(self):
        self.recorded = 0
        self.waited: list[int] = []

    def record(self):
        self.recorded += 1
        return Event(self, self.recorded)


class Event:
    def __init__(self, events: Events, number: int):
        self.events, self.number = events, number

    def synchronize(self) -> None:
        self.events.waited.append(self.number)

    def query(self) -> bool:
        return True


def pool() -> PinnedBuffers:
    return PinnedBuffers(pin=lambda device_index, address, nbytes: object())


def copy(copies, buffers: PinnedBuffers, stage_bytes: int = 64) -> Events:
    events = Events()
    copy_to_host(copies, torch.device("cpu"), stage_bytes=stage_bytes, buffers=buffers, record=events.record)
    return events


def test_every_destination_holds_its_source_whatever_the_pieces():
    sizes = [1, 15, 16, 17, 40, 0, 7]  # elements; a piece of fp32 holds 16 of them
    sources = [torch.randn(n) for n in sizes] + [torch.randn(3, 5).to(torch.bfloat16)]
    destinations = [torch.zeros(s.shape, dtype=torch.float32) for s in sources]
    copy(list(zip(destinations, sources)), pool())
    for destination, source in zip(destinations, sources):
        assert torch.equal(destination, source.float())


def test_each_piece_is_copied_out_after_its_own_copy_and_in_order():
    sources = [torch.randn(40), torch.randn(20)]  # pieces of 16, 16, 8; 16, 4
    destinations = [torch.zeros(40), torch.zeros(20)]
    events = copy(list(zip(destinations, sources)), pool())
    assert events.waited == [1, 2, 3, 4, 5]  # the pieces' events; the last two are the buffers' release


def test_the_staging_buffers_are_lent_again_for_the_next_copy():
    buffers = pool()
    copy([(torch.zeros(100), torch.randn(100))], buffers)
    allocated = buffers.allocated_bytes
    assert allocated == 2 * 64
    copy([(torch.zeros(100), torch.randn(100))], buffers)
    assert buffers.allocated_bytes == allocated


def test_nothing_to_copy_takes_no_buffer():
    buffers = pool()
    copy([], buffers)
    assert buffers.allocated_bytes == 0
