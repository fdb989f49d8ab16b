"""``fdeplb serve``: the HTTP API of one cluster (FastDeploy's EPLB routes + read-only views), with uvicorn.

Credentials come from ``FDEPLB_API_USER`` / ``FDEPLB_API_PASSWORD`` or ``--credentials-file`` (first line
``USER:PASSWORD``), never from a command-line value. Without them ``serve`` refuses to start unless
``--insecure-no-auth`` is given, and then warns on every start. ``/health`` answers without credentials (healthy or
not, and why in one phrase, for probes); ``/metrics`` needs them unless ``--metrics-public``. ``/ui`` is the web
view of the cluster (a browser asks for the same credentials).
"""

from __future__ import annotations

import argparse
import sys

from fdeplb.errors import DependencyError, InputError
from fdeplb.options import cluster_parent, positive_float

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
    store = open_store(args.redis_url, args.cluster)
    settings = ApiSettings(weights_timeout_s=args.weights_timeout_s, metrics_public=args.metrics_public)
    app = create_app(store, credentials, settings)
    log.info("serving", cluster=args.cluster, host=args.host, port=args.port, auth=credentials is not None)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                timeout_graceful_shutdown=5,  # open /v1/ui/events streams do not hold a shutdown
                log_level=args.log_level.lower() if args.log_level.lower() in ("debug", "info", "warning", "error")
                else "info")
    return 0
