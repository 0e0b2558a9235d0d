"""Redis clients for a URL: embedded (fakeredis), standalone, TLS, unix socket, cluster."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from ledger.errors import ConfigurationError
from ledger.extras import need
from ledger.settings import LedgerSettings, require_url

if TYPE_CHECKING:
    import fakeredis

SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster

_SCHEMES = ("embedded", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_servers: dict[str, fakeredis.FakeServer] = {}
_servers_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Target:
    kind: str  # embedded | standalone | cluster
    url: str  # the URL redis-py understands (embedded: the server name)


def parse_url(url: str) -> Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ConfigurationError(
            f"unsupported Redis URL scheme {parts.scheme!r} in {url!r}: use one of "
            + ", ".join(f"{s}://" for s in _SCHEMES)
        )
    if scheme == "embedded":
        return Target("embedded", parts.netloc or "default")
    if scheme.endswith("+cluster"):
        return Target("cluster", urlunsplit(parts._replace(scheme=scheme.split("+")[0])))
    return Target("standalone", url)


def embedded_server(name: str) -> fakeredis.FakeServer:
    """One in-process fakeredis server per name, shared by every client in this process."""
    fakeredis = _fakeredis()
    with _servers_lock:
        if name not in _servers:
            server = fakeredis.FakeServer()
            _add_sha1hex(server)
            _servers[name] = server
        return _servers[name]


def _sha1hex(data: object) -> bytes:
    raw = data if isinstance(data, bytes) else str(data).encode()
    return hashlib.sha1(raw).hexdigest().encode()


def _fakeredis() -> Any:
    """fakeredis, with lupa for its Lua: the ``embedded`` extra, imported on first use."""
    feature = "the embedded backend (embedded://)"
    need("lupa", "embedded", feature)
    return need("fakeredis", "embedded", feature)


def _add_sha1hex(server: fakeredis.FakeServer) -> None:
    """Give the embedded server's Lua the ``redis.sha1hex`` every real Redis has (the
    scripts fingerprint their arguments with it) and fakeredis lacks."""
    _fakeredis().FakeRedis(server=server).eval("return 1", 0)  # creates the Lua runtime
    runtime = getattr(server, "_lua_runtime", None)
    if runtime is None:
        raise ConfigurationError(
            "this fakeredis version keeps no Lua runtime on its server: the embedded "
            "backend cannot provide redis.sha1hex (pin fakeredis to a tested version)"
        )
    runtime.globals().redis.sha1hex = _sha1hex


def _options(settings: LedgerSettings) -> dict[str, Any]:
    # redis-py re-sends a timed-out command by default; the ledger retries itself
    # (tenacity, same operation id), so the driver's own retry is switched off.
    return {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "retry": Retry(NoBackoff(), 0),
    }


def sync_client(settings: LedgerSettings) -> SyncClient:
    t = parse_url(require_url(settings))
    if t.kind == "embedded":
        return _fakeredis().FakeRedis(server=embedded_server(t.url))  # type: ignore[no-any-return]
    if t.kind == "cluster":
        return redis.cluster.RedisCluster.from_url(t.url, **_options(settings))
    return redis.Redis.from_url(t.url, **_options(settings))


def async_client(settings: LedgerSettings) -> AsyncClient:
    t = parse_url(require_url(settings))
    if t.kind == "embedded":
        return _fakeredis().FakeAsyncRedis(server=embedded_server(t.url))  # type: ignore[no-any-return]
    if t.kind == "cluster":
        return redis.asyncio.cluster.RedisCluster.from_url(t.url, **_options(settings))
    return redis.asyncio.Redis.from_url(t.url, **_options(settings))
