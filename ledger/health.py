"""Whether the Redis deployment keeps what the ledger writes.

The ledger's state lives only in Redis: session hashes and the partitions' job
streams. Two server settings decide whether they survive:

* ``maxmemory-policy noeviction``: under any other policy Redis drops keys silently
  when it reaches ``maxmemory`` (a session, or a job stream with the jobs in it);
  with ``noeviction`` it refuses writes instead (OOM), which the ledger reports.
* persistence (``appendonly yes``, or at least an RDB ``save`` policy): without it a
  restart loses every session and job.

``evicted_keys`` above 0 says keys were evicted already. :func:`assess` judges one
server from what it reports (pure); :func:`check` asks every server (every primary
of a cluster). Neither refuses anything: the worker logs the result and sets a
gauge, ``ledger audit`` prints it. CONFIG may be disabled (managed Redis) and INFO
refused by an ACL: what cannot be read is reported as unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rex
from redis.cluster import RedisCluster

from ledger import schema
from ledger.backends import SyncClient, parse_url


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerCheck:
    """What one server reported, and what is wrong or unknown about it."""

    server: str
    policy: str | None  # maxmemory-policy; None: could not be read
    aof: bool | None  # appendonly
    save: str | None  # the RDB save policy ('' none); None: could not be read
    evicted_keys: int | None
    problems: tuple[str, ...]
    unknown: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unknown


@dataclass(frozen=True, slots=True)
class HealthReport:
    servers: tuple[ServerCheck, ...]
    embedded: bool = False  # in-process fakeredis: nothing to check, nothing persists

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.servers)

    @property
    def problems(self) -> list[str]:
        return [f"{s.server}: {p}" for s in self.servers for p in s.problems]

    @property
    def unknown(self) -> list[str]:
        return [f"{s.server}: {u}" for s in self.servers for u in s.unknown]

    @property
    def gauge(self) -> int:
        """1: every required setting verified; 0: a problem found; -1: could not verify."""
        if self.problems:
            return 0
        return -1 if self.unknown else 1


def _int(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return None


def assess(
    server: str,
    memory: Mapping[str, Any] | None,
    persistence: Mapping[str, Any] | None,
    stats: Mapping[str, Any] | None,
    save: str | None,
    why_unread: Mapping[str, str] | None = None,
) -> ServerCheck:
    """Judge one server from its INFO sections (None: not readable) and its RDB save
    policy (CONFIG GET save; None: not readable). `why_unread` says why a section or
    'save' could not be read."""
    why = dict(why_unread or {})
    problems: list[str] = []
    unknown: list[str] = []

    policy = None if memory is None else memory.get("maxmemory_policy")
    policy = None if policy is None else str(policy)
    if policy is None:
        unknown.append(
            "maxmemory-policy unknown (INFO memory "
            + (f"refused: {why['memory']})" if "memory" in why else "has no maxmemory_policy)")
        )
    elif policy != "noeviction":
        problems.append(
            f"maxmemory-policy is {policy}: at maxmemory Redis silently evicts keys (sessions, "
            "job streams with their jobs); set maxmemory-policy noeviction"
        )

    aof_v = None if persistence is None else _int(persistence.get("aof_enabled"))
    aof = None if aof_v is None else aof_v == 1
    if aof is None:
        unknown.append(
            "persistence unknown (INFO persistence "
            + (f"refused: {why['persistence']})" if "persistence" in why else "has no aof_enabled)")
        )
    elif not aof:
        if save is None:
            unknown.append(
                "persistence unknown: appendonly is off and the RDB save policy cannot be read "
                f"(CONFIG GET save: {why.get('save', 'no answer')}); a restart may lose "
                "every session and job"
            )
        elif not save.strip():
            problems.append(
                "persistence is off (appendonly no, no RDB save policy): a restart loses every "
                "session and job; set appendonly yes"
            )

    evicted = None if stats is None else _int(stats.get("evicted_keys"))
    if evicted is None:
        unknown.append(
            "evicted_keys unknown (INFO stats "
            + (f"refused: {why['stats']})" if "stats" in why else "has no evicted_keys)")
        )
    elif evicted > 0:
        problems.append(
            f"{evicted} keys evicted since the server started (evicted_keys): sessions or job "
            "streams may have been lost"
        )
    return ServerCheck(
        server=server,
        policy=policy,
        aof=aof,
        save=save,
        evicted_keys=evicted,
        problems=tuple(problems),
        unknown=tuple(unknown),
    )


def _read(fn: Callable[[], Any], why: dict[str, str], name: str) -> Any:
    """fn(), or None with the reason in why[name] when Redis refuses it (disabled
    command, ACL); an unreachable server raises."""
    try:
        return fn()
    except (rex.ConnectionError, rex.TimeoutError):
        raise
    except rex.RedisError as exc:
        why[name] = f"{type(exc).__name__}: {exc}"[:200]
        return None


def check_server(name: str, r: redis.Redis) -> ServerCheck:
    why: dict[str, str] = {}
    memory = _read(lambda: r.info("memory"), why, "memory")
    persistence = _read(lambda: r.info("persistence"), why, "persistence")
    stats = _read(lambda: r.info("stats"), why, "stats")
    save: str | None = None
    if not (persistence and _int(persistence.get("aof_enabled")) == 1):
        got = _read(lambda: r.config_get("save"), why, "save")
        if isinstance(got, Mapping) and "save" in got:
            v = got["save"]
            save = schema.text(v)
        elif "save" not in why:
            why["save"] = "no 'save' in the reply"
    return assess(name, memory, persistence, stats, save, why)


def _name(r: redis.Redis) -> str:
    kw = r.connection_pool.connection_kwargs
    if "path" in kw:
        return str(kw["path"])
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"


def check(client: SyncClient, redis_url: str | None = None) -> HealthReport:
    """Ask every server (every primary of a cluster). An embedded URL checks nothing."""
    if redis_url is not None and parse_url(redis_url).kind == "embedded":
        return HealthReport((), embedded=True)
    if isinstance(client, RedisCluster):
        out = []
        for node in client.get_primaries():  # type: ignore[no-untyped-call]
            conn = client.get_redis_connection(node)
            out.append(check_server(f"{node.host}:{node.port}", conn))
        return HealthReport(tuple(out))
    return HealthReport((check_server(_name(client), client),))


def describe(report: HealthReport) -> list[str]:
    """One line per problem or unknown, for a person."""
    if report.embedded:
        return []
    return [f"Redis {p}" for p in report.problems] + [f"Redis {u}" for u in report.unknown]
