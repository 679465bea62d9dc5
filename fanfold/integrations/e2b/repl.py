"""The code interpreter's kernel, run inside a sandbox as ``python3 -u -c <this file>``: one
process per context, so names defined by one cell are there for the next, as in a Jupyter kernel.

Requests arrive on stdin, one JSON line each: ``{"code": ..., "env": {...}}``. Events leave on
stdout as ``\\x1e`` + JSON + newline: ``result`` (the last expression's ``repr``), ``error`` and,
last for each request, ``done``. What the cell prints (through ``sys.stdout`` or straight to
file descriptor 1, from a subprocess say) is plain text between events; the host tells the two
apart by the record separator. SIGINT interrupts the running cell (an ``error`` of
``KeyboardInterrupt``) and the kernel waits for the next one. Standard library only: it runs on
whatever Python the image has.
"""

import ast
import json
import os
import signal
import sys
import traceback

MARK = "\x1e"


def emit(event):
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, (MARK + json.dumps(event) + "\n").encode())


def run_cell(code, namespace):
    tree = ast.parse(code, "<cell>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is None:
        return
    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
    if value is None:
        return
    namespace["_"] = value
    event = {"type": "result", "text": repr(value), "is_main_result": True, "extra": {}}
    for method, key in (("_repr_html_", "html"), ("_repr_markdown_", "markdown"), ("_repr_json_", "json")):
        render = getattr(value, method, None)
        if callable(render):
            try:
                event[key] = render()
            except Exception:  # noqa: BLE001 - a broken renderer only loses that format
                pass
    emit(event)


def main():
    for stream in (sys.stdout, sys.stderr):  # whole lines, as a kernel's stream messages carry them
        stream.reconfigure(line_buffering=True, write_through=False)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    count = 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # an interrupt that came after its cell had ended
            continue
        if not line:
            return
        try:
            request = json.loads(line)
        except ValueError:
            continue
        count += 1
        saved = {key: os.environ.get(key) for key in request.get("env") or {}}
        os.environ.update(request.get("env") or {})
        try:
            run_cell(request.get("code", ""), namespace)
        except BaseException as err:  # noqa: BLE001 - every failure of a cell is the cell's error
            if isinstance(err, SystemExit):
                emit({"type": "error", "name": "SystemExit", "value": str(err.code), "traceback": ""})
            else:
                tb = err.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
                    tb = tb.tb_next  # the kernel's own frames are not the cell's
                text = "".join(traceback.format_exception(type(err), err, tb))
                emit({"type": "error", "name": type(err).__name__, "value": str(err), "traceback": text})
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        emit({"type": "done", "execution_count": count})


if __name__ == "__main__":
    main()
