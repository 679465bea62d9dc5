"""The leak census counts every kind of leftover: each test makes one of a kind and sees it counted."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fanfold import EngineConfig
from fanfold.host import census, netns


@pytest.fixture
def lone(tmp_path: Path) -> EngineConfig:
    """A state dir no engine uses: everything the census finds there was made by the test."""
    return EngineConfig(state_dir=tmp_path / "state")


def test_a_fresh_state_dir_has_nothing(lone: EngineConfig) -> None:
    counts = census.census(lone, claims_before=frozenset(census.orphan_claims()))
    assert counts == dict.fromkeys(census.KINDS, 0)


def test_a_named_network_namespace_of_the_state_dir_is_counted(lone: EngineConfig) -> None:
    ip = shutil.which("ip") or pytest.skip("no ip")
    name = f"fanfold-{lone.tag}-build-{os.getpid()}-0"
    subprocess.run([ip, "netns", "add", name], check=True)
    try:
        assert census.census(lone)["netns"] == 1
        assert census.named_netns(lone) == [name]
    finally:
        subprocess.run([ip, "netns", "delete", name], check=True)
    assert census.census(lone)["netns"] == 0


def test_a_network_namespace_held_open_by_this_process_is_counted(lone: EngineConfig) -> None:
    before = census.census(lone)["netns"]
    fd = netns.new_netns()
    try:
        assert census.census(lone)["netns"] == before + 1
    finally:
        os.close(fd)
    assert census.census(lone)["netns"] == before


def test_an_nftables_table_of_the_state_dir_is_counted(lone: EngineConfig) -> None:
    nft = shutil.which("nft") or pytest.skip("no nft")
    table = f"fanfold_{lone.tag}_build_{os.getpid()}_0"
    subprocess.run([nft, "add", "table", "inet", table], check=True)
    try:
        assert census.nft_tables(lone) == [f"inet {table}"]
        assert census.census(lone)["nft_tables"] == 1
    finally:
        subprocess.run([nft, "delete", "table", "inet", table], check=True)
    assert census.census(lone)["nft_tables"] == 0


def test_half_a_uid_claim_and_a_claim_with_no_sandbox_are_orphans(tmp_path: Path) -> None:
    claims = tmp_path / "uids"
    (claims / "by-id").mkdir(parents=True)
    os.symlink("sb-000000000001", claims / "17")  # a crash before its by-id twin
    os.symlink("18", claims / "by-id" / "sb-000000000002")  # or after the slot's link went
    os.symlink("sb-000000000003", claims / "19")  # whole, but its sandbox has no cgroup
    os.symlink("19", claims / "by-id" / "sb-000000000003")
    assert census.orphan_claims(claims) == {
        "slot 17 -> sb-000000000001", "by-id sb-000000000002 -> 18",
        "slot 19 -> sb-000000000003", "by-id sb-000000000003 -> 19",
    }


def test_a_page_server_of_the_state_dir_is_counted(lone: EngineConfig) -> None:
    work = lone.state_dir / "snapshots" / "sn-1" / "lazy"
    # A stand-in with a page server's argv shape: the census goes by argv, not by what runs.
    daemon = subprocess.Popen(["sh", "-c", "read line; :", "criu", "lazy-pages", "-W", str(work)],
                              stdin=subprocess.PIPE)
    try:
        assert census.page_servers(lone) == [daemon.pid]
        assert census.census(lone)["page_servers"] == 1
    finally:
        daemon.communicate(b"\n", timeout=10)
    assert census.census(lone)["page_servers"] == 0
