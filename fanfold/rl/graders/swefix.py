"""The swefix env's grader, run as root in a pristine sandbox of the task image holding only the
submitted library files: ``python3 swefix.py USER``, where USER runs the code under test.

Two children run as USER, one after the other (every process of USER is killed between them):
1. the oracle checks: call expressions over the library (task.json's ``oracle`` names a root-only
   file of ``{"imports", "checks": [{"expr", "expected"}]}``); the child sees the expressions, never
   the expected values, and the values it gives back are compared here;
2. the pristine suite (``suite.py``), whose counts are the library's claim, since the library
   runs in the suite's process.
Prints ``{"ran", "failed", "checks", "checks_failed"}``; the reward is 1 only when every check and
every test pass.
"""

import json
import os
import sys

try:
    from . import kit
except ImportError:  # run as a script in the grading sandbox, beside kit.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kit

TASK_FILE = "/opt/swefix/task.json"
TESTS = "/opt/grader/tests"
"""Where an image's pristine tests are unless task.json's ``tests`` says otherwise."""
HERE = os.path.dirname(os.path.abspath(__file__))


def oracle(task):
    """The oracle file task.json names, or no checks (images built before there were any)."""
    if not task.get("oracle"):
        return {"imports": [], "checks": []}
    with open(task["oracle"]) as handle:
        return json.load(handle)


def check(workdir, user, spec):
    """The expressions of the checks that failed."""
    checks = spec["checks"]
    if not checks:
        return []
    request = {"path": workdir, "imports": spec["imports"], "calls": [{"expr": c["expr"]} for c in checks]}
    try:
        answers = kit.run_untrusted([sys.executable, "-I", "-B", os.path.join(HERE, "calls.py")], user, request,
                                    cwd=workdir, timeout=60)
    except kit.NoAnswer:
        answers = None
    if not isinstance(answers, list) or len(answers) != len(checks):
        return [c["expr"] for c in checks]
    return [c["expr"] for c, answer in zip(checks, answers)
            if not (isinstance(answer, dict) and "value" in answer and kit.same(answer["value"], c["expected"]))]


def suite(workdir, user, tests):
    """(tests run, ids of those that failed) as the suite's child claims them, checked for shape."""
    request = {"path": workdir, "tests": tests, "top": os.path.dirname(tests.rstrip("/"))}
    try:
        claim = kit.run_untrusted([sys.executable, "-I", "-B", os.path.join(HERE, "suite.py")], user, request,
                                  cwd=workdir, timeout=300)
        ran, failed = claim["ran"], claim["failed"]
        if type(ran) is not int or ran < 0 or type(failed) is not list or not all(type(f) is str for f in failed):
            raise kit.NoAnswer("the suite's result is not {ran: int, failed: [str]}")
    except (kit.NoAnswer, KeyError, TypeError) as exc:
        return 0, ["<the suite gave no result: %s>" % str(exc)[:200]]
    return ran, [name[:300] for name in failed[:100]]


def main():
    user = sys.argv[1]
    with open(TASK_FILE) as handle:
        task = json.load(handle)
    workdir = task.get("workdir", "/env")
    checks = oracle(task)
    checks_failed = check(workdir, user, checks)
    ran, failed = suite(workdir, user, task.get("tests", TESTS))
    kit.report({"ran": ran, "failed": failed, "checks": len(checks["checks"]), "checks_failed": checks_failed})


if __name__ == "__main__":
    main()
