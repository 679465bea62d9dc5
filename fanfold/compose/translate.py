"""A Compose file's services as group members: an EnvSpec to build for each, and how it joins the group.

Pure: nothing here builds or starts anything (``fanfold.compose.up`` does); a plan's specs are built
with ``fleet.build`` and its ``group_params`` given the images they became.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._extras import require
from ..errors import FanfoldError, InvalidSpec
from ..groups import MEMBER_NAME, GroupMember, GroupParams, HealthCheck
from ..models import CreateParams
from ..spec import EnvSpec
from .load import ComposeFile

PROJECT_LABEL = "fanfold.compose.project"
"""The label naming the Compose project a group was made from (``fanfold compose ps``/``down`` find it by)."""
MAX_PORT_RANGE = 100
"""The most ports one ``ports`` entry's range may expose."""


@dataclass(frozen=True, kw_only=True)
class ServicePlan:
    """One service as a group member, less the image its spec builds into."""

    name: str
    spec: EnvSpec
    """The member's image: the service's ``image`` or ``build``, its environment, workdir, user and process."""
    tag: str | None = None
    """The name to give the built image (the service's ``image`` beside a ``build``)."""
    after: tuple[str, ...] = ()
    health: HealthCheck | None = None
    ports: tuple[int, ...] = ()
    volumes: dict[str, str] = field(default_factory=dict)

    def member(self, image: str) -> GroupMember:
        return GroupMember(name=self.name, params=CreateParams(image=image), after=self.after, health=self.health,
                           ports=self.ports, volumes=self.volumes)


@dataclass(frozen=True, kw_only=True)
class ComposePlan:
    """A Compose project as a group: its services in the file's order."""

    project: str
    services: tuple[ServicePlan, ...]

    def group_params(self, images: Mapping[str, str], *, network: Any = "none", labels: Mapping[str, str] | None = None,
                     deadline: float | None = None, detached: bool = False) -> GroupParams:
        """The group's create, given each service's built image (service name -> image id)."""
        missing = [service.name for service in self.services if service.name not in images]
        if missing:
            raise InvalidSpec(f"no image for services {missing}: build each plan's spec first")
        return GroupParams(members=tuple(service.member(images[service.name]) for service in self.services),
                           network=network, labels={**(labels or {}), PROJECT_LABEL: self.project},
                           deadline=deadline, detached=detached)


def plan(compose: ComposeFile) -> ComposePlan:
    """The plan of every service of ``compose``; InvalidSpec names the service and key it cannot honour."""
    volumes = _volume_names(compose.volumes)
    services = tuple(_Service(name, keys, compose, volumes).plan() for name, keys in compose.services.items())
    return ComposePlan(project=compose.name, services=services)


def _volume_names(names: tuple[str, ...]) -> dict[str, str]:
    """Compose volume name -> the group volume's (a DNS label: ``db_data`` becomes ``db-data``)."""
    labels: dict[str, str] = {}
    for name in names:
        label = name.lower().replace("_", "-").replace(".", "-")
        if not MEMBER_NAME.match(label):
            raise InvalidSpec(f"volume name {name!r}: use letters, digits, '-' and '_' (at most 63)")
        if label in labels.values():
            raise InvalidSpec(f"volumes {name!r} and {next(k for k, v in labels.items() if v == label)!r} both"
                              f" become group volume {label!r}: rename one")
        labels[name] = label
    return labels


class _Service:
    def __init__(self, name: str, keys: dict[str, Any], compose: ComposeFile, volumes: dict[str, str]) -> None:
        self.name, self.keys, self.compose, self.volume_names = name, keys, compose, volumes

    def fail(self, key: str, why: str) -> InvalidSpec:
        return InvalidSpec(f"services.{self.name}.{key}: {why}")

    def plan(self) -> ServicePlan:
        if not MEMBER_NAME.match(self.name):
            raise InvalidSpec(f"service name {self.name!r}: a group member's name is a DNS label (lower-case letters,"
                              " digits and '-'); rename the service (its name is how the others reach it)")
        spec, tag = self._image()
        environment = self._environment()
        if environment:
            spec = self._step("environment", lambda: spec.env(**environment))
        workdir = self.keys.get("working_dir")
        if workdir:
            spec = self._step("working_dir", lambda: spec.workdir(workdir))
        user = self.keys.get("user")
        if user:
            spec = self._step("user", lambda: spec.user(str(user)))
        volumes, anonymous = self._volumes()
        if anonymous:
            spec = spec.volume(*anonymous)
        argv = self._argv(spec)
        if argv:
            command = _service_command(argv, workdir or _last_workdir(spec), str(user) if user else None)
            spec = self._step("command", lambda: spec.service(self.name, command))
        return ServicePlan(name=self.name, spec=spec, tag=tag, after=self._after(), health=self._health(),
                           ports=self._ports(), volumes=volumes)

    def _step(self, key: str, add) -> EnvSpec:
        try:
            return add()
        except InvalidSpec as err:
            raise self.fail(key, str(err)) from None

    def _image(self) -> tuple[EnvSpec, str | None]:
        image, build = self.keys.get("image"), self.keys.get("build")
        if build is None:
            if not image:
                raise self.fail("image", "a service needs an 'image' (a fanfold base such as 'host', a local image"
                                " id or name) or a 'build'")
            return self._step("image", lambda: EnvSpec(image)), None
        build = {"context": build} if isinstance(build, str) else build
        context = build.get("context") or "."
        if "://" in context or context.startswith("git@"):
            raise self.fail("build.context", f"{context!r} is remote: give a local directory")
        directory = (self.compose.directory / context).resolve()
        dockerfile = directory / build.get("dockerfile", "Dockerfile")
        if not dockerfile.is_file():
            raise self.fail("build", f"no Dockerfile at {str(dockerfile)!r}")
        args = build.get("args") or {}  # load made it a map of strings
        return self._step("build", lambda: EnvSpec.from_dockerfile(
            dockerfile, context=directory, build_args={k: v for k, v in args.items() if v is not None},
            target=build.get("target"))), image or None

    def _environment(self) -> dict[str, str]:
        environment = self.keys.get("environment") or {}  # load made it a map of strings
        return {name: value for name, value in environment.items() if value is not None}

    def _argv(self, spec: EnvSpec) -> list[str]:
        """Compose's rules: a service's ``entrypoint`` drops the image's command; ``command`` replaces it."""
        entrypoint, command = _words(self.keys.get("entrypoint")), _words(self.keys.get("command"))
        image_entrypoint, image_cmd = _image_argv(spec)
        if entrypoint is not None:
            return entrypoint + (command or [])
        return image_entrypoint + (command if command is not None else image_cmd)

    def _after(self) -> tuple[str, ...]:
        depends = self.keys.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {name: {"condition": "service_started"} for name in depends}
        for other, how in depends.items():
            if other not in self.compose.services:
                raise self.fail("depends_on", f"no service {other!r} in the file")
            condition = (how or {}).get("condition", "service_started")
            if condition not in ("service_started", "service_healthy"):
                raise self.fail(f"depends_on.{other}.condition", f"{condition!r} is not supported: a member runs for"
                                " the group's life; use service_started or service_healthy")
            if condition == "service_healthy" and not _has_health(self.compose.services[other]):
                raise self.fail(f"depends_on.{other}.condition", f"service_healthy, but {other!r} has no healthcheck")
        return tuple(depends)

    def _health(self) -> HealthCheck | None:
        check = self.keys.get("healthcheck")
        if not _has_health(self.keys):
            return None
        test = check["test"]
        if isinstance(test, list):
            kind, *argv = test
            cmd: str | list[str] = argv if kind == "CMD" else " ".join(argv)
        else:
            cmd = test
        (compose_spec,) = require("compose", "reading a Compose file", "compose_spec")
        timing = {name: compose_spec.parse_duration(str(check[name]))
                  for name in ("interval", "timeout", "start_period") if name in check}
        if "retries" in check:
            timing["retries"] = check["retries"]
        try:
            return HealthCheck(cmd=cmd, **timing)
        except FanfoldError as err:
            raise self.fail("healthcheck", str(err)) from None

    def _ports(self) -> tuple[int, ...]:
        ports: list[int] = []
        for item in self.keys.get("ports") or ():
            target, protocol = _port_target(item)
            if protocol != "tcp":
                raise self.fail("ports", f"{item!r}: only TCP ports are exposed")
            first, _, last = str(target).partition("-")
            if not first.isdigit() or last and not last.isdigit():
                raise self.fail("ports", f"{item!r}: the container port must be a number or a range a-b")
            span = range(int(first), int(last or first) + 1)
            if not 1 <= len(span) <= MAX_PORT_RANGE:
                raise self.fail("ports", f"{item!r}: a range of 1 to {MAX_PORT_RANGE} ports")
            ports.extend(port for port in span if port not in ports)
        return tuple(ports)

    def _volumes(self) -> tuple[dict[str, str], list[str]]:
        named: dict[str, str] = {}
        anonymous: list[str] = []
        for item in self.keys.get("volumes") or ():
            kind, source, target, read_only = _volume(item)
            if kind == "bind":
                raise self.fail("volumes", f"{item!r}: bind mounts of host paths are not supported: use a named volume"
                                " (declared under the top-level 'volumes') or copy the files in with a build")
            if kind != "volume":
                raise self.fail("volumes", f"{item!r}: a {kind} volume is not supported")
            if source and source not in self.volume_names:
                raise self.fail("volumes", f"{item!r}: volume {source!r} is not declared under the top-level 'volumes'")
            if read_only:
                raise self.fail("volumes", f"{item!r}: read-only volumes are not supported")
            if source:
                named[self.volume_names[source]] = target
            else:
                anonymous.append(target)  # Compose's anonymous volume: a directory of the member's own disk
        return named, anonymous


def _words(value: Any) -> list[str] | None:
    """A Compose command: a list is an argv, a string is split as a shell would split it (no shell runs)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as err:
            raise InvalidSpec(f"bad command {value!r}: {err}") from None
    return [str(word) for word in value]


def _image_argv(spec: EnvSpec) -> tuple[list[str], list[str]]:
    """The entrypoint and command a build's Dockerfile sets (an entrypoint drops an earlier command)."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for step in spec.steps:
        if step.kind == "entrypoint":
            entrypoint, cmd = list(step.arg("argv")), []
        elif step.kind == "cmd":
            cmd = list(step.arg("argv"))
    return entrypoint, cmd


def _last_workdir(spec: EnvSpec) -> str | None:
    paths = [step.arg("path") for step in spec.steps if step.kind == "workdir"]
    return paths[-1] if paths and paths[-1].startswith("/") else None


def _service_command(argv: list[str], workdir: str | None, user: str | None) -> str:
    """The shell command the sandbox's agent starts (it runs services as root: ``setpriv`` drops to ``user``)."""
    command = shlex.join(argv)
    if user:
        name, _, group = user.partition(":")
        if group:
            drop = f"setpriv --reuid={shlex.quote(name)} --regid={shlex.quote(group)} --clear-groups"
        elif name.isdigit():
            drop = f"setpriv --reuid={name} --regid={name} --clear-groups"
        else:
            drop = f'setpriv --reuid={shlex.quote(name)} --regid="$(id -g {shlex.quote(name)})" --init-groups'
        command = f"{drop} {command}"
    return f"cd {shlex.quote(workdir)} && exec {command}" if workdir else f"exec {command}"


def _has_health(keys: dict[str, Any]) -> bool:
    check = keys.get("healthcheck")
    return bool(check) and not check.get("disable") and check.get("test") not in (None, "NONE", ["NONE"])


def _port_target(item: Any) -> tuple[str, str]:
    """A ``ports`` entry's container port (or range) and protocol: ``8000``, ``"8080:80/tcp"`` or the long form."""
    if isinstance(item, dict):
        return str(item.get("target", "")), item.get("protocol") or "tcp"
    text, _, protocol = str(item).partition("/")
    return text.rpartition(":")[2], protocol or "tcp"


def _volume(item: Any) -> tuple[str, str | None, str, bool]:
    """A ``volumes`` entry as (type, source, target, read-only): ``name:/path[:ro]``, ``/path`` or the long form."""
    if isinstance(item, dict):
        return item.get("type", "volume"), item.get("source"), item.get("target", ""), bool(item.get("read_only"))
    parts = str(item).split(":")
    if len(parts) == 1:
        return "volume", None, parts[0], False
    source, target, *mode = parts
    kind = "bind" if source.startswith((".", "/", "~")) else "volume"
    return kind, source, target, bool(mode) and "ro" in mode[0].split(",")

