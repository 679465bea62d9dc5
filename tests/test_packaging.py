"""The core install stays small, and a feature whose extra is missing says which to install.

Each check runs in a fresh interpreter with the extra's packages blocked
(``sys.modules[name] = None`` makes their import fail as if they were not installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from fanfold._extras import DISTRIBUTIONS, EXTRAS

from conftest import STATE_DIR

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = [name for names in EXTRAS.values() for name in names] + ["pandas", "starlette", "pydantic", "uvloop", "httptools"]


def python(code: str, *args: str, blocked: list[str] = OPTIONAL) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter on the tests' state dir, ``blocked`` packages made unimportable."""
    prelude = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    env = {**os.environ, "FANFOLD_STATE_DIR": str(STATE_DIR), "COLUMNS": "200"}
    env.pop("FANFOLD_URL", None)
    return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def cli(*args: str, blocked: list[str] = OPTIONAL) -> subprocess.CompletedProcess[str]:
    return python("from fanfold.cli import main\nmain(prog_name='fanfold')", *args, blocked=blocked)


def requirement_names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip() for r in requirements}


def test_core_dependencies_are_the_sdk_and_cli_only_and_extras_match_the_code():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # dockerfile: buildkit's parser, for `fanfold build Dockerfile` and EnvSpec.from_dockerfile
    assert requirement_names(project["dependencies"]) == {"click", "rich", "h11", "prometheus-client", "dockerfile"}
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert {DISTRIBUTIONS.get(m, m) for m in modules} <= requirement_names(extras[extra]), extra
    (everything,) = extras["all"]
    assert set(everything.removeprefix("fanfold[").removesuffix("]").split(",")) == set(EXTRAS)
    assert "pandas" in requirement_names(extras["test"])
    assert "'.[all,test]'" in (ROOT / "scripts" / "setup.sh").read_text()  # make demo / make test get them all


def test_the_cli_runs_sandboxes_and_reads_trajectories_without_any_extra(tmp_path):
    ran = cli("run", "--", "echo", "core only")
    assert (ran.returncode, ran.stdout) == (0, "core only\n"), ran.stderr
    made = python(f"from fanfold.rl import TrajectoryStore\nTrajectoryStore({str(tmp_path / 't.db')!r}).close()")
    assert made.returncode == 0, made.stderr
    listed = cli("traj", "ls", "--db", str(tmp_path / "t.db"), "--json")
    assert listed.returncode == 0, listed.stderr


def test_serve_without_the_server_extra_names_it(tmp_path):
    served = cli("serve", "--socket", str(tmp_path / "ff.sock"), blocked=["fastapi"])
    assert served.returncode == 2
    assert served.stderr.strip() == ("error: MissingExtra: fanfold serve needs fastapi, which is not installed: "
                                     "pip install 'fanfold[server]'")
    assert not (tmp_path / "ff.sock").exists()
    imported = python("import fanfold.server", blocked=["uvicorn"])
    assert "MissingExtra: fanfold serve needs uvicorn, which is not installed: pip install 'fanfold[server]'" \
        in imported.stderr.splitlines()[-1]


def test_rl_envs_without_the_rl_extra_name_it():
    done = python("import fanfold.rl\ntry:\n    fanfold.rl.SandboxEnv\nexcept ImportError as err:\n"
                  "    print(type(err).__name__, err)", blocked=["gymnasium"])
    assert done.stdout == ("MissingExtra fanfold's RL envs needs gymnasium, which is not installed: "
                           "pip install 'fanfold[rl]'\n"), done.stderr


def test_multi_agent_envs_without_pettingzoo_name_the_rl_extra():
    done = python("try:\n    from fanfold.rl import ParallelSandboxEnv\nexcept ImportError as err:\n"
                  "    print(type(err).__name__, err)", blocked=["pettingzoo"])
    assert done.stdout == ("MissingExtra fanfold's multi-agent envs needs pettingzoo, which is not installed: "
                           "pip install 'fanfold[rl]'\n"), done.stderr


def test_the_policy_client_without_aiohttp_names_the_rl_extra():
    done = python("try:\n    from fanfold.rl import OpenAIPolicy\nexcept ImportError as err:\n"
                  "    print(type(err).__name__, err)", blocked=["aiohttp"])
    assert done.stdout == ("MissingExtra the OpenAI-compatible policy client needs aiohttp, which is not installed: "
                           "pip install 'fanfold[rl]'\n"), done.stderr


def test_parquet_export_without_the_parquet_extra_names_it(tmp_path):
    code = ("from fanfold.rl import TrajectoryStore\nfrom fanfold.errors import FanfoldError\n"
            f"store = TrajectoryStore({str(tmp_path / 't.db')!r})\n"
            "print(store.export(sys.argv[1]))\n"
            "try:\n    store.export(sys.argv[2])\nexcept FanfoldError as err:\n    print(type(err).__name__, err)")
    done = python(code, str(tmp_path / "out.jsonl"), str(tmp_path / "out.parquet"), blocked=["pyarrow"])
    assert done.stdout.splitlines() == [
        "0", "MissingExtra Parquet export needs pyarrow, which is not installed: pip install 'fanfold[parquet]'"], \
        done.stderr
    assert (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.parquet").exists()


def test_the_report_without_the_report_extra_names_it():
    done = python("sys.path.insert(0, 'examples')\nimport report", blocked=["matplotlib"])
    assert done.stderr.splitlines()[-1] == ("fanfold._extras.MissingExtra: the demo's HTML report needs matplotlib, "
                                            "which is not installed: pip install 'fanfold[report]'")


def test_a_ray_fleet_without_the_ray_extra_names_it():
    done = python("from fanfold import AsyncFleet\nAsyncFleet('ray://auto')", blocked=["ray"])
    assert done.stderr.splitlines()[-1] == ("fanfold._extras.MissingExtra: a fleet on a Ray cluster (ray://) needs ray, "
                                            "which is not installed: pip install 'fanfold[ray]'")



def test_the_harbor_environment_without_harbor_names_the_extra():
    done = python("import fanfold.integrations.harbor", blocked=OPTIONAL + ["harbor"])
    assert done.returncode == 1 and "pip install 'fanfold[harbor]'" in done.stderr, done.stderr
