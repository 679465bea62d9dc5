"""The command line, run as a user would."""

from __future__ import annotations

import json

from conftest import run_cli


def test_doctor_passes_here():
    done = run_cli("doctor")
    assert done.returncode == 0, done.stderr
    assert "sandbox" in done.stderr and "FAIL" not in done.stderr


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
