"""The sandbox boundary: what root in a sandbox tries, and what a subverted agent says, must fail
cleanly and leave the host and the sandbox's siblings intact."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import struct
from pathlib import Path

import pytest

from conftest import TOKENS

from fanfold import AsyncFleet, BuildFailed, EngineConfig, EnvSpec, InvalidRequest, SandboxGone, Unauthorized
from fanfold._agent.client import AgentClient, AgentProtocolError, AgentUnreachable

x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe uses x86_64 syscall numbers")

# Each probe makes one call as root in the sandbox and prints its errno (0: it worked).
PROBES = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return 0 if rc >= 0 else ctypes.get_errno()
def write(path, data):
    try:
        with open(path, "w") as f:
            f.write(data)
        return 0
    except OSError as err:
        return err.errno
def read(path):
    try:
        open(path, "rb").read()
        return 0
    except OSError as err:
        return err.errno
def reached(path):
    import stat
    if stat.S_ISCHR(os.stat(path).st_mode):
        return 1  # masked: /dev/null stands there
    return read(path)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = Iovec(ctypes.addressof(buf), 8), Iovec(0x400000, 8)  # the access check comes first
out = {
    "unshare_user": call(272, CLONE_NEWUSER),
    "unshare_mount": call(272, CLONE_NEWNS),
    "clone_newuser": call(56, CLONE_NEWUSER | 17, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "setns": call(308, os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "mount": call(165, 0, 0, 0, 0, 0),
    "keyctl": call(250, 0, -3, 0, 0, 0),
    "add_key": call(248, 0, 0, 0, 0, -3),
    "bpf": call(321, 5, 0, 0),
    "perf_event_open": call(298, 0, 0, -1, -1, 0),
    "init_module": call(175, 0, 0, 0),
    "finit_module": call(313, -1, 0, 0),
    "kexec_load": call(246, 0, 0, 0, 0),
    "reboot": call(169, 0, 0, 0, 0),
    "userfaultfd": call(323, 0),
    "io_uring_setup": call(425, 1, 0),
    "ptrace_pid1": call(101, 16, 1, 0, 0),
    "process_vm_readv_pid1": call(310, 1, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0),
    "pidfd_open_pid1": call(434, 1, 0),
    "ptrace_pid1_high_bits": call(101, 16, 0x100000001, 0, 0),  # the kernel reads 32 bits of a pid
    "pidfd_open_pid1_high_bits": call(434, 0x100000001, 0),
    "pid1_mem": reached("/proc/1/mem"),
    "pid1_task_mem": reached("/proc/1/task/1/mem"),
    "proc_sys": write("/proc/sys/kernel/hostname", "escaped"),
    "sysrq": write("/proc/sysrq-trigger", "h"),
    "sys": write("/sys/kernel/uevent_helper", "/escaped"),
}
print(json.dumps(out))
'''


@x86_64
async def test_root_in_a_sandbox_cannot_reach_the_kernels_surface(afleet):
    host_name = socket.gethostname()
    async with await afleet.create() as sandbox, await afleet.create() as sibling:
        probe = await sandbox.exec(["python3", "-c", PROBES], timeout=60)
        assert probe.exit_code == 0, probe.stderr
        errnos = json.loads(probe.text)
        worked = {name for name, err in errnos.items() if err == 0}
        assert not worked, f"these worked as root in a sandbox: {sorted(worked)} ({errnos})"
        assert errnos["clone3"] == 38  # ENOSYS: libc falls back to clone, which the filter checks
        # the tools too, not only raw calls: a user namespace (where root could mount) is out of reach
        tools = await sandbox.exec("unshare -Urm mount -t tmpfs none /mnt 2>&1; echo rc=$?")
        assert "rc=0" not in tools.text and "Operation not permitted" in tools.text
        # and the sandbox, its sibling and the host carry on as before
        assert (await sandbox.exec("echo alive; hostname")).text == f"alive\n{sandbox.id}\n"
        assert (await sibling.exec("id -u")).text == "0\n"
        forked = await sandbox.exec("python3 -c 'import os; pid = os.fork(); os._exit(0) if pid == 0 else print(os.waitpid(pid, 0)[1])'")
        assert forked.text == "0\n"  # plain fork and clone still work
    assert socket.gethostname() == host_name


async def test_build_steps_run_under_the_default_profile_too(config):
    async with AsyncFleet(config=config) as fleet:
        with pytest.raises(BuildFailed, match="Operation not permitted"):
            await fleet.build(EnvSpec("host").run("unshare -Ur true"))
        image = await fleet.build(EnvSpec("host").run("grep '^Seccomp:' /proc/self/status > /seccomp"))
        async with await fleet.create(image) as sandbox:
            assert (await sandbox.exec("cat /seccomp")).text.split() == ["Seccomp:", "2"]


async def test_a_profile_is_the_operators_choice(afleet, tmp_path):
    profile = tmp_path / "no-mkdir.json"
    profile.write_text(json.dumps({
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
    }))
    status = "grep '^Seccomp:' /proc/self/status"
    async with await afleet.create() as confined:
        assert confined.info.seccomp == "default"
        assert (await confined.exec(status)).text.split() == ["Seccomp:", "2"]
    if afleet.url is not None and "unix" not in afleet.url:
        return  # a token's tenant: test_only_the_host_tenant_picks_a_profile
    async with await afleet.create(seccomp="unconfined") as loose:
        assert (await loose.exec(status)).text.split() == ["Seccomp:", "0"]
        assert (await loose.exec("unshare -U true; echo rc=$?")).text == "rc=0\n"
    async with await afleet.create(seccomp=str(profile)) as custom:
        made = await custom.exec("mkdir /tmp/d 2>&1; echo rc=$?; touch /tmp/f && echo touched")
        assert "Operation not permitted" in made.text and "touched" in made.text
        assert custom.info.seccomp == str(profile)
    before = len(await afleet.list())
    for bad in ("strict", "relative.json", str(tmp_path / "missing.json")):
        with pytest.raises(InvalidRequest, match="seccomp"):
            await afleet.create(seccomp=bad)
    (tmp_path / "broken.json").write_text('{"syscalls": []}')
    with pytest.raises(InvalidRequest, match="defaultAction"):
        await afleet.create(seccomp=str(tmp_path / "broken.json"))
    assert len(await afleet.list()) == before


async def test_only_the_host_tenant_picks_a_profile(server):
    async with AsyncFleet(server.tcp_url, token=TOKENS["alice"]) as fleet:
        with pytest.raises(Unauthorized, match="seccomp"):
            await fleet.create(seccomp="unconfined")
        assert await fleet.list() == []


async def test_a_restored_sandbox_cannot_swap_its_agent_socket(afleet):
    # A loop that tries, as root, to replace the agent's socket from the first instant it runs: in a
    # fork's child that is the instant CRIU lets it go, which must come after the directory is locked.
    attack = ("while :; do if rm -f /.fanfold/run/agent.sock 2>/dev/null; then echo swapped >> /tmp/swapped;"
              " : > /.fanfold/run/agent.sock; fi; done")
    async with await afleet.create() as sandbox:
        await sandbox.exec(f"nohup sh -c '{attack}' >/dev/null 2>&1 &")
        result = await sandbox.fork(2)
        try:
            for child in result.children:
                assert (await child.exec("echo reached; cat /tmp/swapped 2>/dev/null; echo end")).text == "reached\nend\n"
                assert "T" not in (await child.exec("ps -o stat= -C sh | head -1")).text  # the loop runs
            assert (await sandbox.exec("ls /tmp/swapped 2>&1 || true")).text.endswith("No such file or directory\n")
        finally:
            await asyncio.gather(*(c.kill() for c in result.children))


async def test_the_agent_is_not_traceable_after_a_fork_either(afleet):
    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    async with await afleet.create() as sandbox:
        child = (await sandbox.fork(1)).children[0]
        try:
            probe = json.loads((await child.exec(["python3", "-c", PROBES], timeout=60)).text)
            assert not [k for k in ("ptrace_pid1", "process_vm_readv_pid1", "pidfd_open_pid1", "pid1_mem") if probe[k] == 0]
        finally:
            await child.kill()


FLOOD = r'''
import os, socket, struct, sys
path, held = "/.fanfold/run/agent.sock", []
junk = [struct.pack(">BI", ord("a"), 1 << 30), struct.pack(">BI", ord("Q"), 4) + b"oops",
        os.urandom(4096), struct.pack(">BI", ord("x"), 0), struct.pack(">BI", ord("a"), 8) + b"ab"]
for i in range(300):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(junk[i % len(junk)])
    if i % 3 == 0:
        held.append(s)  # left open, half a frame in
    else:
        s.close()
print(len(held))
'''


async def test_flooding_the_agent_with_malformed_frames_leaves_it_serving(afleet):
    async with await afleet.create() as sandbox, await afleet.create() as sibling:
        flood = await sandbox.exec(["python3", "-c", FLOOD], timeout=60)
        assert flood.text == "100\n", flood.stderr
        assert (await sandbox.exec("echo still here")).text == "still here\n"
        assert (await sibling.exec("echo fine")).text == "fine\n"
        assert (await sandbox.exec(["true"])).exit_code == 0


# -- the host against a hostile agent: a real unix socket that speaks as a subverted agent would


def _frame(kind: str, payload: bytes = b"") -> bytes:
    return struct.pack(">BI", ord(kind), len(payload)) + payload


STATUS = b"code=0 signal=0 timeout=0 out_bytes=1 err_bytes=0 out_trunc=0 err_trunc=0 duration_us=5"


async def _hostile(path: Path, reply: bytes) -> asyncio.AbstractServer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the request has begun
        writer.write(reply)
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(answer, str(path))


async def _exec_against(path: Path, reply: bytes, max_output: int = 1024):
    server = await _hostile(path, reply)
    try:
        return await AgentClient(str(path)).exec(["true"], env=[], cwd="/", timeout_ms=0, max_output=max_output)
    finally:
        server.close()
        await server.wait_closed()
        path.unlink(missing_ok=True)


async def test_the_host_never_trusts_what_an_agent_says(tmp_path):
    sock = tmp_path / "agent.sock"
    # output past the limit is cut here, whatever the agent claims
    flood = _frame("p", b"7") + _frame("o", b"x" * 5000) + _frame("o", b"y" * 100) + _frame("z", STATUS)
    raw = await _exec_against(sock, flood, max_output=1000)
    assert bytes(raw.stdout) == b"x" * 1000 and raw.status["out_trunc"] == 1
    for reply, what in [
        (struct.pack(">BI", ord("o"), (1 << 20) + 1), "oversized"),
        (_frame("o", b"early") + _frame("z", STATUS), "out of turn"),
        (_frame("p", b"7") + _frame("z", b"code=zero"), "malformed exit status"),
        (_frame("p", b"7") + _frame("z", b"code=0"), "malformed exit status"),
        (_frame("p", b"-1; rm") + _frame("z", STATUS), "out of turn"),
        (_frame("p", b"7") + _frame("Q", b"?"), "out of turn"),
    ]:
        with pytest.raises(AgentProtocolError, match=what):
            await _exec_against(sock, reply)
    server = await _hostile(sock, _frame("h", b"\xff\xfe not an agent"))
    try:
        with pytest.raises(AgentProtocolError):
            await AgentClient(str(sock)).ping()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_host_connects_only_to_a_socket_never_through_a_link(tmp_path):
    target = tmp_path / "host-service.sock"
    reached: list[bool] = []

    async def served(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(True)
        writer.close()

    server = await asyncio.start_unix_server(served, str(target))
    try:
        link = tmp_path / "agent.sock"
        link.symlink_to(target)
        with pytest.raises(AgentUnreachable, match="cannot reach"):
            await AgentClient(str(link)).ping()
        link.unlink()
        link.write_text("a plain file")
        with pytest.raises(AgentUnreachable, match="not a socket"):
            await AgentClient(str(link)).ping()
    finally:
        server.close()
        await server.wait_closed()
    assert reached == []


async def test_a_sandbox_whose_agent_breaks_the_protocol_is_destroyed(tmp_path):
    """Through the engine (on the fake backend, whose agent's socket a test can reach): the call
    fails with SandboxGone and the sandbox is gone, never a traceback or a retry on a liar."""
    async with AsyncFleet(config=EngineConfig(state_dir=tmp_path / "state", backend="fake")) as fleet:
        sandbox = await fleet.create()
        path = _fake_socket(fleet._transport, sandbox.id)  # the embedded engine's
        path.unlink()
        server = await _hostile(path, _frame("p", b"1") + _frame("o", b"hi") + _frame("z", b"garbage"))
        try:
            with pytest.raises(SandboxGone, match="broke the protocol"):
                await sandbox.exec("echo hi")
        finally:
            server.close()
            await server.wait_closed()
        assert sandbox.id not in {s.id for s in await fleet.list()}


def _fake_socket(engine, sandbox_id: str) -> Path:
    from fanfold.engine import db as dbmod

    return Path(engine.backend.agent(dbmod.row_handle(engine.db.get(sandbox_id))).socket_path)


def test_the_default_profile_is_an_allowlist_without_namespaces_keys_or_mounts():
    from fanfold.runtime import seccomp

    profile = seccomp.load("default")
    assert profile is not None and profile["defaultAction"] == "SCMP_ACT_ERRNO"
    allowed = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args")
               for n in rule["names"]}
    assert {"read", "write", "execve", "openat", "socket"} <= allowed
    # ptrace and its kin are allowed only when the pid's low 32 bits (all the kernel reads) are not 1
    for name, index in (("ptrace", 1), ("process_vm_readv", 0), ("process_vm_writev", 0), ("pidfd_open", 0)):
        conditions = [rule["args"][0] for rule in profile["syscalls"] if rule["names"] == [name]]
        assert {c["index"] for c in conditions} == {index} and len(conditions) == 32, name
        masks = {(c["value"], c["valueTwo"]) for c in conditions if c["op"] == "SCMP_CMP_MASKED_EQ"}
        lets_through = [pid for pid in (0, 1, 2, 3, 7, 1 << 31, (1 << 32) + 1, (1 << 32) + 2)
                        if any(pid & mask == value for mask, value in masks)]
        assert lets_through == [0, 2, 3, 7, 1 << 31, (1 << 32) + 2], name
    assert not allowed & {"unshare", "setns", "keyctl", "mount", "bpf", "perf_event_open", "init_module", "clone",
                          "clone3", "userfaultfd", "io_uring_setup", "kexec_load", "reboot"}
    assert seccomp.bpf("unconfined") is None and len(seccomp.bpf("default") or "") > 1000
    assert os.path.isabs(seccomp.TEMPLATE)
