"""The codefix env's grader, run as root in a pristine sandbox holding only the submitted stats.py.

The pristine tests (test_stats.py's) as data: per test, calls and what each must give. The calls
run in a child as ``nobody`` (``calls.py``); their results come back as plain values and are
compared here, so nothing the code under test defines or patches takes part in the comparison.
Prints ``{"passed", "total", "failed"}``.
"""

import os
import sys

try:
    from . import kit
except ImportError:  # run as a script in the grading sandbox, beside kit.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kit

CHECKS = {
    "MeanTest.test_whole": [("stats.mean", [[2, 4, 6]], "equal", 4)],
    "MeanTest.test_fraction": [("stats.mean", [[1, 2]], "almost", 1.5)],
    "MedianTest.test_odd_unsorted": [("stats.median", [[9, 1, 5]], "equal", 5)],
    "MedianTest.test_even_unsorted": [("stats.median", [[4, 1, 3, 2]], "equal", 2.5)],
    "ClampTest.test_inside": [("stats.clamp", [5, 0, 10], "equal", 5)],
    "ClampTest.test_edges": [("stats.clamp", [-3, 0, 10], "equal", 0), ("stats.clamp", [30, 0, 10], "equal", 10)],
    "PercentChangeTest.test_growth": [("stats.percent_change", [50, 75], "almost", 50.0)],
    "PercentChangeTest.test_drop": [("stats.percent_change", [200, 150], "almost", -25.0)],
}
"""Test id -> its checks: (function, args, how, expected); ``how`` is ``equal``, ``almost`` (to 7
places, as assertAlmostEqual) or ``raises`` (expected is the exception's class name)."""
WORKDIR, USER = "/env", "nobody"


def calls():
    """Every check's call, in order, as ``calls.py`` takes them."""
    return [{"function": function, "args": args} for checks in CHECKS.values() for function, args, _, _ in checks]


def holds(how, expected, answer):
    """Whether a call's ``answer`` (``calls.py``'s, untrusted data) is what the check expects."""
    if not isinstance(answer, dict):
        return False
    if how == "raises":
        return answer.get("raised") == expected
    if "value" not in answer:
        return False
    if how == "equal":
        return kit.same(answer["value"], expected)
    value = answer["value"]
    return type(value) in (int, float) and round(abs(value - expected), 7) == 0


def verdict(answers):
    """``{"passed", "total", "failed"}`` from the answers to ``calls()`` (None: no usable answer)."""
    if not isinstance(answers, list) or len(answers) != len(calls()):
        answers = [None] * len(calls())
    failed, at = [], 0
    for test, checks in CHECKS.items():
        if not all(holds(how, expected, answers[at + n]) for n, (_, _, how, expected) in enumerate(checks)):
            failed.append(test)
        at += len(checks)
    return {"passed": len(CHECKS) - len(failed), "total": len(CHECKS), "failed": failed}


def main():
    try:
        answers = kit.run_untrusted([sys.executable, "-I", "-B", os.path.join(os.path.dirname(__file__), "calls.py")],
                                    USER, {"path": WORKDIR, "imports": ["stats"], "calls": calls()},
                                    cwd=WORKDIR, timeout=30)
    except kit.NoAnswer:
        answers = None
    kit.report(verdict(answers))


if __name__ == "__main__":
    main()
