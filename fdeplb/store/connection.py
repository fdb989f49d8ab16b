"""The connection to Redis and the boundary of its errors: the client a URL names, and the one place redis-py's
exceptions become fdeplb's (the pattern of httpx's ``map_httpcore_exceptions``).

- :func:`connect`: a redis-py client for a ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` or
  ``redis+sentinel://`` URL, without retries of a sent command and with a socket timeout longer than any
  ``XREAD BLOCK`` fdeplb issues (:data:`MAX_BLOCK_MS`);
- :func:`redis_errors` and :func:`map_public_methods`: every public method of the store runs inside the mapping
  (connection refused / reset / timed out, authentication: :class:`~fdeplb.errors.RedisUnavailableError`; any other
  server or client error: :class:`~fdeplb.errors.StoreError`);
- :func:`typed` / :func:`wrong_type`: a key of another Redis type than fdeplb keeps there (``WRONGTYPE``: another
  program wrote it) is a :class:`~fdeplb.errors.CorruptRecordError` naming the key;
- :func:`as_str` / :func:`as_text`: replies (bytes) as text.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fdeplb.errors import CorruptRecordError, InputError, RedisUnavailableError, StoreError

#: longest XREAD BLOCK any fdeplb waiter issues (ms); the socket timeout is set well above it.
MAX_BLOCK_MS = 2_000
SOCKET_TIMEOUT_S = 30.0

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Map redis-py's exceptions to fdeplb's (see the module doc)."""
    try:
        yield
    except redis.TimeoutError as exc:  # the command may have reached Redis and run: its outcome is not known
        raise RedisUnavailableError(f"Redis at {url} did not answer in time ({exc}); a change this command sent may "
                                    f"have been made: look (status, config show, audit) before trying again") from None
    except redis.ConnectionError as exc:  # AuthenticationError is a ConnectionError
        raise RedisUnavailableError(f"Redis at {url} is unavailable: {exc}") from None
    except redis.ResponseError as exc:
        raise StoreError(f"Redis at {url} refused a command: {exc}") from None
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise StoreError(f"Redis client error ({url}): {exc}") from None


def wrong_type(key: str, exc: Exception) -> CorruptRecordError | None:
    """The :class:`CorruptRecordError` naming ``key`` when ``exc`` is Redis's WRONGTYPE (another program wrote a
    value of another type there), else None."""
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE"):
        return CorruptRecordError(f"{key}: is not of the Redis type fdeplb keeps there (WRONGTYPE)", key=key)
    return None


@contextlib.contextmanager
def typed(key: str) -> Iterator[None]:
    """Commands on ``key`` inside: WRONGTYPE becomes :class:`CorruptRecordError` naming ``key`` (:func:`wrong_type`);
    other Redis errors pass on to :func:`redis_errors`."""
    try:
        yield
    except redis.ResponseError as exc:
        raise wrong_type(key, exc) or exc from None


def hgetall(client: Any, key: str) -> dict:
    """``HGETALL key`` on a client (or a WATCHing pipeline), as :func:`typed`."""
    with typed(key):
        return client.hgetall(key)


def as_str(value: Any) -> str:
    """A reply value as text (bytes decoded, invalid UTF-8 replaced; None as "")."""
    return value.decode(errors="replace") if isinstance(value, bytes) else ("" if value is None else str(value))


def as_text(raw: dict) -> dict[str, str]:
    """A hash as read (bytes names and values) as text."""
    try:  # replies are bytes (decode_responses=False): the direct decode is the hot path of every record read
        return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
    except AttributeError:
        return {as_str(k): as_str(v) for k, v in raw.items()}


def _mapped(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with redis_errors(self.url):
            return fn(self, *args, **kwargs)

    wrapper.maps_redis_errors = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def map_public_methods(cls: type) -> type:
    """Wrap every public method of ``cls`` in :func:`redis_errors` (the one boundary), those its bases (the store's
    parts) define included: the whole MRO is walked, and each name is wrapped as it resolves on ``cls`` (the first
    definition in the MRO), once. The wrappers are set on ``cls``, the bases are left as they are; each carries
    ``maps_redis_errors = True`` (what tests check)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in list(vars(klass).items()):
            if name in seen:
                continue
            seen.add(name)
            if name.startswith("_") or not callable(value) or isinstance(value, (staticmethod, classmethod, type)):
                continue
            if not getattr(value, "maps_redis_errors", False):
                setattr(cls, name, _mapped(value))
    return cls


def _host_ports(netloc: str, url: str) -> list[tuple[str, int]]:
    out = []
    for part in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"bad Redis URL {url!r}: expected host:port[,host:port...], got {part!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def connect(url: str, socket_timeout_s: float | None = None) -> Any:
    """A redis-py client for ``url``, bytes replies, no retries of a sent command, each command's reply awaited at
    most ``socket_timeout_s`` seconds (None: :data:`SOCKET_TIMEOUT_S`; never below what the longest ``XREAD
    BLOCK`` needs, :data:`MAX_BLOCK_MS` + 1 s). Accepted forms:

    - ``redis://host:port/db``, ``rediss://...``, ``unix:///path``: one server;
    - ``redis+cluster://host:port[,host:port...]`` (or ``redis://host:port/?cluster=1``): a Redis Cluster, any of
      its nodes as the seed (redis-py's ``RedisCluster``; every fdeplb script's keys share the ``{cluster}`` slot);
    - ``redis+sentinel://host:port[,host:port...]/master_name[/db]``: the master that Sentinel names, looked up
      again after a failover (redis-py's ``Sentinel.master_for``).

    Raises :class:`InputError` for a malformed URL (nothing connects until the first command).
    """
    from urllib.parse import parse_qs, urlsplit

    forms = "redis://host:port/db, rediss://..., unix:///path, redis+cluster://host:port or " \
            "redis+sentinel://host:port/master"
    if not isinstance(url, str) or "://" not in url:
        raise InputError(f"not a Redis URL: {url!r} (expected {forms})")
    timeout = SOCKET_TIMEOUT_S if socket_timeout_s is None else max(float(socket_timeout_s), MAX_BLOCK_MS / 1000 + 1)
    opts = dict(socket_timeout=timeout, socket_connect_timeout=min(10.0, timeout), decode_responses=False)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel",
                            "rediss+sentinel"):
        raise InputError(f"bad Redis URL {url!r}: unknown scheme {parts.scheme!r} (accepted: {forms})")
    query = parse_qs(parts.query)
    try:
        if parts.scheme in ("redis+cluster", "rediss+cluster") or query.get("cluster", ["0"])[0] in ("1", "true"):
            from redis.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h, p) for h, p in _host_ports(parts.netloc, url)]
            return RedisCluster(startup_nodes=nodes, ssl=parts.scheme.startswith("rediss"),
                                password=parts.password, username=parts.username or None, **opts)
        if parts.scheme in ("redis+sentinel", "rediss+sentinel"):
            from redis.sentinel import Sentinel

            path = [x for x in parts.path.split("/") if x]
            if not path:
                raise InputError(f"bad Redis URL {url!r}: name the master, redis+sentinel://host:port/master")
            sentinel = Sentinel(_host_ports(parts.netloc, url), socket_timeout=5.0, socket_connect_timeout=5.0)
            return sentinel.master_for(path[0], db=int(path[1]) if len(path) > 1 else 0,
                                       password=parts.password, retry=Retry(NoBackoff(), 0), **opts)
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **opts)
    except ValueError as exc:  # redis-py's URL parser, a port that is not a number
        raise InputError(f"bad Redis URL {url!r}: {exc}") from None
