"""The route that brings a Compose file up as a group: the file in a JSON body, its services' images built
here, its members started as ``POST /v1/groups`` starts them.

A ``build`` needs its context's files, which a body does not carry: such a file goes up through the
SDK's ``compose_up``, which uploads each context as a build. ``${VAR}`` takes its values from the
body's ``env`` alone, never from the server's own environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, Depends, Request

from ..compose import parse, plan
from ..errors import InvalidRequest, InvalidSpec
from ..groups import info_to_wire
from ..web.deps import ERRORS, check_source, engine, tenant

router = APIRouter(tags=["groups"])
FIELDS = ("file", "env", "project", "network", "labels", "deadline", "detached", "lease")
COMPOSE_BODY = Body(..., description="file: a Compose file's text; env: the values of its ${VAR}s; project: its"
                                     " name when the file has none; network, labels, deadline, detached: as a"
                                     " group's; lease.")


@router.post("/v1/compose", status_code=201, responses=ERRORS)
async def compose_up(request: Request, body: dict[str, Any] = COMPOSE_BODY,
                     caller: str = Depends(tenant)) -> dict[str, Any]:
    """Bring a Compose file up as a group (services from ``image``): running, and healthy where checked, when
    this answers."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown fields {unknown}: a compose request takes {', '.join(FIELDS)}")
    text, env, labels = body.get("file"), body.get("env") or {}, body.get("labels") or {}
    project, lease = body.get("project") or "compose", body.get("lease")
    if not isinstance(text, str):
        raise InvalidRequest("file must be the Compose file's text")
    for name, mapping in (("env", env), ("labels", labels)):
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise InvalidRequest(f"{name} must map names to strings")
    if not isinstance(project, str) or lease is not None and not isinstance(lease, str):
        raise InvalidRequest("project is a name and lease a lease id")
    compose = parse(text, env=env, directory=Path(project))
    built = [name for name, keys in compose.services.items() if "build" in keys]
    if built:
        raise InvalidSpec(f"services {built} have a build, whose context a request body does not carry: bring the file"
                          " up with the SDK's compose_up (or `fanfold compose up`), which uploads it")
    planned = plan(compose)
    fleet = engine(request)
    images = {service.name: (await fleet.build(await fleet.catalog.scoped(service.spec, caller), None,
                                               tenant=caller)).id for service in planned.services}
    params = planned.group_params(images, network=body.get("network", "none"), labels=labels,
                                  deadline=body.get("deadline"), detached=body.get("detached", False))
    for member in params.members:
        check_source(request, member.params.image, caller)
    return info_to_wire(await fleet.create_group(params, tenant=caller, lease=lease))
