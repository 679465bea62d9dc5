"""Dockerfiles read by buildkit's parser into EnvSpecs, and built for real on the ``host`` base."""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
from pathlib import Path

import pytest

from fanfold import BuildFailed, EngineConfig, EnvSpec, Fleet, InvalidSpec
from fanfold.images.builder import StepEvent
from fanfold.images.builder import DEFAULT_PATH
from fanfold.wire import spec_from_json, spec_to_json

from conftest import fleet_args, run_cli
from registry import push_tree, runnable_tree


def dockerfile(where: Path, text: str, name: str = "Dockerfile") -> Path:
    path = where / name
    path.write_text(text)
    return path


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("print('main')\n")
    (tmp_path / "app" / ".hidden").write_text("h\n")
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "b.txt").write_text("b\n")
    return tmp_path


def test_each_supported_instruction_maps_onto_its_step(context):
    path = dockerfile(context, """\
FROM host AS base
ENV A=1 B="two words" C='$literal'
ENV LEGACY value with spaces
WORKDIR /srv
WORKDIR app
COPY app .
COPY a.txt /etc/
COPY ["b.txt", "renamed.txt"]
COPY *.txt ./texts/
ADD a.txt /opt/a
USER 1000:1000
EXPOSE 8000 53/udp
LABEL org.example.team=rl "a b"=c
VOLUME /data
VOLUME ["/logs"]
HEALTHCHECK --interval=1m30s --timeout=500ms --retries=2 CMD curl -f http://localhost/ || exit 1
COPY --chown=1000 a.txt /home/
RUN echo one && \\
    echo two
RUN ["python3", "-c", "print('a b')"]
CMD python3 -m http.server
ENTRYPOINT ["tini", "--"]
""")
    spec = EnvSpec.from_dockerfile(path)
    expected = (
        EnvSpec("host").env(A="1", B="two words", C="$literal").env(LEGACY="value with spaces")
        .workdir("/srv").workdir("/srv/app").copy("app", "/srv/app").copy("a.txt", "/etc/a.txt")
        .copy("b.txt", "/srv/app/renamed.txt").copy("a.txt", "/srv/app/texts/a.txt").copy("b.txt", "/srv/app/texts/b.txt")
        .copy("a.txt", "/opt/a").user("1000:1000").expose(8000, "53/udp")
        .label(**{"org.example.team": "rl", "a b": "c"}).volume("/data").volume("/logs")
        .healthcheck("curl -f http://localhost/ || exit 1", interval_s=90, timeout_s=0.5, retries=2)
        .copy("a.txt", "/home/a.txt", chown="1000")
        .run("echo one &&     echo two").run("python3 -c 'print('\"'\"'a b'\"'\"')'")
        .cmd("/bin/sh", "-c", "python3 -m http.server").entrypoint("tini", "--")
        .cmd("/bin/sh", "-c", "python3 -m http.server")  # Docker keeps a CMD of the same stage after ENTRYPOINT
    )
    assert spec.base == "host" and spec.context == context
    assert spec.steps == expected.steps


def test_args_and_env_substitute_where_docker_does(context):
    path = dockerfile(context, """\
ARG BASE=host
ARG GLOBAL=g
FROM ${BASE}
ARG GLOBAL
ARG VERSION=1.0
ARG EMPTY=
ARG SHADOWED=arg
ENV SHADOWED=env DIR=/opt/v$VERSION
ENV SAME=$DIR NEXT=${DIR}/x
ENV DEFAULTED=${MISSING:-fallback} ALT=${VERSION:+set} NOALT=${EMPTY:+set} DASH=${EMPTY-unset} ESCAPED=\\$VERSION
ENV PATH=/opt/bin:$PATH
WORKDIR $DIR
COPY ${FILE:-a.txt} ./
RUN echo "$VERSION $GLOBAL"
""")
    spec = EnvSpec.from_dockerfile(path, build_args={"VERSION": "2.5", "UNUSED": "x"})
    env = {}
    for step in spec.steps:
        if step.kind == "env":
            env.update(dict(step.arg("vars")))
    assert env["DIR"] == "/opt/v2.5" and env["SHADOWED"] == "env"
    assert env["NEXT"] == "/opt/v2.5/x" and env["SAME"] == "/opt/v2.5"
    assert (env["DEFAULTED"], env["ALT"], env["NOALT"], env["DASH"], env["ESCAPED"]) == ("fallback", "set", "", "", "$VERSION")
    assert env["PATH"] == "/opt/bin:" + DEFAULT_PATH
    workdir, copy, run = spec.steps[-3:]
    assert workdir.arg("path") == "/opt/v2.5" and copy.arg("dst") == "/opt/v2.5/a.txt"
    # RUN is not substituted (its shell does it) but sees the build args, not kept in the image.
    assert run.arg("cmd") == 'echo "$VERSION $GLOBAL"' and run.describe() == 'RUN echo "$VERSION $GLOBAL"'
    assert dict(run.arg("build_args")) == {"EMPTY": "", "GLOBAL": "g", "VERSION": "2.5"}


def test_stages_chain_and_target_picks_one(context):
    path = dockerfile(context, """\
FROM host AS base
ENV STAGE=base
WORKDIR /w
FROM base AS test
RUN echo test
FROM base
COPY a.txt .
""")
    last = EnvSpec.from_dockerfile(path)
    base = EnvSpec("host").env(STAGE="base").workdir("/w")
    assert last.steps == base.copy("a.txt", "/w/a.txt").steps
    assert EnvSpec.from_dockerfile(path, target="test").steps == base.run("echo test").steps
    with pytest.raises(InvalidSpec, match="no stage named 'nope': stages are base, test, 2"):
        EnvSpec.from_dockerfile(path, target="nope")


def test_an_image_base_leaves_what_only_the_image_knows_to_the_builder(context):
    image = "img-0123456789abcdef"
    spec = EnvSpec.from_dockerfile(dockerfile(context, f"""\
FROM {image}
ARG V=1
ENV PATH=/opt/x/bin:$PATH A=$V B="${{HOME:-none}} \\$lit" C=${{PYTHONPATH:+:$PYTHONPATH}}
ENV D=$A E=$PATH F=plain
WORKDIR app
COPY a.txt .
COPY a.txt b.txt sub/
WORKDIR /abs
COPY a.txt .
"""))
    assert spec.base == image
    assert spec.steps == (
        # One step per line: each value sees the variables from before its line, the image's at build time.
        EnvSpec(image).expand_env(PATH="/opt/x/bin:${PATH}", A="1", B="${HOME:-none} \\$lit",
                                  C="${PYTHONPATH:+:${PYTHONPATH}}")
        .expand_env(D="1", E="${PATH}", F="plain")
        .workdir("app").copy("a.txt", "a.txt").copy("a.txt", "sub/a.txt").copy("b.txt", "sub/b.txt")
        .workdir("/abs").copy("a.txt", "/abs/a.txt")
    ).steps
    # A line that names none of the image's variables stays a plain env step.
    assert EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nENV X='$lit' Y=y\n")).steps == \
        EnvSpec(image).env(X="$lit", Y="y").steps
    with pytest.raises(InvalidSpec, match=r"Dockerfile:2: WORKDIR: \$\{HOME\} may be set by the base image"):
        EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nWORKDIR $HOME/x\n"))
    with pytest.raises(InvalidSpec, match="Dockerfile:2: WORKDIR: WORKDIR '../x' contains '..'"):
        EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nWORKDIR ../x\n"))


def test_copy_from_names_an_earlier_stage_or_an_image(context):
    path = dockerfile(context, """\
FROM host AS build
RUN echo x > /out
FROM img-0123456789abcdef
COPY --from=build /out out/
COPY --from=0 out /opt/x
COPY --from=debian:bookworm /etc/os-release /etc/motd /info/
COPY --from=registry.example.org/tools:1 /bin/tool /usr/local/bin/tool
""")
    build = EnvSpec("host").run("echo x > /out")
    assert EnvSpec.from_dockerfile(path).steps == (
        EnvSpec("img-0123456789abcdef").copy_from(build, "/out", "out/").copy_from(build, "/out", "/opt/x")
        .copy_from("debian:bookworm", "/etc/os-release", "/info/").copy_from("debian:bookworm", "/etc/motd", "/info/")
        .copy_from("registry.example.org/tools:1", "/bin/tool", "/usr/local/bin/tool")
    ).steps
    for line, message in [
        ("COPY --from=1 /a /b", "COPY: --from=1 names the stage it is in"),
        ("COPY --from=7 /a /b", "COPY: --from=7: this file has no stage 7"),
        ("COPY --from=Not/An:Image! /a /b", "COPY: --from=Not/An:Image! is neither an earlier stage"),
        ("COPY --from=build /out/*.txt /b/", "COPY: wildcards in COPY --from sources"),
        ("COPY --from=build /a /b /c", "COPY: with several sources the destination must be a directory"),
        ("ADD --from=build /a /b", "ADD: --from=build is not supported"),
    ]:
        with pytest.raises(InvalidSpec, match=f"Dockerfile:4: {re.escape(message)}"):
            EnvSpec.from_dockerfile(dockerfile(context, f"FROM host AS build\nRUN true\nFROM host\n{line}\n"))


def test_the_spec_round_trips_through_the_wire(context):
    spec = EnvSpec.from_dockerfile(dockerfile(context, (
        "FROM host\nENV A=1\nWORKDIR /app\nCOPY app .\nUSER nobody\nEXPOSE 80\nRUN [\"true\"]\n"
        "ENTRYPOINT [\"a\"]\nCMD [\"b\"]\n"
    )))
    assert spec_from_json(spec_to_json(spec)).steps == spec.steps
    staged = EnvSpec.from_dockerfile(dockerfile(context, (
        "FROM localhost:5000/base:1 AS build\nENV PATH=/x:$PATH\nWORKDIR src\nCOPY a.txt .\n"
        "FROM build AS test\nRUN true\nFROM host\nCOPY --from=test /x /y/\nCOPY --from=img-0123456789abcdef /z .\n"
    )))
    data = json.loads(json.dumps(spec_to_json(staged)))
    assert data["steps"][0]["source"]["steps"][0] == {"kind": "env", "vars": {"PATH": "/x:${PATH}"}, "expand": True}
    again = spec_from_json(data)
    assert again.steps == staged.steps and hash(again.steps) == hash(staged.steps)
    with pytest.raises(InvalidSpec, match="expand must be true or false"):
        spec_from_json({"steps": [{"kind": "env", "vars": {}, "expand": "yes"}]})
    with pytest.raises(InvalidSpec, match="environment variable P: unterminated"):
        spec_from_json({"steps": [{"kind": "env", "vars": {"P": "${A:-'x}"}, "expand": True}]})


@pytest.mark.parametrize("line, text, message", [
    (2, "HEALTHCHECK --interval=soon CMD true", "HEALTHCHECK: --interval=soon is not a duration"),
    (2, "HEALTHCHECK CMD", "HEALTHCHECK: write `HEALTHCHECK [OPTIONS] CMD command`"),
    (2, "VOLUME data", "VOLUME: give absolute paths (data)"),
    (2, "COPY --chown='bad user' a.txt /y", "COPY: bad user 'bad user'"),
    (2, "ONBUILD RUN true", "ONBUILD: not supported"),
    (2, "SHELL [\"/bin/bash\", \"-c\"]", "SHELL: not supported: RUN always uses /bin/sh -c"),
    (2, "STOPSIGNAL SIGTERM", "STOPSIGNAL: not supported"),
    (2, "MAINTAINER me", "MAINTAINER: not supported: it is deprecated"),
    (2, "FROBNICATE x", "FROBNICATE: unknown or unsupported instruction"),
    (2, "RUN <<EOF\necho hi\nEOF", "RUN: heredocs are not supported"),
    (2, "RUN --mount=type=cache,target=/c true", "RUN: --mount=type=cache,target=/c is not supported"),
    (2, "COPY --chmod=644 a.txt /y", "COPY: --chmod=644 is not supported: copy, then `RUN chmod`"),
    (2, "ADD https://example.org/x.tgz /y", "ADD: ADD of a URL (https://example.org/x.tgz) is not supported"),
    (2, "ADD pack.tar /y", "ADD: pack.tar is a tar archive"),
    (2, "COPY missing.txt /y", "COPY: source 'missing.txt' not found in the build context"),
    (2, "COPY ../outside /y", "COPY: source '../outside' leaves the build context"),
    (2, "COPY a.txt b.txt /dir", "COPY: with several sources the destination must be a directory"),
    (2, "ENV X=${A/b/c}", "ENV: unsupported substitution"),
    (2, "USER bad user", "USER: bad user 'bad user'"),
    (2, "EXPOSE 99999", "EXPOSE: bad port"),
    (1, "FROM scratch", "FROM: FROM scratch is not supported"),
    (1, "FROM --platform=linux/arm64 host", "FROM: --platform=linux/arm64 is not supported"),
    (1, "FROM Not/An:Image!", "FROM: 'Not/An:Image!' is neither a stage"),
    (1, "RUN true", "RUN: a Dockerfile starts with FROM"),
])
def test_unsupported_instructions_name_file_and_line(context, line, text, message):
    with tarfile.open(context / "pack.tar", "w") as tar:
        tar.add(context / "a.txt", arcname="a.txt")
    source = text if line == 1 else f"FROM host\n{text}\n"
    path = dockerfile(context, source)
    with pytest.raises(InvalidSpec) as info:
        EnvSpec.from_dockerfile(path)
    assert str(info.value).startswith(f"{path}:{line}: "), str(info.value)
    assert message in str(info.value)


def test_a_dockerignore_is_not_silently_skipped(context):
    (context / ".dockerignore").write_text(".env\n")
    with pytest.raises(InvalidSpec, match=r"Dockerfile:3: COPY: .*\.dockerignore exists, and fanfold does not apply it"):
        EnvSpec.from_dockerfile(dockerfile(context, "FROM host\nCOPY a.txt /a\nCOPY app /app\n"))


def test_the_example_dockerfile_is_the_quickstart_env():
    examples = Path(__file__).parent.parent / "examples"
    spec = EnvSpec.from_dockerfile(examples / "demo.Dockerfile")
    assert spec.context == examples
    assert spec.steps == (
        EnvSpec("host").env(PYTHONDONTWRITEBYTECODE="1").workdir("/env").copy("demo_project", "/env")
        .run("python3 -m compileall -q /env").cmd("python3", "-m", "unittest", "-q")
    ).steps


def test_a_file_that_is_no_dockerfile_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidSpec, match="cannot read Dockerfile"):
        EnvSpec.from_dockerfile(tmp_path / "nothing")
    with pytest.raises(InvalidSpec, match="no FROM instruction"):
        EnvSpec.from_dockerfile(dockerfile(tmp_path, "ARG A=1\n"))
    with pytest.raises(InvalidSpec, match="file with no instructions"):
        EnvSpec.from_dockerfile(dockerfile(tmp_path, "# nothing\n"))


# -- real builds ----------------------------------------------------------------------------------

BUILD = """\
FROM {base}
ARG MARK
ENV GREETING="hello there" MARK=$MARK
WORKDIR /srv
WORKDIR app
COPY app .
COPY a.txt b.txt ./texts/
RUN echo "built $MARK in $(pwd)" > built.txt
EXPOSE 8000
CMD ["python3", "main.py"]
"""


def _statuses(events: list[StepEvent]) -> list[str]:
    return [e.status for e in events if e.status != "running"]


def test_a_dockerfile_builds_caches_and_runs(fleet, context):
    mark = f"m{time.time_ns()}"
    spec = EnvSpec.from_dockerfile(dockerfile(context, BUILD.format(base="host")), build_args={"MARK": mark})
    events: list[StepEvent] = []
    image = fleet.build(spec, on_step=events.append)
    assert _statuses(events)[-1] == "built"
    assert (image.workdir, image.cmd, image.ports) == ("/srv/app", ("python3", "main.py"), ("8000/tcp",))
    events.clear()
    assert fleet.build(EnvSpec.from_dockerfile(context / "Dockerfile", build_args={"MARK": mark}),
                       on_step=events.append) == image
    assert set(_statuses(events)) == {"cached"}, events
    with fleet.create(image) as sandbox:
        result = sandbox.exec('pwd; echo "$GREETING/$MARK"; cat built.txt texts/a.txt texts/b.txt; python3 main.py; ls -A')
        assert result.text.splitlines() == [
            "/srv/app", f"hello there/{mark}", f"built {mark} in /srv/app", "a", "b", "main",
            ".hidden", "built.txt", "main.py", "texts",
        ]
    # A local image id as the base: the new steps build on its layers.
    child = dockerfile(context, f"FROM {image.id}\nRUN cat /srv/app/built.txt > /child.txt\nCMD [\"true\"]\n", "child.Dockerfile")
    built = fleet.build(EnvSpec.from_dockerfile(child))
    assert built.layers[:len(image.layers)] == image.layers and built.cmd == ("true",)
    with fleet.create(built) as sandbox:
        assert sandbox.exec("cat /child.txt; echo $GREETING").text == f"built {mark} in /srv/app\nhello there\n"


@pytest.mark.parametrize("transport", ["embedded", "unix"])
def test_fanfold_build_dockerfile_prints_the_image_id(transport, request, config, context):
    mark = f"cli{time.time_ns()}"
    path = dockerfile(context, BUILD.format(base="host"), "web.Dockerfile")
    url = [] if transport == "embedded" else ["--url", str(fleet_args("unix", request, config)["url"])]
    done = run_cli(*url, "build", str(path), "--build-arg", f"MARK={mark}", timeout=300)
    assert done.returncode == 0, done.stderr
    image_id = done.stdout.strip()
    assert image_id.startswith("img-") and done.stderr.splitlines()[-1].endswith(" built")
    # -f with a context directory, as docker build takes it: the same steps, all cached.
    (context / "elsewhere").mkdir()
    moved = dockerfile(context / "elsewhere", BUILD.format(base="host"))
    again = run_cli(*url, "build", "-f", str(moved), str(context), "--build-arg", f"MARK={mark}", timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == image_id
    assert {line.rpartition(" ")[2] for line in again.stderr.splitlines()[1:]} == {"cached"}, again.stderr
    with Fleet(**fleet_args(transport, request, config)) as fleet, fleet.create(image_id) as sandbox:
        assert sandbox.exec("cat built.txt").text == f"built {mark} in /srv/app\n"


def test_fanfold_build_reports_a_bad_dockerfile_line(context):
    path = dockerfile(context, "FROM host\nSTOPSIGNAL SIGTERM\n")
    done = run_cli("build", str(path))
    assert done.returncode == 2 and f"{path}:2: STOPSIGNAL: not supported" in done.stderr
    done = run_cli("build", str(context / "a.txt"), "--target", "x")
    assert done.returncode == 2 and "--build-arg and --target apply to Dockerfiles" in done.stderr


# -- on a pulled image, and in stages (a real registry on loopback) -----------------------------

IMAGE_CONFIG = {"Env": ["PATH=/usr/bin:/bin", "HOME=/root"], "WorkingDir": "/srv"}


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A runnable image with a WorkingDir and an Env, a file in /srv and an absolute link to its own
    /etc/passwd; its ``host/repo@digest``."""
    base = runnable_tree(tmp_path_factory.mktemp("tree") / "base")
    (base / "srv").mkdir()
    (base / "srv/hello.txt").write_text("hello from the image\n")
    os.symlink("/etc/passwd", base / "srv/passwd-link")
    return push_tree(registry, "dockerfile-base:v1", [base], config=IMAGE_CONFIG)


@pytest.fixture(params=["embedded", "unix"])
def ifleet(request: pytest.FixtureRequest, config: EngineConfig, registry):
    args = {"config": config} if request.param == "embedded" else {"url": request.getfixturevalue("image_server").unix_url}
    with Fleet(**args) as fleet:
        yield fleet


ON_IMAGE = """\
FROM {ref}
ARG MARK
ENV PATH=/opt/x/bin:$PATH WHERE="$HOME/${{MISSING:-dflt}}"
WORKDIR app
COPY tool.sh /opt/x/bin/tool
COPY a.txt .
COPY app sub/
RUN tool "$MARK" > ran.txt
"""


def test_a_dockerfile_on_a_pulled_image_expands_its_env_and_workdir(ifleet: Fleet, pushed: str, context: Path):
    (context / "tool.sh").write_text('#!/bin/sh\necho "tool $1 in $(pwd)"\n')
    (context / "tool.sh").chmod(0o755)
    path = dockerfile(context, ON_IMAGE.format(ref=pushed))
    mark = f"m{time.time_ns()}"
    events: list[StepEvent] = []
    image = ifleet.build(EnvSpec.from_dockerfile(path, build_args={"MARK": mark}), on_step=events.append)
    assert "built" in _statuses(events)
    env = dict(image.env)
    assert (image.workdir, env["PATH"], env["WHERE"]) == ("/srv/app", "/opt/x/bin:/usr/bin:/bin", "/root/dflt")
    events.clear()
    assert ifleet.build(EnvSpec.from_dockerfile(path, build_args={"MARK": mark}), on_step=events.append) == image
    assert set(_statuses(events)) == {"cached"}, events
    with ifleet.create(image) as sandbox:
        result = sandbox.exec("pwd; echo $PATH; cat a.txt ran.txt sub/main.py; ls /srv")
        assert result.text.splitlines() == [
            "/srv/app", "/opt/x/bin:/usr/bin:/bin", "a", f"tool {mark} in /srv/app", "print('main')",
            "app", "hello.txt", "passwd-link",
        ]


STAGES = """\
FROM host AS build
ARG MARK
COPY a.txt /in/a.txt
RUN mkdir -p /out/tree && echo "built $MARK from $(cat /in/a.txt)" > /out/file && echo t > /out/tree/t \\
    && echo junk > /stage-only
FROM host
WORKDIR /app
COPY --from=build /out/file /app/
COPY --from=build /out/tree tree
COPY --from={ref} /srv/hello.txt srv/passwd-link ./image/
"""


def test_a_multi_stage_dockerfile_copies_only_what_it_names(ifleet: Fleet, pushed: str, context: Path):
    path = dockerfile(context, STAGES.format(ref=pushed))
    mark = f"m{time.time_ns()}"
    events: list[StepEvent] = []
    image = ifleet.build(EnvSpec.from_dockerfile(path, build_args={"MARK": mark}), on_step=events.append)
    assert any(e.status == "built" and "<- RUN" in e.description for e in events), events  # the stage's own steps
    events.clear()
    assert ifleet.build(EnvSpec.from_dockerfile(path, build_args={"MARK": mark}), on_step=events.append) == image
    assert set(_statuses(events)) == {"cached"}, events
    with ifleet.create(image) as sandbox:
        result = sandbox.exec("cat file tree/t image/hello.txt image/passwd-link; ls -A /app /app/image;"
                              " for p in /stage-only /in /out /app/tree/tree; do test -e $p && echo leaked $p; done; true")
        assert result.text.splitlines() == [
            f"built {mark} from a", "t", "hello from the image",
            # the link resolved inside the image: its own passwd, not the host's
            "root:x:0:0:root:/root:/bin/sh", "app:x:1000:1000:app:/home/app:/bin/sh",
            "/app:", "file", "image", "tree", "", "/app/image:", "hello.txt", "passwd-link",
        ]


def test_a_copy_from_path_missing_in_the_source_fails_the_build(fleet, context: Path):
    path = dockerfile(context, "FROM host AS build\nRUN true\nFROM host\nCOPY --from=build /nowhere /x\n")
    with pytest.raises(BuildFailed, match=r"COPY --from=stage\(host\+1 steps\) /nowhere /x.*in the source image,"
                                          r" no such file or directory in the sandbox: /nowhere"):
        fleet.build(EnvSpec.from_dockerfile(path))
