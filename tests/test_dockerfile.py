"""Dockerfiles read by buildkit's parser into EnvSpecs, and built for real on the ``host`` base."""

from __future__ import annotations

import tarfile
import time
from pathlib import Path

import pytest

from fanfold import EnvSpec, Fleet, InvalidSpec
from fanfold.images.builder import StepEvent
from fanfold.images.builder import DEFAULT_PATH
from fanfold.wire import spec_from_json, spec_to_json

from conftest import fleet_args, run_cli


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
LABEL org.example.team=rl
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
    assert run.arg("cmd") == "export EMPTY='' GLOBAL=g VERSION=2.5\necho \"$VERSION $GLOBAL\""


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


def test_a_local_image_base_takes_absolute_paths_and_known_variables(context):
    image = "img-0123456789abcdef"
    spec = EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nWORKDIR /app\nCOPY a.txt .\nENV X=${{Y:-y}}\n"))
    assert spec.base == image
    assert spec.steps == EnvSpec(image).workdir("/app").copy("a.txt", "/app/a.txt").env(X="y").steps
    with pytest.raises(InvalidSpec, match=r"Dockerfile:2: ENV: \$\{PATH\} is not set by this Dockerfile"):
        EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nENV PATH=/x:$PATH\n"))
    with pytest.raises(InvalidSpec, match="Dockerfile:2: WORKDIR: relative WORKDIR 'app' before any absolute"):
        EnvSpec.from_dockerfile(dockerfile(context, f"FROM {image}\nWORKDIR app\n"))


def test_the_spec_round_trips_through_the_wire(context):
    spec = EnvSpec.from_dockerfile(dockerfile(context, (
        "FROM host\nENV A=1\nWORKDIR /app\nCOPY app .\nUSER nobody\nEXPOSE 80\nRUN [\"true\"]\n"
        "ENTRYPOINT [\"a\"]\nCMD [\"b\"]\n"
    )))
    assert spec_from_json(spec_to_json(spec)).steps == spec.steps


@pytest.mark.parametrize("line, text, message", [
    (2, "HEALTHCHECK CMD true", "HEALTHCHECK: not supported: fanfold does not probe"),
    (2, "ONBUILD RUN true", "ONBUILD: not supported"),
    (2, "SHELL [\"/bin/bash\", \"-c\"]", "SHELL: not supported: RUN always uses /bin/sh -c"),
    (2, "VOLUME /data", "VOLUME: not supported"),
    (2, "STOPSIGNAL SIGTERM", "STOPSIGNAL: not supported"),
    (2, "MAINTAINER me", "MAINTAINER: not supported: it is deprecated"),
    (2, "FROBNICATE x", "FROBNICATE: unknown or unsupported instruction"),
    (2, "RUN <<EOF\necho hi\nEOF", "RUN: heredocs are not supported"),
    (2, "RUN --mount=type=cache,target=/c true", "RUN: --mount=type=cache,target=/c is not supported"),
    (2, "COPY --from=builder /x /y", "COPY: --from=builder is not supported"),
    (2, "COPY --chown=app:app a.txt /y", "COPY: --chown=app:app is not supported: copy, then `RUN chown`"),
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
    path = dockerfile(context, "FROM host\nVOLUME /data\n")
    done = run_cli("build", str(path))
    assert done.returncode == 2 and f"{path}:2: VOLUME: not supported" in done.stderr
    done = run_cli("build", str(context / "a.txt"), "--target", "x")
    assert done.returncode == 2 and "--build-arg and --target apply to Dockerfiles" in done.stderr
