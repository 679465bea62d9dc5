"""Compile the agent once per source version into the state directory."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import HostNotReady

SOURCE = Path(__file__).with_name("agent.c")


def agent_binary(state_dir: Path) -> Path:
    """Path of the static agent binary for this source, building it if needed."""
    source = SOURCE.read_bytes()
    target = state_dir / "bin" / f"fanfold-agent-{hashlib.sha256(source).hexdigest()[:12]}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise HostNotReady("no C compiler to build the sandbox agent: run `apt-get install gcc libc6-dev`")
        tmp = target.with_suffix(".tmp")
        done = subprocess.run(
            [compiler, "-static", "-O2", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise HostNotReady(f"building the sandbox agent failed: {done.stderr[-1500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    return target
