"""Page-locking arithmetic of weight paging (paging/host_pins.py): which pages each group registers, and how a
copy is cut where registrations meet (the driver refuses a copy that spans two). No GPU needed."""

from trainstream.paging.host_pins import PAGE, page_ranges, split_at


def test_ranges_widen_to_pages_and_merge():
    assert page_ranges([(100, 50), (200, 10)]) == [(0, PAGE)]
    assert page_ranges([(0, PAGE), (PAGE, PAGE), (5 * PAGE, 1)]) == [(0, 2 * PAGE), (5 * PAGE, PAGE)]
    assert page_ranges([(10, 0)]) == []


def test_pages_taken_by_an_earlier_group_are_left_out():
    taken = page_ranges([(100, 5000)])  # pages 0 and 1
    assert taken == [(0, 2 * PAGE)]
    assert page_ranges([(5100, 10000)], taken) == [(2 * PAGE, 2 * PAGE)]  # its page 1 went with the first
    assert page_ranges([(PAGE, PAGE)], taken) == []


def test_a_copy_is_cut_where_registrations_meet():
    bounds = [0, 2 * PAGE, 4 * PAGE]  # two registrations: pages 0-1 and 2-3
    assert split_at(bounds, 5100, 10000) == [(0, 2 * PAGE - 5100), (2 * PAGE - 5100, 5100 + 10000 - 2 * PAGE)]
    assert split_at(bounds, 100, 50) == [(0, 50)]
    assert split_at(bounds, 2 * PAGE, PAGE) == [(0, PAGE)]  # starts exactly at a registration
    parts = split_at(bounds, 10, 4 * PAGE)  # runs past the last registration
    assert sum(n for _, n in parts) == 4 * PAGE and len(parts) == 3
