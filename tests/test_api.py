"""The public surface: exports, sync/async parity, and validation that needs no sandbox."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import pytest

import fanfold
from fanfold import (
    AsyncFiles, AsyncFleet, AsyncFork, AsyncSandbox, CreateParams, EnvSpec, Files, Fleet, Fork, Limits, Sandbox,
)
from fanfold.errors import FanfoldError, InvalidRequest, InvalidSpec


def test_all_is_sorted_and_complete():
    assert fanfold.__all__ == sorted(fanfold.__all__)
    for name in fanfold.__all__:
        assert hasattr(fanfold, name), name
    public_errors = {n for n, v in vars(fanfold.errors).items() if isinstance(v, type) and issubclass(v, FanfoldError)}
    assert public_errors <= set(fanfold.__all__)


@pytest.mark.parametrize("sync_cls,async_cls", [
    (Fleet, AsyncFleet), (Sandbox, AsyncSandbox), (Files, AsyncFiles), (Fork, AsyncFork),
    (fanfold.Rollouts, fanfold.AsyncRollouts), (fanfold.Process, fanfold.AsyncProcess), (fanfold.Group, fanfold.AsyncGroup),
])
def test_sync_and_async_twins_match(sync_cls, async_cls):
    def public(cls):
        return {n: m for n, m in inspect.getmembers(cls) if not n.startswith("_") and callable(m)}

    sync_methods, async_methods = public(sync_cls), public(async_cls)
    assert set(sync_methods) == set(async_methods)
    for name, method in async_methods.items():
        a_params = list(inspect.signature(method).parameters)
        s_params = list(inspect.signature(sync_methods[name]).parameters)
        assert a_params == s_params, name


def test_every_error_is_a_fanfold_error():
    for name in fanfold.__all__:
        obj = getattr(fanfold, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, FanfoldError)


@pytest.mark.parametrize("kwargs", [
    {"cpus": 0}, {"cpus": -1}, {"memory_mb": 1}, {"memory_mb": "lots"}, {"pids": 0}, {"disk_mb": 0},
    {"memory_mb": 12.5}, {"pids": True},
])
def test_bad_limits_are_rejected(kwargs):
    with pytest.raises(InvalidRequest, match="limit"):
        Limits(**kwargs)


def test_spec_is_immutable_and_chainable():
    base = EnvSpec("host").workdir("/env")
    a, b = base.run("true"), base.run("false")
    assert len(base.steps) == 1 and len(a.steps) == 2 and a.steps[1] != b.steps[1]


@pytest.mark.parametrize("make", [
    lambda: EnvSpec("Alpine Linux"),  # neither a base nor an image reference
    lambda: EnvSpec("ubuntu:22.04@sha256:short"),
    lambda: EnvSpec("host").user("bad user"),
    lambda: EnvSpec("host").expose(70000),
    lambda: EnvSpec("host").cmd("ok", None),  # type: ignore[arg-type]
    lambda: EnvSpec("host").workdir("../relative"),
    lambda: EnvSpec("host").copy("x", "/a/../b"),
    lambda: EnvSpec("host").run(""),
    lambda: EnvSpec("host").env(**{"1BAD": "x"}),
    lambda: EnvSpec("host").service("bad name", "true"),
    lambda: EnvSpec("host").service("ok", "true", mode="forking"),
])
def test_bad_specs_are_rejected(make):
    with pytest.raises(InvalidSpec):
        make()


def test_snapshots_and_forks_survive_the_wire():
    from fanfold import ExecResult, ForkResult, Outcome, SandboxInfo, SnapshotInfo
    from fanfold import wire

    info = SandboxInfo(id="sb-1", state="running", image_id="img-1", limits=Limits(), source="snap-1",
                       persistence="sticky", priority=3, idle_timeout=60.0)
    snapshot = SnapshotInfo(id="snap-1", parent="img-1", image_id="img-1", sandbox_id="sb-0", memory=True,
                            kind="snapshot", created_at=1.0, size_bytes=4096, name="base", limits=Limits(memory_mb=256))
    fork = ForkResult(parent_id="sb-0", children=(info,), snapshot_id="snap-2", parent_pause_ms=1.5, total_ms=20.0,
                      setup=(ExecResult(outcome=Outcome.EXITED, exit_code=0, stdout=b"\xff"),))
    assert wire.info_from_json(wire.info_to_json(info)) == info
    assert wire.snapshot_from_json(wire.snapshot_to_json(snapshot)) == snapshot
    assert wire.fork_from_json(wire.fork_to_json(fork)) == fork
    old_server = {k: v for k, v in wire.info_to_json(info).items()
                  if k not in ("source", "persistence", "priority", "idle_timeout")}
    assert wire.info_from_json(old_server).persistence == "ephemeral"


async def test_bad_persistence_is_refused_before_any_call():
    with pytest.raises(InvalidRequest, match="persistence"):
        await AsyncFleet("unix:///nonexistent.sock").create(persistence="forever")


def _implementations() -> list[type]:
    from fanfold.client._http import HttpTransport
    from fanfold.engine import Engine
    from fanfold.engine.workers import Router

    found = [Engine, Router, HttpTransport]
    if importlib.util.find_spec("ray") is not None:  # the ray extra: RayTransport imports ray
        from fanfold.cluster.transport import RayTransport

        found.append(RayTransport)
    return found


@pytest.mark.parametrize("impl", _implementations(), ids=lambda cls: cls.__name__)
def test_every_transport_implements_the_engine_api_with_its_signatures(impl):
    from fanfold.engine.api import EngineAPI

    calls = [(name, spec) for name, spec in inspect.getmembers(EngineAPI, inspect.isfunction) if not name.startswith("_")]
    assert {"create", "exec", "fork", "snapshot", "suspend", "read_file", "set_pool", "stats"} <= dict(calls).keys()
    assert len(calls) == 49
    for name, spec in calls:
        wanted, got = inspect.signature(spec), inspect.signature(getattr(impl, name))
        shared = [p for p in got.parameters.values() if p.name in wanted.parameters]
        assert [p.name for p in shared] == list(wanted.parameters), (name, str(got))
        for param in wanted.parameters.values():  # taken the same way: positional or keyword, same default
            given = got.parameters[param.name]
            assert (given.kind, given.default) == (param.kind, param.default), (name, param.name)
        extra = [p for p in got.parameters.values() if p.name not in wanted.parameters]
        assert all(p.default is not inspect.Parameter.empty and p.kind is p.KEYWORD_ONLY for p in extra), (name, str(got))
        assert inspect.iscoroutinefunction(getattr(impl, name)), name


@pytest.mark.parametrize("create", [AsyncFleet.create, Fleet.create], ids=["AsyncFleet", "Fleet"])
def test_the_sdks_create_takes_exactly_create_params(create):
    """The SDK's create spells CreateParams out (its limits spread): same names, same defaults."""
    wanted = {f.name: f.default for f in dataclasses.fields(Limits)}
    for spec in dataclasses.fields(CreateParams):
        if spec.name != "limits":
            wanted[spec.name] = {} if spec.default is dataclasses.MISSING else spec.default
    params = inspect.signature(create).parameters
    got = {name: p.default for name, p in params.items() if name != "self"}
    got.update({name: {} for name, value in got.items() if name in ("env", "labels") and value is None})
    assert got == wanted


@pytest.mark.parametrize("kwargs,match", [
    ({"priority": 11}, "priority=11 is out of range"), ({"deadline": 0}, "deadline=0 is out of range"),
    ({"idle_timeout": True}, "idle_timeout must be a number"), ({"user": "u" * 66}, "user must be"),
    ({"persistence": "forever"}, "persistence must be one of"), ({"limits": {"cpus": 2}}, "fanfold.Limits"),
])
def test_bad_create_params_are_rejected(kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        CreateParams(**kwargs)
