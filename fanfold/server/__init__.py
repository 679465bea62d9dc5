"""``fanfold serve``: the HTTP API over one host's engine, on a unix socket and optionally TCP."""

from .._extras import require

require("server", "fanfold serve")  # before the imports below, so a missing FastAPI names the extra
from ..web.auth import Tenants  # noqa: E402
from .app import create_app  # noqa: E402
from .run import serve  # noqa: E402

__all__ = ["Tenants", "create_app", "serve"]
