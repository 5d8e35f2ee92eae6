"""Page-locking this process's view of the job's host memory for the GPU, in the background.

Weight paging copies each block's host copy to the GPU once or twice a step; from pageable memory
that runs at about 7 GB/s, from page-locked memory at PCIe speed (55 GB/s on the GPU machine). But
locking costs about 2 GiB/s (cudaHostRegister, measured there), so a large model's host copy would hold
up wrap() for many seconds: HostPins locks it on background threads, group by group in the order the
first forward needs them, and a copy waits only for its own group.

Invariants: every page is registered at most once (groups are cut at page boundaries, a page shared
by two groups goes with the first); a copy never spans two registrations (the driver refuses it with
"invalid argument": split() cuts ranges where registrations meet); everything is unregistered by
close(), after the GPU stopped reading (the caller synchronizes first).
"""

from __future__ import annotations

import bisect
import os
import threading

from trainstream import _C

PAGE = 4096


def page_ranges(ranges: list[tuple[int, int]], taken: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """(address, bytes) ranges widened to whole pages and merged, minus the pages of `taken` (merged
    page ranges themselves); disjoint and sorted."""
    pages = sorted((a // PAGE * PAGE, -(-(a + n) // PAGE) * PAGE) for a, n in ranges if n)
    merged: list[list[int]] = []
    for start, end in pages:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        for t_start, t_bytes in sorted(taken):
            t_end = t_start + t_bytes
            if t_end <= start or t_start >= end:
                continue
            if t_start > start:
                out.append((start, t_start - start))
            start = max(start, t_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end - start))
    return out


def split_at(bounds: list[int], address: int, nbytes: int) -> list[tuple[int, int]]:
    """[address, address + nbytes) cut at the sorted addresses `bounds` that fall inside it, as
    (offset from address, bytes) parts."""
    cuts = bounds[bisect.bisect_right(bounds, address):bisect.bisect_left(bounds, address + nbytes)]
    edges = [address, *cuts, address + nbytes]
    return [(start - address, end - start) for start, end in zip(edges, edges[1:]) if end > start]


class HostPins:
    """Registers `groups` (each a list of (address, bytes) ranges) on `threads` background threads,
    in order; wait(g) returns once group g is registered, and raises what its registration raised."""

    def __init__(self, device_index: int, groups: list[list[tuple[int, int]]], threads: int | None = None):
        threads = threads or int(os.environ.get("TRAINSTREAM_PIN_THREADS", 4))
        self._device = device_index
        self._groups, taken = [], []
        for ranges in groups:
            own = page_ranges(ranges, page_ranges(taken))
            taken += own
            self._groups.append(own)
        self._bounds = sorted({x for group in self._groups for a, n in group for x in (a, a + n)})
        self._done = [threading.Event() for _ in self._groups]
        self._errors: list[BaseException | None] = [None] * len(self._groups)
        self._pinned: list[object] = []
        self._lock = threading.Lock()
        self._next = 0
        self.bytes = sum(n for g in self._groups for _, n in g)
        self._threads = [threading.Thread(target=self._work, name=f"trainstream-pin-{t}", daemon=True)
                         for t in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                g = self._next
                self._next += 1
            if g >= len(self._groups):
                return
            try:
                pinned = [_C.PinnedHostRange(self._device, address, nbytes) for address, nbytes in self._groups[g]]
                with self._lock:
                    self._pinned += pinned
            except BaseException as e:  # raised to the caller of wait(g)
                self._errors[g] = e
            finally:
                self._done[g].set()

    def split(self, address: int, nbytes: int) -> list[tuple[int, int]]:
        """[address, address + nbytes) as (offset from address, bytes) parts, each within one
        registration (or outside all of them)."""
        return split_at(self._bounds, address, nbytes)

    def wait(self, g: int) -> None:
        self._done[g].wait()
        if self._errors[g] is not None:
            raise self._errors[g]

    def close(self) -> None:
        for t in self._threads:
            t.join()
        with self._lock:
            self._pinned.clear()  # each unregisters as it goes
