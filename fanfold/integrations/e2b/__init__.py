"""An E2B-compatible endpoint on ``fanfold serve``: the unmodified ``e2b`` SDK works against fanfold
with ``E2B_API_URL=<server>/e2b``, ``E2B_SANDBOX_URL=<server>/e2b/envd`` and ``E2B_API_KEY=<token>``.

Written from E2B's public protocol (its REST API and envd's Connect services), not from its code:
``api`` is the control plane, ``envd`` the process service and what every envd route shares,
``filesystem`` the filesystem service and ``/files``, ``processes`` the table of running
commands, ``interpreter`` the code interpreter's ``/execute`` and ``/contexts`` (a Python process
per context, ``repl.py``), ``connect`` the Connect wire, ``hosts`` the sandbox hosts of ``get_host``, ``account`` the ``user``
account. ``router`` mounts them all under ``/e2b``; ``SandboxHosts`` goes around the app.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI

from . import api, envd, filesystem, interpreter
from .auth import envd_tokens
from .hosts import SandboxHosts
from .interpreter import close_kernels, kernels
from .processes import Processes


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Inside the app's own lifespan: starts after the engine, and ends every process before it closes."""
    engine = app.state.engine
    app.state.e2b = state = envd.E2B(processes=Processes(engine), tokens=envd_tokens(app))
    state.stoppers.append(kernels(app).end)
    unregister = engine.before_checkpoint(state.end_live)  # a checkpoint through /v1 too would wait on them
    try:
        yield
    finally:
        unregister()
        await close_kernels(app)
        await state.processes.close()


router = APIRouter(prefix="/e2b", lifespan=_lifespan)
for _part in (api.router, envd.router, filesystem.router, interpreter.router):
    router.include_router(_part)

__all__ = ["SandboxHosts", "router"]
