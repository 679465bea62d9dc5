"""Harbor on fanfold: ``FanfoldEnvironment`` runs a Harbor task's environment as a fanfold sandbox.

Select it by import path (Harbor >= 0.25, Python >= 3.12)::

    harbor run -p tasks/ -a oracle -e fanfold.integrations.harbor:FanfoldEnvironment

``start`` builds the task's ``environment/Dockerfile`` with fanfold's builder (cached layers; the image
is named after the task and its content hash, so an unchanged task starts at once and ``force_build``
builds again) or pulls its ``docker_image``, then starts a sandbox with the task's cpus, memory,
storage and GPUs. Commands run as ``bash -c`` as Harbor's Docker environment runs them. Harbor's
network policies map onto fanfold's: ``no-network`` is ``"none"``, ``allowlist`` is ``{"allow": [...]}``
(names, wildcards, addresses and CIDRs) and ``public`` is ``"open"``, switched between the agent and
verifier phases with ``set_network``. Docker Compose tasks, host mounts, Windows and TPUs are refused.

The sandboxes run on an engine embedded in Harbor's process, or on a fanfold server: ``url`` and
``token`` (``--ek url=... --ek token=...``) or ``FANFOLD_URL`` and ``FANFOLD_TOKEN``. Environments of
one process share one fleet, closed when the last of them stops.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

from .._extras import MissingExtra

try:
    from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
    from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
    from harbor.models.task.config import NetworkMode, NetworkPolicy
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "harbor":
        raise  # an installed but broken package: let it show
    raise MissingExtra("fanfold's Harbor environment needs Harbor, which is not installed: "
                       "pip install 'fanfold[harbor]' (Harbor needs Python >= 3.12)") from None

from ..client import AsyncFleet, AsyncSandbox
from ..errors import BuildFailed, ExecTimeout, FanfoldError, InvalidSpec
from ..models import Outcome
from ..spec import EnvSpec

DOCKERFILE = "Dockerfile"
UPLOAD_IN_MEMORY = 8 << 20
"""Files up to this size are written with their mode in one call; larger ones are streamed, then chmod-ed."""


def network_value(policy: NetworkPolicy) -> Any:
    """Harbor's network policy as fanfold's ``network=``."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return "none"
    if policy.network_mode == NetworkMode.PUBLIC:
        return "open"
    return {"allow": list(policy.allowed_hosts)}


class FanfoldEnvironment(BaseEnvironment):
    """A Harbor ``BaseEnvironment`` over one fanfold sandbox.

    Keyword arguments beyond Harbor's (``--ek KEY=VALUE``): ``url`` and ``token`` of a fanfold server
    (default ``FANFOLD_URL``/``FANFOLD_TOKEN``, else an embedded engine), ``deadline`` (seconds the
    sandbox may live; default the host's) and ``pids`` (its process limit)."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, *args: Any, url: str | None = None, token: str | None = None,
                 deadline: float | str | None = None, pids: int | str | None = None, **kwargs: Any) -> None:
        self._url, self._token = url, token
        self._deadline = float(deadline) if deadline is not None else None
        self._pids = int(pids) if pids is not None else None
        self._fleet: AsyncFleet | None = None
        self._sandbox: AsyncSandbox | None = None
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config,
                         *args, **kwargs)

    @staticmethod
    def type() -> str:
        return "fanfold"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # fanfold's egress proxy takes every rule kind Harbor names, and set_network switches policy live.
        return EnvironmentCapabilities(
            gpus=True, disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True, network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True, network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True, dynamic_network_policy=True,
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # cgroup limits are hard ceilings; cpu.max takes fractions of a core.
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self) -> None:
        env_dir = self.environment_dir
        if not (env_dir / DOCKERFILE).is_file() and not self.task_env_config.docker_image:
            compose = [p.name for p in env_dir.glob("docker-compose.y*ml")] if env_dir.is_dir() else []
            if compose:
                raise ValueError(f"{env_dir / compose[0]}: fanfold runs one container per environment and does not "
                                 "run Docker Compose tasks; give the task an environment/Dockerfile, or run it on "
                                 "Harbor's docker environment")
            raise FileNotFoundError(f"{env_dir} has no {DOCKERFILE}: add environment/{DOCKERFILE} or set "
                                    "[environment].docker_image in task.toml")
        if self.task_env_config.gpu_types:
            raise ValueError(f"task {self.environment_name} asks for GPU types {self.task_env_config.gpu_types}: "
                             "fanfold picks GPUs by count only; drop [environment].gpu_types")

    async def start(self, force_build: bool) -> None:
        self._fleet = await _fleets.acquire(self._url, self._token)
        try:
            image = await self._image(force_build)
            self._sandbox = await self._fleet.create(
                image, **self._limits(), env=self._startup_env() or None, network=network_value(self.network_policy),
                labels={"harbor.session": _label(self.session_id), "harbor.task": _label(self.environment_name)},
                deadline=self._deadline)
            self.logger.debug(f"Started fanfold sandbox {self._sandbox.id} from {image}")
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def _image(self, force_build: bool) -> str:
        """The image to start from: the task's Dockerfile built (under a name of its content hash), or its
        ``docker_image``."""
        dockerfile = self.environment_dir / DOCKERFILE
        if not dockerfile.is_file():
            return self.task_env_config.docker_image
        assert self._fleet is not None
        tag = f"harbor-{_label(self.environment_name).lower()}:{self.environment_id[:12]}"
        if not force_build and any(tag in image.names for image in await self._fleet.images()):
            return tag
        try:  # Harbor's own error for a task that cannot build: it does not retry it
            spec = EnvSpec.from_dockerfile(dockerfile, context=self.environment_dir)
            return (await self._fleet.build(spec, tag=tag)).id
        except (InvalidSpec, BuildFailed) as err:
            raise SandboxBuildFailedError(f"fanfold cannot build {dockerfile}: {err}") from err

    def _limits(self) -> dict[str, Any]:
        limits: dict[str, Any] = {}
        if (cpus := self._effective_cpus) is not None:
            limits["cpus"] = float(cpus)
        if (memory := self._effective_memory_mb) is not None:
            limits["memory_mb"] = memory
        if (storage := self._effective_storage_mb) is not None:
            limits["disk_mb"] = storage
        if self._effective_gpus:
            limits["gpus"] = self._effective_gpus
        if self._pids is not None:
            limits["pids"] = self._pids
        return limits

    async def stop(self, delete: bool) -> None:
        """Destroy the sandbox (fanfold's are ephemeral: ``delete=False`` keeps nothing) and let go of the fleet."""
        sandbox, self._sandbox = self._sandbox, None
        fleet, self._fleet = self._fleet, None
        try:
            if sandbox is not None:
                await sandbox.kill()
        finally:
            if fleet is not None:
                await _fleets.release(fleet)

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        # cut: connections the agent opened do not outlive its phase.
        await self._live().set_network(network_value(network_policy), cut=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        user = self._resolve_user(user)
        result = await self._live().exec(
            ["bash", "-c", command], cwd=cwd or self.task_env_config.workdir, env=self._merge_env(env),
            timeout=timeout_sec or None, user=str(user) if user is not None else None)
        stdout, stderr = result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace")
        if result.outcome is Outcome.TIMEOUT:
            raise ExecTimeout(f"Command timed out after {timeout_sec} seconds: {command!r}")
        if result.outcome is Outcome.EXITED:
            return ExecResult(stdout=stdout, stderr=stderr, return_code=result.exit_code)
        why = "the sandbox ran out of memory" if result.outcome is Outcome.OOM else f"signal {result.signal}"
        return ExecResult(stdout=stdout, stderr=stderr + f"\nkilled: {why}", return_code=128 + (result.signal or 9))

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        files = self._live().files
        mode = source.stat().st_mode & 0o7777
        if source.stat().st_size <= UPLOAD_IN_MEMORY:
            await files.write(target_path, source.read_bytes(), mode=mode)
            return
        await files.upload(source, target_path)
        await self._checked(f"chmod {mode:o} {shlex.quote(target_path)}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)
        target = PurePosixPath(target_dir)
        dirs = [target, *(target / p.relative_to(source).as_posix() for p in sorted(source.rglob("*")) if p.is_dir())]
        await self._checked("mkdir -p " + " ".join(shlex.quote(str(d)) for d in dirs))
        for path in sorted(source.rglob("*")):
            if path.is_file():
                await self.upload_file(path, str(target / path.relative_to(source).as_posix()))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await self._live().files.download(source_path, target)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        for entry in await self._live().files.list(source_dir):
            if entry.type == "dir":
                await self.download_dir(entry.path, target / entry.name)
            elif entry.type == "file":
                await self.download_file(entry.path, target / entry.name)

    async def _checked(self, command: str) -> None:
        result = await self.exec(command, user="root")
        if result.return_code != 0:
            raise FanfoldError(f"{command!r} failed in sandbox {self._live().id}: {result.stderr or result.stdout}")

    def _live(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise FanfoldError(f"environment {self.session_id} has no sandbox: start() it first")
        return self._sandbox


class _SharedFleets:
    """One started fleet per (address, token, event loop), counted: an embedded engine per process, not per trial."""

    def __init__(self) -> None:
        self._fleets: dict[tuple[Any, ...], tuple[AsyncFleet, int]] = {}
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}  # a lock serves one loop

    async def acquire(self, url: str | None, token: str | None) -> AsyncFleet:
        key = (url, token, asyncio.get_running_loop())
        async with self._guard():
            fleet, count = self._fleets.get(key, (None, 0))
            if fleet is None:
                fleet = AsyncFleet(url, token=token)
                await fleet.start()
            self._fleets[key] = (fleet, count + 1)
            return fleet

    async def release(self, fleet: AsyncFleet) -> None:
        async with self._guard():
            for key, (held, count) in list(self._fleets.items()):
                if held is fleet:
                    if count > 1:
                        self._fleets[key] = (held, count - 1)
                        return
                    del self._fleets[key]
            await fleet.close()

    def _guard(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        for old in [held for held in self._locks if held.is_closed()]:
            del self._locks[old]
        return self._locks.setdefault(loop, asyncio.Lock())


_fleets = _SharedFleets()


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:120] or "task"

