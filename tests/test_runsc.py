"""The gVisor tier (``runtime="runsc"``) against the real runsc: every capability the oci tier has
(exec, files, services, limits, snapshots, fork, suspend, the boundary), and nothing left behind.

One embedded engine on the suite's state dir (images are shared) serves the module; it is
skipped when runsc is not installed.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import pytest_asyncio

from fanfold import AsyncFleet, EngineConfig, EnvSpec, FanfoldError, InvalidRequest, Outcome, SandboxGone, SandboxNotFound
from fanfold.host import cgroups, mounts

from conftest import STATE_DIR
from test_boundary import PROBES
from test_snapshots import COUNTER, advances, count

if shutil.which("runsc") is None:
    pytest.skip("gVisor's runsc is not installed (`make setup` installs it)", allow_module_level=True)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEST_TIMEOUT_S = 120
RUNSC_COMMS = frozenset({"runsc", "runsc-gofer", "runsc-sandbox", "exe"})
SOCKET = "/.fanfold/run/agent.sock"
LOOPS = ["pgrep", "-c", "-P", "1", "-f", "while :"]
"""The counter's loop (a child of PID 1), not a child it is forking at that instant (test_snapshots' count both)."""
FLOOD = """
import subprocess
sleeps, error = [], 0
try:
    for _ in range(200):
        sleeps.append(subprocess.Popen(["sleep", "60"]))
except OSError as err:
    error = err.errno
print(len(sleeps), error)
for sleep in sleeps:
    sleep.kill()
    sleep.wait()
"""
THREADS = ("import threading; out = []; ts = [threading.Thread(target=out.append, args=(i,)) for i in range(16)];"
           " [t.start() for t in ts]; [t.join() for t in ts]; print(sorted(out) == list(range(16)))")


def bounded(test):
    """Fail a test that hangs (an agent that never answers, a runsc call that never returns) after
    TEST_TIMEOUT_S instead of holding the suite; its sandboxes are killed as it unwinds."""
    @functools.wraps(test)
    async def run(*args, **kwargs):
        await asyncio.wait_for(test(*args, **kwargs), TEST_TIMEOUT_S)
    return run


@pytest.fixture(scope="module")
def rconfig() -> EngineConfig:
    return EngineConfig(state_dir=STATE_DIR, runtime="runsc")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rfleet(rconfig: EngineConfig):
    async with AsyncFleet(config=rconfig) as fleet:
        yield fleet
        assert await fleet.list() == [], "a test left a sandbox running"
    assert runsc_leftovers(rconfig) == {}


def runsc_processes(state: Path) -> list[str]:
    """runsc's processes (CLI, gofer, sentry) that name ``state`` as their --root."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if comm in RUNSC_COMMS and f"--root={state}" in cmdline.replace("--root ", "--root="):
            found.append(f"{entry}: {cmdline[:120]}")
    return found


def runsc_leftovers(config: EngineConfig, sandbox_id: str = "sb-") -> dict[str, list[str]]:
    """What runsc sandboxes (one, or all) left on the host: only non-empty entries."""
    state = config.run_dir / "runsc"
    found = {
        "processes": runsc_processes(state),
        "state_files": sorted(p.name for p in state.glob(f"*{sandbox_id}*")) if state.is_dir() else [],
        "cgroups": sorted(i for i in cgroups.leftover_ids(config.cgroup_parent) if i.startswith(sandbox_id)),
        "cgroup_dirs": [str(d) for d in cgroups.sandbox_dirs(config.cgroup_parent) if d.name.startswith(sandbox_id)],
        "mounts": [str(m) for m in mounts.mounts_under(config.state_dir / "sandboxes") if sandbox_id in str(m)],
        "dirs": [str(p) for p in (*config.run_dir.glob(f"{sandbox_id}*"),
                                  *(config.state_dir / "sandboxes").glob(f"{sandbox_id}*"))],
    }
    if sandbox_id == "sb-":  # all sandboxes: the processes are every sandbox's
        return {k: v for k, v in found.items() if v}
    found["processes"] = []  # per sandbox: the caller checks the pids it saw
    return {k: v for k, v in found.items() if v}


def cgroup_pids(config: EngineConfig, sandbox_id: str) -> set[int]:
    procs_file = next(d for d in cgroups.sandbox_dirs(config.cgroup_parent, sandbox_id) if d.parent.parent.name == "pids")
    return {int(p) for p in (procs_file / "cgroup.procs").read_text().split()}


# -- 1. create and exec --------------------------------------------------------------------------


@bounded
async def test_exec_output_exit_code_timeout_and_users(rfleet):
    async with await rfleet.create() as sandbox:
        result = await sandbox.exec("echo out; echo err >&2; exit 3")
        assert (result.outcome, result.exit_code, result.stdout, result.stderr) == (Outcome.EXITED, 3, b"out\n", b"err\n")
        timed = await sandbox.exec("echo before; sleep 30", timeout=0.5)
        assert timed.outcome is Outcome.TIMEOUT and timed.exit_code is None and timed.stdout == b"before\n"
        assert 0.4 < timed.duration_s < 5
        assert (await sandbox.exec("kill -TERM $$")).signal == 15
        assert (await sandbox.exec(["no-such-command-xyz"])).exit_code == 127
        piped = await sandbox.exec(["sh", "-c", 'echo "$A $(pwd)"; cat'], env={"A": "e"}, cwd="/tmp", stdin=b"in\n")
        assert piped.text == "e /tmp\nin\n"
        named = await sandbox.exec('id -u; id -g; echo "$HOME"', user="nobody")
        assert named.text == "65534\n65534\n/nonexistent\n"
        assert (await sandbox.exec("id -u")).text == "0\n"
        results = await asyncio.gather(*(sandbox.exec(f"echo {i}") for i in range(20)))
        assert [r.text for r in results] == [f"{i}\n" for i in range(20)]


@bounded
async def test_output_streams_while_the_command_runs(rfleet):
    seen: list[bytes] = []
    early = asyncio.Event()

    async def on_output(stream: str, data: bytes) -> None:
        seen.append(data)
        early.set()

    async with await rfleet.create() as sandbox:
        items = [i async for i in sandbox.exec_stream("echo first; read go; echo second", stdin=b"go\n", timeout=10)]
        assert items[-1].ok and b"".join(i.data for i in items[:-1]) == b"first\nsecond\n"
        task = asyncio.create_task(sandbox.exec("echo early; sleep 30", on_output=on_output, timeout=60))
        await asyncio.wait_for(early.wait(), 10)
        assert not task.done() and seen == [b"early\n"]
        await sandbox.kill()
        with pytest.raises(SandboxGone):
            await task


@bounded
async def test_the_sandbox_is_a_small_linux_of_its_own(rfleet):
    async with await rfleet.create() as sandbox:
        assert (await sandbox.exec("hostname; cat /etc/hostname")).text == f"{sandbox.id}\n{sandbox.id}\n"
        assert (await sandbox.exec("tr '\\0' ' ' < /proc/1/cmdline")).text.startswith("/.fanfold/agent --listen")
        assert (await sandbox.exec("uname -r")).text.strip() != os.uname().release  # the sentry's kernel
        # only loopback, and no route out
        names = await sandbox.exec(["python3", "-c", "import socket; print([n for _, n in socket.if_nameindex()])"])
        assert names.text == "['lo']\n"
        outbound = await sandbox.exec(
            ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"], timeout=20)
        assert outbound.exit_code != 0 and re.search(rb"Errno (101|113)\]", outbound.stderr), outbound.stderr  # no route
        loop = await sandbox.exec(["python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0));"
                                   " s.listen(); socket.create_connection(s.getsockname()); print('ok')"])
        assert loop.text == "ok\n"
        # Debian's coreutils (statx with AT_NO_AUTOMOUNT) and threads work
        listing = await sandbox.exec("ls -l / && ls -l /usr")
        assert listing.exit_code == 0 and {"usr", "etc", "tmp"} <= set(listing.text.split())
        assert (await sandbox.exec("ls -l /etc/passwd /usr/bin/python3.11 /root >/dev/null")).stderr == b""
        assert (await sandbox.exec(["python3", "-c", THREADS])).text == "True\n"
        # /tmp is the sandbox's disk, which the host sees (not a tmpfs inside gVisor)
        assert "tmpfs" not in (await sandbox.exec("grep ' /tmp ' /proc/mounts || true")).text
        await sandbox.exec("echo from-inside > /tmp/in")
        assert await sandbox.files.read("/tmp/in") == b"from-inside\n"
        await sandbox.files.write("/tmp/out", "from-host\n")
        assert (await sandbox.exec("cat /tmp/out")).text == "from-host\n"
        assert {e.name for e in await sandbox.files.list("/tmp")} >= {"in", "out"}
        assert ".fanfold-keep" not in (await sandbox.exec("ls -A /tmp")).text.split()


# -- 2. files and services -----------------------------------------------------------------------


@bounded
async def test_files_api(rfleet):
    async with await rfleet.create() as sandbox:
        await sandbox.files.write("/data/a/b.txt", "hello")
        await sandbox.files.write("/data/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
        assert await sandbox.files.read("/data/a/b.txt") == b"hello"
        assert (await sandbox.exec("/data/run.sh")).text == "ran\n"
        entries = {e.name: e for e in await sandbox.files.list("/data")}
        assert entries["a"].type == "dir" and entries["run.sh"].mode == 0o755
        await sandbox.exec("echo changed > /data/a/b.txt")
        assert await sandbox.files.read("/data/a/b.txt") == b"changed\n"
        await sandbox.files.remove("/data", recursive=True)
        assert not (await sandbox.exec("test -e /data")).ok


@bounded
async def test_services_start_once_the_agent_is_up_and_its_dir_locked(rfleet):
    probe = (f"test -S {SOCKET} && echo socket > /tmp/prepared;"
             " touch /.fanfold/run/planted 2>/dev/null && echo open >> /tmp/prepared || echo locked >> /tmp/prepared")
    spec = (EnvSpec("host").service("prepare", probe, mode="oneshot")
            .service("web", "cd /tmp && exec python3 -m http.server 8124 --bind 127.0.0.1"))
    image = await rfleet.build(spec)
    fetch = ("import time, urllib.request\nfor _ in range(400):\n    try:\n"
             "        print(urllib.request.urlopen('http://127.0.0.1:8124/prepared').read().decode()); break\n"
             "    except OSError: time.sleep(0.05)\n")
    async with await rfleet.create(image) as sandbox:
        assert await sandbox.files.read("/tmp/prepared") == b"socket\nlocked\n"
        assert (await sandbox.exec(["python3", "-c", fetch], timeout=30)).text == "socket\nlocked\n\n"


# -- 3. limits -----------------------------------------------------------------------------------


@bounded
async def test_memory_limit_ends_the_whole_sandbox_cleanly(rfleet, rconfig):
    """gVisor's sentry is one host process: the host's OOM killer takes it, with every process
    in the sandbox (under crun only the hog dies). The command's outcome is ``oom``, as under crun;
    the note says the sandbox went with it, and the engine leaves nothing."""
    sandbox = await rfleet.create(memory_mb=64)
    try:
        pids = cgroup_pids(rconfig, sandbox.id)
        result = await sandbox.exec(["python3", "-c", "x = bytearray(512 << 20); print(len(x))"], timeout=60)
        assert (result.outcome, result.limits_hit, result.exit_code) == (Outcome.OOM, ("memory",), None)
        assert "ran out of memory" in result.stderr.decode() and "destroyed" in result.stderr.decode()
        assert sandbox.id not in {s.id for s in await rfleet.list()}
        with pytest.raises(SandboxNotFound):
            await sandbox.exec("true")
    finally:
        await sandbox.kill()
    assert runsc_leftovers(rconfig, sandbox.id) == {}
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


@bounded
async def test_pids_limit_stops_a_flood_of_processes_and_the_sandbox_lives(rfleet):
    """Counted inside gVisor (RLIMIT_NPROC): the host's pids limit counts the sentry's threads."""
    async with await rfleet.create(pids=64) as bomb, await rfleet.create() as neighbour:
        flood = await bomb.exec(["python3", "-c", FLOOD], timeout=60)
        started, error = flood.text.split()
        assert 40 <= int(started) < 64 and error == str(errno.EAGAIN), flood.text
        assert (await bomb.exec("echo alive")).text == "alive\n"
        assert (await neighbour.exec("echo fine")).ok


@bounded
async def test_cpu_limit_holds_a_busy_loop_to_its_share(rfleet):
    busy = ["python3", "-c", "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"]
    async with await rfleet.create(cpus=0.25) as sandbox:
        result = await sandbox.exec(busy, timeout=30)
    assert result.ok and result.cpu_s > 0.1
    assert result.cpu_s / result.duration_s < 0.45, (result.cpu_s, result.duration_s)


# -- 4. snapshots, fork, suspend, pause, reset ---------------------------------------------------


@bounded
async def test_disk_and_memory_snapshots_start_copies(rfleet):
    async with await rfleet.create(memory_mb=256) as sandbox:
        await sandbox.exec(COUNTER)
        await sandbox.exec("echo kept > /root/kept; echo tmp > /tmp/kept")
        disk = await sandbox.snapshot()
        memory = await sandbox.snapshot(memory=True)
        assert not disk.memory and memory.memory and memory.size_bytes > 0
        assert await advances(sandbox)  # the source runs on after each
        async with await rfleet.create(disk.id) as from_disk, await rfleet.create(memory.id) as from_memory:
            for copy in (from_disk, from_memory):
                assert (await copy.exec("cat /root/kept /tmp/kept; hostname")).text == f"kept\ntmp\n{copy.id}\n"
            assert (await from_disk.exec(LOOPS)).text.strip() == "0"  # fresh processes on the saved disk
            assert (await from_memory.exec(LOOPS)).text.strip() == "1"  # the loop itself, going on
            assert await advances(from_memory) and from_memory.info.limits.memory_mb == 256
            assert (await from_memory.exec(["python3", "-c", THREADS])).text == "True\n"


@bounded
async def test_fork_children_run_on_apart(rfleet):
    async with await rfleet.create() as parent:
        await parent.exec(COUNTER)
        await parent.files.write("/root/before", "before\n")
        async with await parent.fork(3) as fork:
            children = fork.children
            assert fork.result.parent_pause_ms > 0
            await children[0].files.write("/root/after", "only here\n")
            await children[1].exec("echo mine > /tmp/mine")
            for child in [parent, *children]:
                assert await advances(child)
                assert (await child.exec("cat /root/before")).text == "before\n"
            assert [(await c.exec("cat /root/after")).ok for c in [parent, *children]] == [False, True, False, False]
            assert [(await c.exec("cat /tmp/mine")).ok for c in [parent, *children]] == [False, False, True, False]
            names = [(await c.exec("hostname")).text.strip() for c in [parent, *children]]
            assert names == [parent.id, *(c.id for c in children)] and len(set(names)) == 4
            randoms = {(await c.exec("head -c 16 /dev/urandom | od -An -tx1")).text for c in children}
            assert len(randoms) == 3


@bounded
async def test_fork_of_a_fork_and_of_a_suspended_sandbox(rfleet):
    async with await rfleet.create() as parent:
        await parent.exec(COUNTER)
        async with await parent.fork(1) as first:
            child = first.children[0]
            async with await child.fork(1) as second:
                grandchild = second.children[0]
                assert await advances(grandchild) and await advances(child)
                assert (await grandchild.exec("hostname")).text.strip() == grandchild.id
            assert (await parent.suspend()).state == "suspended"
            async with await parent.fork(1) as third:
                assert await advances(third.children[0]) and await advances(parent)


@bounded
async def test_suspend_resume_keeps_processes_and_files(rfleet, rconfig):
    async with await rfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        for cycle in range(2):
            await sandbox.files.write(f"/root/file{cycle}", f"{cycle}\n")
            before = await count(sandbox)
            assert (await sandbox.suspend()).state == "suspended"
            assert runsc_leftovers(rconfig, sandbox.id).keys() <= {"dirs", "mounts"}  # no processes, no cgroups
            assert (await sandbox.resume()).state == "running"
            after = await count(sandbox)
            assert before <= after < before + 50  # it went on from where it stood, not from 0
            assert await advances(sandbox)
        assert (await sandbox.exec("cat /root/file0 /root/file1")).text == "0\n1\n"
        assert (await sandbox.exec(LOOPS)).text.strip() == "1"
        assert (await sandbox.exec("hostname")).text.strip() == sandbox.id


@bounded
async def test_pause_unpause_and_reset(rfleet):
    async with await rfleet.create() as sandbox:
        await sandbox.exec(COUNTER)
        assert (await sandbox.pause()).state == "paused"
        frozen = await sandbox.files.read("/tmp/count")
        assert await sandbox.files.read("/tmp/count") == frozen  # files calls do not thaw it
        assert (await sandbox.unpause()).state == "running"
        assert await advances(sandbox)
        await sandbox.pause()
        assert await advances(sandbox)  # an exec thaws it
        assert (await sandbox.refresh()).state == "running"
        await sandbox.pause()
        snapshot = await sandbox.snapshot(memory=True)  # thaws it, as under crun
        assert (await sandbox.refresh()).state == "running" and await advances(sandbox)
        await sandbox.exec("echo dirty > /root/dirty")
        info = await sandbox.reset()
        assert info.state == "running" and info.id == sandbox.id
        assert not (await sandbox.exec("cat /root/dirty")).ok and not (await sandbox.exec("cat /tmp/count")).ok
        assert (await sandbox.exec("hostname")).text.strip() == sandbox.id
        async with await rfleet.create(snapshot) as copy:
            await copy.exec("echo dirty > /root/dirty; pkill -f 'while :' || true")
            await copy.reset()
            assert not (await copy.exec("cat /root/dirty")).ok
            assert await advances(copy)


# -- 5. the boundary under gVisor ----------------------------------------------------------------


@bounded
async def test_root_in_a_gvisor_sandbox_is_refused_the_kernels_surface(rfleet):
    async with await rfleet.create() as sandbox:
        probe = await sandbox.exec(["python3", "-c", PROBES], timeout=60)
        assert probe.exit_code == 0, probe.stderr
        errnos = json.loads(probe.text)
        for name in ("unshare_user", "unshare_mount", "clone_newuser", "setns", "mount", "keyctl", "add_key", "bpf",
                     "init_module", "kexec_load", "reboot", "proc_sys", "sysrq", "ptrace_pid1", "pid1_mem"):
            assert errnos[name] != 0, f"{name} worked as root under gVisor ({errnos})"
        tools = await sandbox.exec("unshare -U true 2>&1; echo rc=$?")
        assert "rc=0" not in tools.text and "Operation not permitted" in tools.text
        assert (await sandbox.exec("grep '^Seccomp:' /proc/self/status")).text.split() == ["Seccomp:", "2"]
        assert (await sandbox.exec("echo alive; hostname")).text == f"alive\n{sandbox.id}\n"


@bounded
async def test_unconfined_lets_gvisor_emulate_namespaces(rfleet):
    async with await rfleet.create(seccomp="unconfined") as loose:
        assert (await loose.exec("grep '^Seccomp:' /proc/self/status")).text.split() == ["Seccomp:", "0"]
        assert (await loose.exec("unshare -U true; echo rc=$?")).text == "rc=0\n"
        assert (await loose.exec("unshare -Ur id -u")).text == "0\n"


@bounded
async def test_the_hosts_loopback_is_out_of_reach(rfleet):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        async with await rfleet.create() as sandbox:
            tried = await sandbox.exec(
                ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"],
                timeout=20)
            assert tried.exit_code != 0 and b"refused" in tried.stderr.lower(), tried.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came through
    finally:
        listener.close()


@bounded
async def test_the_agent_socket_cannot_be_replaced_after_create_or_fork(rfleet):
    attack = f"rm -f {SOCKET} 2>&1; : > {SOCKET} 2>&1; mv {SOCKET} /tmp/x 2>&1; echo rc=$?"
    async with await rfleet.create() as sandbox:
        tried = await sandbox.exec(attack)
        assert "rc=0" not in tried.text and "Operation not permitted" in tried.text
        assert (await sandbox.exec("test -S " + SOCKET + " && echo there")).text == "there\n"
        async with await sandbox.fork(2) as fork:
            for child in fork.children:
                tried = await child.exec(attack)
                assert "rc=0" not in tried.text and "Operation not permitted" in tried.text
                assert (await child.exec("echo reached")).text == "reached\n"
        assert (await sandbox.exec("echo still")).text == "still\n"


IMPOSTOR = r"""
import os, socket, struct
path = "/.fanfold/run/agent.sock"
def frame(kind, payload):
    return struct.pack(">BI", ord(kind), len(payload)) + payload
while True:
    try:
        os.unlink(path)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen(8)
    except OSError:
        continue
    while True:  # answer as an agent would, with a token it cannot know
        conn, _ = s.accept()
        kind = conn.recv(5)[:1]
        conn.sendall(frame("t", b"0" * 32) if kind == b"t" else frame("h", b"fanfold-agent 3"))
        conn.close()
"""


@bounded
async def test_a_process_taking_the_agents_socket_as_it_rebinds_ends_its_sandbox(rfleet, rconfig):
    """After a memory checkpoint the agent binds its socket again while the sandbox runs, its dir
    open: root's impostor, racing for that socket all along, either loses (the sandbox carries on,
    answered by its agent) or is caught by the token only the agent knows (the sandbox is ended).
    Never does the host keep talking to the impostor."""
    # Each round ended one way or the other, never with an impostor in place.
    assert await race_the_rebind(rfleet, IMPOSTOR)


async def race_the_rebind(rfleet, script: str, rounds: int = 3) -> list[str]:
    """Start ``script`` (root's attacker in the sandbox) and take a memory snapshot, ``rounds`` times:
    each round either ends the sandbox for a socket something else took ("ended"), or its real agent
    answers afterwards ("carried on")."""
    outcomes = []
    for _ in range(rounds):
        sandbox = await rfleet.create()
        await sandbox.exec(["sh", "-c", f"nohup python3 -c '{script}' >/dev/null 2>&1 &"])
        try:
            snap = await sandbox.snapshot(memory=True)
        except FanfoldError as err:
            assert "something else than its agent took the agent's socket" in str(err)
            with pytest.raises((SandboxGone, SandboxNotFound)):
                await sandbox.exec("echo still")
            outcomes.append("ended")
        else:
            assert (await sandbox.exec("echo mine")).text == "mine\n"  # its real agent, not the attacker
            outcomes.append("carried on")
            await sandbox.kill()
            await rfleet.delete_snapshot(snap.id)
    return outcomes


RELAYER = r"""
import os, socket, struct
path = "/.fanfold/run/agent.sock"
def frame(kind, payload):
    return struct.pack(">BI", ord(kind), len(payload)) + payload
def forged():  # what it would answer an exec with, once the host took it for the agent
    status = b"code=0 signal=0 timeout=0 out_bytes=7 err_bytes=0 out_trunc=0 err_trunc=0 duration_us=1"
    return frame("p", b"1") + frame("o", b"forged\n") + frame("z", status)
while True:
    made = []
    try:  # connections to the agent first, then the name of its socket: refused while the dir is locked
        for _ in range(4):
            made.append(socket.socket(socket.AF_UNIX))
            made[-1].connect(path)
        os.unlink(path)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen(16)
    except OSError:
        for c in made:
            c.close()
        continue
    while True:  # pings and checks of the host go to the agent over the connections made before
        conn, _ = s.accept()
        head = conn.recv(5)
        size = struct.unpack(">BI", head)[1] if len(head) == 5 else 0
        body = conn.recv(size) if 0 < size < 4096 else b""
        if head[:1] in (b"h", b"t") and made:
            to = made.pop()
            to.sendall(head + body)
            conn.sendall(to.recv(65536))
        elif head[:1] in (b"a", b"u"):
            conn.sendall(forged())
        conn.close()
"""


@bounded
async def test_a_process_relaying_the_hosts_check_to_the_agent_ends_its_sandbox(rfleet):
    """The rebind window after a memory checkpoint, attacked by relaying: root connects to the agent
    as it binds again, takes its socket, and passes the host's check to the agent over the connections
    it made before. The agent, finding that its path no longer leads to it, proves nothing: the sandbox
    is ended, or the relayer lost the race and the real agent answers. Never does the host take the
    relayer for the agent (it would answer every exec with what it likes)."""
    assert await race_the_rebind(rfleet, RELAYER)


QUITTER = r"""
import socket, struct
def ask(*frames):
    c = socket.socket(socket.AF_UNIX)
    c.connect("/.fanfold/run/agent.sock")
    answers = []
    for kind, payload in frames:
        c.sendall(struct.pack(">BI", ord(kind), len(payload)) + payload)
        answers.append(c.recv(128)[5:].decode())
    return answers
print(ask(("q", b"c0ffee"))[0])  # as agents before protocol 5 took it
print(ask(("n", b""), ("q", b"0" * 64))[1])  # proven with a key it does not have
"""


@bounded
async def test_a_process_cannot_have_its_agent_let_go_of_its_socket(rfleet):
    """``q`` (let go of the socket, before a checkpoint) is the host's alone: proven with the key the
    agent got before anything of the sandbox ran. Root in the sandbox asking for it is refused, and
    its sandbox carries on."""
    async with await rfleet.create() as sandbox:
        tried = await sandbox.exec(["python3", "-c", QUITTER])
        assert tried.text == "fail EPERM\nfail EPERM\n", tried.stderr
        assert (await sandbox.exec("echo still")).text == "still\n"
        snap = await sandbox.snapshot(memory=True)  # the host's own `q` still works
        assert (await sandbox.exec("echo after")).text == "after\n"
    await rfleet.delete_snapshot(snap.id)


@bounded
async def test_a_restored_agent_proves_itself_with_its_key(rfleet, rconfig):
    from fanfold._agent.client import AgentClient
    from fanfold.runtime.runsc_backend import KEY_FILE, TOKEN_FILE

    async with await rfleet.create() as sandbox:
        snap = await sandbox.snapshot(memory=True)
        memory = rconfig.state_dir / "snapshots" / snap.id / "memory"
        key = (memory / KEY_FILE).read_text()
        assert not (memory / TOKEN_FILE).exists() and (memory / KEY_FILE).stat().st_mode & 0o777 == 0o600
        async with await rfleet.create(snap.id) as copy:
            for live in (sandbox, copy):
                agent = AgentClient(str(rconfig.run_dir / live.id / "agent.sock"))
                assert await agent.proves(key) and not await agent.proves("0" * 64)
                assert await agent.token() == ""  # nothing secret for whoever asks
    await rfleet.delete_snapshot(snap.id)


# -- 6. memory snapshots stay with the runtime that took them ------------------------------------


@bounded
async def test_memory_snapshots_stay_with_their_runtime_and_disk_ones_cross(rfleet, config):
    async with await rfleet.create() as source:
        await source.exec(COUNTER)
        await source.exec("echo kept > /root/kept")
        gvisor, disk = await source.snapshot(memory=True), await source.snapshot()
        async with AsyncFleet(config=config) as crun:
            async with await crun.create() as other:
                await other.exec(COUNTER)
                criu = await other.snapshot(memory=True)
            before = {s.id for s in await crun.list()}
            with pytest.raises(InvalidRequest, match="runsc backend, which this engine's oci backend cannot restore"):
                await asyncio.wait_for(crun.create(gvisor.id), 60)
            with pytest.raises(InvalidRequest, match="oci backend, which this engine's runsc backend cannot restore"):
                await asyncio.wait_for(rfleet.create(criu.id), 60)
            assert {s.id for s in await crun.list()} == before
            async with await crun.create(disk.id) as on_crun:  # a disk snapshot starts anywhere
                assert (await on_crun.exec("cat /root/kept; hostname")).text == f"kept\n{on_crun.id}\n"
            assert await advances(source)  # a crun engine beside it leaves the gVisor sandbox alone
    for snap in (gvisor, disk, criu):
        await rfleet.delete_snapshot(snap.id)


# -- 7. nothing left ------------------------------------------------------------------------------


@bounded
async def test_destroy_leaves_no_process_state_file_cgroup_or_mount(rfleet, rconfig):
    sandbox = await rfleet.create()
    await sandbox.exec("sleep 600 >/dev/null 2>&1 &")
    pids = cgroup_pids(rconfig, sandbox.id)
    names = {Path(f"/proc/{p}/comm").read_text().strip() for p in pids}
    assert names <= RUNSC_COMMS and len(pids) >= 2  # the gofer and the sentry, at least
    assert runsc_leftovers(rconfig, sandbox.id).keys() >= {"state_files", "cgroups", "mounts", "dirs"}
    await sandbox.kill()
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert runsc_leftovers(rconfig, sandbox.id) == {}



@bounded
async def test_a_pty_exec_under_gvisor(rfleet):
    """gVisor's terminals: the slave opened by name where TIOCGPTPEER is missing, resize and Ctrl-C."""
    from fanfold import Pty

    async with await rfleet.create() as sandbox:
        shell = await sandbox.spawn("sh", pty=Pty(24, 80))
        chunks, text = shell.output(), ""
        await shell.write("tty; stty size\n")
        while "24 80" not in text:
            text += (await asyncio.wait_for(anext(chunks), 30)).data.decode()
        await shell.resize(40, 120)
        await shell.write("stty size; exit 6\n")
        while "40 120" not in text:
            text += (await asyncio.wait_for(anext(chunks), 30)).data.decode()
        assert "/dev/pts/" in text
        assert (await asyncio.wait_for(shell.wait(), 30)).exit_code == 6
        # ^C reaches a command once the terminal is its own: it says so before it sleeps
        sleeper = await sandbox.spawn(["sh", "-c", "echo up; exec sleep 100"], pty=Pty())
        ready, said = sleeper.output(), ""
        while "up" not in said:
            said += (await asyncio.wait_for(anext(ready), 30)).data.decode()
        await sleeper.write(b"\x03")
        assert (await asyncio.wait_for(sleeper.wait(), 30)).signal == 2  # SIGINT
