"""An engine killed with SIGKILL leaves nothing behind once the next one starts."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap

from conftest import leaks

from fanfold import AsyncFleet
from fanfold.runtime.oci_sandbox import paths

def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie awaiting a parent that is not ours to reap."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


CRASHER = textwrap.dedent("""
    import json, os, sys
    from fanfold import EngineConfig, Fleet
    fleet = Fleet(config=EngineConfig(state_dir=sys.argv[1]))
    fleet.start()
    boxes = [fleet.create(memory_mb=64) for _ in range(3)]
    for box in boxes:
        box.exec("sleep 1000 >/dev/null 2>&1 &")
    print(json.dumps([box.id for box in boxes]), flush=True)
    os.kill(os.getpid(), 9)
""")


async def test_sigkilled_engine_is_reaped_by_the_next(config):
    done = subprocess.run([sys.executable, "-c", CRASHER, str(config.state_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    ids = json.loads(done.stdout)
    db = sqlite3.connect(config.state_dir / "fanfold.db")
    pids = [db.execute("SELECT pid FROM sandboxes WHERE id=?", (i,)).fetchone()[0] for i in ids]
    # One sandbox loses its row too, as if the crash came between its resources and its record.
    db.execute("DELETE FROM sandboxes WHERE id=?", (ids[0],))
    db.commit()
    db.close()
    assert all(alive(pid) for pid in pids)
    assert all(paths(config, i).rootfs.is_dir() for i in ids)
    async with AsyncFleet(config=config) as fleet:
        assert not {s.id for s in await fleet.list()} & set(ids)
        assert not any(alive(pid) for pid in pids)
        assert not any(paths(config, i).root.exists() or paths(config, i).socket.exists() for i in ids)
        assert leaks(config) == {"mounts": 0, "cgroups": 0, "containers": 0}


async def test_detached_sandboxes_survive_their_creator_until_removed(config):
    script = textwrap.dedent("""
        import sys
        from fanfold import EngineConfig, Fleet
        with Fleet(config=EngineConfig(state_dir=sys.argv[1])) as fleet:
            print(fleet.create(detached=True).id)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(config.state_dir)], capture_output=True, text=True, timeout=60)
    sandbox_id = done.stdout.strip()
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.get(sandbox_id)
        assert (await sandbox.exec("echo still here")).text == "still here\n"
        await sandbox.kill()
        assert sandbox_id not in {s.id for s in await fleet.list()}
