"""The doctor's CRIU check runs the configured binary (``EngineConfig().criu``), and the set-up script parses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fanfold.host import doctor

ROOT = Path(__file__).resolve().parent.parent


def fake_criu(tmp_path: Path, check_output: str, check_status: int) -> Path:
    path = tmp_path / "criu"
    path.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --version) echo 'Version: 4.1.1' ;;\n"
        f"  check) echo '{check_output}'; exit {check_status} ;;\n"
        "esac\n"
    )
    path.chmod(0o755)
    return path


def test_criu_check_passes_and_reports_the_version(tmp_path):
    check = doctor.check_criu(str(fake_criu(tmp_path, "Looks good.", 0)))
    assert check.ok and not check.required and "4.1.1" in check.detail


def test_criu_check_fails_with_the_last_line_and_the_fix(tmp_path):
    check = doctor.check_criu(str(fake_criu(tmp_path, "Error (criu/crtools.c:260): Could not initialize", 1)))
    assert not check.ok and not check.required
    assert "Could not initialize" in check.detail and "scripts/criu.sh" in check.fix


def test_criu_check_uses_the_configured_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("FANFOLD_CRIU", str(tmp_path / "missing" / "criu"))
    check = doctor.check_criu()
    assert not check.ok and "not installed" in check.detail and str(tmp_path) in check.detail


def test_criu_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "criu.sh")], check=True)


def test_lazy_restore_check_sees_the_patched_page_server_and_says_what_the_kernel_tracks(tmp_path):
    check = doctor.check_lazy_restore()
    if not check.ok and "no CRIU" in check.detail:
        pytest.skip("CRIU is not built here")
    assert check.ok and "on-demand, shared page server" in check.detail and "dirty tracking" in check.detail
    stock = doctor.check_lazy_restore(str(fake_criu(tmp_path, "Looks good.", 0)))
    assert not stock.ok and "lacks fanfold's on-demand, shared page server" in stock.detail and "criu.sh" in stock.fix
