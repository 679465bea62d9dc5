"""Errors a new user meets first, over every transport: each names the problem and what to do."""

from __future__ import annotations

import os

import httpx
import pytest

from conftest import TOKENS
from fanfold import ImageNotFound, InvalidRequest
from fanfold.engine.admission import memory_total_mb


async def test_an_unknown_image_names_the_bases(afleet):
    with pytest.raises(ImageNotFound, match="no image 'img-0000000000000000' here") as missing:
        await afleet.create("img-0000000000000000")
    assert "`fanfold images` lists the images here (bases: host, debian:bookworm)" in str(missing.value)


async def test_limits_beyond_the_hosts_capacity_are_refused(afleet):
    total_mb, cores = memory_total_mb(), os.cpu_count()
    with pytest.raises(InvalidRequest, match=f"memory_mb=1000000 is more than this host's memory \\({total_mb} MB\\)"):
        await afleet.create(memory_mb=1_000_000)
    with pytest.raises(InvalidRequest, match=f"cpus=1000 is more than this host's {cores} cores"):
        await afleet.create(cpus=1000)
    with pytest.raises(InvalidRequest, match="more than this host's memory"):
        await afleet.pool("host", 1, memory_mb=total_mb + 1)
    async with await afleet.create(cpus=cores, memory_mb=64) as fits:  # the host's whole is fine
        assert (await fits.exec("true")).ok


async def test_a_rollout_asking_beyond_the_host_is_refused_at_once(server):
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    async with httpx.AsyncClient(base_url=server.tcp_url, headers=headers, timeout=60) as client:
        made = await client.post("/v1/rollouts", json={"rollout_id": "rt-huge", "limits": {"cpus": 1000}})
        assert (await client.get("/v1/rollouts/rt-huge")).status_code == 404
    assert made.status_code == 422 and made.json()["kind"] == "invalid_request"
    assert "cpus=1000 is more than this host's" in made.json()["message"]
