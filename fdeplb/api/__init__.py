"""fdeplb's HTTP surface: FastDeploy's EPLB routes, hardened, plus read-only state, audit, placement, statecharts
and Prometheus metrics (DESIGN.md section 7).

``create_router(store, credentials)`` gives an :class:`fastapi.APIRouter` to mount into a serving node's app;
``create_app(...)`` wraps it in the app ``fdeplb serve`` runs with uvicorn. Needs the ``api`` extra
(``pip install fdeplb[api]``).
"""

from fdeplb.api.auth import Credentials, load_credentials
from fdeplb.api.routes import create_app, create_router
from fdeplb.api.service import ApiSettings

__all__ = ["ApiSettings", "Credentials", "create_app", "create_router", "load_credentials"]
