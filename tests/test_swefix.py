"""The swefix env on a real task image: examples/swe_image/build.py builds more-itertools 10.2.0
with its bug into an OCI image, pushes it to a real registry on loopback, and episodes pull and
run it through ``make_async("swefix", ...)`` with the scripted policy and with one that does nothing."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest

from fanfold import AsyncFleet
from fanfold.errors import InvalidRequest
from fanfold.rl import ScriptedPolicy, TrajectoryStore, make_async, run_episode, scripted
from fanfold.rl.envs.scripts import reply

from registry import run_insecure_registry

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("swe_image_build", ROOT / "examples/swe_image/build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory):
    """The task image built (into an OCI layout) and pushed to a plain-HTTP registry named in
    FANFOLD_INSECURE_REGISTRIES; its ``host/repo@digest`` and the layout."""
    where = tmp_path_factory.mktemp("swe")
    with run_insecure_registry(where / "registry") as running:
        started = time.monotonic()
        build.build(where / "layout")
        ref = build.push(where / "layout", f"{running.host}/swe/more-itertools:padded", tls_verify=False)
        print(f"built and pushed {ref} in {time.monotonic() - started:.1f}s")
        yield ref, where / "layout"


@pytest.fixture
async def fleet(config):
    async with AsyncFleet(config=config) as handle:
        yield handle


async def test_the_scripted_policy_fixes_the_bug_and_its_episode_is_stored(fleet, image, tmp_path):
    image, layout = image
    started = time.monotonic()
    pulled = await fleet.pull(image)
    print(f"pulled in {time.monotonic() - started:.1f}s")
    assert pulled.user == "agent" and pulled.workdir == "/env" and len(pulled.layers) == 2
    assert (await fleet.import_image(layout)).id == pulled.id  # the file and the registry give one image
    store = TrajectoryStore(tmp_path / "t.db")
    env = make_async("swefix", fleet, image=image)
    try:
        started = time.monotonic()
        (episode,) = await run_episode(env, scripted("swefix"), seed=1, store=store)
        print(f"episode of {len(episode.steps)} steps in {time.monotonic() - started:.1f}s")
    finally:
        await env.close()
    calls = [step.tool_call["name"] for step in episode.steps]
    assert calls[:3] == ["run_tests", "shell", "edit_file"] and calls[-1] == "submit"
    first = episode.steps[0].tool_result
    assert "FAIL: test_next_multiple (tests.test_more.PaddedTest" in first and "FAILED (failures=1" in first
    assert "remaining = n - item_count % n" in episode.steps[1].tool_result
    assert episode.total_reward == 1.0 and episode.steps[-1].tool_result == "submitted: 774 of 774 tests pass, 5 of 5 checks"
    stored = store.get(episode.id)
    assert stored.outcome == "success" and stored.complete and stored.image_id == image
    assert [s.tool_call["name"] for s in stored.steps] == calls and stored.task == "swefix/more-itertools-10.2.0-padded"


async def test_doing_nothing_earns_nothing_and_the_grader_is_out_of_reach(fleet, image):
    image, _ = image
    idle = ScriptedPolicy(lambda messages, rng: reply("submit", {}, "Done."))
    env = make_async("swefix", fleet, image=image)
    try:
        (episode,) = await run_episode(env, idle, seed=2)
        assert episode.total_reward == 0.0
        assert episode.steps[0].tool_result == ("submitted: 773 of 774 tests pass, 2 of 5 checks; failing: "
                                               "tests.test_more.PaddedTest.test_next_multiple")
        await env.reset(seed=3)
        # The shell runs as the image's user: it owns the project, not the grader's copy of the tests.
        obs, *_ = await env.step({"name": "shell", "arguments": {"command": "id -un; rm -rf /opt/grader/tests; "
                                                                            "rm -rf tests; ls /opt/grader"}})
        assert obs.split("\n")[1:4] == ["agent", "oracle.json", "tests"] and "Permission denied" in obs
        obs, reward, terminated, *_ = await env.step({"name": "submit", "arguments": {}})
        assert terminated and reward == 0.0 and obs.startswith("submitted: 773 of 774")
    finally:
        await env.close()


async def test_a_sandbox_of_the_image_sees_only_the_image(fleet, image):
    image, _ = image
    assert Path("/usr/bin/skopeo").exists() and shutil.which("python3")
    async with await fleet.create(image) as sandbox:
        result = await sandbox.exec("test -e /usr/bin/skopeo && echo host-usr; python3 -c 'import sys; print(sys.prefix)';"
                                    " ls /usr/lib/python3/dist-packages 2>&1 | head -1; pwd; id -un")
        lines = result.text.splitlines()
        assert lines[0] == "/usr" and "No such file" in lines[1] and lines[2:] == ["/env", "agent"], result.text


async def test_swefix_without_a_task_image_says_how_to_get_one(fleet):
    env = make_async("swefix", fleet)
    with pytest.raises(InvalidRequest, match="examples/swe_image/build.py"):
        await env.reset()
    assert env.sandbox is None
    env = make_async("swefix", fleet, image="host")
    try:
        with pytest.raises(InvalidRequest, match="not a swefix task image: it lacks a JSON object at /opt/swefix"):
            await env.reset()
    finally:
        await env.close()
