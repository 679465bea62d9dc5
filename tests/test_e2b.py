"""The unmodified ``e2b`` SDK against a real ``fanfold serve``: only E2B_API_URL, E2B_SANDBOX_URL
and E2B_API_KEY point it at fanfold. One sandbox serves the tests that leave it as they found it;
the lifecycle tests make their own. Every sandbox made here is killed."""

from __future__ import annotations

import time

import pytest

e2b = pytest.importorskip("e2b")
from e2b import (  # noqa: E402
    AuthenticationException, CommandExitException, NotFoundException, Sandbox, SandboxNotFoundException,
    SandboxQuery,
)


@pytest.fixture(scope="module")
def e2b_env(server):
    """The SDK's configuration for the whole module: fanfold's URLs and alice's token as the API key."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("E2B_API_URL", f"{server.tcp_url}/e2b")
        patch.setenv("E2B_SANDBOX_URL", f"{server.tcp_url}/e2b/envd")
        patch.setenv("E2B_API_KEY", server.tokens["alice"])
        patch.delenv("E2B_DEBUG", raising=False)
        patch.delenv("E2B_DOMAIN", raising=False)
        yield server


@pytest.fixture(scope="module")
def sbx(e2b_env):
    sandbox = Sandbox.create(timeout=600, metadata={"suite": "e2b"}, envs={"GREETING": "hello"})
    yield sandbox
    assert sandbox.kill()


def test_run_streams_output_and_raises_on_a_non_zero_exit(sbx):
    seen = []
    result = sbx.commands.run("echo $GREETING; echo oops >&2; echo bye", on_stdout=seen.append)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello\nbye\n", "oops\n")
    assert "".join(seen) == "hello\nbye\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")
    assert sbx.commands.run("pwd", cwd="/tmp", envs={"X": "y"}).stdout == "/tmp\n"


def test_a_background_command_is_listed_and_killed(sbx):
    handle = sbx.commands.run("sleep 60", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    assert handle.kill()
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert killed.value.exit_code == -1
    assert handle.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(handle.pid) is False


def test_stdin_reaches_a_background_command_until_closed(sbx):
    handle = sbx.commands.run("cat; echo end", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "one\n")
    handle.send_stdin(b"two\n")
    handle.close_stdin()
    assert handle.wait().stdout == "one\ntwo\nend\n"


def test_kill_reaches_a_command_that_never_read_its_stdin(sbx):
    """A signal on the command's own connection would wait behind the stdin it has not read; the
    endpoint signals it from a second command instead."""
    handle = sbx.commands.run("sleep 62", background=True, stdin=True, timeout=0)
    for _ in range(8):
        sbx.commands.send_stdin(handle.pid, "x" * (1 << 19))
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        handle.wait()
    assert "sleep 62" not in sbx.commands.run("ps -eo args").stdout


def test_a_disconnected_command_runs_on_and_can_be_reconnected(sbx):
    handle = sbx.commands.run("read line; echo got $line", background=True, stdin=True, timeout=0)
    handle.disconnect()
    again = sbx.commands.connect(handle.pid, timeout=0)
    sbx.commands.send_stdin(handle.pid, "it\n")
    assert again.wait().stdout == "got it\n"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_100_mb_of_output_arrives_whole_while_the_servers_memory_stays_bounded(sbx, e2b_env):
    """A client that reads as fast as loopback allows gets any amount of output: the command waits
    for it (backpressure) rather than the server holding the output or ending the stream."""
    import hashlib
    import threading

    count = 13_000_000  # 108 MB
    want = sbx.commands.run(f"seq 1 {count} | sha256sum").stdout.split()[0]
    peak, done = [_rss_mib(e2b_env.process.pid)] * 2, threading.Event()
    before = peak[0]

    def sample() -> None:
        while not done.wait(0.05):
            peak[1] = max(peak[1], _rss_mib(e2b_env.process.pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    digest, size = hashlib.sha256(), [0]

    def take(text: str) -> None:
        digest.update(text.encode())
        size[0] += len(text)

    try:
        handle = sbx.commands.run(f"seq 1 {count}", background=True, timeout=0)
        for stdout, _, _ in handle:  # streams without keeping all of it, as on_stdout would
            if stdout:
                take(stdout)
        assert handle.wait().exit_code == 0
    finally:
        done.set()
        sampler.join()
    assert size[0] > 100_000_000 and digest.hexdigest() == want
    assert peak[1] - before < 200, f"the server grew from {before:.0f} to {peak[1]:.0f} MiB"


def test_a_slow_reader_gets_all_the_output_and_holds_the_command_back(sbx):
    """While the client does not read, the command blocks on its full pipe (it is still running long
    after it would have written 40 MB), and nothing is lost."""
    import time

    checks, chunks = [], []

    def slow(text: str) -> None:
        if not chunks:
            time.sleep(1.5)  # the slow reader: seq writes 40 MB in well under a second
            checks.append(sbx.commands.run("pgrep -x seq || true").stdout.strip())
        chunks.append(text)

    result = sbx.commands.run("seq 1 5500000", on_stdout=slow, timeout=120)
    lines = "".join(chunks).splitlines()
    assert (len(lines), lines[0], lines[-1]) == (5_500_000, "1", "5500000")
    assert result.stdout == "".join(chunks) and checks[0].isdigit(), checks


def test_commands_and_files_run_as_user_by_default_and_as_root_when_asked(sbx):
    """As on E2B's templates: a ``user`` (uid 1000, home /home/user) is the default; root still works."""
    assert sbx.commands.run("whoami; id -u; echo $HOME; pwd").stdout.split() == ["user", "1000", "/home/user", "/"]
    assert sbx.commands.run("whoami; echo $HOME", user="root").stdout.split() == ["root", "/root"]
    assert sbx.commands.run("whoami", user="user").stdout == "user\n"
    sbx.files.write("/home/user/deep/note.txt", "mine")
    sbx.files.write("/tmp/by-root.txt", "root's", user="root")
    owners = sbx.commands.run("stat -c %U /home/user /home/user/deep /home/user/deep/note.txt /tmp/by-root.txt")
    assert owners.stdout.split() == ["user", "user", "user", "root"]
    with pytest.raises(CommandExitException):
        sbx.commands.run("touch /root/nope")
    for denied in ("/root/x.txt", "/root/deeper/x.txt"):
        with pytest.raises(e2b.SandboxException, match="Permission denied"):
            sbx.files.write(denied, "no")
    assert "user" not in sbx.get_info().metadata


def test_connect_replays_a_commands_earlier_output(sbx):
    handle = sbx.commands.run("echo early; read line; echo got $line", background=True, stdin=True, timeout=0)
    assert next(iter(handle)) == ("early\n", None, None)
    handle.disconnect()
    again = sbx.commands.connect(handle.pid, timeout=0)
    sbx.commands.send_stdin(handle.pid, "it\n")
    assert again.wait().stdout == "early\ngot it\n"


def test_update_network_switches_the_policy_of_a_running_sandbox(sbx, e2b_env):
    import httpx

    with httpx.Client(base_url=f"{e2b_env.tcp_url}/v1", timeout=60,
                      headers={"Authorization": f"Bearer {e2b_env.tokens['alice']}"}) as http:
        def network():
            return http.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]

        assert network() == "none"
        sbx.update_network({"allow_out": ["example.com", "10.0.0.0/8"]})
        assert network()["allow"] == ["example.com", "10.0.0.0/8"]
        assert "HTTPS_PROXY=" in sbx.commands.run("env").stdout  # later commands go through the proxy
        sbx.update_network({})
        assert network() == "none"
        with pytest.raises(e2b.SandboxException, match="open"):  # the host's own callers only
            sbx.update_network({"allow_internet_access": True})
        with pytest.raises(SandboxNotFoundException):
            Sandbox.update_network(sbx.sandbox_id, {}, api_key=e2b_env.tokens["bob"])
        assert network() == "none"


def test_get_metrics_reports_cpu_memory_and_limits(sbx):
    """Each sample's CPU use is since the one before: busy in between, it is well above zero."""
    sbx.get_metrics()
    sbx.commands.run("head -c 20000000 /dev/urandom | sha256sum")
    [sample] = sbx.get_metrics()
    assert sample.cpu_count >= 1 and 1 < sample.cpu_used_pct <= 100
    assert 0 < sample.mem_used <= sample.mem_total and sample.disk_total > 0
    assert abs(sample.timestamp.timestamp() - time.time()) < 60


def test_get_host_names_a_host_the_server_passes_to_the_sandboxs_port(sbx, e2b_env):
    """``PORT-SANDBOX.DOMAIN`` (the domain: the host the API was reached at) with the traffic token
    reaches the service inside; without the token, or for another sandbox, nothing does."""
    import httpx

    sbx.files.write("/home/user/site/hello.txt", "served from inside")
    serve = ("import http.server as h, functools as f; s = h.ThreadingHTTPServer(('127.0.0.1', 8000),"
             " f.partial(h.SimpleHTTPRequestHandler, directory='/home/user/site')); print('ready', flush=True);"
             " s.serve_forever()")
    server = sbx.commands.run(f'python3 -c "{serve}"', background=True, timeout=0)
    try:
        assert next(iter(server))[0] == "ready\n"
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{e2b_env.tcp_url.removeprefix('http://')}"
        token = {"e2b-traffic-access-token": sbx.traffic_access_token}
        with httpx.Client(base_url=e2b_env.tcp_url, timeout=30) as http:
            got = http.get("/hello.txt?x=1", headers={"Host": host, **token})
            assert (got.status_code, got.text) == (200, "served from inside")
            assert http.get("/hello.txt", headers={"Host": host}).status_code == 404
            other = host.replace(sbx.sandbox_id, "sb-000000000000")
            assert http.get("/hello.txt", headers={"Host": other, **token}).status_code == 404
    finally:
        server.kill()


def test_watch_dir_reports_creates_writes_and_removes(sbx):
    from e2b import FilesystemEventType as Kind

    sbx.files.make_dir("/home/user/watched/sub")
    watcher = sbx.files.watch_dir("/home/user/watched")
    deep = sbx.files.watch_dir("/home/user/watched", recursive=True)
    try:
        sbx.files.write("/home/user/watched/a.txt", "x")
        assert [(e.name, e.type) for e in watcher.get_new_events()] == [("a.txt", Kind.CREATE), ("a.txt", Kind.WRITE)]
        assert watcher.get_new_events() == []
        sbx.commands.run("echo more >> /home/user/watched/a.txt; echo y > /home/user/watched/sub/b.txt")
        assert [(e.name, e.type) for e in watcher.get_new_events()] == [("a.txt", Kind.WRITE)]
        sbx.files.remove("/home/user/watched/a.txt")
        assert [(e.name, e.type) for e in watcher.get_new_events()] == [("a.txt", Kind.REMOVE)]
        assert {(e.name, e.type) for e in deep.get_new_events()} == {
            ("sub/b.txt", Kind.CREATE), ("sub/b.txt", Kind.WRITE)}  # a.txt came and went between the two calls
    finally:
        watcher.stop()
        deep.stop()
    with pytest.raises(e2b.SandboxException):
        watcher.get_new_events()


async def test_the_async_sdks_watch_dir_streams_events(sbx):
    import asyncio

    from e2b import AsyncSandbox, FilesystemEventType as Kind

    sandbox = await AsyncSandbox.connect(sbx.sandbox_id)
    await sandbox.files.make_dir("/home/user/streamed")
    seen, done = [], asyncio.Event()

    def on_event(event) -> None:
        seen.append((event.name, event.type))
        if event.type == Kind.REMOVE:
            done.set()

    handle = await sandbox.files.watch_dir("/home/user/streamed", on_event)
    try:
        await sandbox.files.write("/home/user/streamed/c.txt", "c")
        await asyncio.wait_for(_until(lambda: ("c.txt", Kind.WRITE) in seen), 10)
        await sandbox.files.remove("/home/user/streamed/c.txt")
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await handle.stop()
    assert seen == [("c.txt", Kind.CREATE), ("c.txt", Kind.WRITE), ("c.txt", Kind.REMOVE)]


async def _until(condition) -> None:
    import asyncio

    while not condition():
        await asyncio.sleep(0.05)


def test_files(sbx):
    info = sbx.files.write("/tmp/e2b/a.txt", "alpha")
    assert (info.path, info.name) == ("/tmp/e2b/a.txt", "a.txt")
    sbx.files.write("/tmp/e2b/b.bin", b"\x00\x01", use_octet_stream=True)
    sbx.files.write("/tmp/e2b/c.txt", "gz", gzip=True)
    assert sbx.files.read("/tmp/e2b/a.txt") == "alpha"
    assert sbx.files.read("/tmp/e2b/b.bin", format="bytes") == bytearray(b"\x00\x01")
    assert sbx.files.read("/tmp/e2b/c.txt") == "gz"
    assert sbx.files.make_dir("/tmp/e2b/sub/deeper") is True
    assert sbx.files.make_dir("/tmp/e2b/sub") is False
    entries = {e.name: e for e in sbx.files.list("/tmp/e2b")}
    assert set(entries) == {"a.txt", "b.bin", "c.txt", "sub"}
    assert (entries["a.txt"].size, entries["a.txt"].permissions, entries["sub"].type.value) == (5, "-rw-r--r--", "dir")
    assert "/tmp/e2b/sub/deeper" in [e.path for e in sbx.files.list("/tmp/e2b", depth=2)]
    moved = sbx.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/sub/moved.txt")
    assert moved.path == "/tmp/e2b/sub/moved.txt"
    assert (sbx.files.exists("/tmp/e2b/a.txt"), sbx.files.exists("/tmp/e2b/sub/moved.txt")) == (False, True)
    assert sbx.files.get_info("/tmp/e2b/sub").type.value == "dir"
    sbx.files.remove("/tmp/e2b")
    assert not sbx.files.exists("/tmp/e2b")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/e2b/a.txt")


def test_info_list_and_timeout(sbx):
    info = sbx.get_info()
    assert (info.sandbox_id, info.state.value, info.metadata, info.template_id) == (
        sbx.sandbox_id, "running", {"suite": "e2b"}, "base")
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []
    sbx.set_timeout(900)
    assert (sbx.get_info().end_at - info.end_at).total_seconds() > 250


def test_errors_unknown_sandbox_bad_key_and_another_tenant(sbx, e2b_env):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("sb-does-not-exist")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("sb-does-not-exist")
    assert Sandbox.kill("sb-does-not-exist") is False
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(sbx.sandbox_id, api_key="not-a-token-of-this-server")
    bob = e2b_env.tokens["bob"]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=bob)
    assert Sandbox.kill(sbx.sandbox_id, api_key=bob) is False
    assert Sandbox.list(api_key=bob, query=SandboxQuery(metadata={"suite": "e2b"})).next_items() == []


def test_pause_and_connect_keep_files_and_end_processes(e2b_env):
    sandbox = Sandbox.create(timeout=300)
    try:
        sandbox.files.write("/home/user/kept.txt", "kept")
        sleeper = sandbox.commands.run("sleep 60", background=True)
        assert sandbox.pause() is True
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
        assert sandbox.pause() is False
        with pytest.raises(CommandExitException):
            sleeper.wait()
        resumed = Sandbox.connect(sandbox.sandbox_id)
        assert resumed.get_info().state.value == "running"
        assert resumed.commands.list() == []
        assert resumed.files.read("/home/user/kept.txt") == "kept"
        assert resumed.commands.run("echo back").stdout == "back\n"
    finally:
        assert sandbox.kill()


def test_a_pause_through_fanfolds_own_api_ends_e2b_processes_instead_of_waiting_on_them(e2b_env):
    """A live E2B process or code context is an exec in flight, which a checkpoint waits for: the
    endpoint ends them before any pause, fork or snapshot, the /v1 API's included."""
    import httpx
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sandbox = CodeSandbox.create(timeout=300)
    try:
        sleeper = sandbox.commands.run("sleep 63", background=True, timeout=0)
        assert sandbox.run_code("kept_in_memory = 1").error is None
        with httpx.Client(base_url=f"{e2b_env.tcp_url}/v1", timeout=60,
                          headers={"Authorization": f"Bearer {e2b_env.tokens['alice']}"}) as http:
            paused = http.post(f"/sandboxes/{sandbox.sandbox_id}/pause")
            assert (paused.status_code, paused.json()["state"]) == (200, "paused")
            assert http.post(f"/sandboxes/{sandbox.sandbox_id}/unpause").status_code == 200
        with pytest.raises(CommandExitException):
            sleeper.wait()
        assert sandbox.commands.list() == []
        assert sandbox.run_code("kept_in_memory").error.name == "NameError"  # a fresh context
    finally:
        assert sandbox.kill()


def test_an_idempotency_key_makes_one_sandbox(e2b_env):
    first = Sandbox.create(timeout=120, metadata={"suite": "idem"}, idempotency_key="make-it-once")
    try:
        again = Sandbox.create(timeout=120, metadata={"suite": "idem"}, idempotency_key="make-it-once")
        assert again.sandbox_id == first.sandbox_id
        assert len(Sandbox.list(query=SandboxQuery(metadata={"suite": "idem"})).next_items()) == 1
        with pytest.raises(e2b.SandboxException, match="already used"):
            Sandbox.create(timeout=120, metadata={"suite": "other"}, idempotency_key="make-it-once")
    finally:
        assert first.kill()


def test_snapshots_are_listed_and_deleted(e2b_env):
    sandbox = Sandbox.create(timeout=120)
    try:
        sandbox.files.write("/home/user/in-snapshot.txt", "kept")
        snap = sandbox.create_snapshot(name="e2b-listed")
        listed = sandbox.list_snapshots().next_items()
        assert [(s.snapshot_id, s.names) for s in listed] == [(snap.snapshot_id, ["e2b-listed"])]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name="e2b-listed").next_items()] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(api_key=e2b_env.tokens["bob"]).next_items() == []
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=e2b_env.tokens["bob"]) is False
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert sandbox.list_snapshots().next_items() == []
    finally:
        assert sandbox.kill()


def test_fork_makes_running_copies(e2b_env):
    parent = Sandbox.create(timeout=300)
    children = []
    try:
        parent.files.write("/home/user/state.txt", "parent")
        children = parent.fork(count=2)
        assert len(children) == 2 and all(isinstance(child, Sandbox) for child in children)
        for child in children:
            assert child.sandbox_id != parent.sandbox_id
            assert child.files.read("/home/user/state.txt") == "parent"
            assert child.commands.run("echo child").stdout == "child\n"
    finally:
        for sandbox in [parent, *children]:
            if isinstance(sandbox, Sandbox):
                assert sandbox.kill()


def test_without_bash_commands_run_under_sh(e2b_env):
    sandbox = Sandbox.create(timeout=300)
    try:
        sandbox.files.rename("/usr/bin/bash", "/usr/bin/bash.gone", user="root")
        assert sandbox.commands.run("echo $0").stdout.strip() == "/bin/sh"  # bash's would be /bin/bash
    finally:
        assert sandbox.kill()


# -- the wire, seen without the SDK -----------------------------------------------------------


@pytest.fixture(scope="module")
def raw(e2b_env):
    """An httpx client on the server, and a sandbox made through the raw API: (client, id, envd headers)."""
    import httpx

    with httpx.Client(base_url=f"{e2b_env.tcp_url}/e2b", timeout=60,
                      headers={"X-API-KEY": e2b_env.tokens["alice"]}) as http:
        made = http.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        assert made.status_code == 201, made.text
        body = made.json()
        envd = {"E2b-Sandbox-Id": body["sandboxID"], "X-Access-Token": body["envdAccessToken"]}
        yield http, body["sandboxID"], envd
        assert http.delete(f"/sandboxes/{body['sandboxID']}").status_code == 204


def _stream(http, method: str, message: dict, headers: dict) -> list[tuple[int, dict]]:
    from fanfold.integrations.e2b.connect import STREAM_JSON, envelope, read_envelopes

    answer = http.post(f"/envd/{method}", content=envelope(message),
                       headers={**headers, "Content-Type": STREAM_JSON, "Connect-Protocol-Version": "1"})
    assert (answer.status_code, answer.headers["content-type"]) == (200, STREAM_JSON)
    return read_envelopes(answer.content)


def test_control_plane_errors_are_e2b_json(raw):
    http, sandbox_id, _ = raw
    anonymous = http.get("/v2/sandboxes", headers={"X-API-KEY": ""})
    assert (anonymous.status_code, anonymous.json()["code"]) == (401, 401)
    bad = http.post("/v2/sandboxes", json={"templateID": "base", "timeout": "soon"})
    assert (bad.status_code, bad.json()["code"]) == (400, 400) and "timeout" in bad.json()["message"]
    internet = http.post("/v2/sandboxes", json={"templateID": "base", "allow_internet_access": True})
    assert internet.status_code == 400 and "allow" in internet.json()["message"]
    missing = http.post("/v2/sandboxes", json={"templateID": "no-such-template-here"})
    assert missing.status_code == 404 and set(missing.json()) == {"code", "message"}
    assert http.post(f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 0}).status_code == 400
    not_utf8 = http.post("/v2/sandboxes", content=b'{"templateID": "\xff"}', headers={"Content-Type": "application/json"})
    assert (not_utf8.status_code, not_utf8.json()["code"]) == (400, 400)  # was a 500 "fanfold bug"
    assert http.get("/v2/sandboxes", params={"nextToken": "9" * 5000}).status_code == 200  # was a 500


def test_envd_checks_the_access_token_and_answers_connect_errors(raw):
    http, sandbox_id, envd = raw
    assert http.get("/envd/health", headers=envd).status_code == 204
    wrong = http.get("/envd/health", headers={**envd, "X-Access-Token": "0" * 64})
    assert wrong.status_code == 502 and "was not found" in wrong.json()["message"]
    unknown = http.post("/envd/process.Process/Nope", json={}, headers=envd)
    assert (unknown.status_code, unknown.json()["code"]) == (501, "unimplemented")
    absent = http.post("/envd/process.Process/SendSignal", headers=envd,
                       json={"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert (absent.status_code, absent.json()["code"]) == (404, "not_found")
    assert _stream(http, "filesystem.Filesystem/WatchDir", {"path": "/no/such/dir"}, envd) == [
        (2, {"error": {"code": "not_found", "message": "no directory /no/such/dir in the sandbox"}})]


def test_a_multipart_upload_is_bounded_and_larger_files_stream(raw):
    """Multipart parts are spooled on the host before they reach the sandbox, so their declared length
    is capped (filesystem.MAX_MULTIPART) and one without a length refused; octet-stream streams in."""
    http, _, envd = raw

    def chunked():  # no Content-Length: the size cannot be checked before the parts are spooled
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/x\"\r\n\r\nx\r\n--b--\r\n"

    unknown = http.post("/envd/files", content=chunked(), headers={**envd, "Content-Type": "multipart/form-data; boundary=b"})
    assert unknown.status_code == 400 and "octet-stream" in unknown.json()["message"]
    streamed = http.post("/envd/files", params={"path": "/tmp/streamed"}, content=iter([b"a" * 65536] * 32),
                         headers={**envd, "Content-Type": "application/octet-stream"})
    assert streamed.status_code == 200 and streamed.json()[0]["path"] == "/tmp/streamed"


def test_start_streams_events_and_ends_with_the_connect_end_of_stream(raw):
    http, _, envd = raw
    events = _stream(http, "process.Process/Start",
                     {"process": {"cmd": "/bin/sh", "args": ["-c", "printf hi; exit 4"]}}, envd)
    assert [flags for flags, _ in events] == [0] * (len(events) - 1) + [2]
    assert "pid" in events[0][1]["event"]["start"] and events[-1] == (2, {})
    assert {"event": {"data": {"stdout": "aGk="}}} in [message for _, message in events]
    assert events[-2][1] == {"event": {"end": {"exitCode": 4, "exited": True, "status": "exit status 4"}}}
    slow = _stream(http, "process.Process/Start", {"process": {"cmd": "sleep", "args": ["30"]}},
                   {**envd, "Connect-Timeout-Ms": "300"})
    assert slow[-1][1]["error"]["code"] == "deadline_exceeded"
    nowhere = _stream(http, "process.Process/Start", {"process": {"cmd": "true", "cwd": "/no/such/dir"}}, envd)
    assert nowhere[-1][1]["error"]["code"] == "invalid_argument"
    huge = _stream(http, "process.Process/Start", {"process": {"cmd": "true"}},
                   {**envd, "Connect-Timeout-Ms": "9" * 400, "Keepalive-Ping-Interval": "9" * 400})
    assert huge[-1] == (2, {})  # an over-long number is no limit, not an OverflowError


def test_a_stopping_server_ends_the_processes_it_runs(config, tmp_path, monkeypatch):
    """Processes left running (one watched, one whose client left) end with the server, which stops cleanly."""
    import time

    from conftest import start_server, stop_server

    own = start_server(config.state_dir, tmp_path, "--grace", "2")
    try:
        monkeypatch.setenv("E2B_API_URL", f"{own.tcp_url}/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{own.tcp_url}/e2b/envd")
        monkeypatch.setenv("E2B_API_KEY", own.tokens["alice"])
        sandbox = Sandbox.create(timeout=300)
        watched = sandbox.commands.run("sleep 600", background=True, timeout=0)
        sandbox.commands.run("sleep 600", background=True, timeout=0).disconnect()
        assert len(sandbox.commands.list()) == 2
    finally:
        started = time.monotonic()
        assert stop_server(own) == 0
    assert time.monotonic() - started < 30
    with pytest.raises(Exception):
        watched.wait()


def test_a_mistyped_template_is_a_404_not_a_503_to_retry(image_server):
    """On a server that pulls (image_server), a template no registry can be asked about is not found: the SDKs
    retry 503s for ever."""
    import httpx

    with httpx.Client(base_url=f"{image_server.tcp_url}/e2b", timeout=60,
                      headers={"X-API-KEY": image_server.tokens["alice"]}) as http:
        for template in ("myimage", "img-deadbeef", "debian:bookwrom"):
            missing = http.post("/v2/sandboxes", json={"templateID": template, "timeout": 60})
            assert (missing.status_code, missing.json()["code"]) == (404, 404), missing.text
        assert "did you mean debian:bookworm" in missing.json()["message"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("E2B_API_URL", f"{image_server.tcp_url}/e2b")
        patch.setenv("E2B_SANDBOX_URL", f"{image_server.tcp_url}/e2b/envd")
        patch.setenv("E2B_API_KEY", image_server.tokens["alice"])
        with pytest.raises(e2b.SandboxException, match="^404: no image 'myimage' here"):
            Sandbox.create(template="myimage", timeout=60)
