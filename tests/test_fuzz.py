"""Fuzzing the HTTP API with schemathesis, from the OpenAPI document the server itself serves.

Every operation gets valid and invalid inputs; half the cases aim at a live sandbox, so
exec and files see real work. Nothing may answer 5xx, hang, or leave anything behind
(the session's leak check runs after the server has shut down).
"""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from conftest import TOKENS
from fanfold.server import create_app

EXAMPLES = 30


@schemathesis.serializer("application/x-tar")
def _as_bytes(ctx, value):  # type: ignore[no-untyped-def]
    """Arbitrary bytes as a build archive: the server must refuse them cleanly."""
    return value if isinstance(value, bytes) else repr(value).encode()


def _schema() -> schemathesis.BaseSchema:
    config = SchemathesisConfig()
    config.projects.default.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES, deterministic=True
    )
    # The document the app generates; test_the_served_document_is_the_fuzzed_one checks it is the served one.
    return schemathesis.openapi.from_dict(create_app().openapi(), config=config)


schema = _schema()


def test_the_served_document_is_the_fuzzed_one(server):
    assert httpx.get(f"{server.tcp_url}/openapi.json", timeout=30).json() == create_app().openapi()


@pytest.fixture
def live_sandbox(server):
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    with httpx.Client(base_url=server.tcp_url, headers=headers, timeout=60) as http:
        created = http.post("/v1/sandboxes", json={"memory_mb": 128, "deadline": 600})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        yield sandbox_id
        http.delete(f"/v1/sandboxes/{sandbox_id}")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_no_input_gets_a_5xx_or_hangs(case, server, live_sandbox):
    if "sandbox_id" in (case.path_parameters or {}):
        digest = hashlib.sha256(repr((case.body, case.query)).encode()).digest()
        if digest[0] % 2 == 0:
            case.path_parameters["sandbox_id"] = live_sandbox
    if case.operation.method.upper() == "POST" and case.operation.path == "/v1/sandboxes/{sandbox_id}/exec" \
            and isinstance(case.body, dict):
        case.body["timeout"] = 5  # a random command may be one that waits forever
    auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
    response = case.call(base_url=server.tcp_url, headers=auth, timeout=60)
    if response.status_code == 502 and "/ports/" in case.operation.path:  # the gateway's answer: no service there
        assert response.json()["kind"] == "port_unreachable", response.text[:500]
        return
    assert response.status_code < 500, (case.operation.path, response.status_code, response.text[:500])
    if response.status_code == 201:  # a fuzzed create, fork or snapshot made something: it goes now, not at shutdown
        remove_made(server, auth, response.json())
    if response.status_code == 200 and case.operation.path == "/v1/pools" and case.operation.method.upper() == "PUT":
        pool = response.json()  # a fuzzed pool is emptied now, or it would keep its sandboxes to the end
        with httpx.Client(base_url=server.tcp_url, headers=auth, timeout=60) as http:
            http.put("/v1/pools", json={"image": pool["source"], "size": 0, **pool["limits"]}).raise_for_status()
            settle(http)
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and body.get("kind") and "message" in body, body


def settle(http: httpx.Client, timeout: float = 60) -> None:
    """Wait until the host has no sandbox warming, warm or being destroyed (an emptied pool's go in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = http.get("/v1/stats").json()["sandboxes_by_state"]
        if not any(states.get(state) for state in ("pooled", "creating", "destroying")):
            return
        time.sleep(0.05)
    raise AssertionError(f"the host did not settle in {timeout:g} s: {states}")


def remove_made(server, auth: dict[str, str], made: dict) -> None:  # type: ignore[type-arg]
    """Delete a snapshot taken or a rollout made; kill the sandboxes a create or fork made (a fork's snapshot
    goes with the last)."""
    with httpx.Client(base_url=server.tcp_url, headers=auth, timeout=60) as http:
        for rollout in made.get("rollouts", [made] if "rollout_id" in made else []):
            http.delete(f"/v1/rollouts/{rollout['rollout_id']}")
        if "rollout_id" in made or "rollouts" in made:
            return
        if "parent" in made:
            assert http.delete(f"/v1/snapshots/{made['id']}").status_code == 204
        for child in made.get("children", [made] if "state" in made else []):
            http.delete(f"/v1/sandboxes/{child['id']}")
