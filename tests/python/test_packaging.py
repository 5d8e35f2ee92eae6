"""What an installed wheel relies on: trainstreamd found inside the package, the launchers on PATH that run
the packaged binaries without importing the package, and one version everywhere (shm/version.h)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import trainstream
from trainstream import TrainstreamError, _cli, _connect
from trainstream._connect import PrivateDaemon, daemon_binary

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "python" / "scripts" / "launch_binary.py"
PYTHON = (sys.executable, "-S")  # no site-packages: only PYTHONPATH's package is found, installed or not


@pytest.fixture
def real_daemon() -> str:
    return daemon_binary()  # the one under test: $TRAINSTREAMD (scripts/test.sh), or the wheel's


def _only_packaged(monkeypatch, tmp_path: Path, packaged_dir: Path) -> None:
    """No $TRAINSTREAMD, nothing on PATH: only what lies in `packaged_dir` can be found."""
    monkeypatch.setattr(_connect, "PACKAGED_BINARIES", packaged_dir)
    monkeypatch.delenv("TRAINSTREAMD", raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))


def test_private_daemon_starts_from_the_packaged_binary(monkeypatch, tmp_path, real_daemon):
    # A venv's python run by its full path has no bin/ on PATH: connect() must still find the daemon that
    # the wheel put in the package.
    packaged = tmp_path / "_bin"
    packaged.mkdir()
    (packaged / "trainstreamd").symlink_to(real_daemon)
    _only_packaged(monkeypatch, tmp_path, packaged)
    assert daemon_binary() == str(packaged / "trainstreamd")
    daemon = PrivateDaemon(threads=1)
    try:
        assert daemon.process.args[0] == str(packaged / "trainstreamd")
        assert trainstream.connect(daemon.socket_path).ping()["pid"] == daemon.process.pid
    finally:
        daemon.stop()


def test_no_daemon_anywhere_is_a_clear_error(monkeypatch, tmp_path):
    _only_packaged(monkeypatch, tmp_path, tmp_path / "no-such-dir")
    with pytest.raises(TrainstreamError, match="trainstreamd not found: install trainstream with pip"):
        daemon_binary()


def _fake_install(tmp_path: Path, binary_body: str | None) -> tuple[Path, dict]:
    """A site folder whose trainstream package fails if imported, with _bin/trainstreamd running
    `binary_body` (none when None); the launcher installed as bin/trainstreamd and bin/other."""
    package = tmp_path / "site" / "trainstream"
    (package / "_bin").mkdir(parents=True)
    (package / "__init__.py").write_text("raise SystemExit('the launcher imported the package')\n")
    if binary_body is not None:
        binary = package / "_bin" / "trainstreamd"
        binary.write_text(binary_body)
        binary.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("trainstreamd", "other"):
        shutil.copy(LAUNCHER, bin_dir / name)
    return bin_dir, dict(os.environ, PYTHONPATH=str(tmp_path / "site"))


def test_launcher_runs_the_packaged_binary_without_importing_the_package(tmp_path):
    bin_dir, env = _fake_install(tmp_path, "#!/bin/sh\necho \"packaged binary, pid $$, args: $*\"\n")
    launched = subprocess.Popen([*PYTHON, str(bin_dir / "trainstreamd"), "--version", "x y"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = launched.communicate(timeout=60)
    assert launched.returncode == 0, output
    # The binary replaced the launcher: same pid (what systemd's Type=notify and signals rely on).
    assert output.strip() == f"packaged binary, pid {launched.pid}, args: --version x y"


def test_launcher_says_what_is_wrong(tmp_path):
    bin_dir, env = _fake_install(tmp_path, None)
    missing = subprocess.run([*PYTHON, str(bin_dir / "trainstreamd")], env=env, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode != 0
    assert "trainstreamd: cannot run" in missing.stderr and "_bin/trainstreamd" in missing.stderr
    other = subprocess.run([*PYTHON, str(bin_dir / "other")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert other.returncode != 0 and "runs trainstreamd or trainstreamctl" in other.stderr
    no_package = subprocess.run([*PYTHON, str(bin_dir / "trainstreamd")],
                                env=dict(env, PYTHONPATH=str(tmp_path / "empty")), capture_output=True, text=True,
                                timeout=60, cwd=tmp_path)
    assert no_package.returncode != 0 and "the trainstream package is not importable" in no_package.stderr


def _version_of_the_source() -> str:
    """shm/version.h's kVersion, read with pyproject.toml's own regex (what the wheel's metadata gets)."""
    tomllib = pytest.importorskip("tomllib")
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["metadata"]["version"]
    match = re.search(settings["regex"], (ROOT / settings["input"]).read_text())
    assert match, f"{settings['regex']} not found in {settings['input']}"
    return match.group("value")


def test_one_version_everywhere(capsys, real_daemon):
    version = _version_of_the_source()
    assert trainstream.__version__ == version
    assert _cli.main(["--version"]) == 0
    printed = capsys.readouterr().out
    assert f"trainstream {version} " in printed and f"trainstreamd {version} ({real_daemon})" in printed
    ctl = os.path.join(os.path.dirname(real_daemon), "trainstreamctl")
    if not os.access(ctl, os.X_OK):  # the build tree keeps it elsewhere (tests/python/conftest.py)
        from conftest import ctl_binary
        ctl = ctl_binary()
    assert subprocess.run([ctl, "--version"], capture_output=True, text=True, timeout=60).stdout.strip() == version


def test_version_mismatch_fails(capsys, monkeypatch, tmp_path):
    other = tmp_path / "trainstreamd"
    other.write_text("#!/bin/sh\necho 9.9.9\n")
    other.chmod(0o755)
    monkeypatch.setenv("TRAINSTREAMD", str(other))
    assert _cli.main(["--version"]) == 1
    assert f"differs from the package's {trainstream.__version__}" in capsys.readouterr().out


def test_cli_without_arguments_prints_help(capsys):
    assert _cli.main([]) == 0
    assert "--version" in capsys.readouterr().out


def test_installed_commands():
    # `trainstream --version` and the trainstreamd launcher as pip installed them: only where they are
    # (the wheel's test stage, scripts/test_wheel.sh); a source-tree run has none.
    scripts = sysconfig.get_path("scripts")
    commands = {name: shutil.which(name, path=scripts) for name in ("trainstream", "trainstreamd")}
    if None in commands.values():
        pytest.skip(f"no installed trainstream commands in {scripts} (a source-tree run)")
    result = subprocess.run([commands["trainstream"], "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"trainstream {trainstream.__version__} "), result.stdout
    assert result.stdout.count(trainstream.__version__) == 2
    daemon = subprocess.run([commands["trainstreamd"], "--version"], capture_output=True, text=True, timeout=60)
    assert daemon.stdout.strip() == trainstream.__version__, daemon.stdout + daemon.stderr
