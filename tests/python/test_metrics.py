"""trainstreamd --metrics-listen: the Prometheus endpoint scraped over real HTTP while a job trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request

import pytest
import torch
from conftest import Daemon, ctl, wait_until

import trainstream
from trainstream._connect import daemon_binary


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def scrape(port: int) -> dict[str, float]:
    """The samples of one scrape, by name with labels as written ('name{a="b"}')."""
    text = scrape_text(port)
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.fixture
def metered():
    d = Daemon("--metrics-listen", "127.0.0.1:0")
    assert wait_until(lambda: "metrics endpoint listening" in d.output(), 10)
    d.port = int(re.search(r"metrics endpoint listening on \S+ \(port (\d+)\)", d.output()).group(1))
    yield d
    d.stop()


def train(model, opt, steps: int):
    for _ in range(steps):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    trainstream.synchronize(model)


def test_metrics_move_with_training(metered):
    before = scrape(metered.port)
    assert before['trainstream_jobs{orphaned="false"}'] == 0 and before["trainstream_host_bytes"] == 0
    assert before["trainstream_worker_threads"] == 2
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Linear(256, 1))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=metered.client(), job="m",
                                  bucket_mb=0.01)
    train(model, opt, 2)
    job = f'{{job="m",uid="{os.getuid()}"}}'
    first = scrape(metered.port)
    assert first['trainstream_jobs{orphaned="false"}'] == 1
    assert first[f"trainstream_job_steps_total{job}"] == 2 and first[f"trainstream_job_completed_step{job}"] == 2
    assert first[f"trainstream_job_ranks{job}"] == 1 and first[f"trainstream_job_host_bytes{job}"] > 0
    assert first["trainstream_host_bytes"] == first[f"trainstream_job_host_bytes{job}"]
    buckets = first[f"trainstream_job_updates_total{job}"] / 2
    assert buckets >= 2  # bucket_mb=0.01 splits the model
    assert first[f"trainstream_update_seconds_count{job}"] == 2 * buckets
    assert first[f'trainstream_update_seconds_bucket{{job="m",uid="{os.getuid()}",le="+Inf"}}'] == 2 * buckets
    train(model, opt, 3)
    second = scrape(metered.port)
    assert second[f"trainstream_job_steps_total{job}"] == 5
    assert second[f"trainstream_update_seconds_count{job}"] == 5 * buckets
    assert second[f"trainstream_update_seconds_sum{job}"] > first[f"trainstream_update_seconds_sum{job}"]
    refused = second['trainstream_errors_total{kind="refused_request"}']
    ctl(metered.socket, "drop", "no-such-job", check=False)
    assert scrape(metered.port)['trainstream_errors_total{kind="refused_request"}'] == refused + 1
    trainstream.unwrap(model)
    assert scrape(metered.port)[f"trainstream_job_ranks{job}"] == 0


def test_a_bad_metrics_address_is_refused_by_name():
    result = subprocess.run([daemon_binary(), "--socket", "/tmp/unused.sock", "--metrics-listen", "nowhere"],
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 2 and "metrics_listen 'nowhere' must be HOST:PORT" in result.stderr


def test_the_grafana_dashboard_asks_only_for_metrics_the_daemon_serves(metered):
    dashboard = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana", "trainstreamd-dashboard.json")
    with open(dashboard) as f:
        expressions = [t["expr"] for p in json.load(f)["panels"] for t in p["targets"]]
    wanted = {name for e in expressions for name in re.findall(r"trainstream_[a-z_]+", e)}
    model = torch.nn.Linear(16, 1)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=metered.client(), job="g")
    train(model, opt, 1)
    types = re.findall(r"^# TYPE (\S+) (\S+)$", scrape_text(metered.port), re.MULTILINE)
    served = {name for name, _ in types} | {f"{name}_bucket" for name, kind in types if kind == "histogram"}
    assert wanted and wanted <= served, wanted - served
    trainstream.unwrap(model)
