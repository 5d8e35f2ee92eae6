"""trainstreamd --trace-dir and benchmarks/train_gpt/daemon_trace.py: a real daemon's job writes its
step timeline when the daemon stops, and the analysis puts each step's update after the iteration
that made its gradients, with the update's width (no thread, some, all) adding up to the iteration."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time

import pytest
import torch
from conftest import Daemon

import trainstream

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
import daemon_trace  # noqa: E402

MS = 1_000_000


def test_widths_split_a_window_into_no_some_and_all_threads():
    blocks = [(0, 4 * MS), (2 * MS, 6 * MS), (8 * MS, 9 * MS)]  # two threads
    assert daemon_trace.busy_by_width(blocks, 0, 10 * MS, threads=2) == pytest.approx(
        {"none": 3.0, "some": 5.0, "all": 2.0})
    assert daemon_trace.busy_by_width(blocks, 3 * MS, 5 * MS, threads=2) == pytest.approx(
        {"none": 0.0, "some": 1.0, "all": 1.0})


def test_a_jobs_trace_places_each_update_after_the_iteration_that_made_its_gradients(tmp_path):
    daemon = Daemon("--trace-dir", str(tmp_path))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      client=daemon.client(), bucket_mb=1)
        starts, took = [], []
        for _ in range(6):
            starts.append(time.monotonic_ns())
            model(torch.randn(8, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            took.append(time.monotonic_ns() - starts[-1])
        trainstream.synchronize(model)
        buckets = daemon.client().stats()["jobs"][0]["buckets"]
        trainstream.unwrap(model)
    finally:
        assert daemon.stop() == 0
    trace = daemon_trace.load(str(tmp_path))
    assert trace["dropped"] == 0
    report = daemon_trace.analyse(trace, starts, took, warmup=2)
    assert report["cycles"] == 3  # iterations 2-4: each followed by a timed one
    cycle = report["cycle_medians_ms"]
    assert 0 < cycle["update_from"] <= cycle["update_to"]
    assert cycle["update_thread_ms"] > 0
    one = daemon_trace.cycle(trace["spans"], 3, starts[2], report["threads"])  # iteration 2's gradients
    assert one["update_all_threads_ms"] + one["update_some_threads_ms"] + one["update_gaps_ms"] == \
        pytest.approx(one["update_to"] - one["update_from"], abs=1e-6)
    assert {row["bucket"] for row in report["typical_buckets"]} == set(range(buckets))  # each updated
    assert all(row["update_thread_ms"] > 0 for row in report["typical_buckets"])
    assert "update" in daemon_trace.summary(report)
    daemon_trace.keep(trace, starts, str(tmp_path / "kept.trace.json.gz"))
    with gzip.open(tmp_path / "kept.trace.json.gz", "rt") as f:
        kept = json.load(f)
    assert kept["spans"] == trace["spans"] and kept["iteration_starts_ns"] == starts
