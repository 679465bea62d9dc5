"""File operations confined to a sandbox's root, whatever its symlinks say.

Every path is resolved by the kernel with ``openat2(RESOLVE_IN_ROOT)``, so ``..``
and absolute symlinks inside the sandbox stop at its root instead of reaching the host.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..errors import FanfoldError, FileNotFoundInSandbox, InvalidPath, InvalidRequest, LimitExceeded
from ..models import FileEntry

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def normalize(path: str, cwd: str = "/") -> str:
    """An absolute, normalised sandbox path; ``..`` may not climb above the root."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidPath(f"bad sandbox path {path!r}: give a non-empty string without NUL bytes")
    parts: list[str] = []
    for part in PurePosixPath(cwd, path).parts[1:]:
        if part == "..":
            if not parts:
                raise InvalidPath(f"path {path!r} leaves the sandbox's root")
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _error(err: OSError, path: str) -> FanfoldError:
    code = err.errno
    if code == errno.ENOENT:
        return FileNotFoundInSandbox(f"no such file or directory in the sandbox: {path}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return LimitExceeded(f"the sandbox's disk is full writing {path}: raise disk_mb or write less")
    if code == errno.EISDIR:
        return InvalidPath(f"{path} is a directory")
    if code == errno.ENOTDIR:
        return InvalidPath(f"a component of {path} is not a directory")
    if code == errno.EEXIST:
        return InvalidPath(f"{path} already exists")
    if code == errno.ENOTEMPTY:
        return InvalidPath(f"directory {path} is not empty: pass recursive=True")
    if code in (errno.EXDEV, errno.ELOOP):
        return InvalidPath(f"{path} resolves outside the sandbox or loops")
    return InvalidPath(f"{path}: {os.strerror(code or 0)}")


def open_in(root_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` inside the root; only regular files and directories (a FIFO or device
    node planted by the sandbox must never block or be opened with the engine's rights)."""
    if flags & os.O_PATH:  # openat2 takes no other open flags with O_PATH
        return _openat2(root_fd, path, flags, mode)
    fd = _openat2(root_fd, path, flags | os.O_NONBLOCK, mode)
    kind = os.fstat(fd).st_mode
    if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):
        os.close(fd)
        raise InvalidPath(f"{path} is not a regular file or directory")
    os.set_blocking(fd, True)
    return fd


def _openat2(root_fd: int, path: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    rel = path.lstrip("/") or "."
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, rel.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise _error(OSError(err, os.strerror(err)), path)
    return fd


@contextmanager
def opened(root_fd: int, path: str, flags: int, mode: int = 0o644) -> Iterator[int]:
    fd = open_in(root_fd, path, flags, mode)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def translated(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise _error(err, path) from None


def makedirs(root_fd: int, path: str) -> None:
    current = "/"
    for part in PurePosixPath(path).parts[1:]:
        with opened(root_fd, current, os.O_PATH | os.O_DIRECTORY) as parent, translated(path):
            try:
                os.mkdir(part, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
        current = str(PurePosixPath(current, part))


def read(root_fd: int, path: str, limit: int | None = None) -> bytes:
    with os.fdopen(open_reader(root_fd, path), "rb") as handle, translated(path):
        return handle.read() if limit is None else handle.read(limit)


def write(root_fd: int, path: str, data: bytes, mode: int = 0o644) -> None:
    with PendingFile(root_fd, path, mode) as pending:
        pending.write(data)


def upload(root_fd: int, local: str, path: str) -> int:
    """Copy a host file into the sandbox; returns the bytes copied."""
    try:
        src = open(local, "rb")
    except OSError as err:
        raise InvalidRequest(f"cannot read the local file {local}: {err.strerror}") from None
    with src, PendingFile(root_fd, path, stat.S_IMODE(os.fstat(src.fileno()).st_mode)) as pending:
        with translated(path):
            pending.size = _copy(src.fileno(), pending.fd)
    return pending.size


def download(root_fd: int, path: str, local: str) -> int:
    """Copy a sandbox file to the host; returns the bytes copied."""
    with opened(root_fd, path, os.O_RDONLY) as fd:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise InvalidPath(f"{path} is a directory: download files one by one")
        try:
            dst = open(local, "wb")
        except OSError as err:
            raise InvalidRequest(f"cannot write the local file {local}: {err.strerror}") from None
        with dst, translated(path):
            return _copy(fd, dst.fileno())


def open_reader(root_fd: int, path: str) -> int:
    """An fd on a regular sandbox file for streaming out; the caller closes it."""
    fd = open_in(root_fd, path, os.O_RDONLY)
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidPath(f"{path} is a directory: use list()")
    return fd


class PendingFile:
    """A file written under a temporary name beside ``path`` and renamed into place on commit.

    Every write through the files API goes this way: a write cut off midway never leaves a
    partial file, and a symlink at ``path`` is replaced rather than followed. A FIFO or
    device node at ``path`` is refused. As a context manager it commits on success and
    discards on any exception.
    """

    def __init__(self, root_fd: int, path: str, mode: int = 0o644) -> None:
        self.path = path
        parent, self.name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        if not self.name:
            raise InvalidPath(f"{path} is a directory")
        makedirs(root_fd, parent)
        self.parent_fd = open_in(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
        try:
            kind = os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            kind = stat.S_IFREG
        except OSError as err:
            os.close(self.parent_fd)
            raise _error(err, path) from None
        if not (stat.S_ISREG(kind) or stat.S_ISLNK(kind) or stat.S_ISDIR(kind)):
            os.close(self.parent_fd)
            raise InvalidPath(f"{path} is not a regular file or directory")
        self.temp = f".fanfold-upload-{os.urandom(6).hex()}"
        try:
            with translated(path):  # O_EXCL never follows a symlink planted under the temp name
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=self.parent_fd)
        except BaseException:
            os.close(self.parent_fd)
            raise
        self.size = 0

    def __enter__(self) -> PendingFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def write(self, data: bytes) -> None:
        with translated(self.path):
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        self.size += len(data)

    def commit(self) -> int:
        try:
            with translated(self.path):
                os.close(self.fd)
                self.fd = -1
                os.rename(self.temp, self.name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except BaseException:
            self.discard()
            raise
        os.close(self.parent_fd)
        self.parent_fd = -1
        return self.size

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.parent_fd >= 0:
            try:
                os.unlink(self.temp, dir_fd=self.parent_fd)
            except OSError:
                pass
            os.close(self.parent_fd)
            self.parent_fd = -1


def _copy(src: int, dst: int) -> int:
    total = 0
    while sent := os.sendfile(dst, src, None, 1 << 20):
        total += sent
    return total


def listdir(root_fd: int, path: str) -> list[FileEntry]:
    with opened(root_fd, path, os.O_RDONLY | os.O_DIRECTORY) as fd, translated(path):
        entries = []
        with os.scandir(fd) as it:
            for entry in it:
                info = entry.stat(follow_symlinks=False)
                kind = (
                    "dir" if stat.S_ISDIR(info.st_mode)
                    else "file" if stat.S_ISREG(info.st_mode)
                    else "symlink" if stat.S_ISLNK(info.st_mode)
                    else "other"
                )
                entries.append(FileEntry(
                    name=entry.name, path=str(PurePosixPath(path, entry.name)), type=kind,
                    size=info.st_size, mode=stat.S_IMODE(info.st_mode), mtime=info.st_mtime,
                ))
    return sorted(entries, key=lambda e: e.name)


def remove(root_fd: int, path: str, recursive: bool = False) -> None:
    if path == "/":
        raise InvalidPath("refusing to remove the sandbox's root: kill the sandbox instead")
    parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
    with opened(root_fd, parent, os.O_PATH | os.O_DIRECTORY) as pfd, translated(path):
        info = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=pfd)
        elif recursive:
            shutil.rmtree(name, dir_fd=pfd)
        else:
            os.rmdir(name, dir_fd=pfd)


def tail(root_dir: Path, path: str, max_bytes: int = 4096, max_lines: int = 20) -> str:
    """The last lines of a file under ``root_dir`` (a sandbox's root read through safefs: the sandbox owns its files),
    or a note saying why there are none."""
    root = os.open(root_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_reader(root, path)
    except FanfoldError as err:
        return f"({path} cannot be read: {err})"
    finally:
        os.close(root)
    with os.fdopen(fd, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - max_bytes))
        data = handle.read(max_bytes)
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first is cut partway
    return "\n".join(lines[-max_lines:])
