"""The code interpreter (``/execute``, ``/contexts``) through the real ``e2b-code-interpreter`` SDK
against a real ``fanfold serve``: cells share state, output streams, errors, contexts, a timeout
interrupts the cell and keeps the state, other languages are refused."""

from __future__ import annotations

import asyncio

import pytest
from e2b.exceptions import TimeoutException
from e2b_code_interpreter import Sandbox
from e2b.exceptions import SandboxException

from fanfold import CreateParams


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


async def _events(cell) -> list[dict]:
    return [event async for event in cell]


async def test_a_cell_queued_on_an_ended_context_starts_no_kernel_that_would_block_a_pause(config):
    """A cell waiting on a context that a pause ends gets an error; it must not start a kernel that no
    one tracks (that exec would hold the sandbox, and the next pause would wait on it forever)."""
    from fanfold.engine import Engine
    from fanfold.integrations.e2b.interpreter import Kernels

    engine = Engine(config)
    await engine.start()
    try:
        info = await engine.create(CreateParams(deadline=120))
        kernels = Kernels(engine)
        kernel = kernels.get(info.id, None)
        running = kernel.execute("print('on', flush=True)\nimport time\ntime.sleep(60)", {})
        assert (await anext(running))["text"] == "on\n"  # the first cell holds the context
        queued = asyncio.ensure_future(_events(kernels.get(info.id, None).execute("1 + 1", {})))
        while not kernel.lock._waiters:  # until the queued cell waits on the context's lock
            await asyncio.sleep(0)
        await kernels.end(info.id)
        assert [e["name"] for e in await _events(running)] == ["KernelDied"]
        assert [e.get("name") for e in await queued] == ["KernelError"]
        await asyncio.wait_for(engine.suspend(info.id), 60)  # nothing left running in it
        await engine.kill(info.id)
    finally:
        await engine.close()


async def test_an_event_line_without_its_end_is_bounded_and_scanned_once(config):
    """Output that opens an event line and never ends it is printed text past MAX_EVENT, and each chunk
    is scanned once (it was rescanned whole on every chunk: quadratic, blocking the server)."""
    from fanfold.integrations.e2b import interpreter

    kernel = interpreter.Kernel(None, "sb-x", "ctx", None)  # type: ignore[arg-type]
    kernel._sink = sink = asyncio.Queue()
    chunk = b"x" * 65536
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "MAX_EVENT", 1 << 20)
        kernel._output("stdout", b"before\x1e")
        for _ in range(17):
            kernel._output("stdout", chunk)
        kernel._output("stdout", b'\n\x1e{"type": "result", "text": "1"}\nafter')
    got = [sink.get_nowait() for _ in range(sink.qsize())]
    assert [e["type"] for e in got] == ["stdout", "stdout", "stdout", "result", "stdout"]
    assert got[1]["text"] == "\x1e" + "x" * 17 * 65536 and got[-1]["text"] == "after"


async def test_a_client_that_falls_behind_loses_output_not_server_memory():
    from fanfold.integrations.e2b import interpreter

    kernel = interpreter.Kernel(None, "sb-x", "ctx", None)  # type: ignore[arg-type]
    kernel._sink = sink = asyncio.Queue()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "MAX_BACKLOG", 1 << 20)
        for _ in range(100):
            kernel._output("stdout", b"y" * 65536)
        kernel._output("stdout", b'\x1e{"type": "done", "execution_count": 1}\n\x1e{"type": "done"}\n')
    got = [sink.get_nowait() for _ in range(sink.qsize())]
    assert sum(len(e.get("text", "")) for e in got) < 2 << 20
    assert "output was dropped" in got[-2]["text"] and [e["type"] for e in got].count("done") == 1


def test_restart_ends_a_running_cell_and_bad_bodies_are_400s(e2b_env, server):
    import threading

    import httpx

    with Sandbox.create() as sbx:
        started = threading.Event()
        outcome: dict = {}

        def forever() -> None:
            outcome["cell"] = sbx.run_code("import time\nprint('in', flush=True)\ntime.sleep(600)",
                                           on_stdout=lambda _: started.set(), timeout=120)

        runner = threading.Thread(target=forever)
        runner.start()
        assert started.wait(60)
        sbx.restart_code_context("default-python")  # it waited for the cell to end: forever
        runner.join(60)
        assert outcome["cell"].error is not None and outcome["cell"].error.name == "KernelDied"
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
        url = f"{server.tcp_url}/e2b/envd/execute"
        assert httpx.post(url, headers=headers, json={"code": "1", "context_id": ["x"]}).status_code == 400
        assert httpx.post(url, headers=headers, content=b"x" * (17 << 20)).status_code == 400


async def test_contexts_of_a_sandbox_killed_elsewhere_are_forgotten(config):
    """A sandbox that ends outside the E2B endpoint (its deadline, a /v1 kill) takes its code contexts
    out of the server's table with it."""
    from fanfold.integrations.e2b.interpreter import kernels
    from fanfold.server.app import create_app

    app = create_app(config)
    async with app.router.lifespan_context(app):
        engine = app.state.engine
        info = await engine.create(CreateParams())
        kernel = kernels(app).get(info.id, None)
        events = [event async for event in kernel.execute("1 + 1", {})]
        assert events[0]["text"] == "2" and info.id in kernels(app).by_sandbox
        await engine.kill(info.id)
        await asyncio.gather(kernel.task, return_exceptions=True)
        assert info.id not in kernels(app).by_sandbox
