"""HTTP clients of ``fdeplb serve`` (requests): ``fdeplb trigger --url``, ``fdeplb status --url`` and
``fdeplb audit --url [--follow]``, with the same output as the Redis-backed commands (the formatting functions of
:mod:`fdeplb.cli.views`).

``status`` and ``audit`` are the subcommands :mod:`fdeplb.cli.views` defines; given ``--url`` they call
:func:`run_status` / :func:`run_audit` here. Credentials come from the same places as the server's
(``FDEPLB_API_USER`` / ``FDEPLB_API_PASSWORD`` or ``--credentials-file``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from fdeplb.errors import (AuthError, FdeplbError, InputError, NotFoundError, RedisUnavailableError, StateError,
                           StoreError)

#: HTTP status -> the error the client raises (so the CLI exits with the code of the error table)
_STATUS_ERRORS = {400: InputError, 401: AuthError, 404: NotFoundError, 409: StateError, 413: InputError,
                  503: RedisUnavailableError}
TIMEOUT_S = 30.0
#: records per ``GET /v1/audit`` page (at most the server's limit, fdeplb.api.service.MAX_AUDIT_LIMIT)
AUDIT_PAGE = 10_000
#: how long one ``audit --url --follow`` request long-polls (ms)
FOLLOW_WAIT_MS = 10_000


class ApiClient:
    """A small client of one ``fdeplb serve`` URL (``http://host:port``)."""

    def __init__(self, url: str, credentials_file: str | None = None, timeout_s: float = TIMEOUT_S) -> None:
        from fdeplb.api.auth import load_credentials

        if not url.startswith(("http://", "https://")):
            raise InputError(f"--url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.credentials = load_credentials(credentials_file)
        self.timeout_s = timeout_s

    def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        import requests

        try:
            resp = requests.request(method, self.url + path, timeout=kwargs.pop("timeout", self.timeout_s),
                                    **kwargs)
        except requests.RequestException as exc:
            raise RedisUnavailableError(f"no answer from {self.url}: {type(exc).__name__}") from None
        try:
            body = resp.json()
        except ValueError:
            body = {"msg": resp.text[:200]}
        if resp.status_code != 200:
            cls = _STATUS_ERRORS.get(resp.status_code, StoreError if resp.status_code >= 500 else FdeplbError)
            raise cls(f"{self.url}{path}: HTTP {resp.status_code}: {body.get('msg', '')}")
        return body

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        auth = (self.credentials.user, self.credentials.password) if self.credentials else None
        return self._send("GET", path, auth=auth, params={k: v for k, v in params.items() if v is not None},
                          timeout=self.timeout_s + params.get("wait_ms", 0) / 1000 if "wait_ms" in params
                          else self.timeout_s)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.credentials:
            body = {"user": self.credentials.user, "passwd": self.credentials.password, **body}
        return self._send("POST", path, json=body)


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("trigger", help="ask a cluster's API for a rearrangement round (POST /rearrange_experts)",
                       description="POST /rearrange_experts with action \"\": start one round. Without --ips, the "
                                   "API addresses every rank registered (from GET /v1/state) are sent.")
    t.add_argument("--url", required=True, help="the API, http://host:port")
    t.add_argument("--ips", nargs="+", default=None, metavar="HOST:PORT", help="rank API addresses to name")
    t.add_argument("--credentials-file", default=None, metavar="FILE")
    t.set_defaults(handler=run_trigger)


def run_trigger(args: argparse.Namespace) -> int:
    client = ApiClient(args.url, args.credentials_file)
    ips = args.ips
    if ips is None:
        ips = [a for a in client.get("/v1/state").get("api_addresses", {}).values() if a]
        if not ips:
            raise InputError(f"no rank registered an API address at {args.url}; pass --ips")
    reply = client.post("/rearrange_experts", {"action": "", "ips": ips})
    print(f"round {reply.get('round', '?')} requested")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from fdeplb.cli.views import show_status

    status = ApiClient(args.url, args.credentials_file).get("/v1/state")
    status.pop("api_addresses", None)
    return show_status(status, args.json)


def _entry(record: dict[str, Any]):
    from fdeplb.store import AuditRecord

    return AuditRecord(str(record.get("id", "")), {k: str(v) for k, v in record.items() if k != "id"})


def run_audit(args: argparse.Namespace) -> int:
    """``fdeplb audit --url``: page through ``GET /v1/audit`` (filters applied here, as over Redis), printing as
    the pages come; ``--limit N`` stops after N printed records, ``--follow`` long-polls for new ones. The options
    are checked by :func:`fdeplb.cli.views.check_audit_args` before this is called."""
    from fdeplb.cli.views import format_audit, select
    from fdeplb.recording import audit_dict

    if args.export is not None:
        raise InputError("--export writes a self-contained recording (snapshots and plans too): use --redis-url")
    client = ApiClient(args.url, args.credentials_file)
    filtered = args.round is not None or args.machine is not None or args.rank is not None
    # unfiltered, the server stops at --limit itself; filtered, the records to print are only known here
    page_size = min(args.limit, AUDIT_PAGE) if args.limit is not None and not filtered else AUDIT_PAGE
    printed = 0

    def show(records: list[dict[str, Any]]) -> bool:
        """Print the selected ones of ``records``; False once --limit records are printed."""
        nonlocal printed
        chosen = select([_entry(r) for r in records], round_=args.round, machine=args.machine, rank=args.rank)
        for entry in chosen:
            sys.stdout.write((json.dumps(audit_dict(entry)) if args.json else format_audit(entry)) + "\n")
            printed += 1
            if args.limit is not None and printed >= args.limit:
                sys.stdout.flush()
                return False
        sys.stdout.flush()
        return True

    since = None
    try:
        while True:  # everything there is so far
            page = client.get("/v1/audit", since=since, limit=page_size)
            since = page["last_id"]
            if not show(page["records"]):
                return 0
            if len(page["records"]) < page_size:
                break
        while args.follow:
            page = client.get("/v1/audit", since=since, limit=page_size, wait_ms=FOLLOW_WAIT_MS)
            since = page["last_id"]
            if not show(page["records"]):
                return 0
    except BrokenPipeError:  # `fdeplb audit --url ... | head`: the reader has what it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:  # Ctrl-C ends --follow
        sys.stdout.flush()
    return 0
