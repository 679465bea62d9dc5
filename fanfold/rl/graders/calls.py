"""The untrusted half of a grader: imports the code under test and answers calls with plain data.

Run as an unprivileged user by ``kit.run_untrusted``; reads ``{"path", "imports", "calls"}`` as
JSON on stdin, where each call is ``{"function": "module.name", "args": [...], "kwargs": {...}}``
or ``{"expr": "python expression"}`` (over the imported modules), and prints one JSON list: per
call ``{"value": ...}``, ``{"raised": "ExceptionName"}`` or ``{"unencodable": "type name"}``.
Only values of the exact JSON types travel: an object that claims to equal anything does not.
Nothing it prints is trusted: the grader compares the values with what it expects.
"""

import importlib
import json
import sys

_SCALARS = (str, int, float, bool, type(None))


def plain(value, depth=0):
    """``value`` as exact JSON types (tuples become lists), or raise TypeError."""
    kind = type(value)
    if depth > 50:
        raise TypeError("nested too deep")
    if kind in _SCALARS:
        return value
    if kind in (list, tuple):
        return [plain(item, depth + 1) for item in value]
    if kind is dict and all(type(key) is str for key in value):
        return {key: plain(item, depth + 1) for key, item in value.items()}
    raise TypeError(kind.__name__)


def answer(call, names):
    try:
        if "expr" in call:
            value = eval(call["expr"], dict(names))
        else:
            first, *rest = call["function"].split(".")
            function = names[first]
            for attr in rest:
                function = getattr(function, attr)
            value = function(*call.get("args", []), **call.get("kwargs", {}))
    except Exception as exc:
        return {"raised": type(exc).__name__}
    try:
        return {"value": plain(value)}
    except (TypeError, RecursionError) as exc:
        return {"unencodable": str(exc)}


def main():
    request = json.load(sys.stdin)
    sys.path.insert(0, request["path"])
    names = {}
    for name in request.get("imports", []):
        importlib.import_module(name)
        names[name.partition(".")[0]] = sys.modules[name.partition(".")[0]]
    print(json.dumps([answer(call, names) for call in request["calls"]]))


if __name__ == "__main__":
    main()
