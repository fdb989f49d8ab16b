"""``fdeplb serve``: the HTTP API of one cluster (FastDeploy's EPLB routes + read-only views), with uvicorn.

Credentials come from ``FDEPLB_API_USER`` / ``FDEPLB_API_PASSWORD`` or ``--credentials-file`` (first line
``USER:PASSWORD``), never from a command-line value. Without them ``serve`` refuses to start unless
``--insecure-no-auth`` is given, and then warns on every start. ``/health`` answers without credentials (healthy or
not, and why in one phrase, for probes); ``/metrics`` needs them unless ``--metrics-public``. ``/ui`` is the web
view of the cluster (a browser asks for the same credentials).

TLS: ``--ssl-certfile`` and ``--ssl-keyfile`` (PEM, both or neither) serve HTTPS (uvicorn's); the pair is loaded
before binding, and one that does not load (mismatched, swapped, corrupt, an encrypted key) is one line naming the
files, exit 2. The HTTP clients verify the certificate (``--ca-cert FILE`` or ``REQUESTS_CA_BUNDLE``). Stop: on
SIGTERM / SIGINT open long polls and weight waits answer at once and the server exits within :data:`GRACEFUL_S`
seconds (uvicorn's ``timeout_graceful_shutdown``). ``serving`` is logged only once the socket is bound (a bind that
fails exits 1 with the reason and no such line).
"""

from __future__ import annotations

import argparse
import sys

from fdeplb.errors import DependencyError, InputError, StateError
from fdeplb.options import cluster_parent, positive_float

#: seconds the server lets in-flight requests finish after SIGTERM before it cancels them
GRACEFUL_S = 1

INSECURE_WARNING = ("WARNING: --insecure-no-auth: the API accepts every request without credentials; anyone who "
                    "can reach {host}:{port} can start rounds and clear weights")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a cluster's HTTP API (FastDeploy's EPLB routes, state, metrics)",
                       description=__doc__.replace("``", "`"), formatter_class=argparse.RawDescriptionHelpFormatter,
                       parents=[cluster_parent()])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("--credentials-file", default=None, metavar="FILE",
                   help="file whose first line is USER:PASSWORD (instead of FDEPLB_API_USER / FDEPLB_API_PASSWORD)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve without credentials (never on a reachable address)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without credentials (default: HTTP Basic, as every GET route; /health is "
                        "always open)")
    p.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain) file; needs --ssl-keyfile")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    p.add_argument("--weights-timeout-s", type=positive_float, default=300.0,
                   help="how long /update_model_weight and /clear_load_weight wait for the ranks (default 300)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import open_store
    from fdeplb.log import configure

    configure(args.log_level)
    try:
        import uvicorn

        from fdeplb.api import ApiSettings, create_app
    except ImportError as exc:
        raise DependencyError(f"fdeplb serve needs the api extra: pip install 'fdeplb[api]' ({exc})") from None
    from fdeplb.credentials import file_is_private, load_credentials
    import structlog

    log = structlog.get_logger("fdeplb.serve")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    credentials = load_credentials(args.credentials_file)
    if credentials is None and not args.insecure_no_auth:
        raise InputError("no API credentials: set FDEPLB_API_USER and FDEPLB_API_PASSWORD or pass "
                         "--credentials-file (or --insecure-no-auth to serve without, never on a reachable address)")
    if credentials is not None and args.insecure_no_auth:
        raise InputError("--insecure-no-auth and credentials exclude each other")
    if args.credentials_file and not file_is_private(args.credentials_file):
        log.warning("credentials file is readable by group or others", path=args.credentials_file)
    if credentials is None:
        print(INSECURE_WARNING.format(host=args.host, port=args.port), file=sys.stderr, flush=True)
        log.warning("serving without authentication", host=args.host, port=args.port)
    tls = _tls_files(args.ssl_certfile, args.ssl_keyfile)
    store = open_store(args.redis_url, args.cluster)
    settings = ApiSettings(weights_timeout_s=args.weights_timeout_s, metrics_public=args.metrics_public)
    app = create_app(store, credentials, settings)
    level = args.log_level.lower() if args.log_level.lower() in ("debug", "info", "warning", "error") else "info"
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False, log_level=level,
                            timeout_graceful_shutdown=GRACEFUL_S, **tls)

    class Server(uvicorn.Server):
        """uvicorn's server, which says ``serving`` once bound and ends the API's waits when told to stop."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # bound: a failed bind exits inside startup, before this line
                log.info("serving", cluster=args.cluster, host=args.host, port=args.port,
                         auth=credentials is not None, tls=bool(tls))

        def handle_exit(self, sig, frame) -> None:
            settings.shutdown.set()  # long polls and weight waits answer now, so the graceful stop is short
            super().handle_exit(sig, frame)

    try:
        Server(config).run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind (it logged why)
        if exc.code:
            raise StateError(f"could not serve on {args.host}:{args.port} (see the log line above)") from None
    return 0


def _tls_files(certfile: str | None, keyfile: str | None) -> dict[str, str]:
    """uvicorn's TLS arguments for ``--ssl-certfile`` / ``--ssl-keyfile``: both or neither, each a readable file, and
    a pair that loads (:func:`check_tls_pair`). :class:`InputError` otherwise (exit 2, one line naming the files)."""
    if not certfile and not keyfile:
        return {}
    if not (certfile and keyfile):
        raise InputError("--ssl-certfile and --ssl-keyfile go together (a certificate and its key)")
    import os

    for name, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise InputError(f"{name} {path}: not a readable file")
    check_tls_pair(certfile, keyfile)
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile}


class _Encrypted(Exception):
    """Raised by the passphrase callback: OpenSSL asked for one, so the key is encrypted."""


def _no_passphrase() -> str:
    raise _Encrypted


def check_tls_pair(certfile: str, keyfile: str) -> None:
    """Load ``certfile`` (PEM certificate chain) and ``keyfile`` (PEM private key) as uvicorn will, with the
    standard library's :mod:`ssl`, before serving: :class:`InputError` naming the files and what is wrong: no
    certificate in ``certfile`` (corrupt, or the two files swapped), an encrypted key (uvicorn would prompt for
    its passphrase on the terminal), no readable key, or a key that is not the certificate's."""
    import ssl

    def holds_certificate(path: str) -> bool:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
            return True
        except ssl.SSLError:
            return False

    if not holds_certificate(certfile):
        if holds_certificate(keyfile):
            raise InputError(f"--ssl-certfile {certfile} holds no PEM certificate but --ssl-keyfile {keyfile} does: "
                             f"the two files look swapped")
        raise InputError(f"--ssl-certfile {certfile}: holds no PEM certificate (corrupt, or not a certificate)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except _Encrypted:
        raise InputError(f"--ssl-keyfile {keyfile}: the private key is encrypted; serve needs it unencrypted "
                         f"(openssl pkey -in {keyfile} -out PLAIN.pem, kept private)") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise InputError(f"--ssl-keyfile {keyfile} is not the private key of the certificate in --ssl-certfile "
                             f"{certfile} (key values mismatch)") from None
        said = f"; OpenSSL: {exc.reason}" if exc.reason else ""  # "PEM lib" (no reason) says nothing more
        raise InputError(f"--ssl-keyfile {keyfile}: holds no readable PEM private key for --ssl-certfile "
                         f"{certfile} (corrupt, or not a key{said})") from None
