"""Dockerfiles as EnvSpecs: buildkit's own parser (the ``dockerfile`` package) reads the file, and each
instruction maps onto EnvSpec steps, so a Dockerfile builds into the same cached layers as a spec.

Mapped: FROM (fanfold's bases, an image reference, a local image id, or an earlier ``AS`` stage),
RUN, COPY and ADD of local files (``--chown`` too), ``COPY --from`` a stage or an image, WORKDIR, ENV,
ARG, USER, ENTRYPOINT, CMD, EXPOSE, LABEL; VOLUME and HEALTHCHECK are recorded in the image's config
(a volume is a directory of the sandbox's own disk, and fanfold runs no health probe). Anything else
is an InvalidSpec naming the file, the line and what to do.

On an image base the image's config is not known when the file is read: an ENV value naming a
variable the image may set becomes an ``expand_env`` step, and a relative WORKDIR or COPY destination
stays relative, both resolved by the builder against the image, as Docker does at build time.
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import dockerfile

from ..errors import InvalidSpec
from ..refs import BASES, DEFAULT_PATH, is_image_id, is_image_ref  # DEFAULT_PATH: what `ENV PATH=/x:$PATH` extends
from . import words

EnvSpec = Any
"""An ``fanfold.spec.EnvSpec``, whose class the caller hands in: the spec module imports this one."""


_UNSUPPORTED = {
    "ONBUILD": "build triggers are not supported; put the instructions in the Dockerfile that uses the image",
    "SHELL": "RUN always uses /bin/sh -c; write `RUN bash -c '...'` or use the exec form",
    "STOPSIGNAL": "sandboxes are stopped by fanfold; drop it",
    "MAINTAINER": "it is deprecated; use LABEL or drop it",
}
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def from_dockerfile(path: str | Path, spec_type: type, *, context: str | Path | None = None,
                    build_args: Mapping[str, str] | None = None, target: str | None = None) -> EnvSpec:
    """The EnvSpec a Dockerfile describes: its last stage, or the stage named ``target``.

    ``context`` (default: the Dockerfile's directory) is where COPY and ADD sources are found;
    ``build_args`` override ARG defaults as ``docker build --build-arg`` does."""
    path = Path(path)
    try:
        commands = dockerfile.parse_file(str(path))
    except dockerfile.GoIOError as err:
        raise InvalidSpec(f"cannot read Dockerfile {path}: {err}") from None
    except dockerfile.GoParseError as err:
        raise InvalidSpec(f"{path}: {err}") from None
    root = Path(context if context is not None else path.parent).absolute()
    if not root.is_dir():
        raise InvalidSpec(f"build context {root} is not a directory")
    return _Translator(str(path), root, dict(build_args or {}), spec_type).translate(commands, target)


@dataclass
class _Stage:
    spec: EnvSpec
    env: dict[str, str | None]
    """ENV values known at parse time (None: known only at build time); a base image's own are not,
    which ``known`` says."""
    known: bool
    workdir: str | None
    """None while it is the base image's; relative to that until an absolute WORKDIR."""
    args: dict[str, str | None] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    """Paths this Dockerfile made directories (WORKDIR, COPY of a directory)."""
    cmd: tuple[str, ...] | None = None
    """The stage's own CMD, which a later ENTRYPOINT keeps (an inherited one it drops)."""

    def variables(self) -> dict[str, str]:
        merged = {**{k: v for k, v in self.args.items() if v is not None}, **self.env}
        return {k: v for k, v in merged.items() if v is not None}


class _Translator:
    def __init__(self, name: str, context: Path, build_args: dict[str, str], spec_type: type) -> None:
        self.name, self.context, self.build_args, self.spec_type = name, context, build_args, spec_type
        self.globals: dict[str, str | None] = {}
        self.stages: dict[str, _Stage] = {}
        self.order: list[_Stage] = []
        self.line = 0
        self.instruction = ""

    def fail(self, message: str) -> InvalidSpec:
        return InvalidSpec(f"{self.name}:{self.line}: {self.instruction}: {message}")

    def translate(self, commands: tuple, target: str | None) -> EnvSpec:
        stage: _Stage | None = None
        names: list[str] = []
        for command in commands:
            self.line, self.instruction = command.start_line, command.cmd.upper()
            if self.instruction == "FROM":
                if stage is not None and target is not None and names[-1] == target.lower():
                    break
                stage, stage_name = self._from(command)
                names.append(stage_name)
                self.stages[stage_name] = stage
                self.order.append(stage)
            elif self.instruction == "ARG" and stage is None:
                self._arg(command, self.globals, {}, {k: v for k, v in self.globals.items() if v is not None})
            elif stage is None:
                raise self.fail("a Dockerfile starts with FROM (only ARG may come before it)")
            else:
                self._instruction(command, stage)
        if stage is None:
            raise InvalidSpec(f"{self.name}: no FROM instruction: a Dockerfile starts with FROM")
        if target is not None and target.lower() not in self.stages:
            raise InvalidSpec(f"{self.name}: no stage named {target!r}: stages are {', '.join(names)}")
        return (self.stages[target.lower()] if target is not None else stage).spec.with_context(self.context)

    def _from(self, command) -> tuple[_Stage, str]:
        if command.flags:
            raise self.fail(f"{' '.join(command.flags)} is not supported: fanfold builds for this host's platform")
        words = command.value
        if len(words) not in (1, 3) or (len(words) == 3 and words[1].lower() != "as"):
            raise self.fail("write `FROM image` or `FROM image AS name`")
        base = self.expand(words[0], {k: v for k, v in self.globals.items() if v is not None}, known=True)
        name = words[2].lower() if len(words) == 3 else str(len(self.stages))
        if base.lower() in self.stages:
            parent = self.stages[base.lower()]
            return _Stage(parent.spec, dict(parent.env), parent.known, parent.workdir, dirs=set(parent.dirs)), name
        if base == "scratch":
            raise self.fail("FROM scratch is not supported: start from host, debian:bookworm or an image")
        if base in BASES:
            return _Stage(self.spec_type(base), {"PATH": DEFAULT_PATH}, True, "/", dirs={"/"}), name
        if is_image_id(base) or is_image_ref(base):
            return _Stage(self.spec_type(base), {}, False, None, dirs={"."}), name
        raise self.fail(f"{base!r} is neither a stage of this file, one of {', '.join(BASES)}, an image reference"
                        " nor a local image id (img-...)")

    def _instruction(self, command, stage: _Stage) -> None:
        kind = self.instruction
        if kind in _UNSUPPORTED:
            raise self.fail(f"not supported: {_UNSUPPORTED[kind]}")
        if command.heredocs:
            raise self.fail("heredocs are not supported: put the script in a file and COPY it, or use one RUN line")
        if kind == "ARG":
            return self._arg(command, stage.args, self.globals, stage.variables())
        handler = getattr(self, f"_{kind.lower()}_step", None)
        if handler is None:
            raise self.fail("unknown or unsupported instruction: fanfold maps FROM, RUN, COPY, ADD, WORKDIR, ENV,"
                            " ARG, USER, ENTRYPOINT, CMD, EXPOSE, LABEL, VOLUME and HEALTHCHECK")
        if kind not in ("COPY", "ADD", "HEALTHCHECK") and command.flags:
            raise self.fail(f"{' '.join(command.flags)} is not supported: remove it")
        handler(command, stage)

    # -- variables ---------------------------------------------------------------------------------

    def _arg(self, command, scope: dict[str, str | None], inherited: dict[str, str | None],
             variables: dict[str, str]) -> None:
        """Declare build args in ``scope``: a ``--build-arg`` wins over the default, and a stage's ARG
        without a default takes the value of the global ARG of that name."""
        for word in command.value:
            name, has_default, default = word.partition("=")
            if not _ARG_NAME.match(name):
                raise self.fail(f"bad ARG name {name!r}: letters, digits and '_'")
            if name in self.build_args:
                scope[name] = self.build_args[name]
            elif has_default:
                scope[name] = self.expand(default, variables, known=True)
            else:
                scope[name] = inherited.get(name)
            if scope[name] is not None:
                variables[name] = scope[name]  # type: ignore[assignment]

    def word(self, text: str, stage: _Stage) -> str:
        return self.expand(text, stage.variables(), known=stage.known)

    def expand(self, text: str, variables: Mapping[str, str], *, known: bool) -> str:
        """A word as Docker's shell lexer reads it: quotes removed, ``$VAR``, ``${VAR}``, ``${VAR:-x}``,
        ``${VAR:+x}`` (and the forms without ``:``) replaced."""
        try:
            return words.expand(text, variables) if known else words.expand_known(text, variables)
        except words.UnknownVariable as err:
            raise self.fail(f"${{{err.args[0]}}} may be set by the base image, whose environment is known only at"
                            " build time: fanfold expands such variables in ENV values only; here use one this"
                            " Dockerfile sets with ENV or ARG") from None
        except ValueError as err:
            raise self.fail(str(err)) from None

    def template(self, text: str, stage: _Stage) -> tuple[str, bool]:
        try:
            return words.template(text, stage.variables())
        except ValueError as err:
            raise self.fail(str(err)) from None

    # -- instructions ------------------------------------------------------------------------------

    def _run_step(self, command, stage: _Stage) -> None:
        script = shlex.join(command.value) if command.json else command.value[0]
        # Docker gives RUN the build args as environment variables, not kept in the image.
        exports = {k: v for k, v in stage.args.items() if v is not None and k not in stage.env}
        stage.spec = self._spec(lambda: stage.spec.run(script, build_args=exports))

    def _env_step(self, command, stage: _Stage) -> None:
        values = command.value  # every value of one line sees the variables from before that line
        if stage.known:
            variables = {name: self.word(raw, stage) for name, raw in zip(values[0::2], values[1::2])}
            stage.env.update(variables)
            stage.spec = self._spec(lambda: stage.spec.env(**variables))
            return
        # One step for the line, expanded at build time, when any value names a variable the image may set.
        templates = {name: self.template(raw, stage) for name, raw in zip(values[0::2], values[1::2])}
        if not any(kept for _, kept in templates.values()):
            plain = {name: words.expand(text, {}) for name, (text, _) in templates.items()}
            stage.env.update(plain)
            stage.spec = self._spec(lambda: stage.spec.env(**plain))
            return
        stage.env.update({name: None if kept else words.expand(text, {}) for name, (text, kept) in templates.items()})
        stage.spec = self._spec(lambda: stage.spec.expand_env(**{name: text for name, (text, _) in templates.items()}))

    def _label_step(self, command, stage: _Stage) -> None:
        values = [self.word(word, stage) for word in command.value]
        labels = dict(zip(values[0::2], values[1::2]))
        stage.spec = self._spec(lambda: stage.spec.label(**labels))

    def _volume_step(self, command, stage: _Stage) -> None:
        paths = [self.word(word, stage) for word in command.value]
        relative = [path for path in paths if not path.startswith("/")]
        if relative or not paths:
            raise self.fail(f"give absolute paths ({', '.join(relative) or 'none given'})")
        stage.spec = self._spec(lambda: stage.spec.volume(*paths))

    def _healthcheck_step(self, command, stage: _Stage) -> None:
        times = {"--interval": "interval_s", "--timeout": "timeout_s", "--start-period": "start_period_s"}
        options: dict[str, Any] = {}
        for flag in command.flags:
            option, _, value = flag.partition("=")
            value = self.word(value, stage)
            if option in times:
                options[times[option]] = self._seconds(value, option)
            elif option == "--retries" and value.isdigit():
                options["retries"] = int(value)
            elif option != "--start-interval":  # how often to probe while starting: no probe runs here
                raise self.fail(f"{flag} is not supported: HEALTHCHECK takes --interval, --timeout, --start-period,"
                                " --start-interval and --retries (a whole number)")
        kind, *rest = command.value or ("",)
        if kind.upper() == "NONE" and not rest:
            cmd: str | list[str] | None = None
        elif kind.upper() == "CMD" and rest:
            cmd = list(rest) if command.json else rest[0]
        else:
            raise self.fail("write `HEALTHCHECK [OPTIONS] CMD command` or `HEALTHCHECK NONE`")
        stage.spec = self._spec(lambda: stage.spec.healthcheck(cmd, **options))

    def _seconds(self, text: str, option: str) -> float:
        """A Go duration (``30s``, ``1m30s``, ``500ms``) in seconds."""
        parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)", text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise self.fail(f"{option}={text} is not a duration: write e.g. 30s, 1m30s or 500ms")
        scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
        return sum(float(number) * scale[unit] for number, unit in parts)

    def _workdir_step(self, command, stage: _Stage) -> None:
        stage.workdir, path = self._place(self.word(command.value[0], stage), stage, "WORKDIR")
        stage.dirs.add(stage.workdir)
        stage.spec = self._spec(lambda: stage.spec.workdir(path))

    def _user_step(self, command, stage: _Stage) -> None:
        user = self.word(command.value[0], stage)
        stage.spec = self._spec(lambda: stage.spec.user(user))

    def _expose_step(self, command, stage: _Stage) -> None:
        ports = [self.word(word, stage) for word in command.value]
        stage.spec = self._spec(lambda: stage.spec.expose(*ports))

    def _entrypoint_step(self, command, stage: _Stage) -> None:
        stage.spec = self._spec(lambda: stage.spec.entrypoint(*self._argv(command)))
        if stage.cmd is not None:  # the builder's entrypoint step drops the cmd, as Docker does an inherited one
            stage.spec = stage.spec.cmd(*stage.cmd)

    def _cmd_step(self, command, stage: _Stage) -> None:
        stage.cmd = self._argv(command)
        stage.spec = self._spec(lambda: stage.spec.cmd(*stage.cmd))

    def _argv(self, command) -> tuple[str, ...]:
        if command.json:
            return tuple(command.value)
        return ("/bin/sh", "-c", command.value[0]) if command.value and command.value[0] else ()

    def _copy_step(self, command, stage: _Stage) -> None:
        self._sources(command, stage, add=False)

    def _add_step(self, command, stage: _Stage) -> None:
        self._sources(command, stage, add=True)

    def _sources(self, command, stage: _Stage, *, add: bool) -> None:
        source, chown = None, None
        for flag in command.flags:
            option, _, value = flag.partition("=")
            if option == "--from" and not add:
                source = self._copy_source(self.word(value, stage), stage)
                continue
            if option == "--chown":
                chown = self.word(value, stage)
                continue
            if option == "--chmod":
                raise self.fail(f"{flag} is not supported: copy, then `RUN chmod` the copied paths")
            if option != "--link":
                raise self.fail(f"{flag} is not supported: remove it")
        words = [self.word(word, stage) for word in command.value]
        if len(words) < 2:
            raise self.fail("give one or more sources and a destination")
        *sources, dest = words
        directory = dest.endswith("/") or dest in (".", "./") or dest.endswith("/.")
        key, target = self._place(dest, stage, self.instruction + " destination")
        if source is not None:
            return self._copy_from(source, sources, dest, target, directory or key in stage.dirs, stage, chown)
        matched = [path for source in sources for path in self._matches(source, add)]
        if len(matched) > 1 and not directory and key not in stage.dirs:
            raise self.fail(f"with several sources the destination must be a directory: write {dest.rstrip('/')}/")
        for path in matched:
            into_dir = directory or key in stage.dirs or len(matched) > 1
            if path.is_dir():
                stage.dirs.add(key)
                dst = target
            else:
                dst = posixpath.join(target, path.name) if into_dir else target
            src = path.relative_to(self.context).as_posix()
            stage.spec = self._spec(lambda: stage.spec.copy(src, dst, chown=chown))

    def _copy_source(self, name: str, stage: _Stage) -> EnvSpec | str:
        """What ``--from=name`` names: an earlier stage (by name or index), else an image."""
        found = self.stages.get(name.lower())
        if found is None and name.isdigit():
            if int(name) >= len(self.order):
                raise self.fail(f"--from={name}: this file has no stage {name} before this line")
            found = self.order[int(name)]
        if found is stage:
            raise self.fail(f"--from={name} names the stage it is in: copy from an earlier stage")
        if found is not None:
            return found.spec
        if name in BASES or is_image_id(name) or is_image_ref(name):
            return name
        raise self.fail(f"--from={name} is neither an earlier stage of this file, one of {', '.join(BASES)}, an image"
                        " reference nor a local image id (img-...)")

    def _copy_from(self, source: EnvSpec | str, sources: list[str], dest: str, target: str, into_dir: bool,
                   stage: _Stage, chown: str | None = None) -> None:
        """Paths in another stage or image: whether each is a file or a directory is known only when
        built, so the builder places it (a directory's contents into ``dst``, a file at it or, when
        ``dst`` ends with '/', into it)."""
        if len(sources) > 1 and not into_dir:
            raise self.fail(f"with several sources the destination must be a directory: write {dest.rstrip('/')}/")
        dst = target if not (into_dir or len(sources) > 1) or target.endswith("/") else target + "/"
        for src in sources:
            if glob.has_magic(src):
                raise self.fail(f"wildcards in COPY --from sources ({src}) are not supported: name each file or"
                                " directory")
            path = posixpath.normpath("/" + src.lstrip("/"))  # relative sources: to the other image's root
            if ".." in PurePosixPath(path).parts:
                raise self.fail(f"source {src!r} may not contain '..'")
            stage.spec = self._spec(lambda: stage.spec.copy_from(source, path, dst, chown=chown))

    def _matches(self, source: str, add: bool) -> list[Path]:
        if add and re.match(r"^[a-z][a-z0-9+.-]*://|^git@", source, re.I):
            raise self.fail(f"ADD of a URL ({source}) is not supported: download it in a RUN step (curl, git clone)"
                            " or fetch it into the context and COPY it")
        relative = source.lstrip("/") or "."  # absolute sources are relative to the context, as in Docker
        if ".." in PurePosixPath(relative).parts:
            raise self.fail(f"source {source!r} leaves the build context {self.context}")
        if glob.has_magic(relative):
            found = sorted(Path(p) for p in glob.glob(str(self.context / relative), include_hidden=True))
        else:
            found = [self.context / relative] if os.path.lexists(self.context / relative) else []
        if not found:
            raise self.fail(f"source {source!r} not found in the build context {self.context}")
        ignore = self.context / ".dockerignore"
        if ignore.exists() and (glob.has_magic(relative) or any(path.is_dir() for path in found)):
            # Ignore files often keep secrets (.env) out of images: copying what they exclude is no small difference.
            raise self.fail(f"{ignore} exists, and fanfold does not apply it, so copying {source!r} would take the files"
                            " it excludes: copy the files you need by name, or remove the .dockerignore")
        for path in found:
            if not path.resolve().is_relative_to(self.context.resolve()):
                raise self.fail(f"source {source!r} leaves the build context {self.context} (through a link)")
            if add and path.is_file() and tarfile.is_tarfile(path):
                raise self.fail(f"{source} is a tar archive, which ADD would unpack: unpacking is not supported;"
                                " COPY it and `RUN tar -xf` it, or unpack it into the context and COPY the directory")
        return found

    def _place(self, path: str, stage: _Stage, what: str) -> tuple[str, str]:
        """Where ``path`` is: its key in ``stage.dirs`` (relative: to the base image's workdir) and the
        path a step takes (relative: to the workdir in force when it is built)."""
        if ".." in PurePosixPath(path).parts:
            raise self.fail(f"{what} {path!r} contains '..': give a path without it")
        if path.startswith("/"):
            return str(PurePosixPath(path)), str(PurePosixPath(path))
        if stage.workdir is not None and stage.workdir.startswith("/"):
            joined = str(PurePosixPath(stage.workdir) / path)
            return joined, joined
        return posixpath.normpath(posixpath.join(stage.workdir or ".", path)), posixpath.normpath(path)

    def _spec(self, make) -> EnvSpec:
        try:
            return make()
        except InvalidSpec as err:
            raise self.fail(str(err)) from None
