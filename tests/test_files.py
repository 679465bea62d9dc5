"""Files in and out of sandboxes, confined to the sandbox's root."""

from __future__ import annotations

import os

import pytest

from fanfold import FileNotFoundInSandbox, InvalidPath, InvalidRequest, LimitExceeded


def test_write_read_list_remove(fleet):
    with fleet.create() as sandbox:
        sandbox.files.write("/data/a/b.txt", "hello")
        sandbox.files.write("/data/bin.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
        assert sandbox.files.read("/data/a/b.txt") == b"hello"
        assert sandbox.exec("/data/bin.sh").text == "ran\n"
        entries = {e.name: e for e in sandbox.files.list("/data")}
        assert entries["a"].type == "dir" and entries["bin.sh"].type == "file" and entries["bin.sh"].mode == 0o755
        assert entries["bin.sh"].size == len(b"#!/bin/sh\necho ran\n")
        with pytest.raises(InvalidPath, match="not empty"):
            sandbox.files.remove("/data/a")
        sandbox.files.remove("/data/a", recursive=True)
        sandbox.files.remove("/data/bin.sh")
        assert sandbox.files.list("/data") == []
        with pytest.raises(FileNotFoundInSandbox):
            sandbox.files.read("/data/a/b.txt")


def test_relative_paths_start_at_the_workdir(fleet):
    from fanfold import EnvSpec

    image = fleet.build(EnvSpec("host").workdir("/env"))
    with fleet.create(image) as sandbox:
        sandbox.files.write("notes.txt", "x")
        assert sandbox.exec("cat /env/notes.txt").text == "x"
        assert [e.name for e in sandbox.files.list()] == ["notes.txt"]


def test_upload_and_download_large_file(fleet, tmp_path):
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(1 << 20) * 20)
    with fleet.create() as sandbox:
        assert sandbox.files.upload(source, "/tmp/blob") == 20 << 20
        assert sandbox.exec("md5sum /tmp/blob").text.split()[0] == __import__("hashlib").md5(source.read_bytes()).hexdigest()
        back = tmp_path / "back"
        assert sandbox.files.download("/tmp/blob", back) == 20 << 20
    assert back.read_bytes() == source.read_bytes()


def test_paths_cannot_leave_the_sandbox(fleet, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    with fleet.create() as sandbox:
        with pytest.raises(InvalidPath, match="leaves"):
            sandbox.files.read("../../etc/shadow")
        with pytest.raises(InvalidPath):
            sandbox.files.read("/tmp/../../../etc/passwd")
        sandbox.exec(f"ln -s {secret} /tmp/link; ln -s ../../../../../../{secret} /tmp/rel")
        for link in ("/tmp/link", "/tmp/rel"):
            with pytest.raises(FileNotFoundInSandbox):
                sandbox.files.read(link)
        sandbox.exec("mkdir -p /tmp/d && ln -s / /tmp/d/up")
        sandbox.files.write("/tmp/d/up/etc/planted", "inside")
        assert sandbox.exec("cat /etc/planted").text == "inside"
        assert not os.path.exists("/etc/planted")
        sandbox.exec(f"ln -s {tmp_path} /tmp/dirlink")
        with pytest.raises(FileNotFoundInSandbox):
            sandbox.files.write("/tmp/dirlink/dropped", "x")
        assert not (tmp_path / "dropped").exists()
    assert secret.read_text() == "host only"


def test_bad_paths_and_data(fleet):
    with fleet.create() as sandbox:
        for bad in ("", "a\0b"):
            with pytest.raises(InvalidPath):
                sandbox.files.read(bad)
        with pytest.raises(InvalidPath, match="directory"):
            sandbox.files.read("/tmp")
        with pytest.raises(InvalidPath, match="root"):
            sandbox.files.remove("/")
        with pytest.raises(InvalidRequest):
            sandbox.files.write("/tmp/x", 12345)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="does not exist"):
            sandbox.files.upload("/nonexistent/file", "/tmp/x")


def test_disk_limit_is_enforced(fleet):
    with fleet.create(disk_mb=8) as sandbox:
        result = sandbox.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=32 2>&1; echo rc=$?")
        # ENOSPC on a tmpfs disk, EDQUOT at a btrfs disk's quota: either way the disk is full.
        assert ("No space left" in result.text or "Disk quota exceeded" in result.text) and "rc=1" in result.text
        with pytest.raises(LimitExceeded, match="disk"):
            sandbox.files.write("/tmp/more", b"x" * (4 << 20))
        sandbox.exec("rm /tmp/fill")
        sandbox.files.write("/tmp/more", b"x" * (4 << 20))
