"""The untrusted half of the swefix grader: the task's pristine unittest suite against the project,
as the task's unprivileged user; prints ``{"ran", "failed"}``.

The library runs in this very process, so what this prints is the library's claim, not a fact: the
trusted grader (``swefix.py``) pays only when its out-of-process oracle checks pass as well. What
is here is defence in depth against a library that fakes the suite's result in-process: an audit
hook ends the process on ctypes, gc introspection, swapped code objects and frames of the runner
handed out; and the framework's classes and functions, fingerprinted before the library
loads, must be the same after the run. What stays possible in-process: a trace function (doctest sets
one, so tracing cannot be refused), walking up from a frame of the library's own, rebinding what
the fingerprint does not cover, or printing a result and exiting first: the trusted side reads any
of these as a claim, and the oracle checks decide.
"""

import io
import json
import os
import sys
import unittest

_FRAMEWORK = ("unittest", "json", "io", "os", "sys", "builtins")
_EVENTS = {"gc.get_referrers", "gc.get_referents", "gc.get_objects", "sys._current_frames"}
_PROTECTED = {os.path.abspath(__file__), os.path.dirname(os.path.abspath(unittest.__file__))}
TAMPERED = 86
"""This process's exit status when the audit hook stops it."""


def _runner_frame(frame):
    """A frame of the runner's at work (a module's top level is not: namedtuple asks for those)."""
    if frame.f_code.co_name == "<module>":
        return False
    name = os.path.abspath(frame.f_code.co_filename)
    return name in _PROTECTED or os.path.dirname(name) in _PROTECTED


def audit(event, args):
    """Stop at once (no handler can catch it) on what only a result-faking library needs."""
    if (event in _EVENTS or event.startswith("ctypes.")
            or (event == "import" and args[0] in ("ctypes", "_ctypes"))
            or (event == "object.__setattr__" and args[1] == "__code__")
            or (event == "sys._getframe" and args and _runner_frame(args[0]))):
        os._exit(TAMPERED)


def fingerprint():
    """Identity of every framework module's names and of every attribute of its classes."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _FRAMEWORK:
            continue
        seen[name] = id(module)
        for key, value in list(vars(module).items()):
            seen[(name, key)] = id(value)
            if isinstance(value, type) and getattr(value, "__module__", "").split(".")[0] in _FRAMEWORK:
                for attr, member in list(vars(value).items()):
                    seen[(name, key, attr)] = id(member)
    return seen


def main():
    request = json.load(sys.stdin)
    out = os.fdopen(os.dup(1), "w")  # the output, kept aside before the library can touch fd 1
    sys.path[:0] = [request["top"], request["path"]]
    before = fingerprint()
    sys.addaudithook(audit)
    try:
        suite = unittest.defaultTestLoader.discover(request["tests"], top_level_dir=request["top"])
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
        ran, failed = result.testsRun, sorted({test.id() for test, _ in result.failures + result.errors})
    except BaseException as exc:  # the project no longer imports, or it exits: nothing passes
        ran, failed = 0, ["<%s: %s>" % (type(exc).__name__, str(exc)[:200])]
    after = fingerprint()
    if any(after.get(key) != value for key, value in before.items()):
        ran, failed = 0, ["<the test framework was changed during the run>"]
    out.write(json.dumps({"ran": ran, "failed": failed}) + "\n")
    out.flush()
    os._exit(0)  # no atexit handler or finalizer of the library runs after the result


if __name__ == "__main__":
    main()
