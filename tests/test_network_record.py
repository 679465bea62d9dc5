"""Record and replay of a rollout's traffic, and the shared download cache, on the real runtime
against the tests' outside world (tests/outside.py): TLS terminated with the fleet's CA only for
the sandboxes that ask, the outside shut down for the replay, misses, and cache hits across sandboxes."""

from __future__ import annotations

import dataclasses

import pytest

from fanfold import EngineConfig, Fleet, InvalidRequest, RecordingNotFound

CURL = "curl -sS --max-time 20"
WWW, FILES, PYPI = "www.outside.test", "files.outside.test", "pypi.outside.test"


@pytest.fixture(scope="module")
def fleet(config: EngineConfig, outside):
    # netd trusts the outside's CA for the TLS it terminates and opens again towards the outside
    net = dataclasses.replace(config, net_dns=(outside.dns,), net_ca_file=str(outside.ca_pem))
    with Fleet(config=net) as handle:
        for name in {r["name"] for r in handle.recordings()} & {"rec-basic", "rec-miss", "rec-gone"}:
            handle.delete_recording(name)
        yield handle


def test_a_recorded_rollout_replays_byte_for_byte_with_the_outside_shut_down(fleet, outside):
    policy = {"allow": [WWW, FILES, PYPI], "record": "rec-basic"}
    with fleet.create(network=policy) as box:
        assert box.info.network["record"] == "rec-basic"
        https = box.exec(f"{CURL} https://{WWW}/hello")  # trusts the fleet's CA through SSL_CERT_FILE & co
        assert https.ok and https.text == f"hello from {WWW}", https.stderr
        plain = box.exec(f"{CURL} -X POST --data-binary 'some body' http://{WWW}/echo")
        assert plain.ok and plain.text == "some body"
        big = box.exec(f"{CURL} https://{FILES}/bytes/300000 | sha256sum")
        pip = box.exec("cd /tmp && python3 -m pip download --no-deps --disable-pip-version-check --index-url"
                       f" https://{PYPI}/simple fanfold-probe", timeout=120)
        assert pip.ok, pip.stderr
        wheel = box.exec("sha256sum /tmp/fanfold_probe-1.0-py3-none-any.whl").text.split()[0]
    made = {r["name"]: r for r in fleet.recordings()}["rec-basic"]
    assert made["exchanges"] >= 5 and made["bytes"] >= 300000
    with outside.down():
        with fleet.create(network={"replay": "rec-basic"}) as again:
            assert again.exec(f"{CURL} https://{WWW}/hello").text == f"hello from {WWW}"
            assert again.exec(f"{CURL} -X POST --data-binary 'some body' http://{WWW}/echo").text == "some body"
            assert again.exec(f"{CURL} https://{FILES}/bytes/300000 | sha256sum").text == big.text
            replayed = again.exec("cd /tmp && python3 -m pip download --no-deps --disable-pip-version-check"
                                  f" --index-url https://{PYPI}/simple fanfold-probe", timeout=120)
            assert replayed.ok, replayed.stderr
            assert again.exec("sha256sum /tmp/fanfold_probe-1.0-py3-none-any.whl").text.split()[0] == wheel
            stats = again.network_stats()
            assert stats["replayed"] >= 5 and stats["replay_misses"] == 0


def test_a_request_not_in_the_recording_is_a_clear_miss_and_live_lets_it_out(fleet, outside):
    with fleet.create(network={"allow": [WWW], "record": "rec-miss"}) as box:
        assert box.exec(f"{CURL} http://{WWW}/hello").ok
    before = len(outside.requests())
    with fleet.create(network={"replay": "rec-miss"}) as box:
        miss = box.exec(f"{CURL} -i http://{WWW}/not-recorded")
        assert "502" in miss.text.splitlines()[0] and "x-fanfold-replay: miss" in miss.text.lower()
        assert box.network_stats()["replay_misses"] == 1
    assert len(outside.requests()) == before  # a replay opens nothing outside
    with fleet.create(network={"replay": "rec-miss", "live": True, "allow": [WWW]}) as box:
        assert box.exec(f"{CURL} http://{WWW}/hello?live=1").text == f"hello from {WWW}"
    assert any(r["path"] == "/hello?live=1" for r in outside.requests()[before:])


def test_replaying_a_recording_that_does_not_exist_is_refused_at_create(fleet):
    with pytest.raises(RecordingNotFound, match="no recording 'never-made'"):
        fleet.create(network={"replay": "never-made"})
    with pytest.raises(InvalidRequest, match="records or replays, not both"):
        fleet.create(network={"record": "a", "replay": "b"})


def test_a_recording_in_use_cannot_be_deleted_and_goes_when_free(fleet):
    with fleet.create(network={"allow": [WWW], "record": "rec-gone"}) as box:
        box.exec(f"{CURL} http://{WWW}/hello")
        with pytest.raises(InvalidRequest, match="uses recording 'rec-gone'"):
            fleet.delete_recording("rec-gone")
    fleet.delete_recording("rec-gone")
    assert "rec-gone" not in {r["name"] for r in fleet.recordings()}
    with pytest.raises(RecordingNotFound):
        fleet.delete_recording("rec-gone")


def test_a_sandbox_that_does_not_record_sees_the_outside_s_own_certificate(fleet, outside):
    with fleet.create(network={"allow": [WWW]}) as box:
        fleet_trust = box.exec(f"{CURL} https://{WWW}/hello")  # its system CAs only: the outside's is unknown
        assert fleet_trust.exit_code == 60  # certificate problem: nobody terminated its TLS
        box.files.write("/tmp/outside-ca.pem", outside.ca_pem.read_bytes())
        assert box.exec(f"{CURL} --cacert /tmp/outside-ca.pem https://{WWW}/hello").ok


def test_cached_downloads_are_fetched_once_across_sandboxes(fleet, outside):
    wheel = next(name for name in outside.wheels if name.startswith("fanfold_probe_dep"))
    url = f"http://{FILES}/packages/{wheel}"
    before = [r for r in outside.requests() if r["path"].endswith(wheel)]
    policy = {"allow": [FILES, PYPI], "cache": True}
    digests = []
    for _ in range(2):
        with fleet.create(network=policy) as box:
            digests.append(box.exec(f"{CURL} {url} | sha256sum").text.split()[0])
    fetched = [r for r in outside.requests() if r["path"].endswith(wheel)]
    assert len(fetched) - len(before) <= 1  # the first sandbox's miss, if an earlier test did not fill it
    with outside.down():
        with fleet.create(network=policy) as box:
            digests.append(box.exec(f"{CURL} {url} | sha256sum").text.split()[0])
            assert box.network_stats()["cache_hits"] == 1
            index = box.exec(f"{CURL} -o /dev/null -w '%{{http_code}}' http://{PYPI}/simple/fanfold-probe/")
            assert index.text != "200"  # index pages change: never served from the cache
    assert digests == [outside.wheels[wheel]] * 3
    with fleet.create(network={"allow": [PYPI], "cache": True}) as box:  # a cached URL is no way around a deny
        denied = box.exec(f"{CURL} -o /dev/null -w '%{{http_code}}' {url}")
        assert denied.text == "403"


def test_an_episode_keeps_the_policy_it_ran_under_recording_name_included(config, outside):
    import asyncio

    from fanfold import AsyncFleet
    from fanfold.rl import make_async, run_episode, scripted

    async def run() -> None:
        async with AsyncFleet(config=dataclasses.replace(config, net_dns=(outside.dns,))) as fleet:
            env = make_async("corpus", fleet, network={"allow": [WWW], "record": "rec-episode"})
            try:
                [episode] = await run_episode(env, scripted("corpus"), seed=3)
            finally:
                await env.close()
            assert episode.metadata["network"] == {"allow": [WWW], "deny": [], "record": "rec-episode"}
            if "rec-episode" in {r["name"] for r in await fleet.recordings()}:  # made by its first exchange
                await fleet.delete_recording("rec-episode")

    asyncio.run(run())
