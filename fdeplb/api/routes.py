"""The FastAPI router (mountable into a serving node's existing app) and the app factory of ``fdeplb serve``.

The web view's routes (``/ui``, ``/v1/ui/...``, behind the same HTTP Basic credentials) are
:mod:`fdeplb.api.ui_routes`. Every route authenticates first (POST: FastDeploy's ``user`` / ``passwd`` body fields; GET: HTTP Basic, parsed by
``fastapi.security.HTTPBasic``), then validates, then acts; but ``/health``, open to probes (it tells a caller without
credentials only healthy or not, and why in one phrase), and ``/metrics`` when served with ``metrics_public``. Errors never escape as 5xx tracebacks: a
:class:`~fdeplb.errors.FdeplbError` becomes ``{"code": 1, "msg": "<one line>"}`` with the status of
:func:`fdeplb.errors.http_status`; anything else is a 500 with a generic message (and a log line). Query parameters
are taken as text and checked after the authentication (:mod:`fdeplb.api.service`), so a bad one is a 400 with one
line, not FastAPI's 422 list.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import anyio
import anyio.to_thread
import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool

from fdeplb.api import service, ui_routes
from fdeplb.api.auth import Credentials, check_basic, check_body, has_basic
from fdeplb.api.bodies import CheckBody, ConfigBody, DeleteBody, PlanBody, ReasonBody, RearrangeBody, StatsBody, \
    openapi_body, read_json_object, validate
from fdeplb.api.prometheus import ClusterCollector
from fdeplb.api.service import ApiSettings
from fdeplb.errors import AuthError, FdeplbError, http_status
from fdeplb.store import Store

log = structlog.get_logger("fdeplb.api")


def _error(err: FdeplbError) -> JSONResponse:
    status = http_status(err)
    if isinstance(err, AuthError):
        return JSONResponse({"code": 1, "msg": str(err)}, status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="fdeplb"'})
    return JSONResponse({"code": 1, "msg": str(err).splitlines()[0] if str(err) else type(err).__name__},
                        status_code=status)


def _guarded(fn: Callable) -> Callable:
    """Turn fdeplb errors into one-line JSON refusals and anything else into a logged, generic 500."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await fn(*args, **kwargs)
        except FdeplbError as err:
            if http_status(err) >= 500:
                log.error("request failed", error=str(err), error_type=type(err).__name__)
            return _error(err)
        except Exception as err:  # noqa: BLE001 - the one place that keeps a bug from leaking a traceback
            log.exception("unexpected error", error_type=type(err).__name__)
            return JSONResponse({"code": 1, "msg": f"internal error ({type(err).__name__})"}, status_code=500)

    return wrapper


def _reply(reply: tuple[int, dict]) -> JSONResponse:
    status, body = reply
    return JSONResponse(body, status_code=status)


class _Routes:
    """What every route of one router shares: the store, the settings, the credentials check, the body reader, the
    waiting calls' own thread pool and the metrics registry."""

    def __init__(self, store: Store, credentials: Credentials | None, settings: ApiSettings) -> None:
        self.store, self.credentials, self.settings = store, credentials, settings
        self._waiting_limiter: anyio.CapacityLimiter | None = None  # made on first use, inside the event loop
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ClusterCollector(store))

    async def in_waiting_thread(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in a worker thread of the waiting calls' own pool (:attr:`ApiSettings.max_waiting`), not
        of the one every other route shares: 40 long-polls used to leave /health unanswered until they ended."""
        if self._waiting_limiter is None:
            self._waiting_limiter = anyio.CapacityLimiter(self.settings.max_waiting)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._waiting_limiter)

    async def body_of(self, request: Request, model):
        """The JSON body of a POST route, authenticated (FastDeploy's ``user`` / ``passwd``), then validated."""
        doc = await read_json_object(request, max_bytes=self.settings.max_body_bytes,
                                     max_depth=self.settings.max_depth)
        log.debug("request body", path=request.url.path,  # passwd is redacted by fdeplb.log, whatever it holds
                  body={k: v if k in ("user", "passwd", "action") else type(v).__name__ for k, v in doc.items()})
        check_body(self.credentials, doc)
        return validate(model, doc)

    async def basic(self, request: Request) -> str:
        """HTTP Basic authentication of a GET route (:func:`fdeplb.api.auth.check_basic`); the user name."""
        return await check_basic(self.credentials, request)

    async def operator_body(self, request: Request, model) -> tuple[str, Any]:
        """An operator route's caller (``http:<Basic user>``, authenticated first) and its JSON body, validated."""
        user = await self.basic(request)
        doc = await read_json_object(request, max_bytes=self.settings.max_body_bytes,
                                     max_depth=self.settings.max_depth)
        return f"http:{user or 'anonymous'}", validate(model, doc)


def create_router(store: Store, credentials: Credentials | None, settings: ApiSettings | None = None) -> APIRouter:
    """The EPLB routes of one cluster (see README "Operating over HTTP").

    ``credentials`` None serves without authentication (``fdeplb serve --insecure-no-auth`` only)."""
    router = APIRouter()
    routes = _Routes(store, credentials, settings or ApiSettings())
    _fastdeploy_routes(router, routes)
    _read_only_routes(router, routes)
    ui_routes.add_live_ui(router, routes, _guarded)
    _operator_routes(router, routes)
    return router


def create_player_app(player) -> FastAPI:
    """The recording player's app (``fdeplb replay --ui``): the ``/ui`` page over ``player`` (a
    :class:`fdeplb.ui.PlayerModel`), with this module's error shell; see :mod:`fdeplb.api.ui_routes`."""
    return ui_routes.player_app(player, _guarded, _error)


def _fastdeploy_routes(router: APIRouter, ctx: _Routes) -> None:
    """FastDeploy's EPLB routes, with its bodies and answers."""
    store, settings = ctx.store, ctx.settings

    @router.post("/rearrange_experts", openapi_extra=openapi_body(RearrangeBody), tags=["fastdeploy"])
    @_guarded
    async def rearrange_experts(request: Request) -> Response:
        """Start a round (action ""), supply the next round's load (recv_expert_weight) or commit a cordoned
        round (update_weight_from_tensor)."""
        body = await ctx.body_of(request, RearrangeBody)
        if body.action == "":
            return _reply(await run_in_threadpool(service.start_round, store, body.ips))
        if body.action == "recv_expert_weight":
            return _reply(await run_in_threadpool(service.supply_load, store, body.data))
        if body.action == "update_weight_from_tensor":
            return _reply(await run_in_threadpool(service.commit, store, body.plan_id))
        return _reply(service.refuse(f"invalid action {body.action[:64]}"))

    @router.post("/get_per_expert_tokens_stats", openapi_extra=openapi_body(StatsBody), tags=["fastdeploy"])
    @_guarded
    async def get_per_expert_tokens_stats(request: Request) -> Response:
        """Every rank's last published expert_load window."""
        body = await ctx.body_of(request, StatsBody)
        return _reply(await run_in_threadpool(service.expert_stats, store, body.clear_stat))

    @router.post("/check_redundant", openapi_extra=openapi_body(CheckBody), tags=["fastdeploy"])
    @_guarded
    async def check_redundant(request: Request) -> Response:
        """The rearrangement status (action "") or the ranks' load results (check_load_weight_result)."""
        body = await ctx.body_of(request, CheckBody)
        if body.action == "":
            return _reply(await run_in_threadpool(service.rearrange_status, store, body.check_get_workloads))
        if body.action == "check_load_weight_result":
            return _reply(await run_in_threadpool(service.load_results, store))
        return _reply(service.refuse(f"invalid action {body.action[:64]}"))

    @router.get("/update_model_weight", tags=["fastdeploy"])
    @_guarded
    async def update_model_weight(request: Request) -> Response:
        """Reload every rank's weights (in the current placement) and wait for them (409 naming the ranks that
        held it back when the request was cancelled)."""
        await ctx.basic(request)
        return _reply(await ctx.in_waiting_thread(service.drive_weights, store, "update", settings.weights_timeout_s,
                                                      settings.shutdown))

    @router.get("/clear_load_weight", tags=["fastdeploy"])
    @_guarded
    async def clear_load_weight(request: Request) -> Response:
        """Free every rank's weights and wait for them (409 naming the ranks that held it back when the request
        was cancelled)."""
        await ctx.basic(request)
        return _reply(await ctx.in_waiting_thread(service.drive_weights, store, "clear", settings.weights_timeout_s,
                                                      settings.shutdown))

    @router.get("/health", tags=["fastdeploy"])
    @_guarded
    async def health(request: Request) -> Response:
        """200 when Redis answers and every member rank is registered with its heartbeat within its TTL, else
        503. Open, as FastDeploy's and vLLM's are, for probes: without credentials (or with wrong ones) only
        healthy or not and why in one phrase (:func:`fdeplb.api.service.probe_health`); with the API's credentials
        also the registered ranks, and which lack a heartbeat and why. 503 "Redis unavailable" when the answer
        takes longer than :data:`~fdeplb.api.service.HEALTH_DEADLINE_S`."""
        check = service.health if await has_basic(ctx.credentials, request) else service.probe_health
        try:  # a frozen Redis holds a read for the socket timeout (30 s); a probe gives up long before
            with anyio.fail_after(service.HEALTH_DEADLINE_S):
                return _reply(await anyio.to_thread.run_sync(check, store, abandon_on_cancel=True))
        except TimeoutError:
            return _reply(service.refuse(service.HEALTH_PHRASES["redis"], 503))


def _read_only_routes(router: APIRouter, ctx: _Routes) -> None:
    """fdeplb's own read-only routes: state, audit, placement, statecharts, metrics."""
    store, settings = ctx.store, ctx.settings

    @router.get("/v1/state", tags=["fdeplb"])
    @_guarded
    async def v1_state(request: Request) -> Response:
        """Every machine's state, version, round and plan (as ``fdeplb status --json``)."""
        await ctx.basic(request)
        return JSONResponse(await run_in_threadpool(service.state, store))

    @router.get("/v1/audit", tags=["fdeplb"])
    @_guarded
    async def v1_audit(request: Request, since: str | None = None, limit: str | None = None,
                       wait_ms: str | None = None) -> Response:
        """Audit records after ``since`` (an audit id), at most ``limit`` (default 1000); ``wait_ms`` long-polls."""
        await ctx.basic(request)
        run = ctx.in_waiting_thread if wait_ms not in (None, "", "0") else run_in_threadpool
        return JSONResponse(await run(service.audit, store, since, limit, wait_ms, settings.shutdown))

    @router.get("/v1/placement", tags=["fdeplb"])
    @_guarded
    async def v1_placement(request: Request, format: str | None = None) -> Response:  # noqa: A002 - the query name
        """The current placement as phy2log / log2phy / logcnt, or as a placement file (``format``)."""
        await ctx.basic(request)
        out = await run_in_threadpool(service.placement, store, format)
        if isinstance(out, dict):
            return JSONResponse(out)
        text, media = out
        return Response(text, media_type=media)

    @router.get("/v1/statecharts/{machine}.svg", tags=["fdeplb"])
    @_guarded
    async def v1_statechart(request: Request, machine: str) -> Response:
        """The state diagram of ``machine`` (cluster, rank, weights) as SVG."""
        await ctx.basic(request)
        svg = await run_in_threadpool(service.statechart_svg, machine, settings.statecharts_dir)
        return Response(svg, media_type="image/svg+xml")

    @router.get("/metrics", tags=["fdeplb"])
    @_guarded
    async def metrics(request: Request) -> Response:
        """Prometheus metrics of the cluster (computed from Redis at scrape time); HTTP Basic unless
        ``fdeplb serve --metrics-public``."""
        if not settings.metrics_public:
            await ctx.basic(request)
        return Response(await run_in_threadpool(generate_latest, ctx.registry), media_type=CONTENT_TYPE_LATEST)


def _operator_routes(router: APIRouter, ctx: _Routes) -> None:
    """fdeplb's operator verbs (:mod:`fdeplb.orchestration.operator`): HTTP Basic, a JSON body, audited with the
    caller ``http:<user>`` and the body's ``reason``; a verb that cannot apply is a 409 saying why."""
    store = ctx.store

    @router.post("/v1/round/abort", openapi_extra=openapi_body(ReasonBody), tags=["operator"])
    @_guarded
    async def v1_round_abort(request: Request) -> Response:
        """Abort the round in flight before the commit point (409 after it, or with no round in flight)."""
        who, body = await ctx.operator_body(request, ReasonBody)
        return _reply(await run_in_threadpool(service.abort_round, store, who, body.reason))

    @router.post("/v1/round/plan", openapi_extra=openapi_body(PlanBody), tags=["operator"])
    @_guarded
    async def v1_round_plan(request: Request) -> Response:
        """One round to the body's placement (``fdeplb rearrange --plan``); 400 for a plan the cluster cannot
        take, 409 while a round is in flight; nothing written either way."""
        who, body = await ctx.operator_body(request, PlanBody)
        return _reply(await run_in_threadpool(service.supply_plan, store, body.phy2log, who, body.reason))

    @router.post("/v1/round/cancel", openapi_extra=openapi_body(ReasonBody), tags=["operator"])
    @_guarded
    async def v1_round_cancel(request: Request) -> Response:
        """Withdraw the pending round request (409 when none is pending)."""
        who, body = await ctx.operator_body(request, ReasonBody)
        return _reply(await run_in_threadpool(service.cancel_request, store, who, body.reason))

    @router.get("/v1/config", tags=["operator"])
    @_guarded
    async def v1_config(request: Request) -> Response:
        """The cluster's configuration (``version`` counts the changes)."""
        await ctx.basic(request)
        return JSONResponse(await run_in_threadpool(service.config, store))

    @router.post("/v1/config", openapi_extra=openapi_body(ConfigBody), tags=["operator"])
    @_guarded
    async def v1_config_set(request: Request) -> Response:
        """Change settings (policy, min_gain, cordoned, retention, deadlines): audited, version + 1. The audit export
        path is refused (400): only the command line sets it."""
        who, body = await ctx.operator_body(request, ConfigBody)
        return _reply(await run_in_threadpool(service.change_config, store, body.changes(), who, body.reason))

    @router.post("/v1/cluster/delete", openapi_extra=openapi_body(DeleteBody), tags=["operator"])
    @_guarded
    async def v1_cluster_delete(request: Request) -> Response:
        """Delete every key of the cluster (409 while agents or a coordinator are alive, unless ``force``)."""
        who, body = await ctx.operator_body(request, DeleteBody)
        return _reply(await run_in_threadpool(service.delete_cluster, store, who, body.force))


def create_app(store: Store, credentials: Credentials | None, settings: ApiSettings | None = None) -> FastAPI:
    """A FastAPI app serving :func:`create_router` (what ``fdeplb serve`` runs). No docs routes; the OpenAPI
    schema is available as ``app.openapi()`` in-process only."""
    app = FastAPI(title="fdeplb", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(create_router(store, credentials, settings))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        return JSONResponse({"code": 1, "msg": f"{where}: {first.get('msg', 'invalid')}"}, status_code=400)

    @app.exception_handler(404)
    async def _not_found(_request: Request, _exc: Exception) -> JSONResponse:
        return JSONResponse({"code": 1, "msg": "no such route"}, status_code=404)

    @app.exception_handler(405)
    async def _not_allowed(_request: Request, _exc: Exception) -> JSONResponse:
        return JSONResponse({"code": 1, "msg": "method not allowed on this route"}, status_code=405)

    @app.middleware("http")
    async def _access_log(request: Request, call_next):
        t0 = time.perf_counter()
        structlog.contextvars.bind_contextvars(cluster=store.cluster)
        try:
            response = await call_next(request)
        finally:
            structlog.contextvars.unbind_contextvars("cluster")
        log.info("request", method=request.method, path=request.url.path, status=response.status_code,
                 ms=round((time.perf_counter() - t0) * 1000, 1))
        return response

    return app


__all__ = ["create_app", "create_player_app", "create_router"]
