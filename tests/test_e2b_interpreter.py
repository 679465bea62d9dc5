"""The code interpreter (``/execute``, ``/contexts``) through the real ``e2b-code-interpreter`` SDK
against a real ``fanfold serve``: cells share state, output streams, errors, contexts, a timeout
interrupts the cell and keeps the state, other languages are refused."""

from __future__ import annotations

import pytest
from e2b.exceptions import TimeoutException
from e2b_code_interpreter import Sandbox
from e2b.exceptions import SandboxException


@pytest.fixture
def e2b_env(server, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", server.tcp_url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", server.tcp_url + "/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.tokens["alice"])


def test_cells_share_state_stream_output_and_report_errors(e2b_env):
    with Sandbox.create() as sbx:
        printed: list[str] = []
        first = sbx.run_code("x = 20\nprint('side', x)\nx + 22", on_stdout=lambda m: printed.append(m.line))
        second = sbx.run_code("import os, sys\nprint('to err', file=sys.stderr)\nos.system('echo from a child')\nx * 2")
        failed = sbx.run_code("def f():\n    return missing\nf()")
    assert first.text == "42" and first.logs.stdout == ["side 20\n"] and printed == ["side 20\n"]
    assert first.error is None and first.results[0].is_main_result
    assert second.text == "40" and second.logs.stderr == ["to err\n"] and "from a child\n" in second.logs.stdout
    assert failed.error is not None and failed.error.name == "NameError" and "missing" in failed.error.value
    assert 'File "<cell>", line 2, in f' in failed.error.traceback and failed.text is None


def test_contexts_are_separate_namespaces_with_their_own_cwd(e2b_env):
    with Sandbox.create() as sbx:
        sbx.run_code("shared = 1")
        context = sbx.create_code_context(cwd="/tmp")
        where = sbx.run_code("import os; os.getcwd()", context=context)
        unseen = sbx.run_code("shared", context=context)
        listed = {c.id for c in sbx.list_code_contexts()}
        sbx.remove_code_context(context)
        after = {c.id for c in sbx.list_code_contexts()}
    assert where.text == "'/tmp'" and unseen.error is not None and unseen.error.name == "NameError"
    assert context.id in listed and context.id not in after


def test_a_timeout_interrupts_the_cell_and_keeps_the_state(e2b_env):
    with Sandbox.create() as sbx:
        sbx.run_code("kept = 'yes'")
        with pytest.raises(TimeoutException):
            sbx.run_code("import time\nwhile True: time.sleep(0.05)", timeout=1)
        after = sbx.run_code("kept")
        sbx.restart_code_context("default-python")
        restarted = sbx.run_code("kept")
    assert after.text == "'yes'"
    assert restarted.error is not None and restarted.error.name == "NameError"


def test_other_languages_are_refused_clearly(e2b_env):
    with Sandbox.create() as sbx:
        with pytest.raises(SandboxException, match="Python only"):
            sbx.run_code("console.log(1)", language="javascript")
