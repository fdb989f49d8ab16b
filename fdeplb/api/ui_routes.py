"""The routes of the web view: the ``/ui`` page and its JSON (``/v1/ui/...``), for a live cluster (mounted by
:func:`fdeplb.api.routes.create_router`, behind the API's HTTP Basic credentials) and for a recording
(:func:`player_app`, what ``fdeplb replay --ui`` serves on 127.0.0.1).

- ``GET /ui``, ``/ui/app.js``, ``/ui/style.css``: the page (:data:`fdeplb.ui.STATIC_DIR`); a browser without
  credentials gets 401 with ``WWW-Authenticate: Basic`` and asks for them, then reuses them for every request below.
- ``GET /v1/ui/diagrams``: ``{machine: inline SVG}`` (:func:`fdeplb.ui.annotated_diagrams`).
- ``GET /v1/ui/view``: the view dict (:mod:`fdeplb.ui.view_model`); in the player, ``?step=N``.
- ``GET /v1/ui/audit?machine=&rank=&round=&limit=``: the audit table's rows (400 for a bad filter).
- ``GET /v1/ui/events`` (live only): server-sent events, one ``data:`` line of the view dict within a second of
  each commit (and at least every second), or ``{"redis": "unavailable", "error"}`` while Redis does not answer.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fdeplb.api import service
from fdeplb.errors import FdeplbError, NotFoundError, RedisUnavailableError
from fdeplb.ui import STATIC_DIR, LiveReadModel, PlayerModel, annotated_diagrams

__all__ = ["add_live_ui", "player_app"]

#: the page's files by URL name, with their media types (nothing else under /ui is served)
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "style.css": "text/css; charset=utf-8"}
#: an event stream ends after this long (the browser's EventSource reconnects at once): no response is endless
STREAM_MAX_S = 300.0
#: how long one wait for a commit lasts before the view is sent anyway (heartbeat ages move)
PUSH_EVERY_MS = 1000
#: while Redis does not answer, try again this often (s)
REDIS_RETRY_S = 1.0


#: the page's Content-Security-Policy: its own script and requests only (no inline script, nothing from elsewhere);
#: inline styles stay allowed (the generated diagrams and the grid set them)
PAGE_CSP = ("default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
            "style-src 'self' 'unsafe-inline'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff"}


def _svg_of(machine: str) -> str:
    return service.statechart_svg(machine, None)


def _page_routes(router: APIRouter, guarded: Callable, auth: Callable) -> None:
    """``/ui``, its two files and ``/v1/ui/diagrams``, each after ``auth(request)``."""

    @router.get("/ui", tags=["ui"], include_in_schema=False)
    @guarded
    async def ui_page(request: Request) -> Response:
        await auth(request)
        return FileResponse(STATIC_DIR / "index.html", media_type=PAGE_FILES["index.html"],
                            headers=_PAGE_HEADERS)

    @router.get("/ui/{name}", tags=["ui"], include_in_schema=False)
    @guarded
    async def ui_file(request: Request, name: str) -> Response:
        await auth(request)
        if name not in PAGE_FILES:
            raise NotFoundError(f"no page file {name[:40]!r}")
        return FileResponse(STATIC_DIR / name, media_type=PAGE_FILES[name], headers=_PAGE_HEADERS)

    @router.get("/v1/ui/diagrams", tags=["ui"])
    @guarded
    async def ui_diagrams(request: Request) -> Response:
        """Every machine's statechart as inline SVG, annotated with data-machine / data-state (states) and
        data-from / data-trigger / data-to (edges)."""
        await auth(request)
        return JSONResponse(await run_in_threadpool(annotated_diagrams, _svg_of))


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def add_live_ui(router: APIRouter, ctx, guarded: Callable) -> None:
    """The web view of the live cluster of ``ctx`` (:class:`fdeplb.api.routes._Routes`: store, HTTP Basic
    check, waiting pool) on ``router``."""
    model = LiveReadModel(ctx.store)
    store = ctx.store
    _page_routes(router, guarded, ctx.basic)

    @router.get("/v1/ui/view", tags=["ui"])
    @guarded
    async def ui_view(request: Request) -> Response:
        """The view dict of the cluster now; 503 ``Redis unavailable`` while Redis does not answer."""
        await ctx.basic(request)
        return JSONResponse(await run_in_threadpool(model.view))

    @router.get("/v1/ui/audit", tags=["ui"])
    @guarded
    async def ui_audit(request: Request, machine: str | None = None, rank: str | None = None,
                       round: str | None = None, limit: str | None = None) -> Response:  # noqa: A002 - query name
        """The audit table: the newest records, filtered by machine, rank and round."""
        await ctx.basic(request)
        rows = await run_in_threadpool(lambda: model.audit(machine=machine, rank=rank, round_=round, limit=limit))
        return JSONResponse({"rows": rows})

    @router.get("/v1/ui/events", tags=["ui"])
    @guarded
    async def ui_events(request: Request) -> Response:
        """Server-sent events of the view dict: within a second of every commit, at least every second; a
        ``{"redis": "unavailable"}`` event each second while Redis is down. Each stream ends after
        :data:`STREAM_MAX_S` (EventSource reconnects)."""
        await ctx.basic(request)

        async def stream() -> AsyncIterator[str]:
            end = time.monotonic() + STREAM_MAX_S
            cursor = None
            while time.monotonic() < end and not await request.is_disconnected():
                try:
                    if cursor is None:
                        cursor = await run_in_threadpool(store.cursor)
                    else:
                        await ctx.in_waiting_thread(store.wait, cursor, PUSH_EVERY_MS)
                    payload = await run_in_threadpool(model.view)
                except RedisUnavailableError as err:
                    cursor = None  # read a fresh position once it answers again
                    yield _event({"redis": "unavailable", "error": str(err).splitlines()[0][:200]})
                    await anyio.sleep(REDIS_RETRY_S)
                    continue
                except FdeplbError as err:  # a record that does not parse, the cluster deleted: say so, go on
                    yield _event({"redis": "ok", "error": str(err).splitlines()[0][:200]})
                    await anyio.sleep(REDIS_RETRY_S)
                    continue
                yield _event(payload)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def player_app(player: PlayerModel, _guarded: Callable, _error: Callable) -> FastAPI:
    """The web view of one recording (``fdeplb replay --ui``): the same page and routes over ``player``, without
    credentials (it serves a local file on 127.0.0.1) and without ``/v1/ui/events`` (nothing changes).
    ``_guarded`` / ``_error``: the API's error shell (:func:`fdeplb.api.routes.create_player_app` passes them)."""
    app = FastAPI(title="fdeplb player", docs_url=None, redoc_url=None, openapi_url=None)
    router = APIRouter()

    async def no_auth(_request: Request) -> None:
        return None

    _page_routes(router, _guarded, no_auth)

    @router.get("/v1/ui/view", tags=["ui"])
    @_guarded
    async def ui_view(step: str | None = None) -> Response:
        """The view dict at record ``step`` (0: the header's start; default the last record)."""
        return JSONResponse(await run_in_threadpool(player.view, step))

    @router.get("/v1/ui/audit", tags=["ui"])
    @_guarded
    async def ui_audit(machine: str | None = None, rank: str | None = None, round: str | None = None,  # noqa: A002
                       limit: str | None = None) -> Response:
        """Every record of the recording with its step and check, filtered."""
        rows = await run_in_threadpool(lambda: player.audit(machine=machine, rank=rank, round_=round, limit=limit))
        return JSONResponse({"rows": rows})

    @router.get("/", include_in_schema=False)
    async def root() -> Response:
        return Response(status_code=307, headers={"Location": "/ui"})

    app.include_router(router)

    @app.exception_handler(404)
    async def _not_found(_request: Request, _exc: Exception) -> JSONResponse:
        return _error(NotFoundError("no such route"))

    return app
