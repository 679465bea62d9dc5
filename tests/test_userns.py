"""User namespaces: root in a sandbox is an unprivileged host uid, a range no other live sandbox
has, over layers shared without copying; writes land on disk as the sandbox's root, uid 0."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EngineConfig, HostNotReady
from fanfold.host import doctor, idmap, subids
from fanfold.runtime.oci_sandbox import paths


def _host_ids(engine, sandbox_id: str) -> tuple[int, int]:
    """(uid, gid) PID 1 of the sandbox runs as, seen from the host."""
    pid = engine.db.get(sandbox_id)["pid"]
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    uid = next(line for line in status if line.startswith("Uid:")).split()[1]
    gid = next(line for line in status if line.startswith("Gid:")).split()[1]
    return int(uid), int(gid)


async def test_root_in_a_sandbox_is_an_unprivileged_host_uid_of_its_own(config):
    async with AsyncFleet(config=config) as fleet:
        engine = fleet._transport
        a, b = await asyncio.gather(fleet.create(), fleet.create())
        try:
            ids = {s.id: _host_ids(engine, s.id) for s in (a, b)}
            for sandbox in (a, b):
                uid, gid = ids[sandbox.id]
                assert uid == gid == idmap.base_of(sandbox.id) and uid >= idmap.FIRST_SLOT * idmap.RANGE
                inside = await sandbox.exec("id -u; cat /proc/self/uid_map; stat -c %u:%g /etc/passwd /usr/bin/env")
                first, base, size, *owners = inside.text.split()[1:]
                assert inside.text.split()[0] == "0" and (int(first), int(base), int(size)) == (0, uid, idmap.RANGE)
                assert owners == ["0:0", "0:0"]  # the image's files (and the host's /usr) are root's inside
            assert abs(ids[a.id][0] - ids[b.id][0]) >= idmap.RANGE  # ranges apart, not just different roots
        finally:
            await asyncio.gather(a.kill(), b.kill())
        assert idmap.base_of(a.id) is None and idmap.base_of(b.id) is None  # ranges given back


async def test_writes_land_on_disk_as_the_sandbox_sees_them(config):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            made = await sandbox.exec(
                "echo x > /root/mine; useradd -m bob && su bob -c 'echo y > ~/his'; mkdir /srv/d && chown bob /srv/d;"
                " rm /etc/motd 2>/dev/null; stat -c %U /root/mine /home/bob/his /srv/d")
            assert made.text.split() == ["root", "bob", "bob"], made.stderr
            await sandbox.files.write("/root/from-host", "z")  # through the files API: root's too
            assert (await sandbox.exec("stat -c %u /root/from-host")).text == "0\n"
            upper = paths(config, sandbox.id).disk / "upper"
            on_disk = {name: (upper / name).stat().st_uid for name in ("root/mine", "home/bob/his", "srv/d", "root/from-host")}
            assert on_disk == {"root/mine": 0, "home/bob/his": 1000, "srv/d": 1000, "root/from-host": 0}
            # snapshot layers made of such an upper start in any other range as they were
            snap = await sandbox.snapshot()
        async with await fleet.create(snap) as copy:
            seen = await copy.exec("stat -c %U /root/mine /home/bob/his; cat /root/mine; id -u bob")
            assert seen.text.split() == ["root", "bob", "x", "1000"]
        await fleet.delete_snapshot(snap.id)


async def test_a_fork_child_gets_a_range_of_its_own_and_can_fork_again(config):
    async with AsyncFleet(config=config) as fleet:
        engine = fleet._transport
        async with await fleet.create() as parent:
            await parent.exec("echo parent > /tmp/mark")
            child = (await parent.fork(1)).children[0]
            try:
                assert _host_ids(engine, child.id)[0] not in (0, _host_ids(engine, parent.id)[0])
                assert (await child.exec("cat /tmp/mark; id -u; touch /tmp/w && echo wrote")).text == "parent\n0\nwrote\n"
                grandchild = (await child.fork(1)).children[0]
                try:
                    assert (await grandchild.exec("cat /tmp/mark")).text == "parent\n"
                    assert _host_ids(engine, grandchild.id)[0] not in {_host_ids(engine, s.id)[0] for s in (parent, child)}
                finally:
                    await grandchild.kill()
            finally:
                await child.kill()


LOOPBACK = ("python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
            " c = socket.create_connection(s.getsockname()); print('lo up')\"")


async def test_a_sandbox_without_ip_sockets_is_restored_with_lo_up(config):
    """Its checkpoint says it held no IP socket, so lo comes up after CRIU is done (no action script)."""
    from fanfold.runtime.oci_sandbox import NO_INET_FILE

    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            await sandbox.exec("nohup sleep 600 >/dev/null 2>&1 &")
            snap = await sandbox.snapshot(memory=True)
            assert (config.state_dir / "snapshots" / snap.id / "memory" / NO_INET_FILE).exists()
        async with await fleet.create(snap.id) as copy:
            assert (await copy.exec(LOOPBACK)).text == "lo up\n"
            assert "sleep 600" in (await copy.exec("ps -eo args")).text
        await fleet.delete_snapshot(snap.id)


async def test_without_user_namespaces_root_is_the_hosts(config, tmp_path):
    quiet = EngineConfig(state_dir=config.state_dir, userns=False)
    async with AsyncFleet(config=quiet) as fleet:
        async with await fleet.create() as sandbox:
            assert _host_ids(fleet._transport, sandbox.id) == (0, 0)
            assert idmap.base_of(sandbox.id) is None
            assert (await sandbox.exec("cat /proc/self/uid_map")).text.split() == ["0", "0", "4294967295"]


def test_a_checkpoints_user_namespace_is_rewritten_for_each_restore(tmp_path):
    from fanfold.runtime import criu_images

    images = tmp_path / "images"
    images.mkdir()
    source = images / "userns-11.img"
    criu_images.write_maps(source, {"uid_map": [(0, 1048576, 65536)], "gid_map": [(0, 1048576, 65536)]})
    (images / "pages-1.img").write_bytes(b"pages")
    copy = criu_images.private_copy(images, tmp_path / "copy", 2 * 1048576)
    assert criu_images.read_maps(copy / "userns-11.img")["uid_map"] == [(0, 2 * 1048576, 65536)]
    assert criu_images.read_maps(source)["gid_map"] == [(0, 1048576, 65536)]  # the shared image is left alone
    assert (copy / "pages-1.img").stat().st_ino == (images / "pages-1.img").stat().st_ino  # linked, not copied
    assert criu_images.has_userns(images) and not criu_images.has_userns(tmp_path)


def _subid_files(tmp_path: Path, uids: str, gids: str) -> tuple[Path, Path]:
    (tmp_path / "subuid").write_text(uids)
    (tmp_path / "subgid").write_text(gids)
    return tmp_path / "subuid", tmp_path / "subgid"


def test_without_a_fanfold_entry_one_is_added_where_no_other_tool_has_ids(tmp_path):
    others = "podman:100000:65536\nlxd:1000000:1000000000\n"
    subuid, subgid = _subid_files(tmp_path, others, "podman:100000:65536\nnspawn:1001100000:65536")
    slots = subids.ensure(8, subuid, subgid)
    entry = f"fanfold:1001193472:{8 * idmap.RANGE}\n"  # the first multiple of 65536 past both files' entries
    assert subuid.read_text() == others + entry and subgid.read_text().endswith("65536\n" + entry)
    assert len(slots) == 8 and idmap.base_of_slot(slots[0]) == 1001193472
    assert subids.ensure(8, subuid, subgid) == slots and subuid.read_text().count("fanfold") == 1
    assert doctor.check_uid_ranges(subuid, subgid).ok


def test_an_existing_fanfold_entry_is_used_as_it_is(tmp_path):
    subuid, subgid = _subid_files(tmp_path, "fanfold:2000000:300000\n", "fanfold:2000000:300000\n")
    slots = subids.ensure(16384, subuid, subgid)  # not grown to what would be added: the operator's choice
    bases = [idmap.base_of_slot(s) for s in slots]
    assert bases == [2031616, 2097152, 2162688, 2228224]  # the whole ranges of 65536 inside it
    assert subuid.read_text() == "fanfold:2000000:300000\n"
    sandbox = f"sb-{secrets.token_hex(6)}"
    assert idmap.claim(sandbox, slots, tmp_path / "claims") == bases[0]


def test_a_fanfold_entry_in_one_file_is_copied_to_the_other_and_an_empty_host_starts_at_1048576(tmp_path):
    subuid, subgid = _subid_files(tmp_path, "", "fanfold:1048576:131072")
    assert subids.ensure(4, subuid, subgid) == range(0, 2) and subuid.read_text() == "fanfold:1048576:131072\n"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert doctor.check_uid_ranges(fresh / "subuid", fresh / "subgid").ok is False
    assert subids.ensure(4, fresh / "subuid", fresh / "subgid") == range(0, 4)
    assert (fresh / "subgid").read_text() == f"fanfold:1048576:{4 * idmap.RANGE}\n"


def test_no_room_or_no_shared_range_is_a_clear_error(tmp_path):
    subuid, subgid = _subid_files(tmp_path, "all:1048576:4293800000\n", "")
    with pytest.raises(HostNotReady, match="FANFOLD_UID_RANGES"):
        subids.ensure(4, subuid, subgid)
    subuid, subgid = _subid_files(tmp_path, "fanfold:1048576:65536\n", "fanfold:4194304:65536\n")
    with pytest.raises(HostNotReady, match="share no whole range"):
        subids.ensure(4, subuid, subgid)


async def test_the_engines_ranges_lie_within_the_fanfold_entries(config):
    async with AsyncFleet(config=config) as fleet:
        async with await fleet.create() as sandbox:
            base = idmap.base_of(sandbox.id)
            uid, gid = _host_ids(fleet._transport, sandbox.id)
    for path, first in ((subids.SUBUID, uid), (subids.SUBGID, gid)):
        entry = subids.ours(subids.parse(path.read_text()))
        assert entry is not None and entry.start <= first == base and base + idmap.RANGE <= entry.end, path
