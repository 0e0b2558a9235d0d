"""Redis clients for a URL: embedded (fakeredis), standalone, TLS, unix socket, cluster."""

from __future__ import annotations

import hashlib
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions as rex
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ledger.errors import BackendUnavailable, ConfigurationError, PermissionDenied, translate
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


def _i32(x: float) -> int:
    """A number as LuaBitOp takes it: modulo 2**32, as a signed 32-bit integer."""
    n = int(x) & 0xFFFFFFFF
    return n - (1 << 32) if n & 0x80000000 else n


def _bit_library(runtime: Any) -> Any:
    """The ``bit`` library (LuaBitOp) of Redis's Lua, which fakeredis's lacks."""

    def fold(op: Callable[[int, int], int]) -> Callable[..., int]:
        def f(*xs: float) -> int:
            acc = _i32(xs[0])
            for x in xs[1:]:
                acc = _i32(op(acc, _i32(x)))
            return acc

        return f

    def ror(x: float, n: float) -> int:
        u, k = _i32(x) & 0xFFFFFFFF, int(n) & 31
        return _i32((u >> k) | (u << (32 - k)))

    def rol(x: float, n: float) -> int:
        return ror(x, 32 - (int(n) & 31))

    funcs: dict[str, Callable[..., Any]] = {
        "tobit": _i32,
        "band": fold(lambda a, b: a & b),
        "bor": fold(lambda a, b: a | b),
        "bxor": fold(lambda a, b: a ^ b),
        "bnot": lambda x: _i32(~_i32(x)),
        "lshift": lambda x, n: _i32(_i32(x) << (int(n) & 31)),
        "rshift": lambda x, n: _i32((_i32(x) & 0xFFFFFFFF) >> (int(n) & 31)),
        "arshift": lambda x, n: _i32(_i32(x) >> (int(n) & 31)),
        "ror": ror,
        "rol": rol,
        "tohex": lambda x, n=8: format(_i32(x) & 0xFFFFFFFF, "08x")[-int(n) :].encode(),
    }
    # (the runtime has no encoding: names and strings cross as bytes)
    return runtime.table_from({name.encode(): f for name, f in funcs.items()})


_STRUCT_CODES = {"i8": "q", "B": "B"}
_STRUCT_TOKEN = re.compile(r"i8|B")


def _struct_format(fmt: Any) -> str:
    """A format of Redis's ``struct`` library as Python's: the byte order '<' and the
    codes the scripts use (``i8`` a signed 64-bit integer, ``B`` an unsigned byte)."""
    text = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
    body = text[1:] if text[:1] == "<" else ""
    tokens = _STRUCT_TOKEN.findall(body)
    if not text.startswith("<") or "".join(tokens) != body:
        raise ValueError(f"the embedded struct library reads '<' formats of i8 and B, got {text!r}")
    return "<" + "".join(_STRUCT_CODES[t] for t in tokens)


def _struct_library(runtime: Any) -> Any:
    """``struct.pack`` and ``struct.unpack`` of Redis's Lua (the scripts pack a scope's
    configuration and live counters with them), which fakeredis's lacks."""

    def pack(fmt: Any, *xs: float) -> bytes:
        return struct.pack(_struct_format(fmt), *(int(x) for x in xs))

    def unpack(fmt: Any, data: Any) -> Any:
        f = _struct_format(fmt)
        raw = data if isinstance(data, bytes) else str(data).encode("latin-1")
        return runtime.table_from([*struct.unpack_from(f, raw), struct.calcsize(f) + 1])

    make = runtime.eval(
        "function(p, u) return { pack = p, unpack = function(f, s) return unpack(u(f, s)) end } end"
    )
    return make(pack, unpack)


def _add_sha1hex(server: fakeredis.FakeServer) -> None:
    """Give the embedded server's Lua what every real Redis has and fakeredis lacks:
    ``redis.sha1hex`` (the scripts fingerprint their arguments with it) and the ``bit``
    library (``open`` checks the budget's SHA-256 with it), and ``struct`` (a scope's
    packed fields)."""
    _fakeredis().FakeRedis(server=server).eval("return 1", 0)  # creates the Lua runtime
    runtime = getattr(server, "_lua_runtime", None)
    if runtime is None:
        raise ConfigurationError(
            "this fakeredis version keeps no Lua runtime on its server: the embedded "
            "backend cannot provide redis.sha1hex (pin fakeredis to a tested version)"
        )
    runtime.globals().redis.sha1hex = _sha1hex
    runtime.globals().bit = _bit_library(runtime)
    runtime.globals().struct = _struct_library(runtime)
    expected = getattr(server, "_lua_expected_globals", None)  # (fakeredis refuses a
    if isinstance(expected, set):  # script that adds globals: bit is not the script's)
        expected.update(runtime.globals().keys())
    server._lua_runtime = _CompiledRuntime(runtime)  # type: ignore[attr-defined]


class _CompiledRuntime:
    """The embedded server's Lua runtime, each script compiled once: fakeredis compiles
    a script's text on every EVALSHA and runs a full ``collectgarbage()`` after it, which
    makes a ledger call cost about twice what running it does. A compiled chunk runs
    exactly as the text would (same globals, KEYS and ARGV); Lua's incremental
    collector still runs, as it does in Redis, which never forces a full collection."""

    _FULL_GC = frozenset({"collectgarbage()", b"collectgarbage()"})

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._chunks: dict[Any, Any] = {}

    def execute(self, source: Any) -> Any:
        chunk = self._chunks.get(source)
        if chunk is None:
            if source in self._FULL_GC:
                return None
            if len(self._chunks) >= 512:  # scripts sent as text (EVAL) come and go
                self._chunks.clear()
            chunk = self._chunks[source] = self._runtime.compile(source)
        return chunk()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


def _options(settings: LedgerSettings, *, asyncio: bool = False) -> dict[str, Any]:
    # redis-py re-sends a timed-out command by default; the ledger retries itself
    # (tenacity, same operation id), so the driver's own retry is switched off. An
    # asyncio client gets the asyncio policy (redis-py 8.2 warns on a sync one).
    return {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "retry": (AsyncRetry if asyncio else Retry)(NoBackoff(), 0),
    }


def sync_client(settings: LedgerSettings) -> SyncClient:
    t = parse_url(require_url(settings))
    if t.kind == "embedded":
        return _fakeredis().FakeRedis(server=embedded_server(t.url))  # type: ignore[no-any-return]
    if t.kind == "cluster":
        # redis-py asks the cluster for its slots here, before any call: its errors
        # (a node down, slots not covered) become the ledger's like every call's
        try:
            return redis.cluster.RedisCluster.from_url(t.url, **_options(settings))
        except Exception as exc:
            raise _cluster_unreachable(exc) from exc
    return redis.Redis.from_url(t.url, **_options(settings))


def _cluster_unreachable(exc: BaseException) -> BaseException:
    """A failure to build a cluster client, as the ledger's error: an ACL or credential
    refusal stays ``PermissionDenied``, a server that is no cluster node is a
    ``ConfigurationError``, anything else of the driver's (no node reachable, a node of
    the slot map down, slots not covered) ``BackendUnavailable``: try again later."""
    mapped = translate(exc)
    if isinstance(mapped, PermissionDenied | BackendUnavailable | ConfigurationError):
        return mapped
    if "cluster mode is not enabled" in str(exc).lower():
        return ConfigurationError(
            f"the redis+cluster:// URL names a node not in cluster mode: {exc}"
        )
    if isinstance(exc, rex.RedisError | rex.RedisClusterException):
        return BackendUnavailable(f"Redis Cluster unavailable: {type(exc).__name__}: {exc}")
    return mapped


def async_client(settings: LedgerSettings) -> AsyncClient:
    t = parse_url(require_url(settings))
    if t.kind == "embedded":
        return _fakeredis().FakeAsyncRedis(server=embedded_server(t.url))  # type: ignore[no-any-return]
    if t.kind == "cluster":
        return redis.asyncio.cluster.RedisCluster.from_url(
            t.url, **_options(settings, asyncio=True)
        )
    return redis.asyncio.Redis.from_url(t.url, **_options(settings, asyncio=True))


# --- durable writes: a plain client of the primary that serves a key -------------------
#
# WAIT counts the writes of the connection it is sent on, so a write that waits for its
# replicas is sent, with its WAIT, on one connection of the node that runs it. On a
# Redis Cluster that is a plain client of the slot's primary (the cluster client spreads
# a pipeline's commands by key, and WAIT has none), one per node, kept by the ledger.


def check_durability(settings: LedgerSettings, client: object) -> None:
    """``replica_acks`` needs a server with replicas: refused for the embedded backend."""
    if settings.replica_acks and type(client).__module__.startswith("fakeredis"):
        raise ConfigurationError(
            "replica_acks needs a Redis with replicas; the embedded backend has none "
            "(use replica_acks=0 with embedded://)"
        )


def _node_url(settings: LedgerSettings, host: str, port: int) -> str:
    parts = urlsplit(parse_url(require_url(settings)).url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def sync_primary(
    client: SyncClient,
    settings: LedgerSettings,
    key: str,
    nodes: dict[str, Any],
    refresh: bool = False,
) -> redis.Redis:
    """The client to send a durable write of ``key`` with: the client itself on one
    server, else a plain client of the primary that serves the key's slot (``refresh``:
    after a MOVED, read the slot map again first)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return client
    if refresh:
        client.nodes_manager.initialize()
    node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    if node.name not in nodes:
        nodes[node.name] = redis.Redis.from_url(
            _node_url(settings, node.host, int(node.port)), **_options(settings)
        )
    return nodes[node.name]  # type: ignore[no-any-return]


async def async_primary(
    client: AsyncClient,
    settings: LedgerSettings,
    key: str,
    nodes: dict[str, Any],
    refresh: bool = False,
) -> redis.asyncio.Redis:
    """:func:`sync_primary` for asyncio."""
    if not isinstance(client, redis.asyncio.cluster.RedisCluster):
        return client
    await client.initialize()
    if refresh:
        await client.nodes_manager.initialize()
    node = client.get_node_from_key(key)
    if node is None:
        raise BackendUnavailable(f"no node of the Redis Cluster serves the slot of {key!r}")
    if node.name not in nodes:
        nodes[node.name] = redis.asyncio.Redis.from_url(
            _node_url(settings, node.host, int(node.port)), **_options(settings, asyncio=True)
        )
    return nodes[node.name]  # type: ignore[no-any-return]


def forget(nodes: dict[str, Any], client: object) -> None:
    """Drop the plain client of a primary that did not answer (the caller closes it):
    after a failover its node is gone or a replica, and the next durable write goes to
    the slot's primary as the slot map then says."""
    for name in [n for n, c in nodes.items() if c is client]:
        del nodes[name]
