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
import sys
from typing import Any

from fdeplb.errors import (AuthError, FdeplbError, InputError, NotFoundError, RedisUnavailableError, StateError,
                           StoreError)

#: HTTP status -> the error the client raises (so the CLI exits with the code of the error table)
_STATUS_ERRORS = {400: InputError, 401: AuthError, 404: NotFoundError, 409: StateError, 413: InputError,
                  503: RedisUnavailableError}
TIMEOUT_S = 30.0


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
    from fdeplb.cli.views import print_status

    status = ApiClient(args.url, args.credentials_file).get("/v1/state")
    status.pop("api_addresses", None)
    if args.json:
        print(json.dumps(status, sort_keys=True))
    else:
        print_status(status, sys.stdout)
    return 0


def _entry(record: dict[str, Any]):
    from fdeplb.store import AuditRecord

    return AuditRecord(str(record.get("id", "")), {k: str(v) for k, v in record.items() if k != "id"})


def run_audit(args: argparse.Namespace) -> int:
    from fdeplb.cli.views import format_audit, select
    from fdeplb.recording import audit_dict

    if args.round is not None and args.round < 0:
        raise InputError(f"--round must be >= 0, got {args.round}")
    if args.export is not None:
        raise InputError("--export writes a self-contained recording (snapshots and plans too): use --redis-url")
    client = ApiClient(args.url, args.credentials_file)
    since, entries = None, []
    while True:  # page through everything there is
        page = client.get("/v1/audit", since=since, limit=10_000)
        entries += [_entry(r) for r in page["records"]]
        since = page["last_id"]
        if len(page["records"]) < 10_000:
            break
    chosen = select(entries, round_=args.round, machine=args.machine, rank=args.rank)

    def show(items) -> None:
        for entry in items:
            sys.stdout.write((json.dumps(audit_dict(entry)) if args.json else format_audit(entry)) + "\n")
        sys.stdout.flush()

    show(chosen)
    while args.follow:
        page = client.get("/v1/audit", since=since, limit=10_000, wait_ms=10_000)
        since = page["last_id"]
        show(select([_entry(r) for r in page["records"]], round_=args.round, machine=args.machine, rank=args.rank))
    return 0
