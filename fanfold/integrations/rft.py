"""OpenAI Agent RFT's tool and grader endpoints on ``fanfold serve``, over the rollout service
(docs/design/integrations.md, section 5).

Agent RFT POSTs each tool call to the tool's ``server_url`` with the headers the job names
(``Authorization: Bearer <fanfold token>``), and each finished rollout to an endpoint grader:

- ``POST /v1/rft/tools/{name}`` (or ``POST /v1/rft/tools``, the tool named by the body's ``name``):
  ``{"type": "function_call", "id", "call_id", "name", "arguments": "<JSON>", "trace_id", "item"}``
  runs one of fanfold's tools (shell, read_file, write_file, search) and answers
  ``{"type": "function_call_output", "call_id", "id", "output"}``.
- ``POST /v1/rft/grade/{env}``: ``{"sample", "item", "trace_id"}`` answers ``{"score"}``, the env's
  reward over the trace's sandbox (``codefix``: the share of its pristine tests that pass;
  ``swefix``: 1 or 0), and then ends the rollout, destroying its sandbox. The env grades in a
  fresh sandbox of the rollout's image with only the submitted files copied in
  (``fanfold.rl.grading``): a submission its grader cannot score (a crash, a timeout, output that
  is not its verdict) scores 0, not an error Agent RFT would retry.

``trace_id`` is the rollout id (same for every call of a rollout). The rollout is made on its
first call, its sandbox from, in this order: the item's ``image`` field, the URL's ``?image=``,
the golden image of the URL's ``?env=`` (what its grader needs: give the tool URLs
``?env=codefix`` to grade with ``/v1/rft/grade/codefix``), else ``host``; it ends after
``?deadline=`` seconds (default an hour) unless graded first. A rollout made beforehand with
``POST /v1/rollouts`` under the trace id (for a snapshot, limits or a network) is used as it is;
to be graded, it carries the label ``rft_env=<env>``. The tools are fanfold's four whatever the
env (not codefix's own edit_file, run_tests and submit); the env gives the image and the reward.

Status codes, chosen for what Agent RFT does with them: a 4xx is shown to the model, a 5xx is
retried three times and then the rollout is discarded (never trained on).

- 200 with the output; the same ``X-Request-ID`` (else the same trace and ``call_id``) replays it.
- 422 ``{"kind", "message"}``: the model's mistake (an unknown tool, arguments that are not JSON or
  not the tool's, a missing file). The body has no ``output``, since the docs say a 4xx without
  one is serialized for the model (what a 4xx with one shows is not documented). A request
  fanfold cannot serve as sent (a malformed trace id, an unknown image or env) is a 4xx too.
- 401 a bad token.
- 410 a rollout that cannot go on: its deadline passed or its sandbox was destroyed. The model
  sees it; the grader then answers 410 too, so Agent RFT discards the rollout.
- 503 with Retry-After: whatever is not the model's doing and may pass (capacity, a quota, the
  host failing), so that Agent RFT retries it, and discards the rollout if it persists. 429 is
  never used: only a 5xx is documented as retried.

The grader answers 404 for an unknown env and 422 for one without a grader over a sandbox
(``corpus`` scores its ``submit`` call) or a rollout made for another env. A trace with no
rollout is one whose model called no tool: the env as it starts is graded (a sandbox is made
for it and destroyed), as the reward of doing nothing. A grader token of another tenant than the
tools' sees none of their rollouts, so it would grade every trace that way. A retried grade
replays the first score for an hour.
"""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from .._extras import MissingExtra
from ..client import AsyncFleet, AsyncSandbox
from ..engine import Engine
from ..errors import InvalidRequest, NotFound, QuotaExceeded, Retryable, SandboxGone, SandboxNotFound, ToolError
from ..web.deps import RequestID, tenant
from ..web.rollouts import Reply, app_rollouts, check_rollout, ms_since, reply_response
from ..web.schemas import ROLLOUT_DEADLINE_MAX, ROLLOUT_ID, ErrorBody, FunctionCall, RolloutRequest
from ..web.status import error_response

ENV_LABEL = "rft_env"
"""The label of a rollout made for an env's grader: the env's name."""
DEFAULT_DEADLINE_S = 3600.0

TraceID = Field(min_length=1, max_length=128, pattern=ROLLOUT_ID, description=(
    "The rollout's id, the same for every call of a rollout (Agent RFT's: trace_ and a UUID)."))


class _RftRoute(APIRoute):
    """Failures that may pass answer 503, which Agent RFT retries (a 429 it would show the model);
    a rollout that is over 410, as on the rollout routes."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except (Retryable, QuotaExceeded) as err:
                return error_response(err, 503)
            except SandboxGone as err:
                return error_response(err, 410)

        return route


router = APIRouter(prefix="/v1/rft", tags=["rft"], route_class=_RftRoute)
RESPONSES: dict[int | str, dict[str, Any]] = {
    **{code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422)},
    410: {"model": ErrorBody, "description": "The rollout is over: its deadline passed or its sandbox was destroyed."},
    503: {"model": ErrorBody, "description": "Not the model's doing: Agent RFT retries, then discards the rollout."},
}


class RftCall(FunctionCall):
    """A function_call as Agent RFT sends it: the Responses API item, its rollout and its dataset row."""

    trace_id: str = TraceID
    item: dict[str, Any] = Field(default_factory=dict, description=(
        "The dataset row; a string `image` in it names the image the rollout's sandbox is made from."))


class RftOutput(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    id: str | None = Field(None, description="The call's id, echoed.")
    output: str
    status: Literal["completed"] = "completed"


class GradeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    sample: dict[str, Any] = Field(default_factory=dict, description="The model's final output (unused: the sandbox is graded).")
    item: dict[str, Any] = Field(default_factory=dict, description="The dataset row.")
    trace_id: str = TraceID


class GradeBody(BaseModel):
    score: float


ImageQuery = Query(None, min_length=1, max_length=256, description=(
    "The image (or snapshot) a new rollout's sandbox is made from, unless the item names one."))
EnvQuery = Query(None, min_length=1, max_length=64, description=(
    "An env (codefix, swefix) whose golden image a new rollout's sandbox is made from, for its grader."))
DeadlineQuery = Query(DEFAULT_DEADLINE_S, gt=0, le=ROLLOUT_DEADLINE_MAX, description=(
    "Seconds after its first call that a rollout ends, its sandbox destroyed, unless graded first."))
EnvName = Path(min_length=1, max_length=64, description="The env whose reward scores the sandbox: codefix or swefix.")


# -- tools ------------------------------------------------------------------------------------------

TOOL_RESPONSES = {**RESPONSES, 422: {"model": ErrorBody, "description": (
    "The model's mistake (unknown tool, bad arguments, a missing file), shown to the model; no `output` field.")}}


@router.post("/tools/{name}", response_model=RftOutput, responses=TOOL_RESPONSES)
async def call_tool(body: RftCall, request: Request, name: str = Path(min_length=1, max_length=64, description=(
                        "shell, read_file, write_file or search: one tool URL per name.")),
                    image: str | None = ImageQuery, env: str | None = EnvQuery, deadline: float = DeadlineQuery,
                    caller: str = Depends(tenant), request_id: str | None = RequestID) -> JSONResponse:
    """Run an Agent RFT tool call in the sandbox of its trace's rollout (made on the trace's first call)."""
    return await _call(request, caller, name, body, image, env, deadline, request_id)


@router.post("/tools", response_model=RftOutput, responses=TOOL_RESPONSES)
async def call_named_tool(body: RftCall, request: Request, image: str | None = ImageQuery,
                          env: str | None = EnvQuery, deadline: float = DeadlineQuery,
                          caller: str = Depends(tenant), request_id: str | None = RequestID) -> JSONResponse:
    """As ``/v1/rft/tools/{name}``, for the tool the body's ``name`` names: one URL for every tool."""
    if not body.name:
        raise ToolError("the call names no tool")
    return await _call(request, caller, body.name, body, image, env, deadline, request_id)


async def _call(request: Request, caller: str, name: str, call: RftCall, image: str | None, env: str | None,
                deadline: float, request_id: str | None) -> JSONResponse:
    rollouts = app_rollouts(request)
    await _open(request, caller, call.trace_id, call.item, image, env, deadline)
    # Without an X-Request-ID, the call id keys the retries: Agent RFT resends the same call.
    key = request_id or f"rft:{call.trace_id}:{call.call_id}"
    params = {"rft_tool": name, "call": call.model_dump()}
    status, body, ms = await rollouts.replies.once(
        caller, key, params, lambda: rollouts.call(caller, call.trace_id, name, call))
    body = {**body, "id": call.id} if status == 200 else {"kind": body["kind"], "message": body["message"]}
    return reply_response((status, body, ms))


async def _open(request: Request, caller: str, trace_id: str, item: dict[str, Any], image: str | None,
                env: str | None, deadline: float) -> None:
    """The trace's rollout, recorded now unless it exists (its sandbox comes with its first call)."""
    rollouts = app_rollouts(request)
    if rollouts.store.get(caller, trace_id) is not None:
        return
    if env is not None:
        _env_class(env)  # a name that is no env is refused whatever the image
    source = await _source(request, caller, item, image, env)
    made = RolloutRequest(rollout_id=trace_id, image=source, deadline=deadline,
                          labels={ENV_LABEL: env} if env else {})
    await check_rollout(request, made, caller)
    # A 409 means it was made meanwhile with other parameters: that one stands, as a rollout made
    # beforehand does.
    await rollouts.create(caller, made)


async def _source(request: Request, caller: str, item: dict[str, Any], image: str | None, env: str | None) -> str:
    """The image or snapshot a new rollout's sandbox is made from: the item's, the URL's, the env's, or host."""
    chosen = image if item.get("image") is None else item["image"]
    if chosen is not None:
        if not isinstance(chosen, str) or not 0 < len(chosen) <= 256:
            raise InvalidRequest("the item's image must name an image: a string of 1 to 256 characters")
        return chosen
    if env is None:
        return "host"
    try:
        spec = _env_class(env).env_spec()
    except InvalidRequest as err:  # swefix: a task image of the user's, which the item names
        raise InvalidRequest(f"env {env} has no image of its own: give the item an image field ({err})") from None
    engine = app_rollouts(request).engine
    return (await engine.build(await engine.catalog.scoped(spec, caller), tenant=caller)).id  # its base: the caller's


# -- the grader -------------------------------------------------------------------------------------


@router.post("/grade/{env}", response_model=GradeBody, responses={**RESPONSES, 404: {"model": ErrorBody, "description": (
    "No env of that name.")}, 422: {"model": ErrorBody, "description": (
        "The env has no grader over a sandbox, or the trace's rollout was made for another env.")}})
async def grade(body: GradeRequest, request: Request, env: str = EnvName, image: str | None = ImageQuery,
                deadline: float = DeadlineQuery, caller: str = Depends(tenant),
                request_id: str | None = RequestID) -> JSONResponse:
    """Score the trace's sandbox with the env's reward, then end its rollout (its sandbox is destroyed)."""
    rollouts = app_rollouts(request)
    _graded_env(env)  # an unknown env is refused before the trace is looked at
    key = request_id or f"rft-grade:{body.trace_id}"
    status, reply, ms = await rollouts.replies.once(
        caller, key, {"rft_grade": env, "trace": body.trace_id},
        lambda: _grade(request, caller, env, body, image, deadline))
    return reply_response((status, reply, ms))


async def _grade(request: Request, caller: str, env: str, body: GradeRequest, image: str | None,
                 deadline: float) -> Reply:
    started = time.perf_counter()
    rollouts = app_rollouts(request)
    row = rollouts.store.get(caller, body.trace_id)
    if row is None:  # the model called no tool: the env as it starts is what it leaves
        await _open(request, caller, body.trace_id, body.item, image, env, deadline)
    elif _labels(row).get(ENV_LABEL) != env:
        raise InvalidRequest(
            f"rollout {body.trace_id} was not made for env {env}: give its tool URLs ?env={env}"
            f" (a rollout made with POST /v1/rollouts carries the label {ENV_LABEL}={env})")
    sandbox_id = await rollouts.sandbox(caller, body.trace_id)
    try:
        score = await _score(_graded_env(env), rollouts.engine, caller, sandbox_id)
    except SandboxNotFound:
        raise SandboxGone(f"rollout {body.trace_id}'s sandbox was destroyed: there is nothing to grade") from None
    await rollouts.delete(caller, body.trace_id)
    return 200, {"score": score}, ms_since(started)


def _labels(row: Any) -> dict[str, str]:
    return json.loads(row["params"])["labels"]


class _TenantEngine:
    """The server's engine as one tenant's fleet transport: its sandboxes are made for that tenant."""

    def __init__(self, engine: Engine, tenant: str) -> None:
        self._engine, self._tenant = engine, tenant

    async def create(self, params: Any) -> Any:
        return await self._engine.create(params, tenant=self._tenant)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _EngineFleet(AsyncFleet):
    """The fleet an env's grader uses on the server: the engine itself, creating for the caller's tenant."""

    def __init__(self, engine: Engine, tenant: str) -> None:  # noqa: super().__init__ would make an engine
        self._transport = _TenantEngine(engine, tenant)  # type: ignore[assignment]
        self._started, self.url, self.config = True, None, None


async def _score(cls: type, engine: Engine, tenant: str, sandbox_id: str) -> float:
    """The env's reward over the sandbox as it stands (``grade()``: the passing share of its pristine
    tests, graded in a fresh sandbox of the golden image with only the submission copied in). A
    submission the grader cannot score is 0, never an error Agent RFT would retry."""
    fleet = _EngineFleet(engine, tenant)
    env = cls(fleet)
    env.sandbox = AsyncSandbox(fleet, await engine.get(sandbox_id))
    passed, total = await env.grade()
    return passed / total if total else 0.0


def _graded_env(name: str) -> type:
    """The env class of ``name`` when it grades a sandbox (``grade()``); else NotFound or InvalidRequest."""
    cls = _env_class(name)
    if not callable(getattr(cls, "grade", None)):
        raise InvalidRequest(f"env {name} has no grader over a sandbox: its reward comes from its own submit tool")
    return cls


def _env_class(name: str) -> type:
    """An env that ships, by its short name (never a ``module:Class`` path: that would import a caller's choice)."""
    try:
        from ..rl.env import ENVS, env_class
    except MissingExtra as err:
        raise InvalidRequest(f"this server cannot run envs: {err}") from None
    if name not in ENVS:
        raise NotFound(f"no env {name!r}: the envs are {', '.join(ENVS)}")
    return env_class(name)
