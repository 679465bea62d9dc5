"""Joining a Ray cluster from fanfold's side: one clear line when nothing answers at the address,
instead of Ray's minute of retries and its tracebacks."""

from __future__ import annotations

import socket

from ..errors import InfrastructureError, InvalidRequest

PROBE_TIMEOUT_S = 3.0
"""How long to wait for a TCP connection to the cluster's address before saying nothing is there."""
CLIENT_PORT = 10001
"""Ray Client's port when a ray:// address names none."""
START_HINT = ("start one on this machine with `ray start --head`, then `fanfold ray start` as root;"
              " or name a running one with --address HOST:6379 or RAY_ADDRESS")


def join(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (None: ``auto``) unless this process has; a one-line
    InfrastructureError when no cluster answers there."""
    from .._extras import require

    (ray,) = require("ray", "fanfold on a Ray cluster")
    if ray.is_initialized():
        return
    _check_reachable(address or "auto")
    from . import node

    try:
        node.connect(address)
    except (ConnectionError, RuntimeError) as err:
        raise InfrastructureError(f"cannot join the Ray cluster at {address or 'auto'}: {first_line(err)}") from None
    except ValueError as err:  # a malformed address, or ray:// without Ray Client's packages (ray[client])
        raise InvalidRequest(f"cannot join the Ray cluster at {address or 'auto'}: {first_line(err)}") from None


def _check_reachable(address: str) -> None:
    host, port = _endpoint(address)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        dialled = "" if address == f"{host}:{port}" else f" ({host}:{port})"
        raise InfrastructureError(f"no Ray cluster answers at {address}{dialled}: {err.strerror or err or 'timed out'};"
                                  f" {START_HINT}") from None


def _endpoint(address: str) -> tuple[str, int]:
    """The host and port ``ray.init(address)`` would dial: Ray's own resolution of ``auto`` (the
    RAY_ADDRESS variable, then this machine's latest cluster) and of this host's loopback name."""
    if address.startswith("ray://"):
        host, _, port = address.removeprefix("ray://").partition("/")[0].rpartition(":")
        return (host, int(port)) if host and port.isdigit() else (address.removeprefix("ray://"), CLIENT_PORT)
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        resolved = canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as err:
        # Ray found no address: RAY_ADDRESS is unset and no cluster was started on this machine.
        raise InfrastructureError(f"no Ray cluster runs on this machine and RAY_ADDRESS is not set: {START_HINT}"
                                  ) from None
    except ValueError as err:
        raise InvalidRequest(f"--address {address}: {err}") from None
    host, _, port = resolved.rpartition(":")
    return host.strip("[]"), int(port)


def first_line(err: BaseException) -> str:
    """An error's first line (Ray's messages run on with tracebacks), or its type's name."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
