"""trainstreamd --metrics-listen: the Prometheus endpoint scraped over real HTTP while jobs train; what it
tells about jobs at each --metrics-labels level (by default no job names, sums per uid that never go
down), its bearer token, a Unix socket listener, any-port and IPv6 addresses, and clients that
connect and say nothing."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import urllib.error
import urllib.request

import pytest
import torch
from conftest import Daemon, ctl, wait_until

import trainstream
from trainstream._connect import daemon_binary


def scrape_text(port: int, host: str = "127.0.0.1", path: str = "/metrics", token: str | None = None) -> str:
    request = urllib.request.Request(f"http://{host}:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def status_of(port: int, path: str = "/metrics", token: str | None = None) -> int:
    try:
        scrape_text(port, path=path, token=token)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


def parse(text: str) -> dict[str, float]:
    """The samples of one scrape, by name with labels as written ('name{a="b"}')."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def scrape(port: int) -> dict[str, float]:
    return parse(scrape_text(port))


def metrics_daemon(*args: str) -> Daemon:
    d = Daemon(*args)
    assert wait_until(lambda: "metrics endpoint listening" in d.output(), 10)
    d.port = int(re.search(r"metrics endpoint listening on \S+ \(port (\d+)\)", d.output()).group(1))
    return d


@pytest.fixture
def metered():
    d = metrics_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-labels", "job")
    yield d
    d.stop()


@pytest.fixture
def shared_node():
    """A daemon with the default labels: no job names."""
    d = metrics_daemon("--metrics-listen", "127.0.0.1:0")
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


@pytest.mark.parametrize("args,message", [
    (("--metrics-listen", "nowhere"), "metrics_listen 'nowhere' must be HOST:PORT"),
    (("--metrics-listen", "unix:relative"), "metrics_listen 'unix:relative' must be unix: with an absolute path"),
    (("--metrics-listen", ":0", "--metrics-labels", "all"), "metrics_labels is 'all'; expected none, uid or job"),
    (("--metrics-token-file", "/etc/hostname"), "metrics_token_file needs metrics_listen")])
def test_a_bad_metrics_setting_is_refused_by_name(args, message):
    result = subprocess.run([daemon_binary(), "--socket", "/tmp/unused.sock", *args],
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("labels", ["uid", "job"])
def test_the_grafana_dashboard_asks_only_for_metrics_the_daemon_serves(labels):
    dashboard = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana", "trainstreamd-dashboard.json")
    with open(dashboard) as f:
        expressions = [t["expr"] for p in json.load(f)["panels"] for t in p["targets"]]
    wanted = {name for e in expressions for name in re.findall(r"trainstream_[a-z_]+", e)}
    metered = metrics_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-labels", labels)
    try:
        model = torch.nn.Linear(16, 1)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=metered.client(), job="g")
        train(model, opt, 1)
        types = re.findall(r"^# TYPE (\S+) (\S+)$", scrape_text(metered.port), re.MULTILINE)
        served = {name for name, _ in types} | {f"{name}_bucket" for name, kind in types if kind == "histogram"}
        assert wanted and wanted <= served, wanted - served
        trainstream.unwrap(model)
    finally:
        metered.stop()
    # Every per-job panel groups by uid and job, which both levels of detail carry (job mode both).
    for e in expressions:
        if re.search(r"trainstream_(job_|update_seconds)", e) and "by (" in e:
            assert re.search(r"by \([^)]*uid[^)]*\)", e), e


def start_job(client, name: str, steps: int):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, job=name,
                                  bucket_mb=0.01)
    train(model, opt, steps)
    return model


def test_by_default_jobs_are_summed_per_uid_without_names_and_sums_never_go_down(shared_node):
    client = shared_node.client()
    first, second = start_job(client, "alice-secret-project", 2), start_job(client, "bob-thesis", 3)
    text = scrape_text(shared_node.port)
    assert "alice-secret-project" not in text and "bob-thesis" not in text and "job=" not in text
    uid = f'{{uid="{os.getuid()}"}}'
    before = parse(text)
    assert before[f"trainstream_uid_jobs{uid}"] == 2 and before[f"trainstream_job_ranks{uid}"] == 2
    assert before[f"trainstream_job_steps_total{uid}"] == 5
    assert before[f"trainstream_job_host_bytes{uid}"] == before["trainstream_host_bytes"] > 0
    updates = before[f"trainstream_job_updates_total{uid}"]
    assert before[f"trainstream_update_seconds_count{uid}"] == updates > 0
    trainstream.unwrap(first)
    client.drop_job("alice-secret-project")
    after = scrape(shared_node.port)
    assert after[f"trainstream_uid_jobs{uid}"] == 1
    assert after[f"trainstream_job_steps_total{uid}"] == 5  # the dropped job's steps stay counted
    assert after[f"trainstream_job_updates_total{uid}"] == updates
    assert after[f"trainstream_update_seconds_count{uid}"] == updates
    assert after[f"trainstream_job_host_bytes{uid}"] < before[f"trainstream_job_host_bytes{uid}"]  # a gauge
    trainstream.unwrap(second)


def test_labels_none_tells_nothing_per_job_or_uid():
    d = metrics_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-labels", "none")
    try:
        model = start_job(d.client(), "hidden", 1)
        text = scrape_text(d.port)
        assert "hidden" not in text and "uid=" not in text and "job=" not in text
        assert parse(text)['trainstream_jobs{orphaned="false"}'] == 1
        trainstream.unwrap(model)
    finally:
        d.stop()


def test_a_bearer_token_is_asked_when_set(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-metrics-token-0123456789\n")
    token_file.chmod(0o600)
    d = metrics_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-token-file", str(token_file))
    try:
        assert status_of(d.port) == 401
        assert status_of(d.port, token="a-metrics-token-012345678X") == 401
        assert status_of(d.port, token="a-metrics-token-0123456789") == 200
        assert status_of(d.port, path="/other", token="a-metrics-token-0123456789") == 404
        assert "bearer token asked" in d.output() and "has mode" not in d.output()
    finally:
        d.stop()


def test_a_unix_socket_listener_is_for_the_daemons_user_only(tmp_path):
    path = str(tmp_path / "metrics.sock")
    d = Daemon("--metrics-listen", f"unix:{path}")
    try:
        assert wait_until(lambda: os.path.exists(path), 10)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while chunk := s.recv(65536):
                response += chunk
        assert response.startswith(b"HTTP/1.1 200 OK") and b"trainstream_info" in response
    finally:
        d.stop()
    assert not os.path.exists(path)


@pytest.mark.parametrize("address,host", [(":0", "127.0.0.1"), ("[::1]:0", "[::1]")])
def test_any_port_and_ipv6_addresses_are_served(address, host):
    if host == "[::1]" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    d = metrics_daemon("--metrics-listen", address)
    try:
        assert "trainstream_info" in scrape_text(d.port, host=host)
    finally:
        d.stop()


def test_clients_that_connect_and_say_nothing_do_not_keep_a_scraper_out(shared_node):
    silent = [socket.create_connection(("127.0.0.1", shared_node.port)) for _ in range(40)]
    try:
        assert "trainstream_info" in scrape_text(shared_node.port)
    finally:
        for s in silent:
            s.close()
