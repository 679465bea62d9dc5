"""What every route of ``fanfold serve`` shares, fanfold's own (``fanfold.server``) and the integrations'
(E2B, OpenEnv, Agent RFT) alike: tenancy (``auth``), what a route depends on (``deps``), errors as
statuses (``status``), the request and reply bodies (``schemas``), and the rollout service with its
routes (``rollouts``, which Agent RFT's endpoints drive too). ``fanfold.server`` assembles the app."""

from .._extras import require

require("server", "fanfold serve")  # before any FastAPI import below, so a missing one names the extra
