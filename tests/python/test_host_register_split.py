"""split_range of benchmarks/transfer/host_register.py: page-aligned, equal shares of a range."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "transfer", "host_register.py")
_spec = importlib.util.spec_from_file_location("host_register", _PATH)
host_register = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_register)
split_range = host_register.split_range

PAGE = 4096


def check(nbytes: int, parts: int, align: int) -> list[tuple[int, int]]:
    shares = split_range(nbytes, parts, align)
    assert len(shares) <= parts
    offset = 0
    for start, length in shares:
        assert start == offset and start % align == 0 and length > 0
        offset += length
    assert offset == nbytes  # consecutive, covering the range exactly
    for _, length in shares[:-1]:
        assert length % align == 0  # whole units; only the last may end short
    units = [-(-length // align) for _, length in shares]
    assert max(units, default=0) - min(units, default=0) <= 1 and units == sorted(units, reverse=True)
    return shares


@pytest.mark.parametrize("threads", [1, 2, 4, 8, 16])
def test_gib_in_equal_page_aligned_shares(threads):
    shares = check(1 << 30, threads, PAGE)
    assert len(shares) == threads and {length for _, length in shares} == {(1 << 30) // threads}


def test_uneven_page_counts_differ_by_one_page():
    assert check(10 * PAGE, 4, PAGE) == [(0, 3 * PAGE), (3 * PAGE, 3 * PAGE), (6 * PAGE, 2 * PAGE),
                                         (8 * PAGE, 2 * PAGE)]


def test_size_not_a_multiple_of_the_page():
    assert check(2 * PAGE + 100, 2, PAGE) == [(0, 2 * PAGE), (2 * PAGE, 100)]
    assert check(PAGE + 1, 3, PAGE) == [(0, PAGE), (PAGE, 1)]


def test_fewer_pages_than_parts_and_empty_range():
    assert check(3 * PAGE, 16, PAGE) == [(0, PAGE), (PAGE, PAGE), (2 * PAGE, PAGE)]
    assert check(0, 4, PAGE) == []


@pytest.mark.parametrize("nbytes, parts", [(8 << 30, 16), ((8 << 30) + 12345, 7), (3 << 21, 2)])
def test_huge_page_alignment(nbytes, parts):
    check(nbytes, parts, 2 << 20)


@pytest.mark.parametrize("args", [(-1, 2, PAGE), (PAGE, 0, PAGE), (PAGE, 2, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError, match="split_range needs"):
        split_range(*args)
