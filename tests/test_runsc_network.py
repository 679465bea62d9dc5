"""Sandbox networks on the gVisor tier: the agent relays the proxy's port from inside gVisor's netstack
to a host socket of the engine's, and splices exposed ports to the host. Policies against the tests'
"outside" (tests/outside.py), raw traffic with nowhere to go, policies changed at run time, fork,
suspend and resume keeping the relay, and nothing left behind."""

from __future__ import annotations

import shutil
import uuid

import pytest

from fanfold import EngineConfig, Fleet
from fanfold.errors import InvalidRequest

from conftest import STATE_DIR
from test_network import CURL, RAW, exposed_port_survives_suspend, fetch, port_taken_is_refused, wait_until
from test_runsc import runsc_leftovers

if shutil.which("runsc") is None:
    pytest.skip("gVisor's runsc is not installed (`make setup` installs it)", allow_module_level=True)

WWW = "http://www.outside.test/hello"


@pytest.fixture(scope="module")
def rconfig(outside) -> EngineConfig:
    return EngineConfig(state_dir=STATE_DIR, runtime="runsc", net_dns=(outside.dns,))


@pytest.fixture(scope="module")
def rfleet(rconfig: EngineConfig):
    with Fleet(config=rconfig) as handle:
        yield handle
        assert handle.list() == [], "a test left a sandbox running"
    assert runsc_leftovers(rconfig) == {}


def test_allowed_names_pass_through_the_relay_and_the_rest_are_refused(rfleet, outside):
    before = len(outside.requests())
    with rfleet.create(network={"allow": ["www.outside.test"], "deny": ["bad.outside.test"]}) as box:
        assert box.exec("ls /.fanfold/net").text.split() == ["proxy-3128.sock"]
        assert fetch(box, WWW)[:2] == (200, "hello from www.outside.test")
        status, _, headers = fetch(box, "http://api.outside.test/hello")
        assert status == 403 and "no allow rule matches api.outside.test:80" in headers["x-fanfold-denied"]
        box.files.write("/tmp/ca.pem", outside.ca_pem.read_bytes())
        tls = box.exec(f"{CURL} --cacert /tmp/ca.pem https://www.outside.test/hello")  # a CONNECT tunnel
        assert tls.ok and tls.text == "hello from www.outside.test", tls.stderr
        stats = box.network_stats()
        assert stats["requests"] >= 3 and stats["denied"] == 1 and stats["bytes_down"] > 0
        # The net dir is the host's: the sandbox can neither plant a socket there nor take the relay's.
        planted = box.exec("rm -f /.fanfold/net/proxy-3128.sock; touch /.fanfold/net/x; ls /.fanfold/net")
        assert planted.text.split() == ["proxy-3128.sock"], planted.text
    assert "api.outside.test" not in [r["host"] for r in outside.requests()[before:]]  # refused before any connection


def test_raw_tcp_udp_and_dns_have_nowhere_to_go(rfleet, outside):
    with rfleet.create(network={"allow": ["www.outside.test"]}) as box:
        raw = box.exec(["python3", "-c", RAW])
        assert raw.ok and "reached" not in raw.text and raw.text.count("blocked") == 3, raw.text
        assert "no dns" in raw.text
        assert box.exec(f"{CURL} --noproxy '*' http://203.0.113.2/hello").exit_code != 0
        assert fetch(box, WWW)[0] == 200


def test_a_policy_changes_while_the_sandbox_runs(rfleet, outside):
    with rfleet.create() as box:
        assert box.exec(f"{CURL} {WWW}").exit_code != 0
        box.set_network({"allow": ["www.outside.test"]})
        assert fetch(box, WWW)[0] == 200
        box.set_network({"allow": ["other.example"]})
        assert fetch(box, WWW)[0] == 403
        assert fetch(box, "http://other.example/hello")[0] == 200
        assert box.set_network("none").network == "none"
        assert box.exec(f"{CURL} -x http://127.0.0.1:3128 http://other.example/hello").exit_code != 0
        box.set_network({"allow": ["www.outside.test"]})  # the agent still listens: it relays to the new socket
        assert fetch(box, WWW)[0] == 200


def test_a_port_taken_inside_is_a_clear_error_not_a_stolen_port(rfleet):
    port_taken_is_refused(rfleet)


def test_fork_suspend_and_resume_keep_the_relay(rfleet, outside):
    with rfleet.create(network={"allow": ["www.outside.test"]}) as box:
        assert fetch(box, WWW)[0] == 200
        with box.fork(2) as fork:
            for child in fork.children:
                assert child.info.network == {"allow": ["www.outside.test"], "deny": []}
                assert fetch(child, WWW)[:2] == (200, "hello from www.outside.test")
                assert fetch(child, "http://api.outside.test/hello")[0] == 403
        assert fetch(box, WWW)[0] == 200  # the parent relays again after its checkpoint
        box.suspend()
        assert fetch(box, WWW)[0] == 200  # resumed by the call, relayed to its new socket


def test_an_exposed_port_is_reached_from_the_host_and_survives_suspend(rfleet):
    exposed_port_survives_suspend(rfleet)


def test_nothing_is_left_behind(rfleet, rconfig):
    made = [rfleet.create(network={"allow": ["www.outside.test"]}) for _ in range(3)]
    for box in made:
        assert fetch(box, WWW)[0] == 200
        box.kill()
    for box in made:
        assert runsc_leftovers(rconfig, box.id) == {}, box.id


def test_a_request_in_flight_at_a_fork_ends_and_the_next_one_works(rfleet, outside):
    key = f"fork-{uuid.uuid4().hex[:8]}"
    with rfleet.create(network={"allow": ["www.outside.test"]}) as box:
        box.exec(f"(curl -sS --max-time 60 http://www.outside.test/slow/{key} > /tmp/slow.out 2>&1;"
                 " echo rc=$? >> /tmp/slow.out) & echo started")
        wait_until(lambda: any(r["path"] == f"/slow/{key}" for r in outside.requests()))
        # gVisor cannot save a connection to a host socket: the agent ends it before the checkpoint.
        with box.fork(1) as fork:
            done = box.exec("for i in $(seq 100); do grep -q rc= /tmp/slow.out && break; sleep 0.1; done;"
                            " cat /tmp/slow.out")
            assert "rc=0" not in done.text and "rc=" in done.text, done.text
            assert fetch(fork.children[0], WWW)[0] == 200
        outside.release(key)
        assert fetch(box, WWW)[0] == 200


def test_a_warm_pool_hands_out_sandboxes_with_a_policy(rfleet, outside):
    rfleet.pool("host", 1, wait=60)
    try:
        with rfleet.create(network={"allow": ["www.outside.test"]}) as box:
            assert rfleet.pools()[0].handouts >= 1
            assert fetch(box, WWW)[0] == 200
    finally:
        rfleet.pool("host", 0)
        # every warm sandbox gone, not only hidden: a pooled one shows in list() while it is destroyed
        wait_until(lambda: not any(rfleet.metrics()["sandboxes_by_state"].values()), attempts=600)



def test_transparent_capture_is_refused_clearly_on_gvisor(rfleet):
    with pytest.raises(InvalidRequest, match="cannot capture traffic transparently"):
        rfleet.create(network={"allow": ["www.outside.test"], "transparent": True})
    assert rfleet.list() == []
