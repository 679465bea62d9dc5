"""Set-up's "is it installed already?" probes, run with the tool absent.

Each script has a ``--check`` mode that runs the very probes its install path runs first, and
installs nothing: with the tool hidden from ``PATH`` (or its directory empty) the probe must say
what is missing and exit 1, never die with the shell's 127 as runsc's did under ``pipefail``.
``scripts/bare-install.sh``, which CI runs, proves the install path itself on a bare Debian root.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def path_without(tmp_path: Path, *hidden: str) -> str:
    """A PATH holding every command of this one's except ``hidden``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = Path(directory) / name
            if name in hidden or (bin_dir / name).exists() or not os.access(target, os.X_OK):
                continue
            (bin_dir / name).symlink_to(target)
    return str(bin_dir)


def run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("script", ["setup.sh", "criu.sh", "runsc.sh", "bare-install.sh"])
def test_every_script_parses(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def test_runsc_probe_with_runsc_absent(tmp_path):
    done = run("runsc.sh", "--check", env={"PATH": path_without(tmp_path, "runsc")})
    assert done.returncode == 1, done.stderr
    assert "missing: gVisor's runsc >= 20240729" in done.stdout


def test_runsc_probe_with_a_runsc_too_old(tmp_path):
    fake = tmp_path / "old" / "runsc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'runsc version 0.0~20221219.0'\n")
    fake.chmod(0o755)
    done = run("runsc.sh", "--check", env={"PATH": f"{fake.parent}:{path_without(tmp_path, 'runsc')}"})
    assert done.returncode == 1 and "missing" in done.stdout, done.stderr


def test_criu_probe_with_criu_absent(tmp_path):
    done = run("criu.sh", "--check", env={"FANFOLD_CRIU_DIR": str(tmp_path / "criu")})
    assert done.returncode == 1, done.stderr
    assert f"missing: CRIU >= 4.1 with fanfold's patches at {tmp_path}/criu/criu" in done.stdout
    assert not (tmp_path / "criu").exists(), "--check must create nothing"


def criu_recipe() -> str:
    """The build recipe criu.sh writes into its stamp: the run dir, what is left out, each patch's sha256."""
    patches = sorted((SCRIPTS / "criu").glob("*.patch"))
    return "rundir=/dev/shm without=gnutls,nftables" + "".join(f"\npatch={p.name} sha256:{hashlib.sha256(p.read_bytes()).hexdigest()}"
                                       for p in patches)


def test_criu_probe_with_a_binary_that_does_not_run(tmp_path):
    """The stamp matches this recipe: only the binary, which cannot say its version, makes it missing."""
    directory = tmp_path / "criu"
    directory.mkdir()
    (directory / "criu").write_text("#!/bin/sh\nexit 127\n")
    (directory / "criu").chmod(0o755)
    (directory / "criu.stamp").write_text(f"version=4.1.1\n{criu_recipe()}\n")
    working = tmp_path / "good"
    working.mkdir()
    (working / "criu").write_text("#!/bin/sh\necho 'Version: 4.1.1'\n")
    (working / "criu").chmod(0o755)
    (working / "criu.stamp").write_text(f"version=4.1.1\n{criu_recipe()}\n")
    current = run("criu.sh", "--check", "--install-only", env={"FANFOLD_CRIU_DIR": str(working)})
    assert current.returncode == 0, current.stdout + current.stderr  # the same stamp with a binary that answers
    done = run("criu.sh", "--check", env={"FANFOLD_CRIU_DIR": str(directory)})
    assert done.returncode == 1 and "missing: CRIU" in done.stdout, done.stderr


def test_setup_probe_on_a_machine_with_nothing(tmp_path):
    """dpkg-query, runsc and CRIU absent, no virtual environment: every piece is named, nothing is made."""
    env = {"PATH": path_without(tmp_path, "runsc", "dpkg-query"), "FANFOLD_CRIU_DIR": str(tmp_path / "criu"),
           "FANFOLD_VENV": str(tmp_path / "venv")}
    done = run("setup.sh", "--check", env=env)
    assert done.returncode == 1, done.stderr
    assert "setup: missing packages: crun runc debootstrap" in done.stdout
    assert f"the virtual environment {tmp_path}/venv" in done.stdout
    assert "missing: CRIU" in done.stdout and "missing: gVisor's runsc" in done.stdout
    assert not (tmp_path / "venv").exists() and not (tmp_path / "criu").exists()


def test_setup_refuses_an_unknown_option():
    done = run("setup.sh", "--instal-only", env={})
    assert done.returncode == 2 and "unknown option '--instal-only'" in done.stderr
    assert "--install-only" in done.stderr  # the usage follows


def test_setup_probe_finds_this_machine_set_up():
    """This machine was set up by the suite's own `make test`: the probes find everything."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("this checkout has no virtual environment of its own (set-up was not run here)")
    done = run("setup.sh", "--check", env={})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "setup: everything is installed"
