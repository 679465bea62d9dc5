"""``fanfold serve``: the HTTP API over one host's engine, on a unix socket and optionally TCP."""

from .app import create_app
from .auth import Tenants
from .run import serve

__all__ = ["Tenants", "create_app", "serve"]
