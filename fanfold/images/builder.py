"""Build an EnvSpec into layers: one per step, keyed by its parent's digest and its own inputs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Awaitable, Callable, Literal, Sequence

from ..errors import BuildFailed, FanfoldError, InvalidRequest, InvalidSpec
from ..host import safefs, stepnet
from ..host.offload import to_the_end
from ..runtime import Bind, ContainerSpec, Runtime
from ..runtime import seccomp
from ..runtime.container import ProcessUser
from ..refs import DEFAULT_PATH
from ..spec import BASES, EnvSpec, Step, is_repo_url, words
from ..store import Image, LayerStore, trust
from ..store.layers import Healthcheck
from ..store.rootfs import copy_tree, fold_host_uppers, mount_rootfs, mount_trusted, unmount_rootfs
from . import git, users
from .bases import base_digest, ensure_base, host_dirs

STEP_TIMEOUT_S = 3600


@dataclass(frozen=True)
class StepEvent:
    """Progress of a build, one event as each step starts and ends."""

    index: int
    total: int
    description: str
    status: str
    """``running``, ``cached``, ``built`` or ``failed``. A config step (env, user, cmd...) makes no layer and
    reports no ``running``: it is ``cached`` when every step before it was, else ``built``."""


OnStep = Callable[[StepEvent], None]
ResolveBase = Callable[[str], Awaitable[Image]]
"""Turns a base that is not one of fanfold's own (an image reference or id) into a local image."""
GitGates = Callable[[], git.Gate]
"""The gate a server tenant's repo steps clone through, asked for by each repo step (made on first use)."""
CONFIG_STEPS = ("env", "service", "user", "entrypoint", "cmd", "expose", "label", "volume", "healthcheck")
"""Steps that change an image's config and make no layer."""
Network = Literal["isolated", "host"]
"""Where a build's ``run`` steps are: ``isolated`` (egress through NAT, nothing of the host; see
``host.stepnet``) or ``host`` (the host's own network: for the host's own tenant only)."""
NETWORKS = ("isolated", "host")


def check_network(network: str) -> Network:
    """``network`` when it names a ``Network``; else InvalidRequest."""
    if network not in NETWORKS:
        raise InvalidRequest(f"network must be one of {', '.join(NETWORKS)}, not {network!r}")
    return network  # type: ignore[return-value]


class Builder:
    """Turns specs into images in one LayerStore, running ``run`` steps with a Runtime; ``tag`` (the
    engine's) names its build networks."""

    def __init__(self, store: LayerStore, runtime: Runtime | None, *, mirror: str, scratch_run: Path,
                 tag: str, resolve_base: ResolveBase | None = None, extra_ca_file: str | None = None,
                 confined_refused: Sequence[str] = ()) -> None:
        self.store = store
        self.extra_ca_file = extra_ca_file
        """CAs ``run`` steps trust besides the image's own (``trust``), never written into a layer."""
        self.runtime = runtime
        self.networks = stepnet.StepNetworks(tag, confined_refused)
        """Where ``run`` steps run; a confined build's (a server tenant's) also refuse ``confined_refused``
        (the engine's: the egress proxy's special ranges less ``net_reachable``)."""
        self.mirror = mirror
        self.scratch_run = scratch_run
        self.resolve_base = resolve_base

    async def build(self, spec: EnvSpec, on_step: OnStep | None = None, *, network: Network = "isolated",
                    clones: GitGates | None = None, confined: bool = False) -> Image:
        """Build ``spec``; its layers are safe from gc until its image record names them. Its ``run``
        steps share one network for the build (see ``Network``); ``confined`` (a server tenant's build):
        an isolated one that also refuses ``confined_refused``. With ``clones`` (a server tenant's build),
        its repo steps clone only through that gate (``images.git``); else as the host's git does."""
        isolated = check_network(network) == "isolated"
        net = self.networks.network(confined=confined) if isolated else None
        try:
            async with self.store.making():
                return await self._build(spec, on_step, net, clones)
        finally:
            if net is not None:
                await to_the_end(net.close())

    async def _build(self, spec: EnvSpec, on_step: OnStep | None, net: stepnet.StepNetwork | None,
                     clones: GitGates | None) -> Image:
        report = on_step or (lambda event: None)
        total = len(spec.steps) + 1
        report(StepEvent(0, total, f"BASE {spec.base}", "running"))
        start, digest, cached = await self._base(spec.base)
        report(StepEvent(0, total, f"BASE {spec.base}", "cached" if cached else "built"))
        all_cached = cached
        if not spec.steps and start.id != "":
            return start
        layers = list(start.layers)
        env = dict(start.env)
        config: dict[str, Any] = {
            "workdir": start.workdir, "user": start.user, "entrypoint": start.entrypoint, "cmd": start.cmd,
            "ports": list(start.ports), "services": list(start.services), "labels": dict(start.labels),
            "volumes": list(start.volumes), "healthcheck": start.healthcheck,
        }
        history = list(start.history) or await _off_loop(self._history_of, start, spec.base)
        dirs = start.host_dirs
        context = spec.context or Path.cwd()
        for index, step in enumerate(spec.steps, start=1):
            description = step.describe()
            source = None
            if step.kind == "copy_from":
                source, key = await self._copy_source(step.arg("source"), context, description, report, net, clones)
                inputs: dict[str, object] = {**dict(step.args), "source": key}
            elif step.kind == "repo":
                inputs = await _repo_inputs(step, context, clones() if clones else None)  # asks the remote
            else:
                inputs = await _off_loop(_step_inputs, step, context)  # hashes trees
            if step.kind == "run":
                # What a step saw on the host's network (its loopback services) never serves an isolated
                # build, nor what an operator's step saw on the LAN a confined one (a tenant's), nor does
                # a layer made before steps had a network of their own.
                inputs["network"] = "host" if net is None else "confined" if net.refused else "isolated"
            digest = _step_digest(digest, step, inputs)
            if step.kind in CONFIG_STEPS:
                if step.kind == "env":
                    env.update(_env_values(step, env))
                else:
                    _configure(step, config)
                history.append((description, "", 0))
                report(StepEvent(index, total, description, "cached" if all_cached else "built"))
                continue
            step = _placed(step, str(config["workdir"]))  # relative paths: to the workdir in force
            if step.kind == "workdir":
                config["workdir"] = step.arg("path")
            if self.store.has_layer(digest):
                report(StepEvent(index, total, description, "cached"))
                layers.append(digest)
                history.append((description, digest, await _off_loop(self.store.layer_size, digest)))
                continue
            report(StepEvent(index, total, description, "running"))
            try:
                await self._make_layer(step, digest, tuple(layers), dirs, env, str(config["workdir"]), context,
                                       inputs, net, str(config["user"]), source, clones)
            except BuildFailed:
                report(StepEvent(index, total, description, "failed"))
                raise
            report(StepEvent(index, total, description, "built"))
            all_cached = False
            layers.append(digest)
            history.append((description, digest, await _off_loop(self.store.layer_size, digest)))
        image = Image(
            id="img-" + digest[:16], base=spec.base, layers=tuple(layers), host_dirs=dirs,
            env=tuple(env.items()), workdir=str(config["workdir"]), services=tuple(config["services"]),
            user=str(config["user"]), entrypoint=tuple(config["entrypoint"]), cmd=tuple(config["cmd"]),
            ports=tuple(config["ports"]), source="build", labels=tuple(sorted(config["labels"].items())),
            volumes=tuple(config["volumes"]), healthcheck=config["healthcheck"], history=tuple(history),
        )
        self.store.save_image(image)
        return image

    def _history_of(self, start: Image, base: str) -> list[tuple[str, str, int]]:
        """The history a build starts from: its base's layer, or an image's layers when it kept none."""
        if not start.id:
            return [(f"BASE {base}", start.layers[0], self.store.layer_size(start.layers[0]))]
        return [(f"FROM {base}", layer, self.store.layer_size(layer)) for layer in start.layers]

    async def _base(self, base: str) -> tuple[Image, str, bool]:
        """The image a spec starts from, the digest its steps chain on, and whether it was already here.

        A fanfold base is its own layer (built on first use); any other base is resolved (pulled,
        or loaded by id) and its steps chain on its image id, so a rebuilt base rebuilds them."""
        if base in BASES:
            cached = self.store.has_layer(base_digest(base))
            digest = await _off_loop(ensure_base, self.store, base, self.mirror)
            dirs = host_dirs() if base == "host" else ()
            return Image(id="", base=base, layers=(digest,), host_dirs=dirs), digest, cached
        if self.resolve_base is not None:  # ids too: an unknown one's error names what may have been meant
            known = self.store.resolve_ref(base)
            start = await self.resolve_base(base)
            cached = base == start.id or (known is not None and known == start.id)
        elif base.startswith("img-"):
            start = self.store.load_image(base)
            cached = True
        else:
            raise InvalidSpec(f"base {base!r} is an image reference, and this builder cannot pull images")
        return start, hashlib.sha256(f"image:{start.id}".encode()).hexdigest(), cached

    async def _copy_source(self, source: EnvSpec | str, context: Path, description: str, report: OnStep,
                           net: stepnet.StepNetwork | None, clones: GitGates | None) -> tuple[Image, str]:
        """The image a copy_from step reads and what its layer's key counts of it: a spec is built
        first (its progress reported under the step's name), anything else resolved as a base is."""
        if isinstance(source, str):
            image, digest, _ = await self._base(source)
            return image, image.id or f"base:{digest}"
        nested = source if source.context is not None else source.with_context(context)
        image = await self._build(nested, lambda event: report(StepEvent(
            event.index, event.total, f"{description} <- {event.description}", event.status)), net, clones)
        return image, image.id

    async def _make_layer(self, step, digest, layers, dirs, env, workdir, context, inputs,
                          net: stepnet.StepNetwork | None, user="", source: Image | None = None,
                          clones: GitGates | None = None) -> None:
        async with self.store.alock(digest):
            if self.store.has_layer(digest):
                return
            scratch = self.store.scratch()
            try:
                owner = await _off_loop(self._owner, step, layers, dirs, scratch)
                if step.kind == "run":
                    tree = await self._run_step(step, layers, dirs, env, workdir, scratch, net, user)
                elif step.kind == "copy_from":
                    assert source is not None
                    tree, copied = await _off_loop(_copy_from, self.store, source, step, scratch)
                elif step.kind == "repo":
                    tree = copied = scratch / "upper"
                    tree.mkdir()
                    await _clone(step, tree, context, inputs, clones() if clones else None)
                else:
                    tree = scratch / "upper"
                    tree.mkdir()
                    await _off_loop(_file_step, step, tree, context)
                    copied = tree / step.arg("dst").lstrip("/") if step.kind == "copy" else tree
                if owner is not None:
                    await _off_loop(_chown_tree, copied, *owner)
                self.store.commit(tree, digest)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

    def _owner(self, step: Step, layers: tuple[str, ...], dirs: tuple[str, ...], scratch: Path) -> tuple[int, int] | None:
        """The uid and gid a copy's ``chown`` names, resolved in the image as built so far (mounted for a
        name); a user without a group gets the gid equal to its uid, as Docker's ``--chown`` does."""
        chown = dict(step.args).get("chown") if step.kind in ("copy", "copy_from") else None
        if not chown:
            return None
        name, _, group = chown.partition(":")
        if name.isdigit() and (not group or group.isdigit()):
            who = users.resolve(scratch, chown)  # numbers: checked for range, no file read
        else:
            root, where = scratch / "owner-root", scratch / "owner"
            where.mkdir()
            mount_rootfs(self.store, layers, dirs, root, where)
            try:
                who = users.resolve(root, chown, where="the image's")
            except InvalidRequest as err:
                raise BuildFailed(f"build step {step.describe()!r}: {err}", step=step.describe(), exit_code=None,
                                  output_tail="") from None
            finally:
                unmount_rootfs(root)
                shutil.rmtree(where, ignore_errors=True)
        return who.uid, who.gid if group else who.uid

    async def _run_step(self, step: Step, layers, dirs, env, workdir, scratch: Path, net: stepnet.StepNetwork | None,
                        user: str = "") -> Path:
        if self.runtime is None:
            raise BuildFailed(
                f"build step {step.describe()!r} needs a runtime to run it, and this engine's backend has none:"
                " build the image with the oci backend (its layers are then shared through the state dir)",
                step=step.describe(), exit_code=None, output_tail="",
            )
        netns = None if net is None else await net.netns()  # None: the host's network
        resolvers = "/etc/resolv.conf" if net is None else net.resolvers
        rootfs = scratch / "rootfs"
        extra = trust.load(self.extra_ca_file, self.store.layers_dir.parent)
        await _off_loop(lambda: mount_trusted(self.store, layers, dirs, rootfs, scratch, extra))
        build_id = f"build-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the pid tells reconcile whose it is
        try:
            who = _step_user(step, rootfs, user)
            ident = {} if who is None else who.env()  # the USER's HOME, USER, LOGNAME unless ENV set them
            build_args = dict(step.args).get("build_args", ())
            trusted = {} if extra is None else trust.trust_env()
            variables = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", **trusted, **dict(build_args),
                         **ident, **env}
            spec = ContainerSpec(
                id=build_id, rootfs=rootfs, args=["/bin/sh", "-c", step.arg("cmd")],
                env=[f"{k}={v}" for k, v in variables.items()], cwd=workdir, hostname="fanfold-build",
                host_network=net is None, netns=netns, binds=[Bind(resolvers, "/etc/resolv.conf")],
                user=ProcessUser() if who is None else ProcessUser(who.uid, who.gid, who.groups),
                seccomp_bpf=seccomp.bpf("default"),  # a step runs a tenant's commands as root, as a sandbox does
            )
            done = await self.runtime.run(spec, self.scratch_run / build_id, timeout=STEP_TIMEOUT_S)
        finally:
            unmount_rootfs(rootfs)
            shutil.rmtree(self.scratch_run / build_id, ignore_errors=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            raise BuildFailed(
                f"build step {step.describe()!r} failed with exit code {done.returncode}; output tail:\n{tail}",
                step=step.describe(), exit_code=done.returncode, output_tail=tail,
            )
        return fold_host_uppers(scratch, dirs)


def _step_user(step: Step, rootfs: Path, user: str) -> users.User | None:
    """The USER a run step runs as, resolved in the image as built so far; None for root."""
    if not user:
        return None
    try:
        return users.resolve(rootfs, user, where="the image's")
    except InvalidRequest as err:
        raise BuildFailed(f"build step {step.describe()!r} runs as user {user!r}: {err}",
                          step=step.describe(), exit_code=None, output_tail="") from None


def _configure(step: Step, config: dict[str, Any]) -> None:
    """Apply a step of config alone (not env) to ``config``."""
    if step.kind == "service":
        config["services"].append((step.arg("name"), step.arg("cmd"), step.arg("mode")))
    elif step.kind == "user":
        config["user"] = step.arg("user")
    elif step.kind == "entrypoint":  # as in Docker, a new entrypoint drops the inherited cmd
        config["entrypoint"], config["cmd"] = step.arg("argv"), ()
    elif step.kind == "cmd":
        config["cmd"] = step.arg("argv")
    elif step.kind == "expose":
        config["ports"].extend(p for p in step.arg("ports") if p not in config["ports"])
    elif step.kind == "label":
        config["labels"].update(step.arg("labels"))
    elif step.kind == "volume":
        config["volumes"].extend(p for p in step.arg("paths") if p not in config["volumes"])
    else:
        args = dict(step.args)
        config["healthcheck"] = None if args["test"] == ("NONE",) else Healthcheck(**args)


def _env_values(step: Step, env: dict[str, str]) -> dict[str, str]:
    """An env step's values; an ``expand_env`` one's expanded against the environment before it."""
    values = dict(step.arg("vars"))
    if not dict(step.args).get("expand"):
        return values
    seen = {"PATH": DEFAULT_PATH, **env}  # what a step or exec sees where the image sets no PATH
    try:
        return {name: words.expand(value, seen) for name, value in values.items()}
    except ValueError as err:
        raise BuildFailed(f"build step {step.describe()!r}: {err}", step=step.describe(), exit_code=None,
                          output_tail="") from None


def _placed(step: Step, workdir: str) -> Step:
    """``step`` with a relative workdir path or destination made absolute against ``workdir``."""
    name = {"workdir": "path", "copy": "dst", "copy_from": "dst"}.get(step.kind)
    if name is None or step.arg(name).startswith("/"):
        return step
    path = posixpath.normpath(posixpath.join(workdir, step.arg(name)))
    if step.kind == "copy_from" and step.arg(name).endswith("/"):
        path = path.rstrip("/") + "/"
    return Step(step.kind, tuple((k, path if k == name else v) for k, v in step.args))


def _copy_from(store: LayerStore, source: Image, step: Step, scratch: Path) -> tuple[Path, Path]:
    """A layer tree holding ``src`` copied out of ``source``'s layers, mounted at a scratch dir and
    unmounted again, and where in it the copy went; ``src`` is resolved inside that root, so no link
    in it leads out."""
    root, rw, tree = scratch / "source", scratch / "source-rw", scratch / "upper"
    rw.mkdir()
    tree.mkdir()
    src, dst = step.arg("src"), step.arg("dst")
    mount_rootfs(store, source.layers, source.host_dirs, root, rw)
    try:
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with safefs.opened(fd, src, os.O_PATH) as found:
                real = Path(os.readlink(f"/proc/self/fd/{found}"))
        except FanfoldError as err:
            raise BuildFailed(f"build step {step.describe()!r}: in the source image, {err}", step=step.describe(),
                              exit_code=None, output_tail="") from None
        finally:
            os.close(fd)
        if not real.is_relative_to(root):
            raise BuildFailed(f"build step {step.describe()!r}: {src} resolves outside the source image",
                              step=step.describe(), exit_code=None, output_tail="")
        target = tree / dst.strip("/")
        if real.is_dir() and not real.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
            _copy(f"{real}/.", target)  # the directory's contents, as Docker copies a directory
        else:
            if dst.endswith("/"):
                target = target / PurePosixPath(src).name
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy(str(real), target)
    finally:
        unmount_rootfs(root)
    return tree, target


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    """Own ``top`` and everything under it (links themselves, never followed)."""
    os.lchown(top, uid, gid)
    if top.is_dir() and not top.is_symlink():
        for folder, names, files in os.walk(top):
            for name in names + files:
                os.lchown(os.path.join(folder, name), uid, gid)


def _copy(source: str, target: Path) -> None:
    try:
        copy_tree(source, target)
    except OSError as err:
        raise BuildFailed(str(err), step="COPY --from", exit_code=None, output_tail=str(err)[-2000:]) from None


def _step_inputs(step: Step, context: Path) -> dict[str, object]:
    """What a step's layer depends on. A local source counts by its content, not its path,
    so the same files sent to a server (which unpacks them elsewhere) reuse the layers
    built in-process. A repo step's are ``_repo_inputs``."""
    args = dict(step.args)
    if step.kind == "copy":
        args["src"] = _tree_hash(source_path(step.arg("src"), context))
    return args


async def _repo_inputs(step: Step, context: Path, gate: git.Gate | None) -> dict[str, object]:
    """A repo step's ``_step_inputs``: its ref resolved here, once (the clone checks out this commit);
    a local repository counts by that commit, not its path."""
    commit = await git.resolve_commit(_repo_source(step.arg("src"), context), step.arg("ref"), gate)
    return {**dict(step.args), "commit": commit, **({} if is_repo_url(step.arg("src")) else {"src": "local"})}


def _step_digest(parent: str, step: Step, inputs: dict[str, object]) -> str:
    payload = parent + json.dumps({"kind": step.kind, "args": sorted([k, v] for k, v in inputs.items())},
                                  sort_keys=True, default=list)
    return hashlib.sha256(payload.encode()).hexdigest()


def source_path(src: str, context: Path) -> Path:
    path = (context / src) if not os.path.isabs(src) else Path(src)
    if not path.exists():
        raise InvalidSpec(f"copy source {src!r} does not exist (resolved to {path})")
    return path


def _repo_source(src: str, context: Path) -> str:
    if is_repo_url(src):
        return src
    return str(source_path(src, context))


def _tree_hash(path: Path) -> str:
    digest = hashlib.sha256()
    items = [path] if not path.is_dir() else [path, *sorted(path.rglob("*"))]
    for item in items:
        rel = str(item.relative_to(path)) if item != path else "."
        info = item.lstat()
        digest.update(f"{rel}\0{info.st_mode}\0".encode())
        if item.is_symlink():
            digest.update(os.readlink(item).encode())
        elif item.is_file():
            with open(item, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def _file_step(step: Step, tree: Path, context: Path) -> None:
    if step.kind == "workdir":
        (tree / step.arg("path").lstrip("/")).mkdir(parents=True, exist_ok=True)
    elif step.kind == "copy":
        src, dst = source_path(step.arg("src"), context), tree / step.arg("dst").lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)


async def _clone(step: Step, tree: Path, context: Path, inputs: dict[str, object], gate: git.Gate | None) -> None:
    dst = tree / step.arg("dst").lstrip("/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    await git.clone(_repo_source(step.arg("src"), context), str(dst), str(inputs["commit"]), step=step.describe(),
                    gate=gate)


async def _off_loop(fn, *args):
    return await asyncio.to_thread(fn, *args)
