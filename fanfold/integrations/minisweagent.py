"""mini-swe-agent (v2) on fanfold: ``FanfoldEnvironment`` runs the agent's commands in a sandbox.

Select it in a mini-swe-agent config by its dotted path (there is no short name)::

    environment:
      environment_class: fanfold.integrations.minisweagent.FanfoldEnvironment
      image: host            # a fanfold image: a base name, a built image's id or name, a snapshot
      cwd: /testbed

It behaves as mini-swe-agent's own ``DockerEnvironment``: each action runs in a fresh
``bash -lc`` with stdout and stderr merged, a timeout gives ``returncode`` -1 with
``exception_info``, and output starting with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
raises ``Submitted``. One sandbox per environment, made in the constructor, destroyed by
``cleanup()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .._extras import MissingExtra

try:
    from minisweagent.exceptions import Submitted
    from minisweagent.utils.serialize import recursive_merge
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "minisweagent":
        raise  # an installed but broken package: let it show
    raise MissingExtra("FanfoldEnvironment needs mini-swe-agent, which is not installed: "
                       "pip install 'fanfold[integrations]'") from None
from pydantic import BaseModel, Field

from ..client import Fleet, Sandbox
from ..config import EngineConfig
from ..errors import ExecTimeout, FanfoldError
from ..models import ExecResult, Outcome

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNAME_FIELDS = ("system", "node", "release", "version", "machine")
"""What ``platform.uname()`` gives mini-swe-agent's own envs, and its default templates read."""
_UNAME = "uname -s; uname -n; uname -r; uname -v; uname -m"  # one field a line: version has spaces


class FanfoldEnvironmentConfig(BaseModel):
    """The keyword arguments of ``FanfoldEnvironment`` (mini-swe-agent's ``environment`` section)."""

    image: str = "host"
    """The fanfold image to start from: a base name, an image id or name, or a snapshot id or name."""
    cwd: str = ""
    """Directory the commands run in; empty: the image's working directory."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Host environment variables passed to the commands when set; ``env`` wins over them."""
    timeout: int = 30
    """Seconds a command may run before it is killed."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs each command: the command is appended as its last argument."""
    url: str | None = None
    """A fanfold server; None: ``FANFOLD_URL`` if set, else an engine embedded in this process."""
    token: str | None = Field(default=None, exclude=True)
    """The server's bearer token (default ``FANFOLD_TOKEN``); never serialized."""
    limits: dict[str, Any] = {}
    """Resources of the sandbox, as ``Fleet.create`` takes them: ``cpus``, ``memory_mb``, ``pids``, ``disk_mb``."""
    network: str | dict[str, Any] = "none"
    """The sandbox's network policy (see ``Fleet.create``): ``"none"``, ``{"allow": [...]}`` or ``"open"``."""
    deadline: float | None = None
    """Seconds the sandbox may live; None: the host's default."""
    labels: dict[str, str] = {}
    """Labels of the sandbox, e.g. the task it runs."""


class FanfoldEnvironment:
    """mini-swe-agent's ``Environment`` over one fanfold sandbox.

    ``fleet`` runs the sandbox on a fleet the caller owns (and closes); without it the env makes
    its own from ``url``/``token`` (or an embedded engine, with ``engine_config`` if given) and
    closes it in ``cleanup()``. Other keyword arguments are ``FanfoldEnvironmentConfig`` fields.
    """

    def __init__(self, *, config_class: type = FanfoldEnvironmentConfig, fleet: Fleet | None = None,
                 engine_config: EngineConfig | None = None, logger: logging.Logger | None = None,
                 **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.sandbox: Sandbox | None = None
        self._uname: dict[str, str] | None = None
        self._owned_fleet = None if fleet is not None else Fleet(self.config.url, token=self.config.token,
                                                                 config=engine_config)
        self.fleet = fleet if fleet is not None else self._owned_fleet
        try:
            self.sandbox = self.fleet.create(self.config.image, labels={"minisweagent": "1", **self.config.labels},
                                             deadline=self.config.deadline, network=self.config.network,
                                             **self.config.limits)
        except BaseException:
            self.cleanup()
            raise
        self.logger.info(f"Started fanfold sandbox {self.sandbox.id} from {self.config.image}")

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; returns ``output``, ``returncode``, ``exception_info``."""
        if self.sandbox is None:
            raise RuntimeError("the environment was cleaned up: its sandbox is gone")
        command = action.get("command", "")
        seconds = timeout or self.config.timeout
        try:
            result = self.sandbox.exec(_merged(self.config.interpreter, command), cwd=cwd or self.config.cwd or None,
                                       env=self._command_env() or None, timeout=seconds)
            output = _as_output(result, command, seconds)
        except FanfoldError as exc:  # the sandbox, not the command, failed: the model sees it, as theirs do
            output = _error_output("", exc)
        self._check_finished(output)
        return output

    def _command_env(self) -> dict[str, str]:
        forwarded = {key: value for key in self.config.forward_env if (value := os.getenv(key)) is not None}
        return forwarded | self.config.env

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise ``Submitted`` when the output's first line is the sentinel and the command succeeded."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's ``uname`` (system, node, release, version, machine) and ``kwargs``."""
        return recursive_merge(self.config.model_dump(), self.uname(), kwargs)

    def uname(self) -> dict[str, str]:
        """The sandbox's kernel and machine, as ``platform.uname()`` names them (asked once)."""
        if self._uname is None:
            if self.sandbox is None:
                raise RuntimeError("the environment was cleaned up: its sandbox is gone")
            lines = self.sandbox.exec(["/bin/sh", "-c", _UNAME], timeout=30).text.splitlines()
            self._uname = dict(zip(UNAME_FIELDS, lines + [""] * (len(UNAME_FIELDS) - len(lines))))
        return self._uname

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__name__}",
        }}}

    def cleanup(self) -> None:
        """Destroy the sandbox, and the fleet if this env made it (idempotent)."""
        sandbox, self.sandbox = getattr(self, "sandbox", None), None
        fleet, self._owned_fleet = getattr(self, "_owned_fleet", None), None
        try:
            if sandbox is not None:
                sandbox.kill()
        finally:
            if fleet is not None:
                fleet.close()

    close = cleanup

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # at interpreter exit the fleet closed already, taking the sandbox with it
            pass


def _merged(interpreter: list[str], command: str) -> list[str]:
    # stderr joins stdout inside the sandbox, so the two interleave as they were written,
    # as `docker exec` with stderr=STDOUT gives mini-swe-agent's DockerEnvironment.
    return ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *interpreter, command]


def _as_output(result: ExecResult, command: str, seconds: float) -> dict[str, Any]:
    text = (result.stdout + result.stderr).decode("utf-8", "replace")
    if result.outcome is Outcome.EXITED:
        return {"output": text, "returncode": result.exit_code, "exception_info": ""}
    if result.outcome is Outcome.TIMEOUT:
        return _error_output(text, ExecTimeout(f"Command {command!r} timed out after {seconds:g} seconds"))
    why = "the sandbox ran out of memory" if result.outcome is Outcome.OOM else f"signal {result.signal}"
    return _error_output(text, FanfoldError(f"Command {command!r} was killed: {why}"), outcome=result.outcome.value)


def _error_output(text: str, exc: Exception, **extra: Any) -> dict[str, Any]:
    """mini-swe-agent's shape of a command that did not run to its end."""
    return {"output": text, "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc), **extra}}
