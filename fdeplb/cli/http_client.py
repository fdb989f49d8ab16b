"""The HTTP transport of the command line: a small client of ``fdeplb serve`` (requests), and ``fdeplb trigger``.

``fdeplb status --url`` and ``fdeplb audit --url`` (:mod:`fdeplb.cli.status_view`, :mod:`fdeplb.cli.audit_view`)
take their data from :class:`ApiClient` and print it as they print what they read from Redis. This module is a
leaf: it imports no other ``fdeplb.cli`` module, and neither fastapi nor :mod:`fdeplb.api`, so the HTTP clients
work on an install without the ``api`` extra. Credentials come from the same places as the server's
(``FDEPLB_API_USER`` / ``FDEPLB_API_PASSWORD`` or ``--credentials-file``, :mod:`fdeplb.credentials`).

An HTTP error status is raised as the error of the CLI's error table (:data:`_STATUS_ERRORS`); no answer at all
(refused, unreachable, timed out, a failed TLS handshake: :func:`tls_failure` says why; an ``http://`` URL whose port
completes a TLS handshake: :func:`speaks_tls`) is :class:`~fdeplb.errors.RedisUnavailableError` (exit 7) with one line.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Iterator

from fdeplb.backoff import ride_out
from fdeplb.credentials import load_credentials
from fdeplb.errors import (AuthError, DependencyError, FdeplbError, InputError, NotFoundError, RedisUnavailableError,
                           StateError, StoreError)

#: HTTP status -> the error the client raises (so the CLI exits with the code of the error table)
_STATUS_ERRORS = {400: InputError, 401: AuthError, 404: NotFoundError, 409: StateError, 413: InputError,
                  503: RedisUnavailableError}
TIMEOUT_S = 30.0
#: the longest the TLS probe of an ``http://`` URL that gave no answer may take (s), :func:`speaks_tls`
TLS_PROBE_S = 5.0
#: records per ``GET /v1/audit`` page (at most the server's limit, fdeplb.api.service.MAX_AUDIT_LIMIT)
AUDIT_PAGE = 10_000
#: how long one ``audit --url --follow`` request long-polls (ms)
FOLLOW_WAIT_MS = 10_000


def _requests():
    """The ``requests`` module (a core dependency); :class:`DependencyError` naming the install line if absent."""
    try:
        import requests
    except ImportError:  # pragma: no cover - only on an install that skipped fdeplb's dependencies
        raise DependencyError("the HTTP client (--url) needs requests: pip install 'requests>=2.31' "
                              "(a dependency of fdeplb: reinstall it with pip install 'fdeplb')") from None
    return requests


class ApiClient:
    """A small client of one ``fdeplb serve`` URL (``http://host:port``)."""

    def __init__(self, url: str, credentials_file: str | None = None, timeout_s: float = TIMEOUT_S,
                 ca_cert: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--url must start with http:// or https://, got {url!r}")
        if ca_cert is not None and not os.path.isfile(ca_cert):
            raise InputError(f"--ca-cert {ca_cert}: not a file")
        self.url = url.rstrip("/")
        self.credentials = load_credentials(credentials_file)
        self.timeout_s = timeout_s
        #: what requests verifies an https:// server against: ``ca_cert``, else True (REQUESTS_CA_BUNDLE, or the
        #: system's bundle); the certificate is always verified
        self.verify: str | bool = ca_cert if ca_cert is not None else True

    def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        requests = _requests()
        try:
            resp = requests.request(method, self.url + path, timeout=kwargs.pop("timeout", self.timeout_s),
                                    verify=self.verify, **kwargs)
        except requests.exceptions.SSLError as exc:
            ca_cert = self.verify if isinstance(self.verify, str) else None
            raise RedisUnavailableError(f"no TLS connection to {self.url}: {tls_failure(exc, ca_cert)}") from None
        except requests.RequestException as exc:
            hint = ""
            if self.url.startswith("http://") and isinstance(exc, requests.ConnectionError) and \
                    not isinstance(exc, requests.exceptions.ConnectTimeout) and \
                    speaks_tls(self.url, min(self.timeout_s, TLS_PROBE_S)):  # a TLS server drops plain HTTP
                hint = f": the port seems to speak TLS (it completed a TLS handshake): use https://{self.url[7:]}"
            if method != "GET" and isinstance(exc, requests.exceptions.ReadTimeout):  # sent, its answer lost
                hint = (f": the {method} {path} was sent and may have been applied; look (fdeplb status --url "
                        f"{self.url}) before sending it again")
            raise RedisUnavailableError(f"no answer from {self.url}: {type(exc).__name__}{hint}") from None
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

    def audit_pages(self, page_size: int = AUDIT_PAGE, follow: bool = False, retry_s: float = 0.0) -> Iterator[list]:
        """The audit stream as pages of :class:`~fdeplb.store.AuditRecord` (``GET /v1/audit``, oldest first):
        every record there is so far, ``page_size`` at a time; then, with ``follow``, each long poll's new records
        (an empty page when none came within :data:`FOLLOW_WAIT_MS`), until the caller stops asking. A long poll
        that gets no answer (the server restarting) or a 503 (its Redis away) is retried for up to ``retry_s`` s
        (:func:`fdeplb.backoff.ride_out`), from the last record received; then
        :class:`~fdeplb.errors.RedisUnavailableError`."""
        since = None
        while True:
            page = self.get("/v1/audit", since=since, limit=page_size)
            since = page["last_id"]
            yield [_entry(r) for r in page["records"]]
            if len(page["records"]) < page_size:
                break
        while follow:
            page = ride_out(lambda: self.get("/v1/audit", since=since, limit=page_size, wait_ms=FOLLOW_WAIT_MS),
                            what=f"the API at {self.url}", retry_s=retry_s)
            since = page["last_id"]
            yield [_entry(r) for r in page["records"]]


#: OpenSSL verify codes (X509_V_ERR_*) of a certificate outside its validity period
_EXPIRED, _NOT_YET_VALID = 10, 9
#: ... of a certificate that does not name the host or IP address the client asked for
_NAME_MISMATCH = (62, 64)
#: handshake failures of a server that answered in plain text (an HTTP server, not TLS): OpenSSL's reasons
_NOT_TLS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE")


def _ssl_error(exc: BaseException):
    """The :class:`ssl.SSLError` under a requests error (requests wraps urllib3's MaxRetryError, whose ``reason`` is
    urllib3's SSLError around the ssl module's), found through ``reason``, ``args`` and the cause chain; or None."""
    import ssl

    todo, seen = [exc], set()
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ssl.SSLError):
            return err
        todo += [e for e in (getattr(err, "reason", None), err.__cause__, err.__context__, *err.args)
                 if isinstance(e, BaseException)]
    return None


def tls_failure(exc: BaseException, ca_cert: str | None = None) -> str:
    """What went wrong in a failed TLS handshake (``exc``: a ``requests`` SSLError; ``ca_cert``: the ``--ca-cert``
    file it was verified against, None for the default bundle), in words and with OpenSSL's whole reason (never
    cut): the server does not speak TLS on that port, its certificate has expired (or is not yet valid), does not
    name the host asked for, or was not verified: not signed by the CA in ``ca_cert`` when one was given, else
    (the default bundle) ``--ca-cert`` is named; else the handshake's own error."""
    import ssl

    err = _ssl_error(exc)
    if err is None:
        return f"TLS handshake failed: {exc}"
    text = str(err).split(" (_ssl.c:")[0]
    if isinstance(err, ssl.SSLCertVerificationError):
        what = err.verify_message or text
        if err.verify_code == _EXPIRED:
            return f"the server's certificate has expired ({what}): renew it"
        if err.verify_code == _NOT_YET_VALID:
            return f"the server's certificate is not valid yet ({what}): check the clocks"
        if err.verify_code in _NAME_MISMATCH:
            return (f"the server's certificate does not name this host ({what}): use a host name or IP address "
                    f"the certificate holds, or reissue it with this one")
        if ca_cert is not None:
            return (f"the server's certificate is not signed by the CA in --ca-cert {ca_cert} ({what}): pass the CA "
                    f"that issued it")
        return f"the certificate was not verified: {what} (pass --ca-cert PEM or set REQUESTS_CA_BUNDLE)"
    if err.reason in _NOT_TLS:
        return f"the server does not speak TLS on that port (a plain-HTTP server? try http://) ({text})"
    return f"TLS handshake failed: {text}"


def speaks_tls(url: str, timeout_s: float) -> bool:
    """Whether the host and port of ``url`` (``http://host[:port]``; port 80 when none) complete a TLS handshake
    within ``timeout_s`` seconds (the certificate is not verified: this only tells whether the port speaks TLS).
    False on any socket or TLS error."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s) as sock, \
                context.wrap_socket(sock, server_hostname=parts.hostname):
            return True
    except (OSError, ValueError, TypeError):  # ssl.SSLError is an OSError; a port or host the URL cannot give
        return False


def _entry(record: dict[str, Any]):
    """One JSON audit record of ``GET /v1/audit`` as the :class:`~fdeplb.store.AuditRecord` Redis gives."""
    from fdeplb.store import AuditRecord

    return AuditRecord(str(record.get("id", "")), {k: str(v) for k, v in record.items() if k != "id"})


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("trigger", help="ask a cluster's API for a rearrangement round (POST /rearrange_experts)",
                       description="POST /rearrange_experts with action \"\": start one round. Without --ips, the "
                                   "API addresses every rank registered (from GET /v1/state) are sent.")
    t.add_argument("--url", required=True, help="the API, http://host:port")
    t.add_argument("--ips", nargs="+", default=None, metavar="HOST:PORT", help="rank API addresses to name")
    t.add_argument("--credentials-file", default=None, metavar="FILE")
    t.add_argument("--ca-cert", default=None, metavar="PEM", help="verify an https:// server against this CA bundle")
    t.set_defaults(handler=run_trigger)


def run_trigger(args: argparse.Namespace) -> int:
    client = ApiClient(args.url, args.credentials_file, ca_cert=args.ca_cert)
    ips = args.ips
    if ips is None:
        ips = [a for a in client.get("/v1/state").get("api_addresses", {}).values() if a]
        if not ips:
            raise InputError(f"no rank registered an API address at {args.url}; pass --ips")
    reply = client.post("/rearrange_experts", {"action": "", "ips": ips})
    print(f"round {reply.get('round', '?')} requested")
    return 0
