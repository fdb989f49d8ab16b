"""API credentials: where they come from, and the constant-time check (no HTTP library here).

The server (:mod:`fdeplb.api`) and the HTTP client of the command line (``fdeplb status --url`` ...) both read them
from here, so the client needs neither fastapi nor :mod:`fdeplb.api` (``pip install 'fdeplb[paddle]'`` is enough).

Credentials come from the environment (``FDEPLB_API_USER`` / ``FDEPLB_API_PASSWORD``) or from a file whose first
line is ``USER:PASSWORD`` (``--credentials-file``); never from a command-line value (it would show in ``ps``). Both
values are registered with :func:`fdeplb.log.register_secret`, so no log line ever carries them. Values are
compared with :func:`hmac.compare_digest` (user and password always both compared: the time does not say which was
wrong).
"""

from __future__ import annotations

import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from fdeplb.errors import InputError
from fdeplb.input_files import read_input
from fdeplb.log import register_secret

__all__ = ["ENV_PASSWORD", "ENV_USER", "Credentials", "file_is_private", "load_credentials"]

ENV_USER = "FDEPLB_API_USER"
ENV_PASSWORD = "FDEPLB_API_PASSWORD"


@dataclass(frozen=True)
class Credentials:
    """The one user and password the API accepts. ``repr`` never shows the password."""

    user: str
    password: str

    def __post_init__(self) -> None:
        if not self.user or not self.password:
            raise InputError("API credentials need a non-empty user and a non-empty password")
        if ":" in self.user:
            raise InputError("the API user may not contain ':' (HTTP Basic separates user and password with it)")
        if not (self.user + self.password).isascii() or not (self.user + self.password).isprintable():
            # FastAPI's HTTPBasic decodes the header as ASCII: such credentials would never match
            raise InputError("API credentials must be printable ASCII (HTTP Basic as the server decodes it)")
        register_secret(self.password)

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password=[redacted])"

    def matches(self, user: object, password: object) -> bool:
        """Constant-time comparison of both values (a non-string never matches)."""
        u = user.encode() if isinstance(user, str) else b""
        p = password.encode() if isinstance(password, str) else b""
        ok_user = hmac.compare_digest(u, self.user.encode())
        ok_password = hmac.compare_digest(p, self.password.encode())
        return ok_user & ok_password & isinstance(user, str) & isinstance(password, str)


def load_credentials(credentials_file: str | os.PathLike | None = None,
                     environ: dict[str, str] | None = None) -> Credentials | None:
    """Credentials from ``credentials_file`` (first line ``USER:PASSWORD``) or else from the environment; None when
    neither gives any. :class:`InputError` for an unreadable or malformed file, or only one of the two variables."""
    env = os.environ if environ is None else environ
    if credentials_file is not None:
        path = Path(credentials_file)
        try:  # a regular file only: a FIFO or a device is refused, never waited on
            first = read_input(path, "credentials file").decode("utf-8").splitlines()[:1]
        except UnicodeDecodeError as exc:
            raise InputError(f"cannot read the credentials file {path}: {exc}") from None
        user, sep, password = (first[0] if first else "").partition(":")
        if not sep:
            raise InputError(f"credentials file {path}: the first line must be USER:PASSWORD")
        return Credentials(user.strip(), password.rstrip("\r\n"))
    user, password = env.get(ENV_USER, ""), env.get(ENV_PASSWORD, "")
    if not user and not password:
        return None
    if not user or not password:
        raise InputError(f"set both {ENV_USER} and {ENV_PASSWORD} (only one is set)")
    return Credentials(user, password)


def file_is_private(path: str | os.PathLike) -> bool:
    """True unless the file is readable by group or others."""
    try:
        return not (os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))
    except OSError:
        return True
