"""_pinned_buffers: the page-locked host buffers activation paging lends, with a recording pin and
events whose completion the test decides (the real driver's page-locking runs in test_activations.py
on the GPU machine)."""

from __future__ import annotations

import threading

import pytest
import torch

from trainstream._pinned_buffers import PinnedBuffers, size_class


class Event:
    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


class Pins:
    """Records each page-locked range; `fail` makes the next one raise, as a refusing driver would."""

    def __init__(self):
        self.ranges: list[tuple[int, int, int]] = []
        self.fail = False

    def __call__(self, device_index: int, address: int, nbytes: int):
        if self.fail:
            raise RuntimeError("cuMemHostRegister: out of memory")
        self.ranges.append((device_index, address, nbytes))
        return object()


@pytest.mark.parametrize("nbytes", [1, 3, 1 << 20, (1 << 20) + 1, 3 << 20, (5 << 20) + 7, 48 << 20])
def test_size_class_rounds_up_by_at_most_a_quarter(nbytes):
    size = size_class(nbytes)
    assert nbytes <= size <= max(nbytes * 5 // 4, nbytes + 1)
    assert size_class(size) == size


def test_a_buffer_is_lent_again_only_after_its_last_gpu_use():
    pins = Pins()
    pool = PinnedBuffers(pins)
    shape = torch.Size([1024, 256])
    first = pool.take(shape, torch.float32, 0)
    assert first.host.shape == shape and first.host.dtype == torch.float32
    copy_back = Event()
    first.release([Event(done=True), copy_back])
    second = pool.take(shape, torch.float32, 0)
    assert second.host.data_ptr() != first.host.data_ptr()  # the copy back may still read the first
    copy_back.done = True
    third = pool.take(shape, torch.float32, 0)
    assert third.host.data_ptr() == first.host.data_ptr()
    assert len(pins.ranges) == 2 and pool.allocated_bytes == 2 * size_class(1024 * 256 * 4)


def test_sizes_of_one_class_share_buffers_and_others_do_not():
    pool = PinnedBuffers(Pins())
    lease = pool.take(torch.Size([1000, 1000]), torch.uint8, 0)
    address = lease.host.data_ptr()
    lease.release([])
    assert pool.take(torch.Size([1001, 1000]), torch.uint8, 0).host.data_ptr() == address
    other = pool.take(torch.Size([2000, 1000]), torch.bfloat16, 0)
    assert other.host.data_ptr() != address and other.host.shape == (2000, 1000)


def test_a_lease_is_given_back_once():
    pool = PinnedBuffers(Pins())
    lease = pool.take(torch.Size([4096]), torch.float32, 0)
    lease.release([])
    lease.release([])
    assert pool.take(torch.Size([4096]), torch.float32, 0).host.data_ptr() == lease.host.data_ptr()
    assert pool.take(torch.Size([4096]), torch.float32, 0).host.data_ptr() != lease.host.data_ptr()


def test_buffers_given_back_from_many_threads_are_all_reused():
    pins = Pins()
    pool = PinnedBuffers(pins)
    leases = [pool.take(torch.Size([65536]), torch.float32, 0) for _ in range(32)]
    threads = [threading.Thread(target=lease.release, args=([],)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = {pool.take(torch.Size([65536]), torch.float32, 0).host.data_ptr() for _ in range(32)}
    assert again == {lease.host.data_ptr() for lease in leases} and len(pins.ranges) == 32


def test_a_refused_page_lock_warns_and_stops_trying():
    pins = Pins()
    pins.fail = True
    pool = PinnedBuffers(pins)
    with pytest.warns(UserWarning, match="page-locking .* failed"):
        pool._allocate(4096, 0)
    pins.fail = False
    assert pool._allocate(4096, 0) is None and pins.ranges == []
