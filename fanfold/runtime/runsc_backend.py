"""The gVisor backend (``runtime="runsc"``): each sandbox's system calls served by gVisor's own
kernel in user space (the sentry, on the systrap platform), not by the host's. Needs root and
runsc 20240729 or later (``scripts/runsc.sh``). Build steps still run under crun.

The sandbox is made as the OCI backend makes it (``oci_sandbox``: the same disk, overlay root,
agent, channel dir and cgroups) and handed to ``runsc`` as an OCI bundle, with runsc's own
overlay off so that writes land on the sandbox's disk. What differs (``docs/design/runsc.md``):

- runsc passes no descriptors, so the agent starts with ``--hold``: the host polls its socket,
  locks the channel dir, then lets services start (``g``).
- Memory checkpoints are runsc's own (no CRIU). gVisor cannot save a socket bound on the host,
  so the agent closes its listener first (``q``) and binds it again on SIGUSR2. The host gives each
  agent a key at its first ``g`` (nothing of the sandbox runs before): the agent lets go only for a
  ``q`` proven with it, and, bound again, proves with it that it is what listens at its socket.
- A restored sandbox keeps its source's hostname: the agent's binary renames it (``runsc exec``).
- Limits: a sandbox's processes are counted inside gVisor (RLIMIT_NPROC), since the host's pids
  limit counts the sentry's threads; hitting the memory limit kills the whole sandbox (the host
  sees one process). So ``exact_counters`` is False.
- No user namespace of fanfold's: the sentry runs as nobody in one of gVisor's. The seccomp
  profile is applied by gVisor to the sandbox's processes (``--oci-seccomp``), every refusal EPERM.
- Networks: gVisor's netstack is out of the host's reach, so the agent relays. It listens on the
  proxy's port inside and passes each connection to a unix socket the host binds in the sandbox's
  net dir (``/.fanfold/net``, read-only inside; ``--host-uds=all`` lets the sandbox connect to it);
  an exposed port is an agent connection that the agent splices to the service (``o``). A ``q``
  ends those connections, which gVisor cannot save either.
- GPUs: through gVisor's proxy of NVIDIA's driver (``--nvproxy``, ``nvproxy``), refused before anything
  is made where this runsc or host cannot; no memory checkpoints of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import stat
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable

from .._agent.build import agent_binary
from .._agent.client import AgentClient, AgentUnreachable
from ..errors import CheckpointFailed, HostNotReady, InfrastructureError, InvalidRequest
from ..host import cgroups, disk, doctor, procs, setup
from ..host.cdi import Edits
from ..host.offload import host_errors, on_thread
from ..host.spawn import Finished, log_tail, run
from ..store.rootfs import copy_upper
from . import get_runtime, nvproxy, oci_sandbox, seccomp
from .base import Backend, Capabilities, Handle, SandboxSpec
from .container import Bind, ContainerSpec
from .oci import oci_config
from .oci_backend import quota_disk

START_TIMEOUT_S = 30.0
PIDS_PER_PROCESS = 10
"""Host tasks (the sentry's threads, ptrace stubs) per sandbox process, for the host's pids limit:
a safety net only, the sandbox's own limit is RLIMIT_NPROC inside gVisor."""
KEY_FILE = "fanfold-agent-key"
"""In a sandbox's bundle and its memory checkpoints' dirs: the key its agent got at its first ``g``."""
TOKEN_FILE = "fanfold-agent-token"
"""In a memory checkpoint's dir instead, for an agent of protocol 4 or older (restored from a checkpoint
taken before keys): the token of its last ``q``, which it tells back (``t``)."""
REQUEST_TIMEOUT_S = 10.0
KEEP_TMP = ".fanfold-keep"
PLATFORMS = ("systrap", "ptrace", "kvm")
ENOSYS = 38
RUNSC_NAMES = frozenset({"runsc", "runsc-gofer", "runsc-sandbox", "exe"})
"""What runsc's processes are called (the sentry re-executes itself: ``exe``), for the reaper."""
NET_PATH = "/.fanfold/net"
"""Where a sandbox sees its net dir (read-only): the host's sockets its agent relays connections to."""
NET_FILE = "fanfold-net"
"""In a memory checkpoint's dir: the sandbox had a net dir (its agent relays), and the ports it relayed."""
GPU_FILE = "fanfold-gpus"
"""In a sandbox's bundle: it has GPUs (runsc starts it with ``--nvproxy``; no memory checkpoints)."""


class RunscBackend(oci_sandbox.OnHost, Backend):
    """Sandboxes under gVisor (``runsc``, systrap platform); memory checkpoints by runsc."""

    name = "runsc"
    capabilities = Capabilities(memory="live", exact_counters=False, isolated=True, network=True)
    relays: dict[str, set[int]]
    """The ports each sandbox's agent relays, as this engine asked (``listen_inside``)."""
    gpu_support: nvproxy.Support | None = None
    """What this runsc can do for GPUs, asked at the first sandbox with devices."""

    async def prepare(self) -> None:
        if not setup.is_root():
            raise HostNotReady("the runsc backend needs root (mounts, cgroups): run fanfold as root")
        found = await asyncio.to_thread(doctor.check_gvisor, True)
        binary = shutil.which("runsc")
        if not found.ok or binary is None:
            raise HostNotReady(f"gVisor's runsc: {found.detail}: run {found.fix}, or `make setup`")
        self.prepare_host()
        setup.RUNTIME_NAMES.update(RUNSC_NAMES)
        cfg = self.config
        self.state = cfg.run_dir / "runsc"
        self.state.mkdir(exist_ok=True)
        if cfg.runsc_platform not in PLATFORMS:
            raise HostNotReady(f"gVisor platform {cfg.runsc_platform!r} is not one of {', '.join(PLATFORMS)}:"
                               " set FANFOLD_RUNSC_PLATFORM to one of them")
        # No network but loopback; the agent binds its socket on the host and connects its relays to the
        # host's (``all``); writes go to the sandbox's disk (no overlay of runsc's own), and what the host
        # writes there is seen at once.
        self.argv = [binary, "--root", str(self.state), f"--platform={cfg.runsc_platform}", "--network=none",
                     "--host-uds=all", "--overlay2=none", "--file-access=shared", "--oci-seccomp"]
        self.relays = {}
        # Build steps run under crun, in a network namespace of their own, as with the oci backend.
        self.step_runtime = get_runtime("crun", str(cfg.run_dir / "crun"))
        self.agent_path = await asyncio.to_thread(agent_binary, cfg.state_dir)
        await asyncio.to_thread(seccomp.load, "default")  # HostNotReady now, not at the first create
        self.disk_hold = await asyncio.to_thread(quota_disk, cfg)

    async def close(self, *, idle: bool = True) -> None:
        await self.close_host(idle=idle)

    async def list_ids(self) -> set[str]:
        ids = {p.name.partition("_sandbox:")[0] for p in self.state.glob("sb-*_sandbox:*")}
        ids |= {p.name.removeprefix("runsc-").removesuffix(".sock") for p in self.state.glob("runsc-sb-*.sock")}
        return ids | self.host_ids()

    # -- one sandbox ----------------------------------------------------------------------------

    async def bring_up(self, spec: SandboxSpec) -> Handle:
        cfg = self.config
        if spec.init:
            raise InvalidRequest(f"gVisor sandboxes run no init but fanfold's agent: an image with {spec.init} as init"
                                 " (label fanfold.init) needs the oci backend")
        if spec.devices is not None:
            await self._check_gpus(spec.id, spec.devices)  # before anything is made
        flags = (nvproxy.FLAG,) if spec.devices is not None else ()
        where = await on_thread(oci_sandbox.mount_disk, cfg, self.store, spec.id, spec.layers, spec.host_dirs,
                                spec.limits, self.disk_hold is not None)
        bundle = where.bundle
        bundle.mkdir(exist_ok=True)
        if flags:
            (bundle / GPU_FILE).touch()
        relayed = None if spec.restore is None else _relayed(spec.restore)
        if spec.restore is None or relayed is not None:  # a checkpoint from before relays has no net dir to bind
            _net_dir(where).mkdir(mode=0o700)
        config = await on_thread(self._config, spec, where)
        (bundle / "config.json").write_text(json.dumps(config))
        if spec.restore is None:
            keep = await on_thread(_hold_tmp, where.rootfs)
            await self._start_gpus_told(spec.id, self._runsc(
                spec.id, "run", "--detach", "--pid-file", str(bundle / "pid"), "--bundle", str(bundle), spec.id,
                flags=flags), flags)
            await self._ping_until_up(spec.id)
            if keep is not None:
                keep.unlink(missing_ok=True)
            oci_sandbox.set_immutable(where.channel, True)
            if spec.before_run is not None:
                await spec.before_run(Handle(spec.id, _read_pid(bundle)))
            key = secrets.token_hex(32)
            _write_secret(bundle / KEY_FILE, key)
            await asyncio.wait_for(self.agent_of(spec.id).release_services(key), REQUEST_TIMEOUT_S)
        else:
            secret = _checkpoint_secret(spec.restore)
            if secret is None:
                raise InfrastructureError(f"{spec.restore} holds no gVisor checkpoint of fanfold's (a snapshot taken"
                                          " by another backend?): restore it with the backend that took it")
            if not secret.legacy:  # the restored agent holds its source's key
                _write_secret(bundle / KEY_FILE, secret.value)
            await self._start_gpus_told(spec.id, self._restore(spec.id, spec.restore, where, secret, flags), flags)
            # The restored processes run already (runsc restores nothing stopped), but their relays
            # accept nothing until the engine's listener is there (``l``).
            if spec.before_run is not None:
                await spec.before_run(Handle(spec.id, _read_pid(bundle)))
            else:
                await self._stop_relays(spec.id, relayed or ())
            await self._runsc(spec.id, "exec", "--cap", "CAP_SYS_ADMIN", spec.id, oci_sandbox.AGENT_PATH,
                              "--sethostname", spec.id)
        return Handle(spec.id, _read_pid(bundle))

    def _config(self, spec: SandboxSpec, where: oci_sandbox.Paths) -> dict[str, Any]:
        """The bundle's config: the OCI backend's, plus what gVisor needs."""
        args = [oci_sandbox.AGENT_PATH, "--listen", f"{oci_sandbox.CHANNEL_PATH}/agent.sock", "--hold"]
        for name, cmd, mode in spec.services:
            args += [f"--{mode}", name, cmd]
        binds = oci_sandbox.channel_binds(self.agent_path, where)
        if _net_dir(where).is_dir():
            binds.append(Bind(str(_net_dir(where)), NET_PATH))  # read-only: the sandbox connects, never binds
        container = ContainerSpec(
            id=spec.id, rootfs=where.rootfs, args=args, env=list(spec.env), cwd="/", hostname=spec.id,
            limits=spec.limits, binds=binds, cgroup_path=f"/{self.config.cgroup_parent}/{spec.id}",
            devices=None if spec.devices is None else nvproxy.others(spec.devices),
        )
        config = oci_config(container)
        if spec.devices is not None:
            nvproxy.add_devices(spec.devices, config)
        pids = spec.limits.pids
        config["process"]["rlimits"] = [{"type": "RLIMIT_NPROC", "soft": pids, "hard": pids}]
        config["linux"]["resources"]["pids"] = {"limit": PIDS_PER_PROCESS * pids + 256}
        profile = seccomp.load(spec.seccomp)
        if profile is not None:
            config["linux"]["seccomp"] = _for_gvisor(profile)
        return config

    async def _check_gpus(self, sandbox_id: str, devices: Edits) -> None:
        """HostNotReady unless this runsc and host can give the sandbox ``devices``' GPUs (``nvproxy``)."""
        if self.gpu_support is None:
            self.gpu_support = await on_thread(nvproxy.probe, self.argv[0])
        why = nvproxy.refusal(self.gpu_support, await on_thread(nvproxy.host_driver_version), devices)
        if why is not None:
            raise HostNotReady(f"sandbox {sandbox_id} cannot have GPUs under gVisor: {why}")

    async def _start_gpus_told(self, sandbox_id: str, starting: Awaitable[object], flags: tuple[str, ...]) -> None:
        """Await ``starting`` (runsc's run or restore); a GPU sandbox that nvproxy could not start is the
        host's to fix (its driver), not a failure that retrying mends."""
        try:
            await starting
        except InfrastructureError as err:
            if not flags or "nvidia" not in str(err).lower():
                raise
            raise HostNotReady(f"gVisor's GPU proxy could not start sandbox {sandbox_id} ({err}): check that the"
                               " host's NVIDIA driver is loaded and one `runsc nvproxy list-supported-drivers` lists,"
                               " or use the oci backend for GPU sandboxes (FANFOLD_RUNTIME=crun)") from None

    async def _runsc(self, sandbox_id: str, *args: str, timeout: float = 60, flags: tuple[str, ...] = ()) -> Finished:
        """Run runsc (with global ``flags`` of the sandbox's: ``run`` and ``restore`` start its kernel);
        its output goes to the sandbox's runtime log (a pipe would be handed to the sandbox by ``--detach``
        and never reach end of file)."""
        log = oci_sandbox.paths(self.config, sandbox_id).bundle / "runtime.log"
        done = await run([*self.argv, *flags, *args], log=str(log), timeout=timeout)
        if done.returncode != 0:
            raise InfrastructureError(f"runsc {args[0]} of sandbox {sandbox_id} failed: {log_tail(log)}")
        return done

    async def _ping_until_up(self, sandbox_id: str) -> None:
        agent = self.agent_of(sandbox_id)
        bundle = oci_sandbox.paths(self.config, sandbox_id).bundle
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                await asyncio.wait_for(agent.ping(), max(deadline - time.monotonic(), 0.1))
                return
            except (AgentUnreachable, asyncio.TimeoutError):
                if time.monotonic() > deadline or not procs.running(_read_pid(bundle)):
                    raise InfrastructureError(f"sandbox {sandbox_id}'s agent did not come up under gVisor:"
                                              f" {log_tail(bundle / 'runtime.log')}") from None
                await asyncio.sleep(0.002)

    async def _restore(self, sandbox_id: str, images: Path, where: oci_sandbox.Paths, secret: AgentSecret,
                       flags: tuple[str, ...] = ()) -> None:
        """Restore ``images`` as ``sandbox_id`` over the bundle in ``where``; its agent listens again."""
        bundle = where.bundle
        await self._runsc(sandbox_id, "restore", "--detach", "--image-path", str(images), "--pid-file",
                          str(bundle / "pid"), "--bundle", str(bundle), sandbox_id, flags=flags)
        await self._listen_again(sandbox_id, where, secret)

    async def _listen_again(self, sandbox_id: str, where: oci_sandbox.Paths, secret: AgentSecret) -> None:
        """Have an agent that let go of its socket (``q``) bind it again, lock its dir, then check that
        the dir holds only a socket, and that what listens there is the agent (``secret``).

        The sandbox's processes run meanwhile (runsc restores nothing stopped), so one could put a
        socket of its own in the agent's place before the lock, and pass the host's check to the agent
        over connections it made before: the agent proves itself only once it finds its own socket's
        path leads to it. A sandbox caught at it, or whose agent does not come back, is ended. The dir
        is never left open."""
        oci_sandbox.set_immutable(where.channel, False)
        try:
            # The old socket's file goes first: the agent's own unlink of it did not free the name under
            # gVisor (the agent never answered again). A second rebind after a failed one ends the
            # sandbox: its agent listens on the name just unlinked.
            where.socket.unlink(missing_ok=True)
            await self._runsc(sandbox_id, "kill", sandbox_id, "USR2")
            await self._ping_until_up(sandbox_id)
        except (InfrastructureError, OSError) as err:
            await self._end(sandbox_id)
            raise InfrastructureError(f"{err}; the sandbox was ended") from None
        finally:
            oci_sandbox.set_immutable(where.channel, True)
        if not await self._answers_as_agent(sandbox_id, where, secret):
            await self._end(sandbox_id)
            raise InfrastructureError(f"sandbox {sandbox_id}: something else than its agent took the agent's socket"
                                      " while it was bound again; the sandbox was ended")

    async def _answers_as_agent(self, sandbox_id: str, where: oci_sandbox.Paths, secret: AgentSecret) -> bool:
        try:
            if os.listdir(where.channel) != [where.socket.name] or not stat.S_ISSOCK(os.lstat(where.socket).st_mode):
                return False
            return await asyncio.wait_for(secret.proven_by(self.agent_of(sandbox_id)), REQUEST_TIMEOUT_S)
        except (OSError, AgentUnreachable, asyncio.TimeoutError):
            return False

    # -- networks: relays through the agent ------------------------------------------------------

    async def listen_inside(self, handle: Handle, port: int) -> socket.socket:
        """A listener on the host whose connections come from 127.0.0.1:``port`` inside, relayed by
        the agent. Asked again (a restored sandbox, a new engine), the agent keeps its listener and
        relays to the new socket."""
        where = oci_sandbox.paths(self.config, handle.id)
        if not _net_dir(where).is_dir():
            raise InvalidRequest(f"sandbox {handle.id} was restored from a snapshot taken before gVisor sandboxes had"
                                 " networks: it can have none (a snapshot taken since can)")
        name = f"proxy-{port}.sock"
        try:
            listener = await on_thread(_bind_in, _net_dir(where), name, discard=socket.socket.close)
        except OSError as err:
            raise InfrastructureError(f"binding {name} for sandbox {handle.id} failed: {err}") from None
        try:
            await asyncio.wait_for(self.agent(handle).relay(port, f"{NET_PATH}/{name}"), REQUEST_TIMEOUT_S)
        except OSError as err:  # its errno stays attached: the engine tells EADDRINUSE from the rest
            listener.close()
            raise InfrastructureError(f"opening port {port} in sandbox {handle.id} failed: {err.strerror}") from err
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            listener.close()
            raise InfrastructureError(f"sandbox {handle.id}'s agent did not open port {port}: {err!r}") from None
        self.relays.setdefault(handle.id, set()).add(port)
        return listener

    async def connect_inside(self, handle: Handle, port: int) -> socket.socket:
        try:
            return await asyncio.wait_for(self.agent(handle).open_port(port), REQUEST_TIMEOUT_S)
        except OSError as err:
            raise InfrastructureError(f"connecting to port {port} in sandbox {handle.id} failed: {err.strerror}") from err
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            raise InfrastructureError(f"sandbox {handle.id}'s agent did not connect to port {port}: {err!r}") from None

    async def _relay_again(self, sandbox_id: str) -> None:
        """After a checkpoint that leaves the sandbox running: its relays accept again (a ``q`` held them),
        to the same host sockets."""
        for port in sorted(self.relays.get(sandbox_id, ())):
            await asyncio.wait_for(self.agent_of(sandbox_id).relay(port, f"{NET_PATH}/proxy-{port}.sock"),
                                   REQUEST_TIMEOUT_S)

    async def _stop_relays(self, sandbox_id: str, ports: tuple[int, ...] | list[int]) -> None:
        """A restored sandbox without a network: the relays its source had stop (held, they would keep
        connections waiting forever)."""
        try:
            for port in ports:
                await asyncio.wait_for(self.agent_of(sandbox_id).stop_relay(port), REQUEST_TIMEOUT_S)
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            raise InfrastructureError(f"sandbox {sandbox_id}'s agent did not close its relays: {err!r}") from None

    async def _end(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox (the engine then finds it dead and destroys it)."""
        await on_thread(cgroups.remove, self.config.cgroup_parent, sandbox_id)

    async def release(self, sandbox_id: str, handle: Handle | None = None) -> None:
        cfg = self.config
        where = oci_sandbox.paths(cfg, sandbox_id)
        with host_errors(f"releasing sandbox {sandbox_id} failed (the reaper tries again)"):
            # `runsc delete --force` waits ~1.8 s for the sentry; killing its cgroup takes ~5 ms.
            pids = [p for p in (handle.pid if handle else None, _read_pid(where.bundle)) if p]
            await on_thread(cgroups.remove, cfg.cgroup_parent, sandbox_id)
            for pid in pids:
                await setup.reap(pid, timeout=1.0)
            setup.reap_orphans()
            self._forget(sandbox_id)
            self.relays.pop(sandbox_id, None)
            await on_thread(oci_sandbox.release_host, cfg, sandbox_id, where)  # the net dir is on its root

    def _forget(self, sandbox_id: str) -> None:
        """Remove runsc's state of a sandbox whose processes are gone: what ``delete`` would."""
        for leftover in (*self.state.glob(f"{sandbox_id}_sandbox:*"), self.state / f"runsc-{sandbox_id}.sock"):
            leftover.unlink(missing_ok=True)

    def alive(self, handle: Handle) -> bool:
        pid = handle.pid  # the sentry: a checkpoint leaves it running, a restore's is a new handle's
        cgroup = f"/{self.config.cgroup_parent}/{handle.id}"
        return procs.running(pid) and oci_sandbox.in_sandbox_cgroup(pid or 0, cgroup)

    async def freeze(self, handle: Handle) -> None:
        with host_errors(f"freezing sandbox {handle.id} failed"):
            await self._runsc(handle.id, "pause", handle.id)

    async def thaw(self, handle: Handle) -> None:
        with host_errors(f"thawing sandbox {handle.id} failed"):
            if self._state_of(handle.id) == "paused":
                await self._runsc(handle.id, "resume", handle.id)

    def _state_of(self, sandbox_id: str) -> str | None:
        path = self.state / f"{sandbox_id}_sandbox:{sandbox_id}.state"
        try:
            return json.loads(path.read_text()).get("status")
        except (OSError, ValueError):
            return None

    async def checkpoint(
        self, handle: Handle, dest: Path, host_dirs: tuple[str, ...], *, memory: bool, leave_running: bool,
        frozen: bool = False,
    ) -> float:
        sandbox_id = handle.id
        where = oci_sandbox.paths(self.config, sandbox_id)
        if memory and (where.bundle / GPU_FILE).exists():
            raise InvalidRequest(f"sandbox {sandbox_id} has GPUs, whose state gVisor's GPU proxy cannot save (asked,"
                                 " its kernel dies): snapshot it without memory (memory=False), or run GPU sandboxes"
                                 " that need memory snapshots under the oci backend")
        if not frozen and where.subvolume.is_dir():
            await on_thread(disk.sync, where.subvolume)  # as the oci backend: the snapshot's flush, before the pause
        started = time.perf_counter()
        touched = memory or not frozen  # a frozen sandbox is thawed for the `q` of a memory checkpoint
        secret = _sandbox_secret(where) if memory else None
        unbound: AgentSecret | None = None  # once the agent may have let go of its socket
        try:
            if secret is not None:
                unbound = secret  # a `q` whose answer is lost may still have been carried out
                await self._unbind(handle, frozen, secret)
            if touched:
                await self.freeze(handle)
            await on_thread(copy_upper, where.disk, host_dirs, dest / "layer")
            if secret is not None:
                (dest / "memory").mkdir()
                _write_secret(dest / "memory" / (TOKEN_FILE if secret.legacy else KEY_FILE), secret.value)
                if _net_dir(where).is_dir():
                    (dest / "memory" / NET_FILE).write_text(json.dumps(sorted(self.relays.get(sandbox_id, ()))))
                leave = ["--leave-running"] if leave_running else []
                await self._runsc(sandbox_id, "checkpoint", *leave, "--image-path", str(dest / "memory"), sandbox_id,
                                  timeout=300)
                if not leave_running:
                    return (time.perf_counter() - started) * 1000  # its processes ended; release follows
            if touched:
                await self._carry_on(handle, where, unbound, frozen)
        except (InfrastructureError, OSError) as err:
            if touched:
                with suppress(InfrastructureError, OSError):
                    await self._carry_on(handle, where, unbound, frozen)
            raise CheckpointFailed(f"snapshot of {sandbox_id} failed: {err}") from None
        return (time.perf_counter() - started) * 1000

    async def _carry_on(self, handle: Handle, where: oci_sandbox.Paths, secret: AgentSecret | None,
                        frozen: bool) -> None:
        """After a checkpoint that leaves the sandbox running: thaw it, have its agent listen again
        (when it let go, ``secret``), and freeze it again if it was frozen before."""
        await self.thaw(handle)
        if secret is not None:
            await self._listen_again(handle.id, where, secret)
            try:
                await self._relay_again(handle.id)
            except (OSError, AgentUnreachable, asyncio.TimeoutError) as err:
                raise InfrastructureError(f"sandbox {handle.id}'s agent did not relay again: {err!r}") from None
        if frozen:
            await self.freeze(handle)

    async def _unbind(self, handle: Handle, frozen: bool, secret: AgentSecret) -> None:
        """Have the agent close its listener, which gVisor cannot save (``q``, proven by ``secret``)."""
        if frozen:
            await self.thaw(handle)
        try:
            await asyncio.wait_for(secret.unbind(self.agent(handle)), REQUEST_TIMEOUT_S)
        except (AgentUnreachable, asyncio.TimeoutError) as err:
            raise CheckpointFailed(f"sandbox {handle.id}'s agent did not let go of its socket: {err!r}") from None


@dataclass(frozen=True)
class AgentSecret:
    """What a gVisor sandbox's agent proves itself by: the host's key (protocol 5), or, for an agent of
    protocol 4 or older (restored from a checkpoint taken before keys, ``legacy``), a token it keeps
    from the host's last ``q`` and tells whoever asks: a weaker check, kept for those agents."""

    value: str
    legacy: bool = False

    async def unbind(self, agent: AgentClient) -> None:
        await (agent.drop_listener_legacy(self.value) if self.legacy else agent.drop_listener(self.value))

    async def proven_by(self, agent: AgentClient) -> bool:
        return await agent.token() == self.value if self.legacy else await agent.proves(self.value)


def _sandbox_secret(where: oci_sandbox.Paths) -> AgentSecret:
    """The key the sandbox's agent got, or for an agent without one, a fresh token for its next ``q``."""
    try:
        return AgentSecret((where.bundle / KEY_FILE).read_text())
    except FileNotFoundError:
        return AgentSecret(secrets.token_hex(16), legacy=True)


def _checkpoint_secret(images: Path) -> AgentSecret | None:
    """What the agent of a memory checkpoint proves itself by once restored; None: not a gVisor checkpoint."""
    for name, legacy in ((KEY_FILE, False), (TOKEN_FILE, True)):
        try:
            return AgentSecret((images / name).read_text(), legacy=legacy)
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def _write_secret(path: Path, value: str) -> None:
    """Write a key or token readable by root alone (the bundle and checkpoint dirs are the host's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(value)


def _net_dir(where: oci_sandbox.Paths) -> Path:
    """The sandbox's net dir on the host: on its root's tmpfs, so releasing the root takes it."""
    return where.root / "net"


def _relayed(images: Path) -> list[int] | None:
    """The ports a checkpoint's sandbox relayed, or None when it had no net dir (taken before relays)."""
    try:
        return [int(port) for port in json.loads((images / NET_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        return None


def _bind_in(directory: Path, name: str) -> socket.socket:
    """A non-blocking unix listener at ``directory/name`` (whatever was there replaced), bound through
    the directory's descriptor: the path may be longer than a socket address allows."""
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
        sock.bind(f"/proc/self/fd/{fd}/{name}")
        sock.listen(1024)
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)


def _read_pid(bundle: Path) -> int | None:
    try:
        return int((bundle / "pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _for_gvisor(profile: dict[str, Any]) -> dict[str, Any]:
    """``profile`` as gVisor can apply it. gVisor answers EPERM to every refused call, never the
    rule's errno; a ``clone3`` refused with ENOSYS (so that libc falls back to ``clone``, whose
    flags a filter can read) would then fail every new thread: gVisor's own clone3 is allowed."""
    rules: list[dict[str, Any]] = []
    for rule in profile.get("syscalls") or ():
        if "clone3" in rule.get("names", ()) and rule.get("action") == "SCMP_ACT_ERRNO" \
                and rule.get("errnoRet") == ENOSYS:
            rule = {**rule, "names": [n for n in rule["names"] if n != "clone3"]}
            rules.append({"names": ["clone3"], "action": "SCMP_ACT_ALLOW"})
        if rule.get("names"):
            rules.append(rule)
    return {**profile, "syscalls": rules}


def _hold_tmp(rootfs: Path) -> Path | None:
    """Keep gVisor from mounting a tmpfs of its own on an empty /tmp, which the host (files,
    snapshots) cannot see: a file in it until the agent answers (``bring_up`` removes it; nothing
    else runs before). A bind of /tmp would do as much as a 9p mount of its own."""
    keep = rootfs / "tmp" / KEEP_TMP
    try:
        if not stat.S_ISDIR(os.lstat(rootfs / "tmp").st_mode) or any(os.scandir(rootfs / "tmp")):
            return None  # not a dir (a link, say: then no tmpfs either), or not empty
        os.close(os.open(keep, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError:
        return None  # no /tmp: gVisor makes none
    return keep
