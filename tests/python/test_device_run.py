"""scripts/device_run.sh (scripts/device_run.py), the GPU machine's stages, where there is no GPU: --list
names the stages the benchmarks and tests use, names it does not know are refused before anything runs,
and --dry-run prints the commands of the command lines the device tool is given."""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RUNNER = os.path.join(ROOT, "scripts", "device_run.sh")
KNOBS = ("PYTEST_ARGS", "CUDA_ALLOCATORS", "NANOGPT_MODES", "NANOGPT_TRACE", "BUILD_TARGETS", "SETTING", "VALUES",
         "AB_NAMES", "TS_SYSROOT", "RUNS", "STEPS", "GPT_ARGS")


def device_run(*args: str, out, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in KNOBS}
    return subprocess.run(["bash", RUNNER, *args], capture_output=True, text=True, timeout=60,
                          env={**clean, "OUT": str(out), **env})


# What the README, docs/ and benchmarks/results/*.md cite as the way to reproduce a committed figure, and
# what the GPU tests run through.
KEPT = ["build", "build-fast", "use-bin", "build-before", "python-before", "wheel-before", "wheel-info", "wheels",
        "ds-compile", "torchao", "shm-huge=POLICY", "pack", "test", "test-cuda", "test-paging-cuda", "pytest",
        "bench-adamw", "gpt-small", "gpt-small-offload", "gpt-small-ab", "gpt-small-peers", "gpt-auto", "gpt-large",
        "gpt-largest", "gpt-before-after", "gpt-peers", "gpt-paging", "gpt-start", "gpt-start-floor", "clipping",
        "drop-in", "lora", "hf-full", "hf-paged", "transfer", "ranks", "torchrun-gpt", "allreduce"]


def test_the_list_names_each_stage_the_benchmarks_and_tests_use(tmp_path):
    listed = device_run("--list", out=tmp_path)
    assert listed.returncode == 0, listed.stderr
    for name in KEPT:
        assert re.search(rf"^  {re.escape(name)}  ", listed.stdout, re.M), name


# The refusals are asked for with --dry-run too: a runner that failed to refuse would print, not run.
def test_unknown_and_retired_stages_are_refused_before_any_stage_runs(tmp_path):
    refused = device_run("--dry-run", "build", "gpt-trace", "nonsense", out=tmp_path)
    assert refused.returncode == 2
    assert "gpt-trace was retired" in refused.stderr and "gpt-small-offload" in refused.stderr
    assert "unknown stage 'nonsense'" in refused.stderr and "the stages: build build-fast" in refused.stderr
    assert refused.stdout == ""  # not even the environment's setup


@pytest.mark.parametrize("args,env,why", [
    (["shm-huge=sometimes"], {}, "the policy is one of never, always, within_size, advise"),
    (["pytest"], {}, "PYTEST_ARGS"),
    (["gpt-small-offload"], {"SETTING": "TRAINSTREAM_STAGING_SLOTS"}, "SETTING (an environment variable) and VALUES"),
    (["gpt-small-ab"], {"AB_NAMES": "before later"}, "AB_NAMES are among before, daemon, after, not later"),
])
def test_a_stage_given_what_it_cannot_use_is_refused_by_name(tmp_path, args, env, why):
    refused = device_run("--dry-run", *args, out=tmp_path, **env)
    assert refused.returncode == 2 and why in refused.stderr and refused.stdout == "", refused.stderr


def test_the_device_tools_command_lines_print_their_commands(tmp_path):
    shown = device_run("--dry-run", "wheel-info", "test-cuda", "drop-in", out=tmp_path,
                       NANOGPT_MODES="eager", NANOGPT_TRACE="1")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert re.findall(r"^=== (\S+)", text, re.M) == ["wheel-info", "test-cuda", "drop-in", "done"]
    assert f"> {tmp_path}/wheel_info.txt" in text
    assert f"PYTORCH_CUDA_ALLOC_CONF='' timeout 300 python3 -m pytest -q -p no:cacheprovider " \
           f"tests/python/test_cuda.py > {tmp_path}/pytest_cuda_.log" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 -m pytest" in text
    assert "timeout 540 python3 benchmarks/drop_in/nanogpt_loop.py --steps 24 --modes eager --rounds 2 " \
           f"--daemon-trace --json {tmp_path}/nanogpt_loop.json" in text

    shown = device_run("--dry-run", "build", "test", out=tmp_path)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    if not glob.glob(os.path.join(ROOT, ".device/trainstream/trainstream-*-cp312-*.whl")):  # no wheel: the build
        assert re.search(r"^\+ export TRAINSTREAMD=\S+/build/daemon/trainstreamd$", text, re.M)
    assert "cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo" in text
    assert f"+ cmake --build build -j16 >> {tmp_path}/build.log" in text
    assert f"+ cd build && ctest -j8 --output-on-failure > {tmp_path}/ctest.log" in text
    assert f"python3 -m pytest -q -p no:cacheprovider tests/python --junitxml={tmp_path}/pytest.xml" in text
    assert not list(tmp_path.iterdir())  # printed, not run


def test_the_124m_offload_runs_each_value_of_a_setting_in_turn_within_each_run(tmp_path):
    shown = device_run("--dry-run", "gpt-small-offload", out=tmp_path, SETTING="TRAINSTREAM_STAGING_SLOTS",
                       VALUES="4 16", RUNS="2", GPT_ARGS="--daemon-busy")
    assert shown.returncode == 0, shown.stderr
    runs = re.findall(r"^\+ TRAINSTREAM_STAGING_SLOTS=(\d+) timeout 120 python3 benchmarks/train_gpt/train_gpt.py "
                      r"--config 124m --modes trainstream --steps 40 .* --json (\S+) --daemon-busy$",
                      shown.stdout, re.M)
    assert runs == [(slots, f"{tmp_path}/gpt_124m_offload_{slots}_run{n}.json")
                    for n in (1, 2) for slots in ("4", "16")]


def test_the_before_and_after_runs_alternate_and_the_before_run_uses_the_carried_wheel_of_before(tmp_path):
    shown = device_run("--dry-run", "wheel-before", "gpt-before-after", out=tmp_path, RUNS="2")
    if not glob.glob(os.path.join(ROOT, ".device/before/trainstream-*-cp312-*.whl")):
        assert shown.returncode == 2 and "no cp312 wheel in .device/before/" in shown.stderr, shown.stderr
        return
    assert shown.returncode == 0, shown.stderr
    assert "--target /tmp/before/python .device/before/trainstream-" in shown.stdout
    runs = re.findall(r"^\+ cd \S+ && (TRAINSTREAMD=\S+ )?.*train_gpt.py --config 1.86b .* --json (\S+)$",
                      shown.stdout, re.M)
    before = "TRAINSTREAMD=/tmp/before/build/daemon/trainstreamd "
    assert [(env == before, path.rsplit("/", 1)[1]) for env, path in runs] == [
        (True, "gpt_1.86b_cap24_before_run1.json"), (False, "gpt_1.86b_cap24_after_run1.json"),
        (True, "gpt_1.86b_cap24_before_run2.json"), (False, "gpt_1.86b_cap24_after_run2.json")]
