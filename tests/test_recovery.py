"""An engine killed with SIGKILL leaves nothing behind once the next one starts."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import leaks

from fanfold import AsyncFleet
from fanfold.host import idmap
from fanfold.runtime import criu_images
from fanfold.runtime.oci_sandbox import paths, restore_copy

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


def _aged(*links: Path) -> None:
    """Date links two minutes back: half claims younger than a minute may be a claim in flight."""
    past = time.time() - 120
    for link in links:
        os.utime(link, (past, past), follow_symlinks=False)


async def test_a_crash_between_a_uid_claims_two_links_leaves_nothing_the_next_engine_keeps(config):
    claims, top = idmap.CLAIMS, idmap.SLOTS - 1
    crashed, old_crashed, held, young = (f"sb-{secrets.token_hex(6)}" for _ in range(4))
    idmap.claim(held, range(top - 3, top - 2))  # a whole claim is left alone
    (claims / "by-id").mkdir(parents=True, exist_ok=True)
    os.symlink(str(top), claims / "by-id" / crashed)  # the first link a claim makes, then the crash
    os.symlink(old_crashed, claims / str(top - 1))  # what an older version's crash left: its slot's link
    os.symlink(young, claims / str(top - 2))  # too young to tell from an older version's claim in flight
    _aged(claims / "by-id" / crashed, claims / str(top - 1), claims / "by-id" / held, claims / str(top - 3))
    try:
        async with AsyncFleet(config=config):
            pass
        assert not os.path.lexists(claims / "by-id" / crashed) and not os.path.lexists(claims / str(top - 1))
        assert idmap.base_of(held) == idmap.base_of_slot(top - 3) and os.path.lexists(claims / str(top - 2))
    finally:
        idmap.release(held)
        for link in (claims / "by-id" / crashed, claims / str(top - 1), claims / str(top - 2)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)


def test_a_half_claim_goes_with_its_sandboxs_release_and_with_a_sweep(tmp_path):
    half = f"sb-{secrets.token_hex(6)}"
    (tmp_path / "by-id").mkdir()
    os.symlink("7", tmp_path / "by-id" / half)  # a crash after the first link
    assert idmap.sweep(tmp_path) == 0  # a claim in flight, as far as a sweep can tell
    idmap.release(half, tmp_path)
    assert not os.path.lexists(tmp_path / "by-id" / half)
    whole = f"sb-{secrets.token_hex(6)}"
    assert idmap.claim(whole, range(7, 9), tmp_path) == idmap.base_of_slot(7)
    os.symlink("7", tmp_path / "by-id" / half)  # another sandbox's crashed claim of the same slot
    assert idmap.sweep(tmp_path, min_age=0) == 1 and idmap.base_of(whole, tmp_path) == idmap.base_of_slot(7)
    idmap.release(whole, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".lock", "by-id"] and os.listdir(tmp_path / "by-id") == []


async def test_a_crash_mid_restore_leaves_no_rewritten_images(config):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            snap = await sandbox.snapshot(memory=True)
        images = config.state_dir / "snapshots" / snap.id / "memory"
        assert criu_images.has_userns(images)
        crashed = f"sb-{secrets.token_hex(6)}"
        copy = criu_images.private_copy(images, restore_copy(images, crashed), idmap.base_of_slot(idmap.SLOTS - 1))
        assert copy.is_dir() and not paths(config, crashed).root.exists()  # as a restore killed mid-way leaves it
    async with AsyncFleet(config=config) as fleet:
        assert not copy.exists()
        async with await fleet.create(snap.id) as restored:  # the images the copy linked to are whole
            assert (await restored.exec("echo ok")).text == "ok\n"
        await fleet.delete_snapshot(snap.id)


async def test_a_suspend_snapshot_whose_sandbox_went_with_a_crash_is_swept(config):
    async with AsyncFleet(config=config) as fleet:
        sandbox = await fleet.create(detached=True)
        await sandbox.suspend()
        snapshot_id = fleet._transport.db.get(sandbox.id)["suspended_to"]
    with sqlite3.connect(config.state_dir / "fanfold.db") as db:  # an engine died destroying it, its row gone
        db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox.id,))
    assert (config.state_dir / "snapshots" / snapshot_id).is_dir()
    async with AsyncFleet(config=config) as fleet:
        assert snapshot_id not in {s.id for s in await fleet.snapshots()}
        assert not (config.state_dir / "snapshots" / snapshot_id).exists()
