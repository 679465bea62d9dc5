"""Grading that trusts nothing the policy controls: the submission's files, copied as bytes into a
pristine sandbox made from the env's golden image, graded there by a trusted program.

    graded = await grade_submission(fleet, env.sandbox.info.image_id, env.sandbox, ["/env/stats.py"],
                                    ["python3", "-I", "/opt/grader/grade.py"])
    reward = graded.verdict["passed"] / graded.verdict["total"] if graded.ok else 0.0

Only the named regular files travel (read through the files API, never by a command in the
policy's sandbox): a symlink, a device, a missing or an oversized file refuses the submission.
Whatever else the policy did (daemons, programs replaced on PATH, ``sitecustomize``, ``.pth``
and ``conftest.py`` files, forged result files) stays behind in its own sandbox. The grader runs
as root with no network, a timeout and an output cap; its stdout must be exactly one line holding
one JSON object, else the submission scores as failed. The grading sandbox is destroyed on every
path. Inside it, a grader that runs the code under test should do so as another user and read
back plain data only (``fanfold.rl.graders.kit.run_untrusted``), as the envs that ship do.

A failed submission is a ``Graded`` without a verdict (reward zero), never an exception; errors
of the fleet (``Retryable``) and of a sandbox that is gone still raise, since they say nothing of
the policy.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import posixpath
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Mapping

from ..client import AsyncFleet, AsyncSandbox
from ..errors import FileNotFoundInSandbox, InvalidPath, InvalidRequest
from ..images import Image
from ..models import ExecResult, Outcome, SnapshotInfo

MAX_FILE_BYTES = 1 << 20
MAX_TOTAL_BYTES = 16 << 20
MAX_FILES = 500
MAX_OUTPUT = 65536
GRADER_LABEL = "fanfold.grader"


@dataclass(frozen=True)
class Graded:
    """What a grader said (``verdict``, the JSON object it printed), or why it said nothing usable
    (``failure``): then the reward is zero."""

    verdict: dict[str, Any] | None
    failure: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict is not None


class SubmissionRefused(InvalidRequest):
    """A submitted path is not a plain regular file of a sane size: the submission scores zero."""


async def grade_submission(
    fleet: AsyncFleet, image: str | Image | SnapshotInfo, submission: AsyncSandbox, files: Iterable[str],
    command: list[str], *, trusted_files: Mapping[str, bytes | str] | None = None, cwd: str = "/",
    timeout: float = 60.0, max_output: int = MAX_OUTPUT, max_file_bytes: int = MAX_FILE_BYTES,
    limits: Mapping[str, Any] | None = None,
) -> Graded:
    """Grade the ``files`` (absolute paths) of the policy's sandbox ``submission`` in a pristine sandbox
    of ``image`` (the env's golden image, never the policy's sandbox or a snapshot of it).

    ``trusted_files`` (path to contents, from the host) are written first, then the submission at
    the same paths; ``command`` then runs there as root, with no network, ``timeout`` seconds and
    ``max_output`` bytes of output; ``limits`` (``memory_mb``, ``pids``, ...) go to ``fleet.create``."""
    try:
        contents = await read_submission(submission, files, max_file_bytes=max_file_bytes)
    except SubmissionRefused as refused:
        return Graded(None, str(refused))
    async with pristine_sandbox(fleet, image, timeout=timeout, limits=limits) as clean:
        try:
            await write_files(clean, {**(trusted_files or {}), **contents})
        except SubmissionRefused as refused:
            return Graded(None, str(refused))
        return await run_grader(clean, command, cwd=cwd, timeout=timeout, max_output=max_output)


@asynccontextmanager
async def pristine_sandbox(fleet: AsyncFleet, image: str | Image | SnapshotInfo, *, timeout: float = 60.0,
                           limits: Mapping[str, Any] | None = None) -> AsyncIterator[AsyncSandbox]:
    """A fresh sandbox of ``image`` with no network, destroyed on leaving (on every path)."""
    sandbox = await fleet.create(image, network="none", deadline=timeout + 300, labels={GRADER_LABEL: "1"},
                                 **dict(limits or {}))
    try:
        yield sandbox
    finally:
        await asyncio.shield(sandbox.kill())


async def read_submission(sandbox: AsyncSandbox, paths: Iterable[str], *, max_file_bytes: int = MAX_FILE_BYTES,
                          max_total_bytes: int = MAX_TOTAL_BYTES) -> dict[str, bytes]:
    """The bytes of each of ``paths`` in ``sandbox``; SubmissionRefused unless each is a regular file
    (not a symlink, device, FIFO or directory) of at most ``max_file_bytes``."""
    contents: dict[str, bytes] = {}
    listings: dict[str, dict[str, Any]] = {}
    for path in paths:
        path = _absolute(path)
        parent, name = posixpath.split(path)
        if parent not in listings:
            try:
                listings[parent] = {entry.name: entry for entry in await sandbox.files.list(parent)}
            except (FileNotFoundInSandbox, InvalidPath):
                listings[parent] = {}
        entry = listings[parent].get(name)
        if entry is None:
            raise SubmissionRefused(f"{path} is missing")
        if entry.type != "file":
            raise SubmissionRefused(f"{path} is not a regular file (a {entry.type})")
        if entry.size > max_file_bytes:
            raise SubmissionRefused(f"{path} has {entry.size} bytes, more than {max_file_bytes}")
        try:
            data = await sandbox.files.read(path)
        except (FileNotFoundInSandbox, InvalidPath) as exc:  # swapped since the listing
            raise SubmissionRefused(f"{path} cannot be read as a regular file: {exc}") from None
        if len(data) > max_file_bytes:
            raise SubmissionRefused(f"{path} grew past {max_file_bytes} bytes")
        contents[path] = data
        if sum(map(len, contents.values())) > max_total_bytes:
            raise SubmissionRefused(f"the submission has more than {max_total_bytes} bytes")
    return contents


async def find_files(sandbox: AsyncSandbox, root: str, include: Iterable[str], exclude: Iterable[str] = (), *,
                     max_files: int = MAX_FILES) -> list[str]:
    """The regular files under ``root`` whose path relative to it matches a glob of ``include``
    (``fnmatch``: ``*`` crosses ``/``), skipping every entry that ``exclude`` names: a glob with a
    ``/`` matches the relative path, one without it the entry's name (``tests``, ``conftest.py``).
    Symlinks are neither followed nor listed; SubmissionRefused past ``max_files`` entries looked at."""
    include, exclude = tuple(include), tuple(exclude)
    found, pending, seen = [], [_absolute(root)], 0
    while pending:
        directory = pending.pop()
        try:
            entries = await sandbox.files.list(directory)
        except (FileNotFoundInSandbox, InvalidPath):
            continue
        seen += len(entries)
        if seen > max_files:
            raise SubmissionRefused(f"more than {max_files} files under {root}")
        for entry in entries:
            path = posixpath.join(directory, entry.name)
            relative = posixpath.relpath(path, root)
            if any(fnmatch.fnmatchcase(relative if "/" in glob else entry.name, glob) for glob in exclude):
                continue
            if entry.type == "dir":
                pending.append(path)
            elif entry.type == "file" and any(fnmatch.fnmatchcase(relative, glob) for glob in include):
                found.append(path)
    return sorted(found)


async def write_files(sandbox: AsyncSandbox, files: Mapping[str, bytes | str]) -> None:
    """Write ``files`` (mode 0644, the sandbox root's); a path the image holds as a directory refuses them."""
    for path, data in files.items():
        try:
            await sandbox.files.write(_absolute(path), data, mode=0o644)
        except (InvalidPath, FileNotFoundInSandbox) as exc:
            raise SubmissionRefused(f"{path} cannot be written in the grading sandbox: {exc}") from None


async def run_grader(sandbox: AsyncSandbox, command: list[str], *, cwd: str = "/", timeout: float = 60.0,
                     max_output: int = MAX_OUTPUT) -> Graded:
    """Run the trusted grader as root and read its verdict (``parse_verdict``)."""
    result = await sandbox.exec(command, cwd=cwd, timeout=timeout, max_output=max_output, user="root")
    return parse_verdict(result)


def parse_verdict(result: ExecResult) -> Graded:
    """The verdict of a grader's run: it exited 0 and printed one line, one JSON object, no more."""
    if result.outcome is not Outcome.EXITED or result.exit_code != 0:
        return Graded(None, f"the grader ended {result.outcome.value} (exit {result.exit_code})")
    if result.stdout_truncated:
        return Graded(None, "the grader printed more than its output cap")
    try:
        lines = result.stdout.decode("utf-8").splitlines()
        if len(lines) != 1:
            raise ValueError(f"{len(lines)} lines")
        verdict = json.loads(lines[0], parse_constant=_not_json)
    except ValueError as exc:
        return Graded(None, f"the grader's output is not one line of JSON: {exc}")
    if not isinstance(verdict, dict):
        return Graded(None, "the grader's output is not a JSON object")
    return Graded(verdict)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _absolute(path: str) -> str:
    full = posixpath.normpath(path)
    if not full.startswith("/") or full.startswith("//"):
        raise InvalidRequest(f"{path!r}: give submission paths as absolute paths")
    return full
