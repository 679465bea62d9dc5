"""SWE-ReX on fanfold: ``FanfoldDeployment`` runs ``swerex-remote`` in a sandbox for SWE-ReX's ``RemoteRuntime``.

It takes the place of SWE-ReX's ``DockerDeployment``::

    deployment = FanfoldDeployment(image="python:3.12-slim")   # any image with Python >= 3.10
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    ...
    await deployment.stop()                                     # destroys the sandbox

``start`` adds one build step to the image, a virtual environment at ``/opt/swerex`` with the
client's own version of swe-rex installed by pip (built once per image, then cached), starts
``swerex-remote`` in a sandbox of it with a fresh auth token, and reaches it through fanfold's port
exposure: a loopback port of an embedded fleet, or the server's port route, which checks the
fanfold token and keeps it from the sandbox. ``install=False`` takes an image that has
``swerex-remote`` already (at ``executable``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shlex
import time
from typing import Any
from urllib.parse import urlsplit

from .._extras import MissingExtra

try:
    from swerex import __version__ as SWEREX_VERSION
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
    from swerex.runtime.abstract import IsAliveResponse
    from swerex.runtime.remote import RemoteRuntime
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "swerex":
        raise  # an installed but broken package: let it show
    raise MissingExtra("FanfoldDeployment needs swe-rex, which is not installed: "
                       "pip install 'fanfold[integrations]'") from None
from pydantic import BaseModel, ConfigDict, Field

from ..client import AsyncFleet, AsyncSandbox
from ..config import EngineConfig, env_token
from ..errors import BuildFailed, FanfoldError
from ..spec import EnvSpec

VENV = "/opt/swerex"
PACKAGE = f"swe-rex=={SWEREX_VERSION}"
"""What the install step gives pip by default: this client's own version, which speaks its protocol."""
LOG = "/tmp/swerex-remote.log"
"""Where swerex-remote's output goes inside the sandbox (its tail is in a failed start's error)."""
POLL_S = (0.05, 0.5)
"""The first and the longest pause between probes while swerex-remote starts."""

_VENV_STEP = f"""set -e
command -v python3 >/dev/null \\
  || {{ echo "swerex-remote needs python3 (>= 3.10) in the image, which has none" >&2; exit 1; }}
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \\
  || {{ echo "swerex-remote needs Python >= 3.10; the image has $(python3 -V 2>&1)" >&2; exit 1; }}
python3 -m venv {VENV} \\
  || {{ echo "python3 -m venv failed: add the venv module to the image (Debian: python3-venv)" >&2; exit 1; }}"""
_PIP_STEP = ("{venv}/bin/pip install --no-cache-dir --disable-pip-version-check -q {package}"
             " && {venv}/bin/swerex-remote --version")
# Started detached (its own session, output to a file) so that the exec returns at once and the
# server outlives it; the pid lets a failed start tell "exited" from "still starting".
_LAUNCH = '({command} >{log} 2>&1 </dev/null & echo $!)'


def _auth_token() -> str:
    """A fresh key for one ``swerex-remote``; about one in 64 begins with ``-``."""
    return secrets.token_urlsafe(24)


class SwerexStartFailed(FanfoldError, DeploymentStartupError):
    """swerex-remote did not come up in the sandbox: the message says why, with the end of its log."""

    kind = "swerex_start_failed"


class SwerexStartTimeout(SwerexStartFailed, TimeoutError):
    """swerex-remote did not answer within ``startup_timeout``."""

    kind = "swerex_start_timeout"


class FanfoldDeploymentConfig(BaseModel):
    """The keyword arguments of ``FanfoldDeployment``."""

    model_config = ConfigDict(extra="forbid")

    image: str = "host"
    """The fanfold image: a base name, an image reference or id; with ``install=False`` also an image's
    name or a snapshot."""
    install: bool = True
    """Add the build steps of ``with_swerex``: ``package`` installed into a virtual environment at
    /opt/swerex (needs python3 >= 3.10 with venv in the image, and pip's index reachable from the
    build); False: the image has ``swerex-remote`` already, at ``executable``."""
    package: str = PACKAGE
    """What the install step gives pip (a requirement, a wheel's path or URL): by default swe-rex at
    this client's version, which speaks its protocol."""
    executable: str = f"{VENV}/bin/swerex-remote"
    """swerex-remote's path inside the sandbox."""
    port: int = 8000
    """The port swerex-remote listens on inside the sandbox (on its loopback)."""
    startup_timeout: float = 60.0
    """Seconds swerex-remote may take to answer once the sandbox runs (the image build is not counted)."""
    runtime_timeout: float = 5.0
    """Seconds the runtime's ``is_alive`` waits for an answer."""
    url: str | None = None
    """A fanfold server; None: ``FANFOLD_URL`` if set, else an engine embedded in this process."""
    token: str | None = Field(default=None, exclude=True, repr=False)
    """The server's bearer token (default ``FANFOLD_TOKEN``); the runtime's requests carry it to the
    server's port route, which does not pass it on. Never serialized."""
    limits: dict[str, Any] = {}
    """Resources of the sandbox, as ``Fleet.create`` takes them: ``cpus``, ``memory_mb``, ``pids``, ``disk_mb``."""
    network: str | dict[str, Any] = "none"
    """The sandbox's network policy: ``"none"``, ``{"allow": [...]}`` or ``"open"``."""
    env: dict[str, str] = {}
    """Environment variables of the sandbox, and so of swerex-remote and its sessions."""
    deadline: float | None = None
    """Seconds the sandbox may live; None: the host's default."""
    labels: dict[str, str] = {}
    """Labels of the sandbox, e.g. the task it runs."""


class FanfoldDeployment(AbstractDeployment):
    """SWE-ReX's deployment on one fanfold sandbox; ``runtime`` is a ``RemoteRuntime``.

    ``fleet`` runs the sandbox on an ``AsyncFleet`` the caller owns (started, and closed by the
    caller); without it ``start`` makes one from ``url``/``token`` (or an embedded engine, with
    ``engine_config`` if given) and ``stop`` closes it. Other keyword arguments are
    ``FanfoldDeploymentConfig`` fields.
    """

    def __init__(self, *, fleet: AsyncFleet | None = None, engine_config: EngineConfig | None = None,
                 logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = FanfoldDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._given_fleet, self._engine_config = fleet, engine_config
        self._fleet: AsyncFleet | None = None
        self._owned_fleet: AsyncFleet | None = None
        self.sandbox: AsyncSandbox | None = None
        self._runtime: RemoteRuntime | None = None

    @classmethod
    def from_config(cls, config: FanfoldDeploymentConfig, **kwargs: Any) -> FanfoldDeployment:
        return cls(**config.model_dump(), token=config.token, **kwargs)

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> RemoteRuntime:
        """The runtime talking to swerex-remote; ``DeploymentNotStartedError`` before ``start`` or after ``stop``."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Whether swerex-remote answers (test it with ``bool()``); ``DeploymentNotStartedError`` when not started."""
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Build the image (cached), start a sandbox and swerex-remote in it, and wait until it answers.

        A failure raises ``SwerexStartFailed`` (``SwerexStartTimeout`` after ``startup_timeout``) and
        leaves no sandbox behind."""
        if self._runtime is not None:
            return
        try:
            fleet = await self._open_fleet()
            image = await self._image(fleet)
            self._hooks.on_custom_step("Starting sandbox")
            self.sandbox = await fleet.create(
                image, env=self._config.env or None, labels={"swerex": "1", **self._config.labels},
                deadline=self._config.deadline, network=self._config.network, **self._config.limits)
            self.logger.info(f"Started fanfold sandbox {self.sandbox.id} from {self._config.image}")
            self._hooks.on_custom_step("Starting runtime")
            token = _auth_token()
            pid = await self._launch(token)
            self._runtime = await self._connect(token)
            await self._wait_until_alive(pid)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Close the runtime, destroy the sandbox, and close the fleet if this deployment made it (idempotent)."""
        runtime, self._runtime = self._runtime, None
        sandbox, self.sandbox = self.sandbox, None
        fleet, self._owned_fleet, self._fleet = self._owned_fleet, None, None
        try:
            if runtime is not None:
                await _quietly(runtime.close(), self.logger, "closing the runtime")
            if sandbox is not None:
                await sandbox.kill()
        finally:
            if fleet is not None:
                await fleet.close()

    def __del__(self) -> None:
        # SWE-ReX's own __del__ runs stop() on whatever loop is current; the sandbox belongs to the
        # fleet's, and the fleet destroys it when closed or when the process ends.
        if getattr(self, "sandbox", None) is not None:
            try:
                self.logger.warning("FanfoldDeployment dropped without stop(): its fleet destroys the sandbox")
            except Exception:  # logging already torn down at interpreter exit
                pass

    # -- start's parts --------------------------------------------------------------------------

    async def _open_fleet(self) -> AsyncFleet:
        if self._given_fleet is not None:
            self._fleet = self._given_fleet
        else:
            self._owned_fleet = AsyncFleet(self._config.url, token=self._config.token, config=self._engine_config)
            await self._owned_fleet.start()
            self._fleet = self._owned_fleet
        return self._fleet

    async def _image(self, fleet: AsyncFleet) -> str:
        if not self._config.install:
            return self._config.image
        self._hooks.on_custom_step("Installing swe-rex in the image")
        spec = with_swerex(self._config.image, self._config.package)
        started = time.monotonic()
        try:
            image = await fleet.build(spec)
        except BuildFailed as err:
            raise SwerexStartFailed(f"installing {self._config.package} into image {self._config.image!r} "
                                    f"failed: {err}") from err
        self.logger.info(f"Image {image.id} with swerex-remote ready in {time.monotonic() - started:.1f} s")
        return image.id

    async def _launch(self, token: str) -> str:
        assert self.sandbox is not None
        argv = [self._config.executable, "--host", "127.0.0.1", "--port", str(self._config.port),
                # one word: a token that begins with "-" would read to argparse as the next option
                f"--auth-token={token}"]
        command = _LAUNCH.format(command="setsid " + shlex.join(argv), log=LOG)
        if "TERM" not in self._config.env:
            # Sandboxes get TERM=xterm; under it bash's readline wraps each session's output in
            # bracketed-paste noise. Docker's containers (SWE-ReX's usual home) have no TERM.
            command = "unset TERM; " + command
        done = await self.sandbox.exec(["/bin/sh", "-c", command], timeout=30)
        pid = done.text.strip()
        if done.exit_code != 0 or not pid.isdigit():
            raise SwerexStartFailed(f"could not start {self._config.executable} in sandbox {self.sandbox.id}: "
                                    f"{(done.stdout + done.stderr).decode(errors='replace').strip()}")
        return pid

    async def _connect(self, token: str) -> RemoteRuntime:
        """A runtime for the exposed port: direct on the host's loopback, or through the server's port route."""
        assert self.sandbox is not None and self._fleet is not None
        url = (await self.sandbox.expose(self._config.port)).rstrip("/")
        through_server = urlsplit(url).path.startswith("/v1/sandboxes/")
        if through_server and (self._fleet.url or "").startswith("unix:"):
            raise SwerexStartFailed("a sandbox's port reaches this process only over TCP: give the server's "
                                    "http:// URL, or call from the host's own tenant (which gets a loopback port)")
        common = {"auth_token": token, "host": url, "timeout": self._config.runtime_timeout, "logger": self.logger}
        fanfold_token = self._config.token or env_token()
        if through_server and fanfold_token:
            return _PortRouteRuntime(fanfold_token=fanfold_token, **common)
        return RemoteRuntime(**common)

    async def _wait_until_alive(self, pid: str) -> None:
        """Probe until swerex-remote answers; fail at once if it exited, or after ``startup_timeout``."""
        assert self.sandbox is not None and self._runtime is not None
        deadline = time.monotonic() + self._config.startup_timeout
        pause = POLL_S[0]
        while True:
            probe = min(self._config.runtime_timeout, max(0.1, deadline - time.monotonic()))
            answer = await self._runtime.is_alive(timeout=probe)
            if answer.is_alive:
                return
            if answer.message.startswith("Status code 401 "):  # the server's port route, not swerex-remote
                raise SwerexStartFailed("the fanfold server refused the runtime's requests to the sandbox's port "
                                        "(401): give FanfoldDeployment the fleet's token (token= or FANFOLD_TOKEN)")
            if not await self._running(pid):
                raise SwerexStartFailed(f"swerex-remote exited in sandbox {self.sandbox.id} before it answered; "
                                        f"its output:\n{await self._log_tail()}")
            if time.monotonic() >= deadline:
                raise SwerexStartTimeout(
                    f"swerex-remote did not answer on port {self._config.port} of sandbox {self.sandbox.id} within "
                    f"{self._config.startup_timeout:g} s (startup_timeout); the last probe said: "
                    f"{answer.message.strip().splitlines()[-1] if answer.message.strip() else 'nothing'}; "
                    f"its output:\n{await self._log_tail()}")
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, POLL_S[1])

    async def _running(self, pid: str) -> bool:
        assert self.sandbox is not None
        return (await self.sandbox.exec(["/bin/sh", "-c", f"kill -0 {pid}"], timeout=10)).exit_code == 0

    async def _log_tail(self) -> str:
        assert self.sandbox is not None
        done = await self.sandbox.exec(["tail", "-c", "4000", LOG], timeout=10)
        return done.text.strip() or "(none)"


def with_swerex(image: EnvSpec | str = "host", package: str = PACKAGE) -> EnvSpec:
    """``image`` (a spec, or a base, reference or image id) plus two build steps: a virtual environment
    at /opt/swerex, then ``package`` (swe-rex) installed into it by pip. Each is cached, so another
    version reuses the first. ``FanfoldDeployment(image=..., install=False)`` takes what it builds."""
    spec = image if isinstance(image, EnvSpec) else EnvSpec(image)
    return spec.run(_VENV_STEP).run(_PIP_STEP.format(venv=VENV, package=shlex.quote(package)))


class _PortRouteRuntime(RemoteRuntime):
    """A ``RemoteRuntime`` whose requests also carry the fanfold token, which the server's port route
    checks and strips; swerex-remote sees only its own ``X-API-Key``."""

    def __init__(self, *, fanfold_token: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fanfold_token = fanfold_token

    @property
    def _headers(self) -> dict[str, str]:
        return {**super()._headers, "Authorization": f"Bearer {self._fanfold_token}"}


async def _quietly(call: Any, logger: logging.Logger, what: str) -> None:
    """Await ``call``; a failure is logged, since what follows (destroying the sandbox) ends it anyway."""
    try:
        await call
    except Exception as err:  # swerex-remote already gone, or the server's route refused
        logger.debug(f"{what} failed: {err}")
