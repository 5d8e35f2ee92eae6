"""benchmarks/train_gpt/neighbor.py: the process it runs beside a benchmark's steps is running while the
body runs, reports its rate when stopped, and is gone afterwards; a spec it cannot run is refused by name."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
from neighbor import neighbor  # noqa: E402


def child_pids() -> set[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


@pytest.mark.parametrize("kind,unit", [("triad", "GB/s"), ("compute", "GB/s in cache")])
def test_a_neighbor_runs_during_the_body_and_reports_its_rate(kind, unit):
    before = child_pids()
    with neighbor(f"{kind}:1") as report:
        (pid,) = child_pids() - before
        time.sleep(0.3)
        assert report == {}
    assert report["kind"] == kind and report["n"] == 1 and report["unit"] == unit and report["rate"] > 0
    assert pid not in child_pids() and not os.path.exists(f"/proc/{pid}")


def test_no_spec_runs_nothing():
    before = child_pids()
    with neighbor(None) as report:
        assert not child_pids() - before
    assert report == {}


@pytest.mark.parametrize("spec", ["bogus:2", "triad", "triad:0", "triad:x"])
def test_a_spec_it_cannot_run_is_refused_with_what_is_allowed(spec):
    with pytest.raises(SystemExit, match=r"triad:N, compute:N, adamw:N or copies:N .*" + spec):
        with neighbor(spec):
            pass
