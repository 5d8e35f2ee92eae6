"""A uid truncates its own job's segments under a root trainstreamd (it may: they are its files). The
daemon must not die of the SIGBUS its next access would raise: that client's session fails naming the
truncation, its job is dropped and its segments removed, and a job beside it trains on to torch's
weights. (Truncated orphans: test_adoption.py; the guard itself: tests/cpp/guard/.)"""

from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import OTHER_UID, start_shared_daemon, wait_until
from test_metrics import scrape
from test_parity import TOLERANCE, adamw, max_difference, mlp, mse_step

import trainstream

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 12


@pytest.fixture
def metered_open_daemon():
    d = start_shared_daemon("--metrics-listen", "127.0.0.1:0")
    assert wait_until(lambda: "metrics endpoint listening" in d.output(), 10)
    d.port = int(re.search(r"metrics endpoint listening on \S+ \(port (\d+)\)", d.output()).group(1))
    yield d
    d.stop()
    shutil.rmtree(d.shared_dir, ignore_errors=True)


def start_truncating_rank(daemon, job: str, segment: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, os.path.join(HERE, "truncating_rank.py"), "--socket", daemon.socket, "--job", job,
            "--segment", segment, "--uid", str(OTHER_UID)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)


def read_until(process: subprocess.Popen, prefix: str, lines: list[str]) -> str:
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the truncating rank exited without {prefix!r}:\n{''.join(lines)}")


@pytest.mark.parametrize("segment", ["state", "rank"])
def test_a_uid_truncating_its_segment_loses_its_job_and_nothing_else(metered_open_daemon, segment):
    daemon = metered_open_daemon
    victim = start_truncating_rank(daemon, "victim", segment)
    model = mlp()
    reference = copy.deepcopy(model)
    ref_opt = adamw(reference, foreach=False)
    model, opt = trainstream.wrap(model, adamw(model), client=daemon.client(), job="beside")
    lines: list[str] = []
    try:
        for step in range(STEPS):
            if step == 3:
                key = read_until(victim, "key ", lines).split()[1]
                read_until(victim, "trained", lines)  # both jobs trained side by side
                victim.stdin.write("truncate\n")
                victim.stdin.flush()
            for m, o in ((model, opt), (reference, ref_opt)):
                mse_step(m, step).backward()
                o.step()
                o.zero_grad()
        trainstream.synchronize(model)
        rest, _ = victim.communicate(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
    output = "".join(lines) + rest
    assert victim.returncode == 0, output
    assert re.search(rf"error: trainstreamd: job 'victim' was dropped: shared memory segment "
                     rf"trainstream\.{OTHER_UID}\.{key}\.{'state' if segment == 'state' else 'rank0'} was truncated "
                     rf"by its owner \(uid {OTHER_UID}\) while trainstreamd used it", output), output

    assert daemon.process.poll() is None, daemon.output()
    assert wait_until(lambda: not glob.glob(f"/dev/shm/trainstream.{OTHER_UID}.{key}.*"), 5), "segments left behind"
    assert [j["name"] for j in daemon.client().stats()["jobs"]] == ["beside"]
    assert f"job 'victim' (uid {OTHER_UID}) dropped, its segments removed" in daemon.output()
    assert scrape(daemon.port)['trainstream_errors_total{kind="truncated_segment"}'] == 1
    assert max_difference(model, reference) <= TOLERANCE  # trained on through it, as torch
    assert max_difference(model, mlp()) > 1e-3
    trainstream.unwrap(model)
