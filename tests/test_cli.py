"""The command line, run as a user would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fanfold.host import cgroups, mounts

from conftest import STATE_DIR, run_cli


def test_doctor_passes_here():
    done = run_cli("doctor")
    assert done.returncode == 0, done.stderr
    assert "sandbox" in done.stderr and "FAIL" not in done.stderr
    assert re.search(r"ok\s+disks\s+btrfs with quotas", done.stderr) and re.search(r"ok\s+image tools", done.stderr)


def test_run_prints_output_and_passes_the_exit_code():
    done = run_cli("run", "--memory-mb", "128", "--", "sh", "-c", "echo out; echo err >&2; exit 4")
    assert (done.returncode, done.stdout, "err" in done.stderr) == (4, "out\n", True)


def test_run_timeout_exits_124():
    done = run_cli("run", "--timeout", "0.3", "--", "sleep", "30")
    assert done.returncode == 124 and "timeout" in done.stderr


def test_create_exec_ls_rm():
    created = run_cli("create", "--label", "rollout_id=r1", "--memory-mb", "128")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    assert run_cli("exec", sandbox_id, "--", "hostname").stdout == sandbox_id + "\n"
    listed = json.loads(run_cli("ls", "--json").stdout)
    mine = [s for s in listed if s["id"] == sandbox_id]
    assert mine and mine[0]["labels"] == {"rollout_id": "r1"} and mine[0]["state"] == "running"
    assert run_cli("rm", sandbox_id).returncode == 0
    assert sandbox_id not in run_cli("ls", "--json").stdout


def test_build_specfile(tmp_path):
    (tmp_path / "hello.txt").write_text("from the spec dir\n")
    (tmp_path / "spec.py").write_text(
        "from fanfold import EnvSpec\nspec = EnvSpec('host').workdir('/app').copy('hello.txt', '/app/hello.txt')\n"
    )
    done = run_cli("build", str(tmp_path / "spec.py"))
    assert done.returncode == 0, done.stderr
    image_id = done.stdout.strip()
    assert image_id.startswith("img-") and "COPY" in done.stderr
    shown = run_cli("run", "--image", image_id, "--", "cat", "hello.txt")
    assert shown.stdout == "from the spec dir\n"


def test_errors_are_one_clear_line():
    for args in (["run", "--image", "nope", "--", "true"], ["exec", "sb-missing", "--", "true"],
                 ["run", "--memory-mb", "1", "--", "true"]):
        done = run_cli(*args)
        assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_snapshot_fork_and_lifecycle_commands():
    created = run_cli("create", "--memory-mb", "128", "--persistence", "persistent", "--priority", "3")
    sandbox_id = created.stdout.strip()
    try:
        shown = [s for s in json.loads(run_cli("ls", "--json").stdout) if s["id"] == sandbox_id][0]
        assert (shown["persistence"], shown["priority"]) == ("persistent", 3)
        name = f"cli-{sandbox_id}"
        taken = run_cli("snapshot", sandbox_id, "--name", name)
        assert taken.returncode == 0 and taken.stdout.startswith("snap-"), taken.stderr
        snapshot_id = taken.stdout.strip()
        listed = json.loads(run_cli("snapshots", "--json").stdout)
        assert [s["name"] for s in listed if s["id"] == snapshot_id] == [name]
        tree = run_cli("snapshots", "--tree").stdout
        assert shown["image_id"] in tree and snapshot_id in tree and name in tree
        table = run_cli("snapshots").stdout
        assert snapshot_id in table
        for verb, state in (("pause", "paused"), ("unpause", "running"), ("suspend", "suspended"),
                            ("resume", "running"), ("reset", "running")):
            done = run_cli(verb, sandbox_id)
            assert done.stdout == f"{sandbox_id} {state}\n", (verb, done.stderr)
        forked = run_cli("fork", sandbox_id, "-n", "2", "--cmd", "true")
        assert forked.returncode == 0 and "parent paused" in forked.stderr, forked.stderr
        children = forked.stdout.split()
        assert len(children) == 2 and all(c.startswith("sb-") for c in children)
        assert run_cli("exec", children[0], "--", "hostname").stdout == children[0] + "\n"  # outlived `fork`
        assert run_cli("rm", *children).returncode == 0
        from_snapshot = run_cli("create", "--image", name, "--memory-mb", "128").stdout.strip()
        assert run_cli("rm-snapshot", snapshot_id).returncode == 2  # in use by from_snapshot
        assert run_cli("rm", from_snapshot).returncode == 0
        assert run_cli("rm-snapshot", name).stdout == name + "\n"
        assert run_cli("gc").returncode == 0
        assert snapshot_id not in run_cli("snapshots").stdout
    finally:
        run_cli("rm", sandbox_id)


# -- what a new user trips on (issue 13) ------------------------------------------------------

def _created(*args: str) -> str:
    made = run_cli("create", "--memory-mb", "128", *args)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_a_command_that_cannot_start_says_why_and_exits_127():
    expected = "cannot run 'nosuchcommand': No such file or directory"
    ran = run_cli("run", "--", "nosuchcommand")
    assert ran.returncode == 127 and expected in ran.stderr, ran.stderr
    sandbox_id = _created()
    try:
        done = run_cli("exec", sandbox_id, "--", "nosuchcommand")
        assert done.returncode == 127 and expected in done.stderr, done.stderr
    finally:
        run_cli("rm", sandbox_id)


def test_stdin_env_and_cwd_reach_the_command():
    assert run_cli("run", "--", "cat", input="data\n").stdout == "data\n"
    assert run_cli("run", "--cwd", "/tmp", "--", "pwd").stdout == "/tmp\n"
    sandbox_id = _created()
    try:
        assert run_cli("exec", sandbox_id, "--", "wc", "-c", input="12345").stdout.strip() == "5"
        shown = run_cli("exec", sandbox_id, "--env", "K=v=1", "--cwd", "/tmp", "--", "sh", "-c", 'echo "$K $PWD"')
        assert shown.stdout == "v=1 /tmp\n", shown.stderr
        bad = run_cli("exec", sandbox_id, "--env", "novalue", "--", "true")
        assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
    finally:
        run_cli("rm", sandbox_id)


def _interrupted(*args: str, url: str | None = None) -> tuple[str, subprocess.CompletedProcess[str]]:
    """Start a CLI command whose CMD prints one line and then waits; Ctrl-C it once that line is out."""
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR), **({"FANFOLD_URL": url} if url else {})}
    process = subprocess.Popen(  # SIGINT's default restored: a shell may start background jobs with it ignored
        [sys.executable, "-m", "fanfold.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline().strip()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return first, subprocess.CompletedProcess(args, process.returncode, out, err)


def _gone(sandbox_id: str, pid: str) -> bool:
    """PID has left SANDBOX within 10 s (the agent kills a command whose caller hung up)."""
    waited = run_cli("exec", sandbox_id, "--", "timeout", "10", "sh", "-c", f"while kill -0 {pid} 2>/dev/null; do :; done")
    return waited.returncode == 0


@pytest.mark.parametrize("transport", ["embedded", "unix"])
def test_ctrl_c_on_exec_kills_the_command_and_exits_130(transport, request):
    url = request.getfixturevalue("server").unix_url if transport == "unix" else None
    sandbox_id = _created()
    try:
        pid, done = _interrupted("exec", sandbox_id, "--", "sh", "-c", "echo $$; exec sleep 60", url=url)
        assert pid.isdigit() and done.returncode == 130, (pid, done.stderr)
        assert "Aborted" not in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert _gone(sandbox_id, pid)
    finally:
        run_cli("rm", sandbox_id)


def test_ctrl_c_on_run_destroys_its_sandbox_and_exits_130(config):
    sandbox_id, done = _interrupted("run", "--", "sh", "-c", "hostname; exec sleep 60")
    assert sandbox_id.startswith("sb-") and done.returncode == 130, (sandbox_id, done.stderr)
    assert sandbox_id not in cgroups.leftover_ids(config.cgroup_parent)
    assert not mounts.mounts_under(config.state_dir / "sandboxes" / sandbox_id)
    assert sandbox_id not in run_cli("ls", "--json").stdout


@pytest.mark.parametrize("source,line,error", [
    ("from fanfold import EnvSpec\nspec = EnvSpec('host'\n", 2, "SyntaxError: '(' was never closed"),
    ("from fanfold import EnvSpec\nimport nosuchmodule\n", 2, "ModuleNotFoundError: No module named 'nosuchmodule'"),
    ("def make():\n    return 1 / 0\n\nspec = make()\n", 2, "ZeroDivisionError: division by zero"),
])
def test_a_broken_specfile_is_one_line_naming_file_line_and_error(tmp_path, source, line, error):
    (tmp_path / "broken.py").write_text(source)
    done = run_cli("build", str(tmp_path / "broken.py"))
    assert done.returncode == 2
    assert done.stderr == f"error: InvalidSpec: {tmp_path / 'broken.py'}:{line}: {error}\n"


def test_ls_prints_whole_ids_and_labels_into_a_pipe():
    label = "note=" + "x" * 120
    sandbox_id = _created("--label", label)
    try:
        rows = [line.split("\t") for line in run_cli("ls").stdout.splitlines()]
        assert rows[0] == ["ID", "STATE", "IMAGE", "CPUS", "MEM MB", "TENANT", "LABELS"]
        assert [row for row in rows if row[0] == sandbox_id][0][-2:] == ["(host)", label]
    finally:
        run_cli("rm", sandbox_id)


def test_fork_cmd_shows_each_childs_output_and_fails_when_it_failed():
    parent = _created()
    children: list[str] = []
    try:
        forked = run_cli("fork", parent, "-n", "2", "--cmd", "hostname; echo oops >&2; exit 3")
        children = forked.stdout.split()
        assert forked.returncode == 1 and len(children) == 2, forked.stderr
        for child in children:
            assert f"{child} stdout: {child}\n" in forked.stderr and f"{child} stderr: oops\n" in forked.stderr
            assert f"{child}: --cmd failed (exit code 3)" in forked.stderr
        assert run_cli("rm", *children).returncode == 0
        fine = run_cli("fork", parent, "--cmd", "echo reseeded")
        children = fine.stdout.split()
        assert fine.returncode == 0 and f"{children[0]} stdout: reseeded\n" in fine.stderr, fine.stderr
    finally:
        run_cli("rm", parent, *children)


HEAVY = ["fanfold.engine", "aiohttp", "prometheus_client", "fastapi", "gymnasium"]


def _modules_after(code: str) -> set[str]:
    """Top-level names in sys.modules after ``code`` runs in a fresh interpreter."""
    probe = code + "\nimport sys\nprint(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "FANFOLD_URL"})
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines()[-1].split())


def test_importing_fanfold_loads_no_engine_server_or_http_stack():
    loaded = _modules_after("import fanfold")
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_a_remote_fleet_loads_no_engine_and_help_loads_no_client():
    remote = _modules_after("from fanfold import Fleet\nFleet('unix:///nonexistent.sock')")
    assert "fanfold.client._http" in remote
    assert not remote & {"fanfold.engine.core", "aiohttp", "prometheus_client", "fastapi", "gymnasium"}
    helped = _modules_after("from fanfold.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert not helped & {"fanfold.client", "asyncio", "rich", "aiohttp", "fanfold.engine", "gymnasium"}


def test_lazy_exports_match_what_type_checkers_see():
    import ast

    import fanfold

    tree = ast.parse(Path(fanfold.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    seen = {alias.name: "." * node.level + (node.module or "") for node in guarded.body
            if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == fanfold._WHERE and sorted(seen) == sorted(fanfold.__all__)


def test_a_lazy_command_lists_the_help_of_the_command_it_loads():
    from fanfold.cli import FanfoldGroup

    for name, stub in FanfoldGroup.lazy.items():
        loaded = stub.load()
        assert loaded.name == name and stub.short_help == loaded.help.splitlines()[0]


def test_the_fake_backend_runs_a_command_in_a_state_dir_of_its_own(tmp_path):
    done = run_cli("--backend", "fake", "--state-dir", str(tmp_path), "run", "--", "sh", "-c", "echo ok > made; cat made")
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    assert not list((tmp_path / "fake").iterdir())  # the sandbox's dir went with it


def test_build_tag_docker_run_semantics_and_images_inspect_history(tmp_path):
    name = f"cli-habits-{os.getpid()}:v1"
    (tmp_path / "a.txt").write_text("hi\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM host\nLABEL team=rl\nRUN echo 'app:x:4242:4242::/home/app:/bin/sh' >> /etc/passwd\n"
        "COPY --chown=app a.txt /srv/a.txt\nVOLUME /data\nHEALTHCHECK --interval=5s CMD test -f /srv/a.txt\n"
        "ENTRYPOINT [\"/bin/echo\", \"entry:\"]\nCMD [\"default\"]\n")
    built = run_cli("build", "-t", name, str(tmp_path))
    assert built.returncode == 0, built.stderr
    image_id = built.stdout.strip()
    assert run_cli("run", "--image", name).stdout == "entry: default\n"
    assert run_cli("run", "--image", name, "--", "a", "b").stdout == "entry: a b\n"  # after the entrypoint, as Docker
    listed = run_cli("run", "--image", name, "--entrypoint", "stat", "--", "-c", "%u:%g", "/srv/a.txt")
    assert listed.stdout == "4242:4242\n", listed.stderr
    assert run_cli("run", "--image", name, "--entrypoint", "").returncode == 2  # no entrypoint, and its cmd dropped
    shown = run_cli("images", "inspect", name)
    assert shown.returncode == 0, shown.stderr
    for text in (image_id, "team=rl", "/data (directories of the sandbox's own disk)", "test -f /srv/a.txt",
                 '["/bin/echo", "entry:"]', "BASE host", "COPY --chown=app a.txt /srv/a.txt"):
        assert text in shown.stdout, (text, shown.stdout)
    assert json.loads(run_cli("images", "inspect", "--json", image_id).stdout)["volumes"] == ["/data"]
    steps = [line.split("\t") for line in run_cli("images", "history", name).stdout.splitlines()[1:]]
    assert [s[0] for s in steps] == [str(n) for n in range(1, 9)] and steps[1][1:] == ["-", "-", "LABEL team=rl"]
    missing = run_cli("images", "inspect", name.replace("habits", "habit"))
    assert missing.returncode == 2 and f"did you mean {name}" in missing.stderr
    assert run_cli("rmi", name).returncode == 0


def test_build_prints_each_step_once_numbered_in_order(tmp_path):
    mark = f"m{os.getpid()}-{tmp_path.name}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM host\nARG VERSION={mark}\nENV APP=demo\nRUN echo $VERSION [x] > /v\nUSER nobody\n"
        "RUN cat /v && \\\n    echo two\n")
    done = run_cli("build", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[1/5", "[2/5", "[3/5", "[4/5", "[5/5"], lines
    assert lines[1] == "[2/5] ENV APP=demo cached" and lines[3] == "[4/5] USER nobody built", lines
    assert lines[2] == "[3/5] RUN echo $VERSION [x] > /v ... built" and "export" not in done.stderr, lines
    image = done.stdout.strip()
    assert run_cli("run", "--image", image, "--", "cat", "/v").stdout == f"{mark} [x]\n"


def test_create_options_are_the_models_own():
    """The CLI's limit and lifecycle options take their defaults, ranges and help from Limits and
    CreateParams: no second copy to drift, and a value past a model's bound is refused up front."""
    from dataclasses import fields

    import click

    from fanfold import CreateParams, Limits
    from fanfold.cli import main
    from fanfold.models import field_docs

    create = main.get_command(click.Context(main), "create")
    options = {param.name: param for param in create.params}
    for cls, names in ((Limits, [f.name for f in fields(Limits)]), (CreateParams, ["deadline", "priority", "idle_timeout"])):
        docs = field_docs(cls)
        for spec in fields(cls):
            if spec.name not in names:
                continue
            option, low = options[spec.name], spec.metadata.get("ge", spec.metadata.get("gt"))
            assert option.default == spec.default and option.help.startswith(docs[spec.name].replace("``", ""))
            if low is None:  # unbounded (gpus, gpu_exclusive): the model checks the value itself
                continue
            shown_low = int(low) if float(low).is_integer() else low
            assert option.help.endswith(f"{shown_low} to {int(spec.metadata['le'])}]"), option.help
    refused = run_cli("create", "--memory-mb", "8")
    assert refused.returncode == 2 and "error:" in refused.stderr and "memory_mb=8 is out of range" in refused.stderr
