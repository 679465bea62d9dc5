"""Sandboxes are isolated from each other and from the host."""

from __future__ import annotations

import asyncio
import os

from fanfold import Outcome


async def test_rm_rf_root_harms_no_one(afleet):
    async with await afleet.create() as victim, await afleet.create() as bystander:
        result = await victim.exec("rm -rf --no-preserve-root / 2>/dev/null; ls /usr/bin | wc -l", timeout=120)
        assert result.outcome is Outcome.EXITED
        assert (await bystander.exec("ls /usr/bin | wc -l")).text.strip() != "0"
        assert (await victim.exec(["/bin/true"])).exit_code == 127  # its own /bin is gone
    assert os.path.exists("/usr/bin/python3")
    async with await afleet.create() as fresh:
        assert (await fresh.exec("python3 -c 'print(42)'")).text == "42\n"


async def test_sandboxes_do_not_see_each_other(afleet):
    a, b = await asyncio.gather(afleet.create(), afleet.create())
    try:
        await a.exec("echo mine > /tmp/private; sleep 60 >/dev/null 2>&1 &")
        seen = await b.exec("cat /tmp/private; ps -e -o comm= | grep -c sleep; hostname")
        assert b"No such file" in seen.stderr
        assert seen.text.split() == ["0", b.id]
        assert (await a.exec("ps -e -o pid= | head -1")).text.strip() == "1"
    finally:
        await asyncio.gather(a.kill(), b.kill())


async def test_no_network_but_loopback(afleet):
    async with await afleet.create() as sandbox:
        devices = await sandbox.exec("ls /sys/class/net")
        outbound = await sandbox.exec(
            ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"], timeout=20
        )
        loop = await sandbox.exec(
            ["python3", "-c",
             "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
             "c=socket.create_connection(s.getsockname()); print('ok')"]
        )
    assert devices.text.split() == ["lo"]
    assert outbound.exit_code != 0 and b"unreachable" in outbound.stderr.lower()
    assert loop.text == "ok\n"


async def test_sandbox_cannot_mount_or_load_modules(afleet):
    async with await afleet.create() as sandbox:
        result = await sandbox.exec("mount -t tmpfs x /mnt 2>&1; echo rc=$?")
    assert "rc=0" not in result.text


async def test_runc_is_a_drop_in_runtime(tmp_path):
    from fanfold import AsyncFleet, EngineConfig

    async with AsyncFleet(config=EngineConfig(state_dir=tmp_path / "state", runtime="runc")) as fleet:
        async with await fleet.create(memory_mb=64) as sandbox:
            result = await sandbox.exec("echo $((6 * 7)); ls /sys/class/net")
            oom = await sandbox.exec(["python3", "-c", "bytearray(256 << 20)"], timeout=60)
    assert result.text.split() == ["42", "lo"]
    assert oom.outcome is Outcome.OOM
    from fanfold.host import cgroups

    config = EngineConfig(state_dir=tmp_path / "state", runtime="runc")
    assert not any(d.exists() for d in cgroups.sandbox_dirs(config.cgroup_parent))
