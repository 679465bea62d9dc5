"""Commands in sandboxes: typed results with the resources each used."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from .._agent.client import (AgentClient, AgentGone, AgentProtocolError, AgentTooOld, AgentUnreachable, ExecControl,
                             ExecUser)
from ..errors import InfrastructureError, InvalidRequest, SandboxGone
from ..host import safefs
from ..images import users
from ..images.builder import DEFAULT_PATH
from ..models import ExecResult
from . import db as dbmod
from .api import OnOutput
from .checks import check_strings
from .execution import build_result, check_exec_args, sandbox_oom_result
from .lifecycle import Lifecycle
from .network import row_policy
from .sources import base_env


class Execs:
    """Runs commands through the backend's agent, each holding its sandbox running."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self._in_exec: dict[str, int] = {}
        """Execs in flight per sandbox: a command alone in its sandbox gets its own peak memory."""

    async def exec(
        self, sandbox_id: str, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
        stdin: bytes | str | None = None, timeout: float | None = None, max_output: int | None = None,
        on_output: OnOutput | None = None, user: str | None = None, control: ExecControl | None = None,
    ) -> ExecResult:
        life = self.life
        if user is not None and not isinstance(user, str):
            raise InvalidRequest(f"user must be a name or uid, optionally with ':group', got {user!r}")
        argv, stdin_bytes, limit = check_exec_args(cmd, stdin, timeout, max_output, life.config.max_output_bytes)
        started = time.perf_counter()
        try:
            async with life.using(sandbox_id) as row:
                result = await self._exec(row, argv, cwd, env, stdin_bytes, timeout, limit, on_output, user, control)
        except InfrastructureError:
            life.telemetry.exec_failed_infra()
            raise
        life.telemetry.executed(time.perf_counter() - started, result.outcome.value)
        return result

    async def _exec(self, row: Any, argv: list[str], cwd: str | None, env: dict[str, str] | None,
                    stdin_bytes: bytes | None, timeout: float | None, limit: int,
                    on_output: OnOutput | None, user: str | None, control: ExecControl | None) -> ExecResult:
        life, sandbox_id = self.life, row["id"]
        img = life.sources.store.load_image(row["image_id"])
        workdir = safefs.normalize(cwd, img.workdir) if cwd is not None else img.workdir
        as_user = user or row["exec_user"]
        # passwd and group are read off the loop: the sandbox makes them as large as it likes (up to 1 MiB)
        who = await asyncio.to_thread(users.resolve, life.backend.root(sandbox_id), as_user) if as_user else None
        # the user's HOME, USER and LOGNAME, unless the image or the caller set them
        image_env = dict(img.env)
        ident = {} if who is None else {k: v for k, v in who.env().items() if k not in image_env}
        proxy = life.network.env(row_policy(row))  # the policy now in force, set at create or since
        gpus = {} if row["gpu_ids"] == "[]" else life.gpus.env(json.loads(row["gpu_ids"]), dbmod.row_info(row).limits,
                                                               image_env, DEFAULT_PATH)
        merged = {**ident, **gpus, **proxy, **json.loads(row["env"]), **check_strings(env, "env")}
        alone = not self._in_exec.get(sandbox_id)
        self._in_exec[sandbox_id] = self._in_exec.get(sandbox_id, 0) + 1
        handle = dbmod.row_handle(row)
        counters = life.backend.counters(handle)
        if alone:  # the peak then measures this command alone
            counters.reset_peak()
        before = counters.read()
        started = time.perf_counter()
        try:
            raw = await asyncio.wait_for(
                life.backend.exec(
                    handle, argv, env=base_env(img, sandbox_id, merged, life.trust_env), cwd=workdir,
                    timeout_ms=0 if timeout is None else max(1, math.ceil(timeout * 1000)),
                    max_output=limit, stdin=stdin_bytes, on_chunk=on_output,
                    user=_switch(who), control=control,
                ),
                None if timeout is None else timeout + 30,
            )
        except AgentTooOld:
            if control is not None and control.pty is not None:
                raise InvalidRequest(
                    f"sandbox {sandbox_id} runs an agent from an older memory snapshot that has no terminals:"
                    " run the command without a pty, or create the sandbox afresh from its image") from None
            raise InvalidRequest(
                f"sandbox {sandbox_id} runs an agent from an older memory snapshot that cannot run commands as"
                f" user {as_user!r}: run it as user='root', or create the sandbox afresh from its image") from None
        except AgentProtocolError as err:
            # Only a sandbox that subverted its agent gets here: it is no longer ours to run.
            life.telemetry.sandboxes_reaped.labels(reason="crashed").inc()
            await asyncio.shield(life.destroy(sandbox_id))
            raise SandboxGone(f"sandbox {sandbox_id}'s agent broke the protocol ({err}); the sandbox was"
                              " destroyed") from None
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            if sandbox_id in life.destroying:
                await asyncio.shield(life.destroying[sandbox_id])
            now_row = life.db.get(sandbox_id)
            if now_row is None or now_row["state"] != "running":
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed during the command") from None
            dying = counters.read()  # before its cgroup goes with it
            try:
                await life.gone_if_dead(sandbox_id, now_row["pid"], within=0.25)
            except SandboxGone:
                oom = sandbox_oom_result(before, dying, sandbox_id, time.perf_counter() - started)
                if oom is None:
                    raise
                return oom
            if isinstance(err, AgentGone) or await _let_go(life.backend.agent(handle)):
                # Its agent let go of its socket outside a checkpoint (an older agent takes a `q` from
                # inside): nothing brings it back, so the sandbox ends rather than fail every exec.
                life.telemetry.sandboxes_reaped.labels(reason="crashed").inc()
                await asyncio.shield(life.destroy(sandbox_id))
                raise SandboxGone(f"sandbox {sandbox_id}'s agent no longer listens on its socket (a process in the"
                                  " sandbox had it let go); the sandbox was destroyed") from None
            raise InfrastructureError(f"lost contact with sandbox {sandbox_id}'s agent: {err}") from None
        finally:
            left = self._in_exec.pop(sandbox_id, 1) - 1
            if left:
                self._in_exec[sandbox_id] = left
            after = counters.read()
            counters.close()
        return build_result(raw, argv, before, after, workdir)


async def _let_go(agent: AgentClient) -> bool:
    """Whether nothing listens on the agent's socket any more (an exec that raced the agent's letting
    go sees its connection reset instead)."""
    try:
        await asyncio.wait_for(agent.ping(), 5)
    except AgentGone:
        return True
    except (AgentUnreachable, asyncio.TimeoutError):
        pass
    return False


def _switch(who: users.User | None) -> ExecUser | None:
    """The agent's ``u`` frame, or None to run as PID 1 does (root with no other group): so root
    needs no frame, and works on agents restored from snapshots older than the frame."""
    if who is None or (who.uid == 0 and who.gid == 0 and set(who.groups) <= {0}):
        return None
    return ExecUser(who.uid, who.gid, who.groups)
