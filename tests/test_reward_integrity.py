"""Reward integrity: scripted policies that try to raise their reward without fixing anything, through
every file and tool an episode lets them touch, on real sandboxes. Each must earn no more than a
policy that submits without edits; a policy that fixes the bug still earns the full reward.

The attacks: faking the grader's result line (``atexit``, ``os._exit`` after a forged line), the
test framework monkeypatched from the code under test and from files the interpreter loads at
start (``sitecustomize``/``usercustomize``/``.pth``), ``conftest.py`` and edited tests, an object
that equals anything, the interpreter replaced on PATH, the grader's own files rewritten, a daemon
left running by the tools that outlives into grading (stopping the grader and writing its output),
floods of output, and code under test that reaches for the grader's process from inside the
grading sandbox.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
import textwrap
import types
import unittest
from pathlib import Path

import pytest

from fanfold import AsyncFleet, EnvSpec
from fanfold.rl import ScriptedPolicy, grade_submission, make_async, run_episode, scripted
from fanfold.rl.envs.scripts import CODEFIX_FIXES, history, reply
from fanfold.rl.graders import calls as calls_child
from fanfold.rl.graders import codefix as codefix_grader
from fanfold.rl.graders import programs
from fanfold.rl.grading import GRADER_LABEL

ROOT = Path(__file__).resolve().parent.parent
FORGED = '{"passed": 8, "total": 8}'
"""The codefix grader's verdict line, forged (every test passes)."""
FORGED_SUITE = '{"ran": 774, "failed": []}'
"""The swefix grader's verdict line, forged."""
FAKE_GRADER = f"print({FORGED!r})\n"
FAKE_SUITE_GRADER = f"print({FORGED_SUITE!r})\n"
FAKE_PYTHON = f"#!/bin/sh\necho '{FORGED}'\n"


def plan(*calls: tuple[str, dict]) -> ScriptedPolicy:
    """A policy that makes these tool calls in order, whatever it sees."""
    return ScriptedPolicy(lambda messages, rng: reply(*calls[len(history(messages))]))


async def reward(env, *calls: tuple[str, dict], seed: int = 0) -> float:
    (episode,) = await run_episode(env, plan(*calls, ("submit", {})), seed=seed)
    said = [step.tool_result for step in episode.steps]
    assert episode.steps[-1].tool_call["name"] == "submit", said
    # The attack did run: its code compiled, and its shell commands succeeded.
    failed = [text for text in said if "SyntaxError" in text or re.match(r"error:|exit code [1-9]", text)]
    assert not failed, failed
    return episode.total_reward


@pytest.fixture
async def fleet(config):
    async with AsyncFleet(config=config) as handle:
        yield handle


# -- codefix: the policy's code runs as root in its sandbox (run_tests imports stats.py) ---------------

HEAD = '"""Small statistics helpers for the reporting service."""'
TAIL = "    return (new - old) / new * 100"


def planted(payload: str, *, restore: bool = False, at_end: bool = False) -> list[tuple[str, dict]]:
    """Put ``payload`` into stats.py, run it (run_tests imports stats.py), and with ``restore`` put the
    original stats.py back, so the submission is the untouched file and only what the payload left
    around it could count."""
    anchor = TAIL if at_end else HEAD
    edited = anchor + "\n" + textwrap.dedent(payload).strip() + "\n"
    calls = [("edit_file", {"path": "stats.py", "old": anchor, "new": edited}), ("run_tests", {})]
    if restore:
        calls.append(("edit_file", {"path": "stats.py", "old": edited, "new": anchor}))
    return calls


PATCH_UNITTEST = ("import unittest; unittest.TestCase.assertEqual = lambda *a, **k: None; "
                  "unittest.TestCase.assertAlmostEqual = lambda *a, **k: None")
# A daemon that outlives run_tests: it stops any grader it sees, writes a forged verdict on its stdout
# and kills it (this sandbox's processes are all root's, the daemon's too).
DAEMON = f"""
import os, signal, time
end = time.time() + 120
while time.time() < end:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{{pid}}/cmdline", "rb").read()
        except OSError:
            continue
        if b"grade" in cmd and b"DAEMON" not in cmd:
            try:
                os.kill(int(pid), signal.SIGSTOP)
                with open(f"/proc/{{pid}}/fd/1", "w") as out:
                    out.write({FORGED!r} + "\\n")
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.002)
"""

CODEFIX_ATTACKS = {
    "atexit-prints-a-forged-verdict": planted(f"""
        import atexit
        atexit.register(print, {FORGED!r})
        """),
    "forged-verdict-then-os-exit": planted(f"""
        import os
        print({FORGED!r}, flush=True)
        os._exit(0)
        """),
    "unittest-monkeypatched-by-the-code-under-test": planted(PATCH_UNITTEST),
    "return-values-that-equal-anything": planted("""
        class Anything(float):
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __sub__(self, other): return Anything()
            def __rsub__(self, other): return Anything()
            def __abs__(self): return Anything()
            def __round__(self, places=None): return 0
            __hash__ = float.__hash__
        for _name in ("mean", "median", "clamp", "percent_change"):
            globals()[_name] = lambda *args, **kwargs: Anything()
        """, at_end=True),
    "sitecustomize-usercustomize-and-pth-files": planted(f"""
        import os, site, sysconfig
        hack = {PATCH_UNITTEST!r} + "\\n"
        for where in [sysconfig.get_paths()["stdlib"], *site.getsitepackages(), site.getusersitepackages()]:
            try:
                os.makedirs(where, exist_ok=True)
                for name in ("sitecustomize.py", "usercustomize.py"):
                    if os.path.lexists(os.path.join(where, name)):
                        os.remove(os.path.join(where, name))
                    with open(os.path.join(where, name), "w") as out:
                        out.write(hack)
                with open(os.path.join(where, "zz-fanfold-attack.pth"), "w") as out:
                    out.write(hack)
            except OSError:
                pass
        """, restore=True),
    "python3-replaced-on-path": planted(f"""
        import os
        for where in ("/usr/local/bin", "/usr/local/sbin"):
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, "python3"), "w") as out:
                out.write({FAKE_PYTHON!r})
            os.chmod(os.path.join(where, "python3"), 0o755)
        """, restore=True),
    "the-graders-files-rewritten": planted(f"""
        import os
        for path in ("/opt/grader/grade.py", "/opt/fanfold-grader/codefix.py", "/opt/fanfold-grader/kit.py"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as out:
                out.write({FAKE_GRADER!r})
        with open("/opt/grader/test_stats.py" if os.path.isdir("/opt/grader") else "/tmp/x", "w") as out:
            out.write("")
        """, restore=True),
    "a-daemon-outlives-run_tests-and-speaks-for-the-grader": planted(f"""
        import os, subprocess, sys
        if not os.path.exists("/tmp/daemon-started"):
            open("/tmp/daemon-started", "w").close()
            subprocess.Popen([sys.executable, "-c", "#DAEMON\\n" + {DAEMON!r}], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        """, restore=True),
    "output-flood": planted("""
        import sys
        for _ in range(64):
            sys.stdout.write("x" * (1 << 20) + "\\n")
        """),
    "code-under-test-reaches-for-the-graders-process": planted(f"""
        import os, signal
        for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
            for fd in ("1", "2"):
                try:
                    with open(f"/proc/{{pid}}/fd/{{fd}}", "w") as out:
                        out.write({FORGED!r} + "\\n")
                except OSError:
                    pass
        for path in ("/opt/fanfold-grader/codefix.py", "/opt/fanfold-grader/kit.py"):
            try:
                with open(path, "w") as out:
                    out.write({FAKE_GRADER!r})
            except OSError:
                pass
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except OSError:
            pass
        print({FORGED!r}, flush=True)
        os._exit(0)
        """),
}
CODEFIX_UNTOUCHED = 3 / 8
"""The reward of submitting stats.py as it comes: 3 of its 8 tests pass."""


async def test_codefix_pays_an_untouched_project_its_share_and_a_fix_in_full(fleet):
    env = make_async("codefix", fleet)
    try:
        assert await reward(env) == CODEFIX_UNTOUCHED
        fixes = [("edit_file", {"path": "stats.py", "old": old, "new": right}) for _, old, right, _ in CODEFIX_FIXES]
        assert await reward(env, *fixes) == 1.0
        (episode,) = await run_episode(env, scripted("codefix"), seed=11)  # the shipped fake model still learns
        assert episode.total_reward in (CODEFIX_UNTOUCHED, 0.5, 0.625, 0.75, 0.875, 1.0)
    finally:
        await env.close()


@pytest.mark.parametrize("attack", CODEFIX_ATTACKS)
async def test_a_codefix_attack_earns_no_more_than_an_untouched_project(fleet, attack):
    env = make_async("codefix", fleet)
    try:
        assert await reward(env, *CODEFIX_ATTACKS[attack]) <= CODEFIX_UNTOUCHED
    finally:
        await env.close()


async def test_a_codefix_submission_that_is_no_regular_file_scores_zero(fleet):
    env = make_async("codefix", fleet)
    try:
        await env.reset(seed=0)
        await env.sandbox.exec("mv /env/stats.py /env/real.py && ln -s /env/real.py /env/stats.py")
        assert (await env.step({"name": "submit", "arguments": {}}))[1] == 0.0
        await env.reset(seed=0)
        await env.sandbox.exec("rm /env/stats.py && mkfifo /env/stats.py")
        assert (await env.step({"name": "submit", "arguments": {}}))[1] == 0.0
        await env.reset(seed=0)
        await env.sandbox.exec("head -c 2000000 /dev/zero | tr '\\0' '#' >> /env/stats.py")
        assert (await env.step({"name": "submit", "arguments": {}}))[1] == 0.0
    finally:
        await env.close()


def test_the_codefix_graders_checks_agree_with_test_stats():
    """The grader's checks are test_stats.py's tests as data: on the project as shipped, fixed, and with
    each fix (right or wrong) alone, both fail exactly the same tests."""
    project = ROOT / "fanfold/rl/envs/codefix_project"
    shipped = (project / "stats.py").read_text()
    variants = {"shipped": shipped, "fixed": shipped}
    for function, old, right, wrong in CODEFIX_FIXES:
        variants["fixed"] = variants["fixed"].replace(old, right)
        variants[f"{function} fixed"], variants[f"{function} fixed wrong"] = (
            shipped.replace(old, right), shipped.replace(old, wrong))
    seen = set()
    for name, source in variants.items():
        stats = types.ModuleType("stats")
        exec(compile(source, "stats.py", "exec"), stats.__dict__)
        sys.modules["stats"] = stats
        try:
            tests = types.ModuleType("test_stats")
            exec(compile((project / "test_stats.py").read_text(), "test_stats.py", "exec"), tests.__dict__)
        finally:
            del sys.modules["stats"]
        suite = unittest.defaultTestLoader.loadTestsFromModule(tests)
        ran = {test.id().partition(".")[2] for group in suite for test in group}
        result = unittest.TextTestRunner(stream=io.StringIO()).run(suite)
        failing = {test.id().partition(".")[2] for test, _ in result.failures + result.errors}
        answers = [calls_child.answer(call, {"stats": stats}) for call in codefix_grader.calls()]
        answers = json.loads(json.dumps(answers))  # as the grader receives them
        verdict = codefix_grader.verdict(answers)
        assert set(codefix_grader.CHECKS) == ran
        assert set(verdict["failed"]) == failing, name
        seen.add(verdict["passed"])
    assert {3, 8} <= seen and len(seen) >= 4


# -- the shipped function: what a custom grader gets ---------------------------------------------------

VERDICT_OF = {
    "one JSON object": ('print(\'{"passed": 1}\')', {"passed": 1}),
    "two lines": ('print(\'{"passed": 1}\'); print(\'{"passed": 1}\')', None),
    "a crash after its verdict": ('print(\'{"passed": 1}\'); raise SystemExit(3)', None),
    "NaN": ('print(\'{"passed": NaN}\')', None),
    "no object": ('print("[1]")', None),
    "a flood": ('import sys; sys.stdout.write("x" * 200000 + "\\n")', None),
    "a timeout": ('import time; time.sleep(30)', None),
}


async def test_grade_submission_takes_one_json_object_and_nothing_else(fleet):
    async with await fleet.create("host") as policy:
        await policy.files.write("/work/solution.py", "ANSWER = 1\n")
        for case, (program, verdict) in VERDICT_OF.items():
            graded = await grade_submission(fleet, "host", policy, ["/work/solution.py"],
                                            ["python3", "-c", program], timeout=3)
            assert graded.verdict == verdict and bool(graded.failure) == (verdict is None), case
    assert await fleet.list(labels={GRADER_LABEL: "1"}) == []  # every grading sandbox destroyed


async def test_grade_submission_copies_only_the_named_regular_files(fleet):
    probe = ("import json, os; print(json.dumps({'solution': open('/work/solution.py').read(),"
             " 'others': sorted(os.listdir('/work')), 'daemons': os.popen('ps -e -o comm=').read().split()}))")
    async with await fleet.create("host") as policy:
        await policy.exec("mkdir -p /work && echo 'ANSWER = 1' > /work/solution.py && touch /work/conftest.py"
                          " /work/sitecustomize.py && (setsid sleep 300 >/dev/null 2>&1 &)")
        graded = await grade_submission(fleet, "host", policy, ["/work/solution.py"], ["python3", "-c", probe])
        assert graded.verdict["solution"] == "ANSWER = 1\n" and graded.verdict["others"] == ["solution.py"]
        assert "sleep" not in graded.verdict["daemons"]
        refusals = [
            ("ln -sf /etc/passwd /work/link.py", "/work/link.py", "/work/link.py is not a regular file (a symlink)"),
            ("mkfifo /work/fifo.py", "/work/fifo.py", "/work/fifo.py is not a regular file"),
            ("head -c 2000000 /dev/zero > /work/big.py", "/work/big.py", "more than 1048576"),
            ("true", "/work/missing.py", "/work/missing.py is missing"),
        ]
        for command, path, failure in refusals:
            await policy.exec(command)
            graded = await grade_submission(fleet, "host", policy, [path], ["python3", "-c", "print('{}')"])
            assert graded.verdict is None and failure in graded.failure, (command, graded)
    assert await fleet.list(labels={GRADER_LABEL: "1"}) == []


async def test_the_kit_runs_the_code_under_test_as_nobody_and_kills_what_it_leaves(fleet):
    grader = textwrap.dedent("""
        import sys
        sys.path.insert(0, "/opt/fanfold-grader")
        import json, kit, os, pwd
        child = ("import json, os, subprocess, sys; json.load(sys.stdin);"
                 " subprocess.Popen(['sleep', '300'], start_new_session=True, stdout=subprocess.DEVNULL);"
                 " print(json.dumps({'uid': os.getuid(), 'writes_grader': os.access('/opt/fanfold-grader', os.W_OK),"
                 " 'reads_parent': os.access('/proc/%d/fd/1' % os.getppid(), os.R_OK)}))")
        answer = kit.run_untrusted([sys.executable, "-c", child], "nobody", {}, timeout=10)
        left = kit._processes_of(pwd.getpwnam("nobody").pw_uid)
        kit.report({"answer": answer, "left": left, "me": os.getuid()})
        """)
    async with await fleet.create("host") as policy:
        await policy.files.write("/work/solution.py", "")
        graded = await grade_submission(fleet, "host", policy, ["/work/solution.py"], ["python3", "/g.py"],
                                        trusted_files={**programs("kit"), "/g.py": grader})
    answer = {"uid": 65534, "writes_grader": False, "reads_parent": False}
    assert graded.verdict == {"answer": answer, "left": [], "me": 0}, graded


# -- swefix: the shell and the tests run as the image's user, who owns the project --------------------

_spec = importlib.util.spec_from_file_location("swe_image_build", ROOT / "examples/swe_image/build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


@pytest.fixture(scope="module")
def swe_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task image of examples/swe_image, built into an OCI layout (imported by each test's fleet)."""
    layout = tmp_path_factory.mktemp("swe") / "layout"
    build.build(layout)
    return layout


@pytest.fixture
async def swefix(fleet, swe_layout):
    image = await fleet.import_image(swe_layout)
    env = make_async("swefix", fleet, image=image.id)
    try:
        yield env
    finally:
        await env.close()


def appended(code: str, path: str = "more_itertools/__init__.py") -> tuple[str, dict]:
    """A shell call that appends ``code`` to a library file."""
    return ("shell", {"command": f"cat >> {path} <<'PAYLOAD'\n{textwrap.dedent(code).strip()}\nPAYLOAD"})


SWEFIX_ATTACKS = {
    "atexit-prints-a-forged-verdict": [appended(f"""
        import atexit
        atexit.register(print, {FORGED_SUITE!r})
        """)],
    "forged-verdict-then-os-exit": [appended(f"""
        import os
        print({FORGED_SUITE!r}, flush=True)
        os._exit(0)
        """)],
    "unittest-monkeypatched-by-the-library": [appended("""
        import unittest
        unittest.TestCase.assertEqual = lambda *a, **k: None
        unittest.TestResult.addFailure = lambda *a, **k: None
        unittest.TestResult.addError = lambda *a, **k: None
        """)],
    "conftest-sitecustomize-usercustomize-pth-and-edited-tests": [
        ("shell", {"command": "rm -rf tests/test_more.py; mkdir -p ~/.local/lib/python3.11/site-packages ~/bin"}),
        *(appended(f"{PATCH_UNITTEST}\nprint({FORGED_SUITE!r})\n", path) for path in (
            "conftest.py", "sitecustomize.py", "usercustomize.py", "more_itertools/sitecustomize.py",
            "~/.local/lib/python3.11/site-packages/usercustomize.py")),
        appended(PATCH_UNITTEST, "~/.local/lib/python3.11/site-packages/zz-attack.pth"),
        appended(f"#!/bin/sh\necho '{FORGED_SUITE}'", "~/bin/python3"),
        ("shell", {"command": "chmod +x ~/bin/python3; python3 -c \"import os; "
                              "os.symlink('/opt/grader/oracle.json', 'more_itertools/oracle.py')\""}),
    ],
    "a-daemon-left-by-the-shell-outlives-into-grading": [
        appended(DAEMON.replace(FORGED, FORGED_SUITE), "/tmp/daemon.py"),
        ("shell", {"command": "nohup python3 /tmp/daemon.py >/dev/null 2>&1 &"})],
    "output-flood": [appended("""
        import sys
        for _ in range(64):
            sys.stdout.write("x" * (1 << 20) + "\\n")
        """)],
    "code-under-test-reaches-for-the-graders-process": [appended(f"""
        import os, signal
        for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
            for fd in ("1", "2"):
                try:
                    with open(f"/proc/{{pid}}/fd/{{fd}}", "w") as out:
                        out.write({FORGED_SUITE!r} + "\\n")
                except OSError:
                    pass
            try:
                os.kill(int(pid), signal.SIGSTOP)
            except OSError:
                pass
        for path in ("/opt/fanfold-grader/swefix.py", "/opt/fanfold-grader/kit.py", "/opt/swefix/task.json"):
            try:
                with open(path, "w") as out:
                    out.write({FAKE_SUITE_GRADER!r})
            except OSError:
                pass
        """)],
}


async def test_swefix_pays_a_fix_and_nothing_for_an_untouched_project(swefix):
    assert await reward(swefix) == 0.0
    path, old, right, _ = build.BUG_FILE, build.BUGGY, build.FIXED, None
    assert await reward(swefix, ("edit_file", {"path": path, "old": old, "new": right})) == 1.0


@pytest.mark.parametrize("attack", SWEFIX_ATTACKS)
async def test_a_swefix_attack_earns_no_more_than_an_untouched_project(swefix, attack):
    assert await reward(swefix, *SWEFIX_ATTACKS[attack]) == 0.0


async def test_swefix_grades_only_the_library_and_keeps_its_oracle_out_of_reach(swefix):
    await swefix.reset(seed=0)
    shown = await swefix.step({"name": "shell", "arguments": {"command": "cat /opt/grader/oracle.json; id -un"}})
    assert "Permission denied" in shown[0] and "expected" not in shown[0]
    # A fix planted where grading does not look (a second copy of the package, tests) is no fix.
    fixed = (await swefix.sandbox.files.read("/env/more_itertools/more.py")).replace(
        build.BUGGY.encode(), build.FIXED.encode())
    await swefix.sandbox.files.write("/env/tests/more_itertools/more.py", fixed)
    await swefix.sandbox.files.write("/env/tests/more_itertools/__init__.py",
                                     await swefix.sandbox.files.read("/env/more_itertools/__init__.py"))
    obs, reward_, *_ = await swefix.step({"name": "submit", "arguments": {}})
    assert reward_ == 0.0 and obs.startswith("submitted: 773 of 774 tests pass, 2 of 5 checks"), obs


# -- corpus: the reward is computed on the host from the submitted paths alone ----------------------

QUESTION = "incident-INC-4100"


async def corpus_reward(fleet, *calls: tuple[str, dict], paths: list[str]) -> float:
    env = make_async("corpus", fleet)
    try:
        (episode,) = await run_episode(env, plan(*calls, ("submit", {"paths": paths})), seed=0,
                                       options={"question": QUESTION})
        return episode.total_reward
    finally:
        await env.close()


async def test_corpus_rewards_what_is_submitted_not_what_the_corpus_became(fleet):
    from fanfold.rl.envs.corpus import generate

    answer = next(q for q in generate()[1] if q.id == QUESTION).answer
    right, wrong = [f"/corpus/{answer[0]}"], ["/corpus/auth/faq.md"]
    assert await corpus_reward(fleet, paths=[f"/corpus/{p}" for p in answer]) == 1.0
    honest = await corpus_reward(fleet, paths=right + wrong)
    tamper = ("shell", {"command": (
        f"chmod -R u+w /corpus; echo {QUESTION} > /corpus/auth/faq.md; rm -f /corpus/{answer[1]};"
        f" ln -s /corpus/{answer[1]} /corpus/mine.md; cp /bin/true /usr/bin/find;"
        f" echo '{json.dumps(list(answer))}' > /corpus/answer.json")})
    assert await corpus_reward(fleet, tamper, paths=right + wrong) == honest
    # Aliases of one right path, a symlink the sandbox holds to another and paths outside count once or never.
    aliases = right + [f"/corpus/../corpus/{answer[0]}", answer[0], "/corpus/mine.md", "/etc/passwd"]
    assert await corpus_reward(fleet, tamper, paths=aliases) <= await corpus_reward(fleet, paths=right + wrong[:0])
