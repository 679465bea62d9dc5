"""Compose files read, validated and planned as sandbox groups (no sandbox: the translation alone)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fanfold import InvalidSpec
from fanfold.compose import PROJECT_LABEL, load, parse, plan
from fanfold.compose.interpolate import interpolate
from fanfold.groups import HealthCheck


def compose(where: Path, text: str, *, name: str = "docker-compose.yaml") -> Path:
    path = where / name
    path.write_text(textwrap.dedent(text))
    return path


def planned(tmp_path: Path, text: str, env: dict[str, str] | None = None):
    return plan(parse(textwrap.dedent(text), env=env or {}, directory=tmp_path))


def steps(service) -> list[str]:
    return [step.describe() for step in service.spec.steps]


APP_AND_DB = """\
    name: shop
    services:
      db:
        image: host
        command: python3 -m http.server 8000
        working_dir: /srv
        healthcheck:
          test: ["CMD", "python3", "-c", "print(1)"]
          interval: 500ms
          timeout: 5s
          retries: 20
          start_period: 1m30s
        volumes:
          - db_data:/srv/data
      app:
        image: debian:bookworm
        depends_on:
          db: {condition: service_healthy}
        environment:
          - DB_URL=http://db:8000
          - FROM_HOST
        user: "1000"
        entrypoint: ["sleep"]
        command: infinity
        ports: ["127.0.0.1:9000:9000", {target: 9100, published: 80}, "7000-7002/tcp", 5000]
        volumes:
          - type: volume
            source: db_data
            target: /data
    volumes:
      db_data:
    """


def test_an_app_and_a_database_become_two_members_in_the_file_order(tmp_path):
    shop = planned(tmp_path, APP_AND_DB, env={"FROM_HOST": "yes"})
    assert shop.project == "shop"
    db, app = shop.services
    assert (db.name, db.spec.base, db.after, db.ports) == ("db", "host", (), ())
    assert steps(db) == ["WORKDIR /srv", "SERVICE db cd /srv && exec python3 -m http.server 8000 simple"]
    assert db.health == HealthCheck(cmd=["python3", "-c", "print(1)"], interval=0.5, timeout=5.0, retries=20,
                                    start_period=90.0)
    assert db.volumes == {"db-data": "/srv/data"}  # a group volume's name is a DNS label
    assert (app.spec.base, app.after, app.health) == ("debian:bookworm", ("db",), None)
    assert steps(app) == ["ENV DB_URL=http://db:8000 FROM_HOST=yes", "USER 1000",
                          "SERVICE app exec setpriv --reuid=1000 --regid=1000 --clear-groups sleep infinity simple"]
    assert app.ports == (9000, 9100, 7000, 7001, 7002, 5000)  # the container's ports: the host's are fanfold's to pick
    assert app.volumes == {"db-data": "/data"}


def test_the_plan_becomes_group_params_with_the_built_images(tmp_path):
    shop = planned(tmp_path, APP_AND_DB)
    params = shop.group_params({"db": "img-db", "app": "img-app"}, labels={"team": "a"}, deadline=60)
    assert [m.name for m in params.members] == ["db", "app"]
    assert [m.params.image for m in params.members] == ["img-db", "img-app"]
    assert params.members[1].after == ("db",) and params.members[0].health is not None
    assert params.labels == {"team": "a", PROJECT_LABEL: "shop"} and params.deadline == 60
    with pytest.raises(InvalidSpec, match=r"no image for services \['app'\]"):
        shop.group_params({"db": "img-db"})


def test_build_uses_the_dockerfile_its_args_target_and_the_image_name_as_tag(tmp_path):
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "serve.py").write_text("print('hi')\n")
    (tmp_path / "web" / "Web.dockerfile").write_text(textwrap.dedent("""\
        FROM host AS base
        ARG GREETING=hello
        WORKDIR /app
        COPY serve.py .
        RUN echo $GREETING > greeting
        ENTRYPOINT ["python3"]
        CMD ["serve.py"]
        FROM base AS extra
        RUN true
        """))
    web, = planned(tmp_path, """\
        services:
          web:
            image: shop-web:dev
            build:
              context: ./web
              dockerfile: Web.dockerfile
              args: [GREETING=hi]
              target: base
        """).services
    assert web.tag == "shop-web:dev" and web.spec.context == (tmp_path / "web").resolve()
    assert steps(web)[-1] == "SERVICE web cd /app && exec python3 serve.py simple"  # the Dockerfile's own process
    assert "RUN echo $GREETING > greeting" in steps(web) and "RUN true" not in steps(web)
    assert dict(web.spec.steps[2].args)["build_args"] == (("GREETING", "hi"),)


def test_compose_rules_for_entrypoint_and_command_over_the_images(tmp_path):
    (tmp_path / "Dockerfile").write_text('FROM host\nENTRYPOINT ["python3", "-u"]\nCMD ["main.py"]\n')
    services = planned(tmp_path, """\
        services:
          own: {build: ., command: other.py}
          entry: {build: ., entrypoint: /bin/sh -c}
          both: {build: ., entrypoint: [sh, -c], command: ["echo 'a b'"]}
          idle: {image: host}
        """).services
    assert [steps(s)[-1] for s in services[:3]] == [
        "SERVICE own exec python3 -u other.py simple",  # command replaces the image's CMD only
        "SERVICE entry exec /bin/sh -c simple",  # an entrypoint drops the image's CMD
        "SERVICE both exec sh -c 'echo '\"'\"'a b'\"'\"'' simple"]
    assert steps(services[3]) == []  # nothing to run: the member idles, reachable by exec


def test_user_by_name_and_group_drops_privileges_in_the_service(tmp_path):
    named, grouped = planned(tmp_path, """\
        services:
          named: {image: host, user: app, command: [id]}
          grouped: {image: host, user: "1000:100", command: [id]}
        """).services
    assert steps(named)[-1] == 'SERVICE named exec setpriv --reuid=app --regid="$(id -g app)" --init-groups id simple'
    assert steps(grouped)[-1] == "SERVICE grouped exec setpriv --reuid=1000 --regid=100 --clear-groups id simple"


def test_health_checks_in_each_form(tmp_path):
    shell, argv, none, disabled, defaults = planned(tmp_path, """\
        services:
          shell: {image: host, healthcheck: {test: "curl -f localhost || exit 1"}}
          argv: {image: host, healthcheck: {test: [CMD-SHELL, "test -e /ready"]}}
          none: {image: host, healthcheck: {test: [NONE]}}
          disabled: {image: host, healthcheck: {disable: true}}
          defaults: {image: host, healthcheck: {test: [CMD, "true"], timeout: 2s}}
        """).services
    assert shell.health.cmd == "curl -f localhost || exit 1" and argv.health.cmd == "test -e /ready"
    assert none.health is None and disabled.health is None
    assert defaults.health == HealthCheck(cmd=["true"], timeout=2.0)  # what the file leaves out: fanfold's defaults


def test_depends_on_in_list_and_map_form(tmp_path):
    services = planned(tmp_path, """\
        services:
          a: {image: host}
          b: {image: host, depends_on: [a]}
          c: {image: host, depends_on: {a: {condition: service_started}, b: {condition: service_started}}}
        """).services
    assert [s.after for s in services] == [(), ("a",), ("a", "b")]


@pytest.mark.parametrize("service, message", [
    ("{image: host, depends_on: {db: {condition: service_completed_successfully}}}",
     "services.app.depends_on.db.condition: 'service_completed_successfully' is not supported"),
    ("{image: host, depends_on: {db: {condition: service_healthy}}}",
     "services.app.depends_on.db.condition: service_healthy, but 'db' has no healthcheck"),
    ("{image: host, volumes: ['./data:/data']}", r"services.app.volumes: './data:/data': bind mounts of host paths"),
    ("{image: host, volumes: [{type: bind, source: /etc, target: /x}]}", "bind mounts of host paths are not supported"),
    ("{image: host, volumes: [{type: tmpfs, target: /x}]}", "a tmpfs volume is not supported"),
    ("{image: host, volumes: ['other:/x']}", "volume 'other' is not declared under the top-level 'volumes'"),
    ("{image: host, volumes: ['db_data:/x:ro']}", "read-only volumes are not supported"),
    ("{image: host, ports: ['53:53/udp']}", r"services.app.ports: '53:53/udp': only TCP ports are exposed"),
    ("{image: host, ports: ['1-1000']}", "a range of 1 to 100 ports"),
    ("{image: nope!}", "services.app.image: invalid image name part"),  # the spec's own check
    ("{command: 'true'}", "services.app.image: a service needs an 'image'"),
    ("{build: ./missing}", "services.app.build: no Dockerfile at"),
    ("{build: 'https://example.org/repo.git'}", "services.app.build.context: 'https://example.org/repo.git' is remote"),
    ("{image: host, user: 'a b'}", "services.app.user: invalid user or group name character"),
    ("{image: host, environment: {'1X': y}}", "services.app.environment: bad environment variable 1X"),
    ("{image: host, healthcheck: {test: [CMD, 'true'], interval: 0s}}", "services.app.healthcheck: health.interval"),
])
def test_what_fanfold_cannot_honour_is_refused_naming_the_service_and_key(tmp_path, service, message):
    with pytest.raises(InvalidSpec, match=message):
        planned(tmp_path, f"""\
            services:
              db: {{image: host}}
              app: {service}
            volumes:
              db_data:
            """)


@pytest.mark.parametrize("text, message", [
    ("services:\n  app: {image: host, privileged: true}\n", r"unsupported compose key 'services.app.privileged': remove it;"
     r" fanfold supports build, command, depends_on"),
    ("services:\n  app: {image: host, restart: always, networks: [x]}\nnetworks: {x: {}}\n",
     r"unsupported compose keys? '(services.app.restart|networks)'"),
    ("services:\n  app: {image: host, restart: always, env_file: .env}\n",
     r"unsupported compose keys 'services.app.env_file', 'services.app.restart': remove them"),
    ("services:\n  app: {image: host}\nsecrets: {s: {file: ./s}}\n", r"unsupported compose key 'secrets'"),
    ("services:\n  app: {image: host}\nvolumes: {v: {external: true}}\n", r"unsupported compose key 'volumes.v.external'"),
    ("services:\n  app: {build: {context: ., cache_from: [x]}}\n", r"'services.app.build.cache_from'"),
    ("services:\n  app: {image: host, healthcheck: {test: [CMD, 'true'], start_interval: 1s}}\n",
     r"'services.app.healthcheck.start_interval'"),
    ("services:\n  app: {image: host, depends_on: {db: {condition: service_started, restart: true}}}\n  db: {image: host}\n",
     r"'services.app.depends_on.db.restart'"),
    ("services:\n  app: {image: host, ports: [{target: 80, mode: host}]}\n", r"'services.app.ports\[0\].mode'"),
    ("services:\n  app: {image: host, imag: host}\n", r"not a valid compose file: services.app: extension key `imag`"),
    ("services:\n  app: {image: host, healthcheck: {interval: 3q}}\n", r"services.app.healthcheck.interval: `q` is not"),
    ("services:\n  app: {image: host, depends_on: {db: {condition: bogus}}}\n", r"unknown variant `bogus`"),
    ("services: {}\n", "defines no services"),
    ("- a list\n", "a compose file is a mapping"),
    ("services: [\n", "not valid YAML"),
    ("services:\n  My_App: {image: host}\n", "service name 'My_App': a group member's name is a DNS label"),
])
def test_keys_outside_fanfolds_subset_or_the_spec_are_refused_by_name(tmp_path, text, message):
    with pytest.raises(InvalidSpec, match=message):
        planned(tmp_path, text)


def test_version_and_extension_keys_are_ignored_as_compose_ignores_them(tmp_path):
    app, = planned(tmp_path, """\
        version: "3.9"
        x-common: &common {image: host}
        services:
          app: {<<: *common, x-note: kept out}
        """).services
    assert app.spec.base == "host"


def test_interpolation_follows_the_compose_spec():
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "$SET ${SET} $$SET $$": "v v $SET $", "${UNSET}|$UNSET|": "||", "a $ b": "a $ b",
        "${EMPTY:-d} ${EMPTY-d} ${UNSET-d}": "d  d", "${SET:-d}": "v",
        "${SET:+alt} ${EMPTY:+alt}|${EMPTY+alt}": "alt |alt", "${UNSET:-${SET}x}": "vx", "${UNSET:-a:b}": "a:b",
    }
    for text, want in cases.items():
        assert interpolate(text, env) == want, text
    assert interpolate({"k": ["${SET}", 3, None]}, env) == {"k": ["v", 3, None]}
    with pytest.raises(InvalidSpec, match=r"services.db.image: variable TAG is required: set TAG"):
        interpolate({"services": {"db": {"image": "db:${TAG:?set TAG}"}}}, env)
    with pytest.raises(InvalidSpec, match="variable EMPTY is required: it is unset or empty"):
        interpolate("${EMPTY:?}", env)
    assert interpolate("${EMPTY?}", env) == ""
    with pytest.raises(InvalidSpec, match="without its closing"):
        interpolate("${SET:-x", env)
    with pytest.raises(InvalidSpec, match="bad reference to SET"):
        interpolate("${SET%x}", env)


def test_load_reads_dot_env_under_the_process_environment_and_names_the_project(tmp_path, monkeypatch):
    project = tmp_path / "My Shop"
    project.mkdir()
    (project / ".env").write_text("PORT=8000\nTAG=from-file\n")
    monkeypatch.setenv("TAG", "from-shell")
    monkeypatch.delenv("COMPOSE_PROJECT_NAME", raising=False)
    path = compose(project, """\
        services:
          web:
            image: host
            command: python3 -m http.server ${PORT}
            environment: {TAG: "${TAG}", FLAG: true, RATIO: 1.5}
            ports: ["${PORT}:${PORT}"]
        """)
    loaded = load(path)
    assert loaded.name == "myshop" and loaded.directory == project
    web, = plan(loaded).services
    assert steps(web) == ["ENV FLAG=true RATIO=1.5 TAG=from-shell", "SERVICE web exec python3 -m http.server 8000 simple"]
    assert web.ports == (8000,)
    assert load(path, env={"PORT": "1", "COMPOSE_PROJECT_NAME": "named"}).name == "named"
    with pytest.raises(InvalidSpec, match="cannot read compose file"):
        load(project / "missing.yaml")
