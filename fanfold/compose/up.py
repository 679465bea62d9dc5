"""Bringing a Compose project up and down on a fleet: build each service's image, then start the group.

Written against the fleet's public calls (``build``, ``create_group``, ``groups``, ``group``), so the
same code drives an embedded engine and a server; the SDK's ``compose_up`` and ``compose_down`` call it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import InvalidRequest
from .load import load
from .translate import PROJECT_LABEL, plan

OnProgress = Callable[[str, str], None]
"""Called with (service, what happened): ``building``, ``built img-...``; ``""`` for the whole group."""


async def up(fleet: Any, path: str | Path, *, env: Mapping[str, str] | None = None, network: Any = "none",
             labels: Mapping[str, str] | None = None, deadline: float | None = None, detached: bool = False,
             on_progress: OnProgress | None = None) -> Any:
    """Build every service of the Compose file at ``path`` and start them as one group (an AsyncGroup)."""
    report = on_progress or (lambda service, what: None)
    project = plan(load(path, env=env))
    images: dict[str, str] = {}
    for service in project.services:
        report(service.name, "building")
        image = await fleet.build(service.spec, tag=service.tag)
        images[service.name] = image.id
        report(service.name, f"built {image.id}")
    params = project.group_params(images, network=network, labels=labels, deadline=deadline, detached=detached)
    report("", f"starting {len(params.members)} services as project {project.project!r}")
    return await fleet.create_group(params)


def project_name(path: str | Path | None, project: str | None) -> str:
    """The project ``down`` acts on: ``project`` when given, else the one the Compose file at ``path`` names."""
    if (path is None) == (project is None):
        raise InvalidRequest("name the Compose project by its file or by its name, one of the two")
    return project if project is not None else load(path).name


def in_project(info: Any, project: str) -> bool:
    """Whether the group ``info`` (a GroupInfo) was brought up from Compose project ``project``."""
    return info.labels.get(PROJECT_LABEL) == project
