"""How the API authenticates a request: FastDeploy's body fields on POST routes, HTTP Basic on GET routes
(``/health`` is open to anyone; ``/metrics`` too with ``fdeplb serve --metrics-public``).

POST routes take FastDeploy's ``user`` / ``passwd`` body fields; GET routes take HTTP Basic auth, parsed by
:class:`fastapi.security.HTTPBasic` (``auto_error=False``: a missing or malformed header is our own 401, not
FastAPI's). Both are compared by :meth:`Credentials.matches` (constant time). Where the credentials come from
(environment or file) is :mod:`fdeplb.credentials`, re-exported here.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.security import HTTPBasic

from fdeplb.credentials import ENV_PASSWORD, ENV_USER, Credentials, file_is_private, load_credentials
from fdeplb.errors import AuthError

__all__ = ["AUTH_FAILED", "ENV_PASSWORD", "ENV_USER", "Credentials", "check_basic", "check_body",
           "file_is_private", "has_basic", "load_credentials"]

#: FastDeploy's answer to wrong credentials (same text)
AUTH_FAILED = "user or passwd is invalid"
#: the HTTP Basic parser; ``auto_error=False`` returns None for a missing header or another scheme
_BASIC = HTTPBasic(auto_error=False)


def check_body(credentials: Credentials | None, body: dict) -> None:
    """FastDeploy's ``user`` / ``passwd`` body fields; :class:`AuthError` unless they match (None: no auth)."""
    if credentials is not None and not credentials.matches(body.get("user"), body.get("passwd")):
        raise AuthError(AUTH_FAILED)


async def has_basic(credentials: Credentials | None, request: Request) -> bool:
    """Whether ``request`` carries matching HTTP Basic credentials (True when the API has none): for a route open
    to anyone that tells its authenticated callers more (``/health``)."""
    try:
        await check_basic(credentials, request)
    except AuthError:
        return False
    return True


async def check_basic(credentials: Credentials | None, request: Request) -> str:
    """HTTP Basic auth of a GET route (and of fdeplb's own operator POST routes); returns the user name ("" when
    the API has no credentials). :class:`AuthError` unless it matches (None: no auth). A header that is absent, of
    another scheme, not base64 or without ``:`` is the same :class:`AuthError` as a wrong password."""
    if credentials is None:
        return ""
    try:
        given = await _BASIC(request)
    except HTTPException:  # malformed: HTTPBasic raises even with auto_error=False
        given = None
    if given is None or not credentials.matches(given.username, given.password):
        raise AuthError(AUTH_FAILED)
    return given.username
