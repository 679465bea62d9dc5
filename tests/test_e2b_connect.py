"""The Connect wire of the E2B endpoint, without a server: what fanfold writes is what the SDK's own
generated messages parse (strictly: no unknown field passes), and framing round-trips."""

from __future__ import annotations

import asyncio
import json

import pytest

from fanfold.errors import FileNotFoundInSandbox, InvalidPath, LimitExceeded, SandboxGone, Unauthorized
from fanfold.integrations.e2b.connect import (
    RpcError, code_for_status, end_of_stream, envelope, read_envelopes, rpc_error, stream_request, timestamp, unb64,
)
from fanfold.integrations.e2b.filesystem import entry_info
from fanfold.integrations.e2b.processes import end_event
from fanfold.models import ExecResult, FileEntry, Outcome

pytest.importorskip("e2b")
from e2b.envd.filesystem import filesystem_pb  # noqa: E402
from e2b.envd.process import process_pb  # noqa: E402


def test_envelopes_round_trip_and_end_the_stream():
    data = envelope({"event": {"start": {"pid": 7}}}) + end_of_stream(RpcError("not_found", "gone"))
    assert read_envelopes(data) == [(0, {"event": {"start": {"pid": 7}}}),
                                    (2, {"error": {"code": "not_found", "message": "gone"}})]
    assert read_envelopes(end_of_stream()) == [(2, {})]
    assert stream_request(envelope({"path": "/"})) == {"path": "/"}


@pytest.mark.parametrize("broken", [b"\x00\x00\x00", b"\x00\x00\x00\x00\x09{}", b"\x01\x00\x00\x00\x02{}",
                                    b"\x00\x00\x00\x00\x01[", b"\x00\x00\x00\x00\x02[]"])
def test_broken_framing_is_an_rpc_error(broken):
    with pytest.raises(RpcError):
        read_envelopes(broken)


def test_bytes_accept_every_base64_spelling():
    assert unb64("aGk=", "x") == unb64("aGk", "x") == b"hi"
    assert unb64("-_8", "x") == unb64("+/8=", "x") == b"\xfb\xff"
    with pytest.raises(RpcError):
        unb64(5, "x")


def test_fanfold_errors_map_to_connect_codes():
    assert rpc_error(FileNotFoundInSandbox("x")).code == "not_found"
    assert rpc_error(InvalidPath("x")).code == "invalid_argument"
    assert rpc_error(LimitExceeded("x")).code == "failed_precondition"
    assert rpc_error(Unauthorized("x")).code == "unauthenticated"
    gone = rpc_error(SandboxGone("x"), "sb-1")
    assert gone.code == "unavailable" and "was not found" in gone.message  # what the SDK reads as not running
    assert (code_for_status(404), code_for_status(503), code_for_status(418)) == ("unimplemented", "unavailable", "unknown")


async def _finished(result: ExecResult) -> asyncio.Task[ExecResult]:
    async def done() -> ExecResult:
        return result
    task = asyncio.create_task(done())
    await task
    return task


@pytest.mark.parametrize("result, exit_code, status", [
    (ExecResult(outcome=Outcome.EXITED, exit_code=3), 3, "exit status 3"),
    (ExecResult(outcome=Outcome.KILLED, exit_code=None, signal=9), -1, "signal: killed"),
    (ExecResult(outcome=Outcome.OOM, exit_code=None, signal=9), -1, "signal: killed"),
])
async def test_end_events_parse_as_the_sdks_process_events(result, exit_code, status):
    event, error = end_event(await _finished(result), "sb-1")
    assert error is None
    parsed = process_pb.StartResponse.from_json(json.dumps({"event": event}))
    end = parsed.event.event.value
    assert (end.exit_code, end.status) == (exit_code, status)
    data = process_pb.StartResponse.from_json(json.dumps({"event": {"data": {"stdout": "aGk="}}}))
    assert data.event.event.value.output.value == b"hi"


async def test_a_timed_out_command_ends_its_stream_with_deadline_exceeded():
    event, error = end_event(await _finished(ExecResult(outcome=Outcome.TIMEOUT, exit_code=None, signal=9)), "sb-1")
    assert event is None and error is not None and error.code == "deadline_exceeded"


def test_entry_info_parses_as_the_sdks():
    entry = FileEntry(name="a.txt", path="/tmp/a.txt", type="file", size=5, mode=0o644, mtime=1_700_000_000.25)
    parsed = filesystem_pb.EntryInfo.from_json(json.dumps(entry_info(entry)))
    assert (parsed.name, parsed.type, parsed.size, parsed.mode, parsed.permissions) == (
        "a.txt", filesystem_pb.FileType.FILE, 5, 0o644, "-rw-r--r--")
    assert parsed.modified_time.to_datetime().timestamp() == 1_700_000_000.25
    assert timestamp(0) == "1970-01-01T00:00:00.000000Z"


async def test_output_waits_for_a_full_watcher_until_it_reads_or_leaves():
    """The exec's on_output blocks (so the agent's stream is not read) while a watcher holds
    MAX_BACKLOG_BYTES; a read makes room, and a watcher that leaves never holds the command up."""
    from fanfold._agent.client import ExecControl
    from fanfold.integrations.e2b.processes import MAX_BACKLOG_BYTES, Process

    process = Process(config={}, tag=None, control=ExecControl(keep_output=False))
    slow, gone = process.watch(), process.watch()
    chunk = b"x" * 65536
    for _ in range(MAX_BACKLOG_BYTES // 87384 + 1):
        await asyncio.wait_for(process.output("stdout", chunk), 1)
    blocked = asyncio.create_task(process.output("stdout", chunk))
    await asyncio.sleep(0.05)
    assert not blocked.done() and slow.size >= MAX_BACKLOG_BYTES
    process.unwatch(gone)
    slow.get_nowait()  # room again
    await asyncio.wait_for(blocked, 1)
    assert slow.size < MAX_BACKLOG_BYTES + 90_000 and gone not in process.watchers
