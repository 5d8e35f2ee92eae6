#!/usr/bin/env python3
"""The GPU machine's stages: builds or installs trainstream there and runs the named stages in the order
given, each writing its logs and JSON under $OUT (/tmp/out unless set). `scripts/device_run.sh` runs this;
the device tool calls that, carrying `.device`:

    scripts/device_run.sh build test bench-adamw gpt-small gpt-large
    scripts/device_run.sh --list               # every stage, what it runs, the variables it reads
    scripts/device_run.sh --dry-run gpt-large  # the commands, not run (works on any machine)

Stdlib only: the machine has Python 3.12 and torch, and no network. Unknown stage names, and names of
stages retired for good (RETIRED), are refused before anything runs (exit 2). A build that fails ends the
run (exit 1); any other stage that fails shows it in its output, and the run goes on to the next stage.

Which trainstream a run uses, decided once before the first stage:
- A cp312 wheel carried in .device/trainstream/ (git-ignored, as all of .device; about 6 MB of carry's
  64 MiB): `scripts/build_wheels.sh --python 3.12 --no-sdist --out .device/trainstream`. It goes into a
  fresh venv, /tmp/ts-venv (again only when the wheel changed), that sees the machine's torch and the
  other packages of its python3 through a .pth file. No sysroot is on any path and TRAINSTREAMD is unset:
  connect() starts the wheel's trainstreamd, the tests' conftest finds it and its trainstreamctl alike.
- Otherwise this tree's build (a stage builds it, or use-bin copies one) against the sysroot,
  .device/sysroot.tgz (see ../shared/device/README.md). The daemon's metrics need prometheus-cpp in it,
  which the sysroot script leaves out by default:
    EXTRA_PKGS="prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1" \\
      ../shared/device/make-sysroot.sh /tmp/sr/sysroot && tar -C /tmp/sr -czf .device/sysroot.tgz sysroot
Stages that compile or use a build's binaries (build, build-fast, build-before, use-bin, python-before)
switch the rest of the run to this tree's build and the sysroot, as without a wheel.

Peers come from wheels carried in .whl/ (torchao, DeepSpeed and what DeepSpeed needs), installed once per
machine into /tmp/site, which every stage's PYTHONPATH holds. TRAINSTREAM_TRANSPORT=cuda-client-copy runs
the GPU stages through the fallback transport (the default is cuda-ipc); gpt-small and gpt-large name their
JSON after it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / (os.environ.get("OUT") or "/tmp/out")  # a relative $OUT: from the tree's root
VENV = Path("/tmp/ts-venv")
SITE = "/tmp/site"  # the peers' wheels, installed by install_wheels
BEFORE = "/tmp/before"  # another commit's tree (build-before, python-before) for the A/B stages
TRAIN_GPT = "benchmarks/train_gpt/train_gpt.py"
ADAMW_JSON = "benchmarks/results/adamw_h200-16core.json"  # the host's triad, for the host bounds
ADAMW = ("--adamw-json", ADAMW_JSON)
HUGE_POLICIES = ("never", "always", "within_size", "advise")  # tmpfs's huge= (shm/segment.cpp asks for them)
DRY = False  # --dry-run: commands printed, not run


# --- running commands ---------------------------------------------------------------------------------

def knob(name: str, default: str = "") -> str:
    """Environment variable `name` as a stage reads it: unset or empty gives `default` (${NAME:-default})."""
    return os.environ.get(name) or default


def words(name: str, default: str = "") -> list[str]:
    """A knob split into words, as the shell splits an unquoted ${NAME}."""
    return knob(name, default).split()


def count(name: str, default: str) -> range:
    """1..N for knob `name` (RUNS and the like)."""
    value = knob(name, default)
    if not value.isdigit():
        raise SystemExit(f"{name} must be a whole number, not {value!r}")
    return range(1, int(value) + 1)


def out(name: str) -> str:
    return str(OUT / name)


def matches(pattern: str) -> list[str]:
    """The files `pattern` matches, sorted; the pattern itself where none does (as the shell's glob)."""
    return sorted(glob.glob(pattern)) or [pattern]


def run(argv, *, env: dict | None = None, cwd=None, timeout: int | str | None = None, log: str | None = None,
        append: bool = False, keep: str | None = None, drop: str | None = None, head: int | None = None,
        show: int | None = None, label: str = "") -> int:
    """Runs `argv` (`env` over the run's environment, in `cwd`, ended after `timeout` seconds by coreutils'
    timeout) with its stdout and stderr together: all of it into `log` (appended with `append`), then to
    the screen the lines `keep` matches and `drop` does not, the first `head` of those, the last `show`
    of those (all with None, none with 0), each after "[label] ". Returns its exit status."""
    argv = [str(a) for a in argv]
    if timeout:
        argv = ["timeout", str(timeout), *argv]
    if DRY:
        assignments = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
        where = f"cd {cwd} && " if cwd else ""
        into = f" {'>>' if append else '>'} {log}" if log else ""
        print(f"+ {where}{' '.join([*assignments, shlex.join(argv)])}{into}", flush=True)
        return 0
    # Into `log` as it runs, as the shell's redirection did: a run the device tool kills at its limit still
    # brings back the log of the stage it was in (a hanging test's, a build's).
    sink = open(log, "a" if append else "w") if log else None  # noqa: SIM115 (read back below)
    start = sink.tell() if sink else 0
    try:
        proc = subprocess.run(argv, cwd=cwd, env={**os.environ, **env} if env else None,
                              stdout=sink or subprocess.PIPE, stderr=subprocess.STDOUT)
        text, status = "" if sink else proc.stdout.decode(errors="replace"), proc.returncode
    except OSError as e:  # not found, not executable, no such cwd: as the shell says it
        text, status = f"{e.filename or argv[0]}: {e.strerror}\n", 127
        if sink:
            sink.write(text)
    if sink:
        sink.close()
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    lines = [line for line in text.splitlines()
             if (keep is None or re.search(keep, line)) and (drop is None or not re.search(drop, line))]
    lines = lines[:head] if head is not None else lines
    lines = lines[max(0, len(lines) - show):] if show is not None else lines
    for line in lines:
        print(f"[{label}] {line}" if label else line, flush=True)
    return status


def all_ok(*argvs, **options) -> bool:
    """Runs each command in turn while they succeed (the shell's &&)."""
    return all(run(argv, **options) == 0 for argv in argvs)


def output(argv, unknown: str) -> str:
    """What `argv` prints, stripped (the shell's $(...)); `unknown` stands for it in a dry run."""
    if DRY:
        return unknown
    try:
        return subprocess.run([str(a) for a in argv], stdout=subprocess.PIPE, text=True).stdout.strip()
    except OSError:
        return ""


def site_packages(python: str) -> str:
    """Where interpreter `python` installs packages (its purelib)."""
    return output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  f"<site-packages of {python}>")


def write(path, text: str) -> None:
    """`text` into file `path` (the shell's echo >)."""
    if DRY:
        print(f"+ write {path}: {text.strip()}", flush=True)
        return
    try:
        Path(path).write_text(text)
    except OSError as e:  # as the shell's redirection: said, and the run goes on
        print(f"{path}: {e.strerror}", flush=True)


def set_env(**values: str) -> None:
    """Exports `values` to every later command (unsets those that are None)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        if DRY:
            print(f"+ unset {name}" if value is None else f"+ export {name}={shlex.quote(value)}", flush=True)


@contextlib.contextmanager
def background(argv: list[str], log: str):
    """Runs `argv` (its output into `log`) while the body runs, then ends it with SIGTERM."""
    if DRY:
        print(f"+ {shlex.join(argv)} > {log} &", flush=True)
        yield
        return
    proc = None
    with open(log, "w") as f:
        try:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        except OSError as e:  # the body runs without it, and says so
            print(f"{argv[0]}: {e.strerror}", file=f)
            print(f"{argv[0]}: {e.strerror}", flush=True)
    try:
        yield
    finally:
        if proc:
            proc.terminate()
            proc.wait()


def header(name: str) -> None:
    print(f"=== {name} ({time.strftime('%H:%M:%S')})", flush=True)


# --- which trainstream ------------------------------------------------------------------------------

def use_sysroot() -> None:
    """The sysroot's libraries for the compiler and this tree's build (its daemon, its Python package) for
    everything after: once per run."""
    if os.environ.get("TS_SYSROOT"):
        return
    if not Path(".device/sysroot").is_dir():
        run(["tar", "-C", ".device", "-xzf", ".device/sysroot.tgz"])
    sysroot = f"{ROOT}/.device/sysroot/usr"
    set_env(TS_SYSROOT=sysroot,
            PATH=f"{sysroot}/bin:" + os.environ.get("PATH", "").replace(f"{VENV}/bin:", ""),
            LD_LIBRARY_PATH=f"{sysroot}/lib/x86_64-linux-gnu:" + os.environ.get("LD_LIBRARY_PATH", ""),
            PKG_CONFIG_PATH=f"{sysroot}/lib/x86_64-linux-gnu/pkgconfig",
            TRAINSTREAMD=f"{ROOT}/build/daemon/trainstreamd", PYTHONPATH=f"{ROOT}/python:{SITE}")


def use_wheel(wheel: str) -> None:
    """The carried wheel installed into VENV (again only when the wheel changed), first on PATH."""
    with open(wheel, "rb") as f:
        installed = f"{hashlib.sha256(f.read()).hexdigest()}  -"  # as `sha256sum <wheel` writes it
    marker = VENV / "installed-wheel"
    current = marker.read_text().strip() if marker.is_file() else None
    if not os.access(VENV / "bin/trainstreamd", os.X_OK) or current != installed:
        machine_site = site_packages("python3")
        run(["rm", "-rf", VENV])
        pip = ["install", "-q", "--no-index", "--no-deps", wheel]
        if run(["python3", "-m", "venv", VENV], show=0) == 0:
            run([f"{VENV}/bin/python", "-m", "pip", *pip], show=2)
        else:  # a python3 without ensurepip: the machine's pip installs into the venv
            all_ok(["python3", "-m", "venv", "--without-pip", VENV],
                   ["python3", "-m", "pip", "--python", f"{VENV}/bin/python", *pip], show=2)
        venv_site = site_packages(f"{VENV}/bin/python")
        # after the venv's own site-packages: its trainstream wins
        write(f"{venv_site}/machine-site-packages.pth", machine_site + "\n")
        write(marker, installed + "\n")
    set_env(PATH=f"{VENV}/bin:" + os.environ.get("PATH", ""), PYTHONPATH=SITE, TRAINSTREAMD=None)


def carried_wheel() -> str | None:
    wheels = sorted(glob.glob(".device/trainstream/trainstream-*-cp312-*.whl"))
    return wheels[-1] if wheels else None


def install_wheels() -> None:
    """The peers from the wheels carried in .whl, once per machine."""
    if Path(SITE).is_dir():
        return
    run(["python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--target", SITE, *matches(".whl/*.whl")], show=2)


def describe_machine() -> None:
    """machine.txt: cores, memory, /dev/shm, the GPU; then /dev/shm large enough for the biggest jobs."""
    run(["bash", "-c", "nproc; free -g; df -h /dev/shm; "
         "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv"], log=out("machine.txt"), show=0)
    run(["mount", "-o", "remount,size=120G", "/dev/shm"], show=0)


def cmake_configure(build_type: str, *options: str) -> list[str]:
    return ["cmake", "-S", ".", "-B", "build", "-G", "Ninja", f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_PREFIX_PATH={os.environ.get('TS_SYSROOT', '')}", *options,
            f"-Dpybind11_DIR={output(['python3', '-m', 'pybind11', '--cmakedir'], '<pybind11 --cmakedir>')}",
            f"-DPython_EXECUTABLE={shutil.which('python3') or 'python3'}"]


FAST_TARGETS = ("--target", "trainstreamd", "_C", "ts_bench_adamw")  # what the GPU-facing stages use


def build_or_exit(configure: list[str], build_args, log: str, lines: int, cwd=None) -> None:
    """cmake's configure, then its build, into `log`; where either fails, the log's last `lines` and the run
    ends (exit 1): the stages after need the build."""
    if not (run(configure, cwd=cwd, log=log, show=0) == 0
            and run(["cmake", "--build", "build", *build_args], cwd=cwd, log=log, append=True, show=0) == 0):
        run(["tail", f"-{lines}", log])
        raise SystemExit(1)


# --- train_gpt's runs --------------------------------------------------------------------------------

def train_gpt(*args) -> list[str]:
    return ["python3", TRAIN_GPT, *args]


def brief(path: str, label: str) -> None:
    """One line of a train_gpt JSON's first run: its step, phases, busy cores, median waits on the daemon,
    the neighbor beside it, its GPU phases (--gpu-phases) and the daemon's running workers and idle
    milliseconds in each (--daemon-busy)."""
    if DRY:
        print(f"+ brief {path}", flush=True)
        return
    try:
        with open(path) as f:
            r = json.load(f)["runs"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"[{label}] no result in {path}: {e!r}", flush=True)
        return

    def median(key: str, digits: int) -> float:
        return round(statistics.median(r.get(key) or [0]), digits)

    parts = [r["mode"], r.get("error") or f"{r['step_ms']:.1f} ms",
             {k: round(v, 1) for k, v in r.get("phases_ms", {}).items()},
             {k: round(v, 2) for k, v in r.get("busy_cores", {}).items()},
             "weights wait", median("weights_wait_ms", 1), "region wait", median("region_wait_ms", 2),
             "wanted wait", median("wanted_wait_ms", 2), r.get("beside", ""),
             {k: round(v, 1) for k, v in r.get("gpu_phases_ms", {}).items()}]
    if "daemon_busy" in r:
        parts += [{k: round(v, 1) for k, v in r["daemon_busy"][part].items()}
                  for part in ("cores_by_gpu_phase", "idle_ms_by_gpu_phase")]
    print(f"[{label}]", *parts, flush=True)


def small_offload(json_path: str, label: str, *args: str, env: dict | None = None) -> None:
    """The 124M's forced offload for STEPS (40) steps into `json_path`, quietly, then its brief line;
    `args` go to train_gpt, `env` to its environment."""
    run(train_gpt("--config", "124m", "--modes", "trainstream", "--steps", knob("STEPS", "40"), *ADAMW,
                  "--json", json_path, *args), env=env, timeout=120, show=0)
    brief(json_path, label)


def triad_gbs() -> str:
    """The host's memory bandwidth the bounds use: the STREAM triad of the machine's benchmarks/adamw result."""
    with open(ADAMW_JSON) as f:
        return str(json.load(f)["triad"]["gb_per_s"])


# --- the stages ------------------------------------------------------------------------------------------

@dataclass
class Stage:
    group: str
    name: str  # "name=VALUE": the stage takes what follows its "="
    purpose: str
    knobs: list[str]
    run: Callable
    check: Callable[[str | None], str | None] | None = None  # why not, asked before any stage runs


STAGES: dict[str, Stage] = {}
SETUP, TESTS, BENCHMARKS = "setup", "tests", "benchmarks"


def stage(group: str, name: str, purpose: str, knobs: str = "", check=None):
    def register(fn):
        STAGES[name] = Stage(group, name, purpose, knobs.split(), fn, check)
        return fn
    return register


@stage(SETUP, "build", "this tree built (RelWithDebInfo, with its tests) against the sysroot: build.log, "
       "machine.txt", "BUILD_TARGETS")
def build():
    use_sysroot()
    header("build")
    describe_machine()
    targets = ["--target", *words("BUILD_TARGETS")] if knob("BUILD_TARGETS") else []
    build_or_exit(cmake_configure("RelWithDebInfo"), ["-j16", *targets], out("build.log"), 40)


@stage(SETUP, "build-fast", "Release, the daemon, the module and ts_bench_adamw only; the stripped binaries "
       "into $OUT/bin, to carry back in .device/bin (use-bin)", "BUILD_JOBS")
def build_fast():
    use_sysroot()
    header("build-fast")
    describe_machine()
    build_or_exit(cmake_configure("Release", "-DTRAINSTREAM_BUILD_TESTS=OFF"),
                  [f"-j{knob('BUILD_JOBS', '16')}", *FAST_TARGETS], out("build.log"), 40)
    all_ok(["mkdir", "-p", out("bin")],
           ["cp", "build/daemon/trainstreamd", *matches("python/trainstream/_C*.so"),
            "build/benchmarks/adamw/ts_bench_adamw", out("bin") + "/"],
           ["strip", out("bin/trainstreamd"), out("bin/ts_bench_adamw"), *matches(out("bin/_C*.so"))])


@stage(SETUP, "use-bin", "the binaries of an earlier build-fast of the same sources, carried in .device/bin, "
       "in place of a build")
def use_bin():
    use_sysroot()
    header("use-bin")
    all_ok(["mkdir", "-p", "build/daemon", "build/benchmarks/adamw"],
           ["cp", ".device/bin/trainstreamd", "build/daemon/"],
           ["cp", ".device/bin/ts_bench_adamw", "build/benchmarks/adamw/"],
           ["cp", *matches(".device/bin/_C*.so"), "python/trainstream/"])


@stage(SETUP, "build-before", "the commit in .device/before.tar (a source tarball) built as build-fast "
       "builds, into /tmp/before, for the before/after stages: build_before.log", "BUILD_JOBS")
def build_before():
    use_sysroot()
    header("build-before")
    all_ok(["rm", "-rf", BEFORE], ["mkdir", "-p", BEFORE], ["tar", "-C", BEFORE, "-xf", ".device/before.tar"])
    build_or_exit(cmake_configure("Release", "-DTRAINSTREAM_BUILD_TESTS=OFF"),
                  [f"-j{knob('BUILD_JOBS', '16')}", *FAST_TARGETS], out("build_before.log"), 20, cwd=BEFORE)


@stage(SETUP, "python-before", "the Python of .device/before.tar over this tree's binaries (use-bin or "
       "build-fast first), in /tmp/before as build-before leaves it: an A/B of a change to the Python alone")
def python_before():
    use_sysroot()
    header("python-before")
    all_ok(["rm", "-rf", BEFORE], ["mkdir", "-p", f"{BEFORE}/build/daemon"],
           ["tar", "-C", BEFORE, "-xf", ".device/before.tar", "python"],
           ["cp", *matches("python/trainstream/_C*.so"), f"{BEFORE}/python/trainstream/"],
           ["cp", "build/daemon/trainstreamd", f"{BEFORE}/build/daemon/"])


@stage(SETUP, "wheel-before", "another commit's cp312 wheel, carried in .device/before/, installed into "
       "/tmp/before as build-before leaves it (python/, build/daemon/trainstreamd): the before/after stages "
       "without a sysroot", check=lambda _: None if glob.glob(".device/before/trainstream-*-cp312-*.whl")
       else "no cp312 wheel in .device/before/")
def wheel_before():
    header("wheel-before")
    wheel = sorted(glob.glob(".device/before/trainstream-*-cp312-*.whl"))[-1]
    all_ok(["rm", "-rf", BEFORE], ["mkdir", "-p", f"{BEFORE}/build/daemon"],
           [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--target", f"{BEFORE}/python", wheel],
           ["ln", "-s", f"{BEFORE}/python/trainstream/_bin/trainstreamd", f"{BEFORE}/build/daemon/trainstreamd"])


@stage(SETUP, "wheel-info", "which trainstream this run uses and what its binaries load: wheel_info.txt "
       "(ldd of each), machine.txt")
def wheel_info():
    header("wheel-info")
    describe_machine()
    info = out("wheel_info.txt")
    found = [shutil.which(name) for name in ("python3", "trainstreamd", "trainstreamctl")]
    write(info, "".join(f"{line}\n" for line in [
        f"wheel: {carried_wheel() or 'none'}", f"PATH={os.environ.get('PATH', '')}",
        f"LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')}",
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} TRAINSTREAMD={os.environ.get('TRAINSTREAMD', '')}",
        *[path for path in found if path]]))
    run(["trainstream", "--version"], log=info, append=True, show=0)
    run(["python3", "-c", "import torch, trainstream._C as c; "
         "print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); print(c.__file__)"],
        log=info, append=True, show=0)
    site = site_packages("python3")
    for binary in matches(f"{site}/trainstream/_C.*.so") + matches(f"{site}/trainstream/_bin/*"):
        run(["bash", "-c", 'echo "== $1"; ldd "$1"', "-", binary], log=info, append=True, show=0)
    if DRY:
        return
    lines = Path(info).read_text(errors="replace").splitlines()
    print(*lines[:12], sep="\n")
    print(f"libraries resolved in trainstream.libs: {sum('trainstream.libs' in line for line in lines)}")
    outside = [line for line in lines if re.search("not found|sysroot", line)]
    if outside:
        print(*outside, "wheel-info: a library outside the wheel (above)", sep="\n", flush=True)


@stage(SETUP, "wheels", "the peers (torchao, DeepSpeed) from the wheels carried in .whl, into /tmp/site")
def wheels():
    header("wheels")
    install_wheels()
    run(["python3", "-c", "import torchao, deepspeed; "
         "print('torchao', torchao.__version__, 'deepspeed', deepspeed.__version__)"], show=1)


@stage(SETUP, "ds-compile", "DeepSpeed's cpu_adam op compiled once (its first use would pay it inside a "
       "mode's timeout): ds_compile.log")
def ds_compile():
    header("ds-compile")
    install_wheels()
    run(["python3", "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
        log=out("ds_compile.log"), show=2)


@stage(SETUP, "torchao", "the reference offloader from a wheel in .device (`pip download torchao --no-deps "
       "-d .device` here: the machine has no network)")
def torchao():
    header("torchao")
    run(["python3", "-m", "pip", "install", "-q", "--no-deps", "--no-index", *matches(".device/torchao-*.whl")],
        show=2)
    run(["python3", "-c", "import torchao.optim; print('torchao', torchao.__version__)"], show=1)


def check_huge(policy: str | None) -> str | None:
    if policy not in HUGE_POLICIES:
        return f"shm-huge={policy}: the policy is one of {', '.join(HUGE_POLICIES)}"
    return None


@stage(SETUP, "shm-huge=POLICY", "/dev/shm remounted with huge=POLICY (never, always, within_size, advise); "
       "the figures in benchmarks/results are with advise", check=check_huge)
def shm_huge(policy: str):
    header(f"shm-huge={policy}")
    if run(["mount", "-o", f"remount,huge={policy}", "/dev/shm"]) == 0:
        run(["grep", "/dev/shm", "/proc/mounts"])


@stage(SETUP, "pack", "what is under $OUT so far into one file, results-N.tgz (the device tool returns at "
       "most 8 files); bin/ stays as it is")
def pack():
    header("pack")
    n = len(glob.glob(out("results-*.tgz")))
    all_ok(["tar", "-czf", "/tmp/results.tgz", "--exclude=./results-*.tgz", "--exclude=./bin", "."],
           ["find", ".", "-mindepth", "1", "-maxdepth", "1", "!", "-name", "results-*.tgz", "!", "-name", "bin",
            "-exec", "rm", "-rf", "{}", "+"],
           ["mv", "/tmp/results.tgz", f"results-{n}.tgz"], cwd=OUT)
    run(["ls", "-la", OUT])


@stage(TESTS, "test", "ctest (ctest.log; with BUILD_TARGETS only ts_optimizer_test), then pytest over "
       "PYTEST_ARGS (tests/python): pytest.log, pytest.xml", "BUILD_TARGETS PYTEST_ARGS")
def test():
    header("ctest")
    if knob("BUILD_TARGETS"):
        run(["build/tests/cpp/optimizer/ts_optimizer_test"], log=out("ctest.log"), show=3)
    else:
        run(["ctest", "-j8", "--output-on-failure"], cwd="build", log=out("ctest.log"), show=5)
    header("pytest")
    run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", *words("PYTEST_ARGS", "tests/python"),
         f"--junitxml={out('pytest.xml')}"], log=out("pytest.log"), show=15)


@stage(TESTS, "test-cuda", "the GPU tests (PYTEST_ARGS, tests/python/test_cuda.py) under each of "
       "CUDA_ALLOCATORS (default expandable): pytest_cuda_.log, pytest_cuda_expandable.log",
       "PYTEST_ARGS CUDA_ALLOCATORS CUDA_TEST_TIMEOUT")
def test_cuda():
    header("test-cuda")
    for allocator in words("CUDA_ALLOCATORS", "default expandable"):
        conf = "expandable_segments:True" if allocator == "expandable" else ""
        run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider",
             *words("PYTEST_ARGS", "tests/python/test_cuda.py")], env={"PYTORCH_CUDA_ALLOC_CONF": conf},
            timeout=knob("CUDA_TEST_TIMEOUT", "300"), log=out(f"pytest_cuda_{'expandable' if conf else ''}.log"),
            show=3, label=conf or "default")


@stage(TESTS, "test-paging-cuda", "test_paging_cuda.py, test_cuda.py and test_cuda_auto.py (and PYTEST_ARGS): "
       "pytest_cuda.log", "PYTEST_ARGS TEST_TIMEOUT")
def test_paging_cuda():
    header("test-paging-cuda")
    run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/python/test_paging_cuda.py",
         "tests/python/test_cuda.py", "tests/python/test_cuda_auto.py", *words("PYTEST_ARGS")],
        timeout=knob("TEST_TIMEOUT", "400"), log=out("pytest_cuda.log"), show=15)


def check_pytest_args(_) -> str | None:
    return None if knob("PYTEST_ARGS") else "pytest runs the tests PYTEST_ARGS names, and it is empty"


@stage(TESTS, "pytest", "only the GPU tests PYTEST_ARGS names (a change's own, when device time is short): "
       "pytest.log", "PYTEST_ARGS TEST_TIMEOUT", check=check_pytest_args)
def pytest():
    header("pytest")
    run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", *words("PYTEST_ARGS")],
        timeout=knob("TEST_TIMEOUT", "400"), log=out("pytest.log"), show=5)


@stage(BENCHMARKS, "bench-adamw", "the host AdamW kernels and the STREAM triad, 100M parameters, 16 threads: "
       "bench_adamw.log, adamw_h200-16core.json (also in benchmarks/results, where the bounds read the triad)")
def bench_adamw():
    header("bench-adamw")
    run(["python3", "benchmarks/adamw/run.py", "--bench", "build/benchmarks/adamw/ts_bench_adamw", "--threads", "16",
         "--params", "100e6", "--tag", "h200-16core"], log=out("bench_adamw.log"), show=40)
    if Path(ADAMW_JSON).is_file() or DRY:
        run(["cp", ADAMW_JSON, f"{OUT}/"])


@stage(BENCHMARKS, "adamw-before-after", "the host kernels of /tmp/before (build-before) against this tree's, "
       "interleaved RUNS (2) times (the machine's bandwidth drifts): adamw_h200-16core-{before,after}-run<n>.json",
       "RUNS")
def adamw_before_after():
    header("adamw-before-after")
    skip = []
    for n in count("RUNS", "2"):
        for name, tree in (("before", BEFORE), ("after", ".")):
            run(["python3", "benchmarks/adamw/run.py", "--bench", f"{tree}/build/benchmarks/adamw/ts_bench_adamw",
                 "--threads", "16", "--params", "100e6", "--reps", "5", *skip, "--tag", f"h200-16core-{name}-run{n}",
                 "--out-dir", OUT], keep=r"^  (fp32|bf16|torch)", head=7, label=f"{name} {n}")
            skip = ["--skip-torch"]


@stage(BENCHMARKS, "gpt-small", "the 124M GPT in train_gpt's default modes: gpt_124m_<transport>.json",
       "TRAINSTREAM_TRANSPORT")
def gpt_small():
    header("gpt-small")
    transport = knob("TRAINSTREAM_TRANSPORT", "cuda-ipc")
    run(train_gpt("--config", "124m", *ADAMW, "--json", out(f"gpt_124m_{transport}.json")), show=8)


def check_setting(_) -> str | None:
    if bool(knob("SETTING")) != bool(knob("VALUES")):
        return "gpt-small-offload: SETTING (an environment variable) and VALUES (its values) go together"
    return None


@stage(BENCHMARKS, "gpt-small-offload", "the 124M's forced offload (STEPS, 40), RUNS (2) times, each run its "
       "own process, a brief line each: gpt_124m_offload[_<value>]_run<n>.json. SETTING=VAR VALUES='a b' runs "
       "each value of environment variable VAR in turn within a run (the machine drifts between runs); "
       "GPT_ARGS go to train_gpt (--daemon-busy, --daemon-trace --gpu-phases, --hook-times, --bucket-mb N, ...)",
       "RUNS STEPS SETTING VALUES GPT_ARGS", check=check_setting)
def gpt_small_offload():
    header("gpt-small-offload")
    setting = knob("SETTING")
    for n in count("RUNS", "2"):
        for value in words("VALUES") if setting else [""]:
            name = f"_{re.sub(r'[^A-Za-z0-9._-]', '-', value)}" if setting else ""
            small_offload(out(f"gpt_124m_offload{name}_run{n}.json"), f"{setting}={value}, run {n}" if setting
                          else f"run {n}", *words("GPT_ARGS"), env={setting: value} if setting else None)


def check_ab_names(_) -> str | None:
    wrong = set(words("AB_NAMES")) - {"before", "daemon", "after"}
    return f"gpt-small-ab: AB_NAMES are among before, daemon, after, not {' '.join(sorted(wrong))}" if wrong else None


@stage(BENCHMARKS, "gpt-small-ab", "the 124M's forced offload alternated RUNS (2) times: \"before\" all of "
       "/tmp/before (build-before, or python-before for a change of the Python alone), \"daemon\" this tree's "
       "daemon under before's Python, \"after\" all of this tree (AB_NAMES chooses): gpt_124m_<name>_run<n>.json",
       "RUNS AB_NAMES STEPS", check=check_ab_names)
def gpt_small_ab():
    header("gpt-small-ab")
    for n in count("RUNS", "2"):
        for name in words("AB_NAMES", "before daemon after"):
            daemon = BEFORE if name == "before" else ROOT
            python = f"{ROOT}/python" if name == "after" else f"{BEFORE}/python"
            small_offload(out(f"gpt_124m_{name}_run{n}.json"), f"{name} {n}",
                          env={"TRAINSTREAMD": f"{daemon}/build/daemon/trainstreamd", "PYTHONPATH": f"{python}:{SITE}"})


@stage(BENCHMARKS, "gpt-small-peers", "the 124M's forced offload beside the GPU-only step, torchao and "
       "DeepSpeed ZeRO-2/3, one invocation (GPT_MODES): gpt_124m_peers.json", "STEPS GPT_MODES PEERS_TIMEOUT")
def gpt_small_peers():
    header("gpt-small-peers")
    install_wheels()
    run(train_gpt("--config", "124m", "--steps", knob("STEPS", "40"), "--modes",
                  knob("GPT_MODES", "gpu-only,trainstream,torchao,deepspeed-zero2,deepspeed-zero3"), *ADAMW,
                  "--json", out("gpt_124m_peers.json")), timeout=knob("PEERS_TIMEOUT", "400"), show=8)


@stage(BENCHMARKS, "gpt-auto", "the 124M: stock fused AdamW, offload=\"auto\", the GPU-only step, forced "
       "offload, 40 steps (medians of 8 differed by 10% between GPU-only and stock): gpt_124m_auto.json")
def gpt_auto():
    header("gpt-auto")
    run(train_gpt("--config", "124m", "--modes", "stock,auto,gpu-only,trainstream", "--steps", "40", *ADAMW,
                  "--json", out("gpt_124m_auto.json")), timeout=200, show=1)


@stage(BENCHMARKS, "gpt-large", "the 1.86B under a 24 GiB cap (GPT_MODES), stock uncapped, and bf16 weights "
       "and moments: gpt_1.86b_cap24_<transport>.json, gpt_1.86b_uncapped_stock.json, "
       "gpt_1.86b_cap24_bf16_<transport>.json", "GPT_MODES TRAINSTREAM_TRANSPORT")
def gpt_large():
    header("gpt-large")
    transport = knob("TRAINSTREAM_TRANSPORT", "cuda-ipc")
    run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", "6", "--modes",
                  knob("GPT_MODES", "gpu-only,stock,trainstream,auto"), *ADAMW,
                  "--json", out(f"gpt_1.86b_cap24_{transport}.json")), show=8)
    run(train_gpt("--config", "1.86b", "--steps", "6", "--modes", "stock", "--json",
                  out("gpt_1.86b_uncapped_stock.json")), show=2)
    run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", "6", "--modes", "trainstream",
                  "--bf16-weights", "--moment-dtype", "bfloat16", *ADAMW,
                  "--json", out(f"gpt_1.86b_cap24_bf16_{transport}.json")), show=2)


@stage(BENCHMARKS, "gpt-memory", "the 1.86B under the 24 GiB cap: GPU-only, trainstream, torchao "
       "(gpt_1.86b_cap24_memory.json); then trainstream with activation paging under each of PAGING_CAPS "
       "(PAGING_GIB=N pages the first N GiB only): gpt_1.86b_cap<cap>_paging[<N>gib].json",
       "GPT_MODES PAGING_CAPS PAGING_GIB")
def gpt_memory():
    header("gpt-memory")
    run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", "6", "--modes",
                  knob("GPT_MODES", "gpu-only,trainstream,torchao"), *ADAMW,
                  "--json", out("gpt_1.86b_cap24_memory.json")),
        timeout=400, show=4)
    gib = knob("PAGING_GIB")
    for cap in words("PAGING_CAPS", "24 16"):
        run(train_gpt("--config", "1.86b", "--vram-cap-gib", cap, "--steps", "6", "--modes", "trainstream",
                      "--activation-paging", *(["--paging-gib", gib] if gib else []), *ADAMW,
                      "--json", out(f"gpt_1.86b_cap{cap}_paging{f'{gib}gib' if gib else ''}.json")),
            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, timeout=200, show=2)


@stage(BENCHMARKS, "gpt-largest", "the largest GPTs under the 24 GiB cap, bf16 weights and moments, batch 4 "
       "(LARGEST_CONFIGS; PAGING=1 pages activations): gpt_<config>_bf16_cap24[_paging].json",
       "LARGEST_CONFIGS PAGING")
def gpt_largest():
    header("gpt-largest")
    paging = bool(knob("PAGING"))
    for config in words("LARGEST_CONFIGS", "5b 7b"):
        run(train_gpt("--config", config, "--batch", "4", "--vram-cap-gib", "24", "--bf16-weights",
                      *(["--activation-paging"] if paging else []), "--moment-dtype", "bfloat16", "--steps", "3",
                      "--warmup", "1", "--modes", "trainstream", *ADAMW,
                      "--json", out(f"gpt_{config}_bf16_cap24{'_paging' if paging else ''}.json")), show=3)


def tree_env(tree) -> dict | None:
    """What runs `tree`'s trainstream: its build (or wheel-before's package and daemon), or for this tree
    from the carried wheel, the run's own environment."""
    if tree == ROOT and not os.environ.get("TS_SYSROOT"):
        return None
    return {"TRAINSTREAMD": f"{tree}/build/daemon/trainstreamd", "PYTHONPATH": f"{tree}/python:{SITE}"}


@stage(BENCHMARKS, "gpt-before-after", "the 1.86B under a 24 GiB cap through /tmp/before (build-before or "
       "wheel-before) and this tree, in turn RUNS (1) times (the machine drifts): "
       "gpt_1.86b_cap24_{before,after}[_run<n>].json", "STEPS RUNS")
def gpt_before_after():
    header("gpt-before-after")
    runs = int(knob("RUNS", "1"))
    for n in range(1, runs + 1):
        for name, tree in (("before", BEFORE), ("after", ROOT)):
            suffix = f"_run{n}" if runs > 1 else ""
            run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", knob("STEPS", "5"), "--warmup",
                          "2", "--modes", "trainstream", "--json", out(f"gpt_1.86b_cap24_{name}{suffix}.json")),
                cwd=tree if Path(tree, TRAIN_GPT).is_file() else ROOT, env=tree_env(tree), timeout=200, show=1,
                label=f"{name}{suffix}")


@stage(BENCHMARKS, "gpt-peers", "the 1.86B, bf16 weights and moments, clipped at 1.0, 24 GiB cap: trainstream "
       "beside DeepSpeed ZeRO-2/3 (GPT_MODES): gpt_1.86b_cap24_bf16_clip1.0_peers.json",
       "STEPS GPT_MODES PEERS_TIMEOUT")
def gpt_peers():
    header("gpt-peers")
    install_wheels()
    run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", knob("STEPS", "4"), "--warmup", "2",
                  "--bf16-weights", "--moment-dtype", "bfloat16", "--max-grad-norm", "1.0", "--modes",
                  knob("GPT_MODES", "trainstream,deepspeed-zero2,deepspeed-zero3"), *ADAMW,
                  "--json", out("gpt_1.86b_cap24_bf16_clip1.0_peers.json")),
        timeout=knob("PEERS_TIMEOUT", "300"), show=1)


@stage(BENCHMARKS, "gpt-paging", "a GPT bigger than the cap, paged (PAGED_CONFIG 1.86b under CAP 4 GiB; "
       "WEIGHTS=bf16 for bf16 weights), against the GPU-only step (GPT_MODES=deepspeed-zero3: DeepSpeed's): "
       "gpt_<config>_cap<cap>_<weights>_paged.json", "PAGED_CONFIG CAP WEIGHTS STEPS GPT_MODES GPT_ARGS PAGED_TIMEOUT")
def gpt_paging():
    header("gpt-paging")
    install_wheels()
    config, weights, cap = knob("PAGED_CONFIG", "1.86b"), knob("WEIGHTS", "fp32"), knob("CAP", "4")
    run(train_gpt("--config", config, "--vram-cap-gib", cap, "--steps", knob("STEPS", "4"), "--warmup", "2",
                  "--param-offload", "true", "--checkpoint-blocks", "--chunked-loss", "--moment-dtype", "bfloat16",
                  "--uncapped-reference", "--modes", knob("GPT_MODES", "gpu-only,trainstream"),
                  *(["--bf16-weights"] if weights == "bf16" else []), *words("GPT_ARGS"), *ADAMW,
                  "--json", out(f"gpt_{config}_cap{cap}_{weights}_paged.json")),
        timeout=knob("PAGED_TIMEOUT", "480"), show=6)
    run(["free", "-g"], head=2)


def shm_policy() -> str:
    """/dev/shm's huge= policy now (never where the mount names none)."""
    with open("/proc/mounts") as f:
        found = [m.group(1) for line in f if "/dev/shm" in line for m in [re.search(r"huge=([a-z_]*)", line)] if m]
    return found[0] if found else "never"


@stage(BENCHMARKS, "gpt-start", "wrap() to the end of the first step of START_CONFIG (1.86b, 24 GiB cap, two "
       "steps; START_ARGS to train_gpt): how long a private daemon takes to serve, then the run against a daemon "
       "logging at info, whose log says how long backing the state took; each run its own "
       "gpt_<config>_start_<shm policy>[_START_LABEL]_run<n>.json and daemon_start_*.log. START_DAEMON: another "
       "trainstreamd; START_PYTHON: another trainstream package's folder (python-before's /tmp/before/python)",
       "START_CONFIG START_ARGS START_LABEL START_DAEMON START_PYTHON")
def gpt_start():
    header("gpt-start")
    policy = shm_policy() + (f"_{knob('START_LABEL')}" if knob("START_LABEL") else "")
    config = knob("START_CONFIG", "1.86b")
    n = 1
    while Path(out(f"gpt_{config}_start_{policy}_run{n}.json")).exists():
        n += 1
    policy = f"{policy}_run{n}"
    run(["python3", "-c", "import time; from trainstream._connect import PrivateDaemon as P; t = time.perf_counter(); "
         "d = P(); print(f'private daemon serving after {time.perf_counter() - t:.2f} s'); d.stop()"])
    # Without the sysroot (a wheel): the wheel's trainstreamd on PATH and its package in the venv.
    sysroot = bool(knob("TS_SYSROOT"))
    daemon = knob("START_DAEMON") or (knob("TRAINSTREAMD") if sysroot else shutil.which("trainstreamd") or "")
    python = knob("START_PYTHON") or (f"{ROOT}/python" if sysroot else "")
    socket, log = "/tmp/ts-start.sock", out(f"daemon_start_{policy}.log")
    run(["rm", "-f", socket])
    with background([daemon, "--socket", socket, "--log-level", "info"], log):
        for _ in range(0 if DRY else 200):
            if Path(socket).is_socket():
                break
            time.sleep(0.05)
        run(train_gpt("--config", config, "--vram-cap-gib", "24", "--steps", "2", "--warmup", "1", "--modes",
                      "trainstream", *words("START_ARGS"), *ADAMW, "--json", out(f"gpt_{config}_start_{policy}.json")),
            env={"TRAINSTREAM_ADDRESS": f"unix:{socket}", "PYTHONPATH": f"{python}:{SITE}" if python else SITE},
            timeout=180, show=1, label=policy)
    run(["grep", "-h", r"created\|page-locked ahead", log])


@stage(BENCHMARKS, "gpt-start-floor", "the GPU-only first step of START_CONFIG (1.86b; forward + backward, no "
       "optimizer, not capped): the model's own warm-up, the floor under gpt-start's first step: "
       "gpt_<config>_gpu-only_first-step.json", "START_CONFIG")
def gpt_start_floor():
    header("gpt-start-floor")
    config = knob("START_CONFIG", "1.86b")
    path = out(f"gpt_{config}_gpu-only_first-step.json")
    run(train_gpt("--config", config, "--vram-cap-gib", "24", "--uncapped-reference", "--steps", "2", "--warmup", "1",
                  "--modes", "gpu-only", "--json", path), timeout=180, show=0)
    if DRY:
        return
    try:
        with open(path) as f:
            r = json.load(f)["runs"][0]
        print(r.get("error") or (round(r["first_step_seconds"], 2),
                                 {k: round(v) for k, v in r["first_step_phases_ms"].items()}), flush=True)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"no result in {path}: {e!r}", flush=True)


@stage(BENCHMARKS, "clipping", "the redo rate over REDO_STEPS (220; 0 skips it) steps of the 124M "
       "(clipping_redo_rate_124m.json); the 1.86B clipped against unclipped, for each of CLIP_WEIGHTS "
       "(fp32 bf16): gpt_1.86b_cap24_<weights>_clip{none,1.0}.json", "REDO_STEPS CLIP_WEIGHTS STEPS")
def clipping():
    header("clipping")
    redo_steps = knob("REDO_STEPS", "220")
    if redo_steps != "0":
        run(["python3", "benchmarks/clipping/redo_rate.py", "--device", "cuda", "--steps", redo_steps,
             "--json", out("clipping_redo_rate_124m.json")], timeout=150, show=4)
    for weights in words("CLIP_WEIGHTS", "fp32 bf16"):
        flags = ["--bf16-weights", "--moment-dtype", "bfloat16"] if weights == "bf16" else []
        for norm in ("none", "1.0"):
            clip = ["--max-grad-norm", norm] if norm != "none" else []
            run(train_gpt("--config", "1.86b", "--vram-cap-gib", "24", "--steps", knob("STEPS", "6"), "--warmup", "2",
                          "--modes", "trainstream", *flags, *clip, *ADAMW,
                          "--json", out(f"gpt_1.86b_cap24_{weights}_clip{norm}.json")),
                timeout=120, show=1, label=f"{weights} clip {norm}")


@stage(BENCHMARKS, "drop-in", "the nanoGPT loop: the one line against the explicit options and stock, the "
       "modes in turn NANOGPT_ROUNDS times (NANOGPT_MODES; NANOGPT_TRACE=1 adds --daemon-trace, per micro-batch "
       "milestones): nanogpt_loop.json. Its tests: test-cuda (-m cuda)",
       "NANOGPT_MODES NANOGPT_ROUNDS NANOGPT_TRACE NANOGPT_TIMEOUT NANOGPT_STEPS")
def drop_in():
    header("drop-in")
    modes = ["--modes", *words("NANOGPT_MODES")] if knob("NANOGPT_MODES") else []
    run(["python3", "benchmarks/drop_in/nanogpt_loop.py", "--steps", knob("NANOGPT_STEPS", "24"), *modes,
         "--rounds", knob("NANOGPT_ROUNDS", "2"), *(["--daemon-trace"] if knob("NANOGPT_TRACE") else []),
         "--json", out("nanogpt_loop.json")], timeout=knob("NANOGPT_TIMEOUT", "540"), show=40)


@stage(BENCHMARKS, "lora", "LoRA r=16 on Qwen2.5-shaped bases bigger than the cap, per LORA_SHAPES entry "
       "(shape:cap GiB): trainstream beside the stock Trainer (LORA_MODES), each mode its own process within "
       "LORA_MODE_TIMEOUT (N, or N,MODE=N,...): lora_<shape>_cap<cap>.json. One shape fits a device call",
       "LORA_SHAPES LORA_MODES LORA_MODE_TIMEOUT LORA_TIMEOUT STEPS WARMUP")
def lora():
    header("lora")
    install_wheels()
    for spec in words("LORA_SHAPES", "14b:8 32b:12"):
        shape, cap = spec.split(":")[0], spec.split(":")[-1]
        run(["python3", "benchmarks/lora/lora_bench.py", "--shape", shape, "--vram-cap-gib", cap,
             "--modes", knob("LORA_MODES", "trainstream,gpu-only,accelerate"),
             "--mode-timeout", knob("LORA_MODE_TIMEOUT", "150"), "--steps", knob("STEPS", "4"),
             "--warmup", knob("WARMUP", "2"), "--json", out(f"lora_{shape}_cap{cap}.json")],
            timeout=knob("LORA_TIMEOUT", "540"), show=1)


HF_PROGRESS = r"^step |it/s\]"  # the Trainer's progress lines


@stage(BENCHMARKS, "hf-full", "the Qwen2.5-1.5B shape (HF_SHAPE) fully fine-tuned through TrainstreamTrainer "
       "under HF_CAP (24) GiB, beside the stock Trainer under the cap and uncapped: "
       "hf_full_<shape>_cap<cap>.json; HF_PROFILE=1 adds a timeline of trainstream alone (trace_hf_<shape>.json.gz)",
       "HF_SHAPE HF_CAP HF_STEPS HF_ARGS HF_FULL_TIMEOUT HF_PROFILE")
def hf_full():
    header("hf-full")
    shape, cap = knob("HF_SHAPE", "1.5b"), knob("HF_CAP", "24")
    run(["python3", "examples/hf_finetune.py", "--shape", shape, "--cap-gib", cap, "--steps", knob("HF_STEPS", "8"),
         "--compare-stock", *words("HF_ARGS"), "--host-gbs", triad_gbs(),
         "--json", out(f"hf_full_{shape}_cap{cap}.json")],
        timeout=knob("HF_FULL_TIMEOUT", "300"), drop=HF_PROGRESS, show=6)
    if knob("HF_PROFILE"):  # trainstream alone, a timeline of its last two of six steps
        run(["python3", "examples/hf_finetune.py", "--shape", shape, "--cap-gib", cap, "--steps", "6",
             "--profile", out(f"trace_hf_{shape}.json")], timeout=120, show=0)
        run(["gzip", "-f", out(f"trace_hf_{shape}.json")])


@stage(BENCHMARKS, "hf-paged", "a full fine-tune of HF_SHAPE (the Qwen2.5-7B shape) through TrainstreamTrainer, "
       "its layers paged, under HF_CAP (24) GiB, bf16 moments, checkpointed layers: hf_paged_<shape>_cap<cap>.json",
       "HF_SHAPE HF_CAP HF_STEPS HF_PAGED_TIMEOUT")
def hf_paged():
    header("hf-paged")
    shape, cap = knob("HF_SHAPE", "7b"), knob("HF_CAP", "24")
    run(["python3", "examples/hf_finetune.py", "--shape", shape, "--paged", "--init-on-gpu", "--cap-gib", cap,
         "--steps", knob("HF_STEPS", "6"), "--moment-dtype", "bfloat16", "--gradient-checkpointing",
         "--host-gbs", triad_gbs(), "--json", out(f"hf_paged_{shape}_cap{cap}.json")],
        timeout=knob("HF_PAGED_TIMEOUT", "240"), drop=HF_PROGRESS, show=4)
    run(["free", "-g"], head=2)


@stage(BENCHMARKS, "transfer", "the transports alone on 1..all GPUs (TRANSPORTS), with the daemon's threads "
       "and with one: transfer_<n>gpu_<transport>[_1thread].json", "TRANSPORTS")
def transfer():
    header("transfer")
    gpus = 1 if DRY else len(output(["nvidia-smi", "-L"], "").splitlines())
    for n in range(gpus, 0, -1):
        for transport in words("TRANSPORTS", "cuda-ipc cuda-client-copy"):
            command = ["python3", "benchmarks/transfer/transfer.py", "--gpus", str(n), "--transport", transport]
            run([*command, "--json", out(f"transfer_{n}gpu_{transport}.json")], show=1)
            run([*command, "--daemon-threads", "1", "--json", out(f"transfer_{n}gpu_{transport}_1thread.json")], show=1)


@stage(BENCHMARKS, "ranks", "4 ranks of the 124M sharing one daemon against private ones: ranks_4x124m.json")
def ranks():
    header("ranks")
    run(["python3", "benchmarks/ranks/shared_vs_private.py", "--ranks", "4", "--config", "124m",
         "--json", out("ranks_4x124m.json")], show=3)


@stage(BENCHMARKS, "torchrun-gpt", "torchrun's ranks on the machine's GPUs (MEASURES check,bench; RANKS): "
       "torchrun_gpt_<measures>[_<ranks>].json", "MEASURES RANKS")
def torchrun_gpt():
    header("torchrun-gpt")
    measures, rank_count = knob("MEASURES"), knob("RANKS")
    run(["python3", "benchmarks/ranks/torchrun_gpt.py", "--measures", measures or "check,bench",
         *(["--ranks", rank_count] if rank_count else []),
         "--json", out(f"torchrun_gpt_{measures or 'all'}{f'_{rank_count}' if rank_count else ''}.json")], show=6)


@stage(BENCHMARKS, "allreduce", "the peer all-reduce against gloo on loopback, one process per node, for each "
       "of NODES (2 3 4), RUNS (3) times: allreduce_h200-16core-<n>nodes-run<r>.json (needs build)",
       "NODES RUNS SIZES CONNECTIONS")
def allreduce():
    header("allreduce")
    sizes, connections = knob("SIZES"), knob("CONNECTIONS")
    for nodes in words("NODES", "2 3 4"):
        for n in count("RUNS", "3"):
            tag = f"h200-16core-{nodes}nodes-run{n}"
            run(["python3", "benchmarks/allreduce/run.py", "--bench", "build/benchmarks/allreduce/ts_bench_allreduce",
                 "--nodes", nodes, *(["--sizes", sizes] if sizes else []),
                 *(["--connections", connections] if connections else []), "--tag", tag],
                keep="MiB", label=f"{nodes} nodes, run {n}")
            run(["cp", f"benchmarks/results/allreduce_{tag}.json", f"{OUT}/"])


# Stages retired on 2026-12-07 (issue 47): one-off probes whose results are committed under
# benchmarks/results/ (mostly train_gpt.md). Each ran as `git show cd20087:scripts/device_run.sh` defines it;
# the scripts they ran are still in benchmarks/. Name -> what runs the same now (None: nothing does).
RETIRED = {
    "gpt-small-slots": "SETTING=TRAINSTREAM_STAGING_SLOTS VALUES='4 8 16' gpt-small-offload",
    "gpt-small-kernels": "SETTING=TRAINSTREAM_KERNEL VALUES='avx512bf16 avx2' gpt-small-offload",
    "gpt-gpu-waits": "SETTING=TRAINSTREAM_GPU_WAITS VALUES='0 1' gpt-small-offload",
    "gpt-small-transports": "SETTING=TRAINSTREAM_TRANSPORT VALUES='cuda-ipc cuda-client-copy' gpt-small-offload",
    "gpt-daemon-busy": "GPT_ARGS=--daemon-busy gpt-small-offload",
    "gpt-small-hooks": "GPT_ARGS=--hook-times RUNS=1 gpt-small-offload",
    "gpt-small-buckets": "GPT_ARGS='--bucket-mb N --daemon-busy' gpt-small-offload, once per size",
    "gpt-trace": "GPT_ARGS='--daemon-trace --gpu-phases' gpt-small-offload (its main variant)",
    "gpt-split-probe": "GPT_ARGS='--daemon-busy --probe-detached-lookup' gpt-small-offload (its probe variant)",
    "gpt-halves": "GPT_ARGS='--state-halves N' gpt-small-offload, N 1 or 2",
    "gpt-threads": "GPT_ARGS='--daemon-threads N --daemon-nice M' gpt-small-offload",
    "gpt-large-transports": "GPT_MODES=gpu-only,trainstream gpt-large under each TRAINSTREAM_TRANSPORT",
    "adamw-ab": "adamw-before-after",
    "gpt-gpu-phases": None,  # train_gpt --gpu-phases
    "gpt-beside": None,  # train_gpt --modes gpu-only --beside SPEC
    "gpt-profile": None,  # train_gpt --profile
    "gpt-small-placement": None,
    "python-per-module": None,
    "adamw-beside-copies": None,
    "tied-rows": None,  # benchmarks/train_gpt/tied_rows.py
    "launch-queue": None,  # benchmarks/transfer/launch_queue.py, and so on
    "populate": None,
    "seed-copy": None,
    "host-register": None,
    "pinned-alloc": None,
    "context-probe": None,
    "transfer-slots": None,
}


def find(arg: str) -> tuple[Stage | None, str | None]:
    """The stage `arg` names, and the value after its "=" for a stage that takes one."""
    if arg in STAGES and "=" not in arg:
        return STAGES[arg], None
    prefix, has_value, value = arg.partition("=")
    for s in STAGES.values():
        if has_value and s.name.startswith(f"{prefix}="):
            return s, value
    return None, None


def refusals(args: list[str]) -> list[str]:
    """Why the stages `args` cannot run, before any does: unknown or retired names, a wrong value."""
    problems = []
    for arg in args:
        s, value = find(arg)
        if s is None and arg in RETIRED:
            now = f"the same now: {RETIRED[arg]}" if RETIRED[arg] else "no stage runs it now"
            problems.append(f"{arg} was retired (issue 47), its results being under benchmarks/results/; {now}; "
                            "as it ran: git show cd20087:scripts/device_run.sh")
        elif s is None:
            problems.append(f"unknown stage {arg!r}")
        elif s.check and (problem := s.check(value)):
            problems.append(problem)
    if any(find(arg)[0] is None for arg in args):
        problems.append("the stages: " + " ".join(STAGES))
    if knob("RUNS") and not knob("RUNS").isdigit():  # count()'s knob, refused before the first stage
        problems.append(f"RUNS must be a whole number, not {knob('RUNS')!r}")
    return problems


def listing() -> str:
    """--list: each stage, its purpose and [the variables it reads], by group."""
    lines = ["Stages (scripts/device_run.sh STAGE...; run in the order given, logs and JSON into $OUT):"]
    width = max(len(name) for name in STAGES)
    for group in (SETUP, TESTS, BENCHMARKS):
        lines.append(f"\n{group}")
        for s in (s for s in STAGES.values() if s.group == group):
            text = s.purpose + (f" [{' '.join(s.knobs)}]" if s.knobs else "")
            lines.append(textwrap.fill(text, 116, initial_indent=f"  {s.name:<{width}}  ",
                                       subsequent_indent=" " * (width + 4)))
    lines.append("")
    lines.append(textwrap.fill("retired (issue 47; `git show cd20087:scripts/device_run.sh` has each as it ran): "
                               + " ".join(RETIRED), 116, subsequent_indent="  "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Runs the GPU machine's stages in order (scripts/device_run.sh).")
    parser.add_argument("stages", nargs="*", help="stage names, in the order to run them (--list names them)")
    parser.add_argument("--list", action="store_true", help="every stage, its purpose and the variables it reads")
    parser.add_argument("--dry-run", action="store_true", help="print the commands the stages would run")
    args = parser.parse_args(argv)
    if args.list:
        try:
            print(listing(), flush=True)
        except BrokenPipeError:  # `--list | head`: the rest unread
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    problems = refusals(args.stages)
    if problems:
        print(*problems, sep="\n", file=sys.stderr)
        return 2
    global DRY
    DRY = args.dry_run
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(ROOT)
    if not DRY:
        OUT.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    wheel = carried_wheel()
    if wheel:
        use_wheel(wheel)
    else:
        use_sysroot()
    for arg in args.stages:
        s, value = find(arg)
        try:
            if "=" in s.name:
                s.run(value)
            else:
                s.run()
        except Exception as e:  # noqa: BLE001 - as a failed command: the run goes on to the next stage
            print(f"{arg} failed: {e!r}", flush=True)
    header("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
