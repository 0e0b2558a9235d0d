"""Security: least-privilege ACL users, TLS, tenant isolation by prefix, hash-tag safety.

The module starts its own redis-server (never the machine's 6379; the TLS test starts
another); its default user is the admin that sets up ACL users and inspects keys.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from ledger import (
    Agent,
    BackendUnavailable,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    PermissionDenied,
    SessionBudget,
    TiktokenCounter,
    protocol,
)
from ledger import cli as ledger_cli
from ledger.errors import translated
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Worker, WorkerSettings
from tests.support import servers

WM, RET, REC, SCR = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)

# The least-privilege user of one tenant: the line of docs/reliability.md#security, read
# from the doc as users copy it, so the doc is what these tests run. It was found
# empirically: test_acl_line_is_minimal removes each command in turn and shows some
# operation then fails with NOPERM. Key pattern: only the tenant's hash-tagged keys
# ('<prefix>:{p<N>}:...'): a plain '<prefix>:*' would also match another tenant whose
# prefix is '<prefix>:<more>'. Commands: what the client sends (EVALSHA, SCRIPT LOAD after
# NOSCRIPT, the reads and stream commands of the client, CLI and worker) and what the
# scripts call inside, since Redis checks a script's redis.call() against the caller's ACL
# too (RENAME among them: the outcome generations rotate once per op retention).
ROOT = Path(__file__).resolve().parents[1]


def documented_acl_line() -> str:
    doc = (ROOT / "docs" / "reliability.md").read_text()
    found = re.search(r"^## Security\n.*?^```text\n(ACL SETUSER [^\n]*)\n```", doc, re.S | re.M)
    assert found is not None, "docs/reliability.md#security has no ACL line"
    return found.group(1)


ACL_LINE = (
    documented_acl_line()
    .replace("{p*", "{{p*")
    .replace("<user>", "{user}")
    .replace("<password>", "{password}")
    .replace("<prefix>", "{prefix}")
)
ACL_COMMANDS = tuple(w[1:] for w in ACL_LINE.split() if w.startswith("+"))
# Outcomes kept 1 s, so that the exercise runs past the op retention (every mutating
# script then rotates the session's outcome generations, RENAME); one try per call, which
# a retention this short requires (LedgerSettings checks it covers the retry window).
RETENTION_S = 1


def acl_settings(url: str, prefix: str) -> LedgerSettings:
    return LedgerSettings(
        redis_url=url, prefix=prefix, op_retention_seconds=RETENTION_S, retry_attempts=1
    )


SYSTEM = "You answer questions about the handbook."


def budget() -> SessionBudget:
    """10k window; high-water mark 7,200 tokens."""
    return SessionBudget(
        window=10_000,
        system_prompt=1_000,
        working_memory_floor=1_000,
        min_memory=0,
        tool_framing=100,
        output_reserve=400,
    )


def new_prefix() -> str:
    return f"sec{uuid.uuid4().hex[:10]}"


def acl_setuser(admin: redis.Redis, user: str, password: str, prefix: str, *drop: str) -> None:
    """Run ACL_LINE for this user and prefix, without the commands in `drop`."""
    words = ACL_LINE.format(user=user, password=password, prefix=prefix).split()
    admin.execute_command(*(w for w in words if w.removeprefix("+") not in drop))


def acl_denial(exc: BaseException) -> bool:
    """An ACL refusal, as Redis 7 words it for a command (NOPERM ... no permissions)
    or for a redis.call() inside a script (ERR The user executing the script can't ...)."""
    text = str(exc)
    return any(w in text for w in ("NOPERM", "no permissions", "can't run this command"))


class CliFailed(Exception):
    """A ``ledger`` command that exited with an error; its output says why."""


def cli_ok(*argv: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ledger_cli.main(list(argv))
    if code != ledger_cli.EXIT_OK:
        raise CliFailed(f"ledger {' '.join(argv)} exited {code}: {err.getvalue()}{out.getvalue()}")


def user_url(server: servers.RedisProcess, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


class FailingCompactor:
    """A compactor that always raises: its jobs end in the dead-letter stream."""

    def __call__(self, request: CompactionRequest) -> CompactionPlan:
        raise RuntimeError("summarizer down")


failing_compactor = FailingCompactor()


@dataclass
class Exercised:
    ops: list[str]
    dead_letters: int


def exercise_everything(
    ledger: Ledger, url: str, admin: redis.Redis, done: list[str] | None = None
) -> Exercised:
    """Every operation of the client, the CLI and the worker, with checks that each
    took effect (the worker swallows job errors, so its effects are read back).
    `done` collects the steps that completed (the caller sees how far it got)."""
    done = [] if done is None else done
    p = ledger.settings.prefix
    b = budget()
    tokens = TiktokenCounter()
    # the agent loop's session, opened first: its turns come after the op retention
    agent_budget = SessionBudget(window=8_000, system_prompt=tokens(SYSTEM), output_reserve=1_000)
    agent_session = ledger.open_session("tenant/agent", agent_budget)
    opened = time.monotonic()

    # sessions, admissions, reservations
    s = ledger.open_session("tenant/a", b)
    ledger.open_session("tenant/a", b)  # re-attach
    s.admit(RET, [Item("doc1#1", 300), Item("doc1#2", 200)])
    s.release(RET, ["doc1#2"])
    s.admit(WM, [Item("turn-1", 500)])
    s.reserve(SCR, "r1", 300)
    s.settle("r1", 250, "tool-1")
    s.reserve(SCR, "r2", 100)
    s.void("r2")
    s.reserve(REC, "r3", 100, lease_ms=1)
    time.sleep(0.01)
    assert ledger.expire_due(s.keys.partition) == 1
    # the worker's check of a partition on a cluster (its ZRANGEBYSCORE, TIME, XPENDING)
    s.reserve(REC, "r4", 100, lease_ms=60_000)
    check = ledger.check_partition(s.keys.partition, "ledger-workers", 1)
    assert check.due_ms is not None and 0 < check.due_ms <= 60_000
    done += ["open", "admit", "release", "reserve", "settle", "void", "expire_due", "check"]

    # turns and the rules (docs/rules.md)
    t = s.begin_turn(500)
    s.record_span(t.turn, "recall", 800, 50)
    s.end_turn(t.turn, 1_500)
    small = s.admit_tool_result("call-1", 120, b'{"ok": 1}')
    big = s.admit_tool_result("call-2", 50_000, b"x" * 1000)
    assert small.outcome == "admitted" and big.spilled
    assert ledger.read_spill("tenant/a", "call-2") == b"x" * 1000
    done += ["begin_turn", "record_span", "end_turn", "admit_tool_result", "read_spill"]
    t = s.begin_turn(500)  # the two-call turn's end: a tool result and the commit in one call
    assert s.finish_turn(t.turn, 1_500, [("call-f", 120, b'{"ok": 1}')]).tools == (("call-f", 120),)
    done += ["finish_turn"]

    # reads
    snap = s.snapshot()
    assert snap.free >= 0
    assert ledger.audit("tenant/a").clean
    assert {i.id for i in ledger.items("tenant/a")} >= {"doc1#1", "turn-1", "tool-1"}
    assert "tenant/a" in ledger.session_ids()
    done += ["snapshot", "audit", "items", "session_ids"]

    # turns short of room by 100 tokens: each reclaims scratchpad, the first building the
    # reclaim-order index, the second reading it as the calls kept it
    for k in range(2):
        s.admit_tool_result(f"call-r{k}", 100, b"{}")
        v = s.snapshot().raw
        room = v["W"] - v["S"] - v["T"] - v["out"] - max(v["a_rm"], v["F_rm"]) - v["a_s"]
        t = s.begin_turn(room + 100, output_reserve=v["out"])
        assert t.reclaimed and t.reclaimed[0][0] == SCR, t
        s.end_turn(t.turn, 1_500)
    done += ["reclaim"]

    # jobs: a compaction that a failing compactor leaves to the dead-letter stream,
    # one that the simulated compactor performs, and a hard reset after repeated
    # failed compactions.
    def fill(sid: str) -> None:
        x = ledger.open_session(sid, b)
        x.admit(WM, [Item(f"m{i}", 650) for i in range(10)])  # occupancy 7,600 > 7,200
        x.end_turn(x.begin_turn(0).turn, 7_000)

    fill("tenant/dead")
    w_fail = Worker(
        ledger,
        WorkerSettings(
            consumer="failing",
            compactor="tests.test_security:failing_compactor",
            claim_idle_ms=10,
            max_deliveries=1,
        ),
    )
    w_fail.ensure_groups()
    w_fail.poll_once()  # the compactor raises: the job stays pending, error recorded
    time.sleep(0.05)
    w_fail.poll_once()  # taken over after claim_idle_ms, delivered twice: dead-lettered
    part = ledger.keyspace.partition_of("tenant/dead")
    dead = admin.xlen(f"{ledger.keyspace.tag(part)}:dead")
    assert dead == 1, "the failing job was not dead-lettered"
    done += ["worker.ensure_groups", "worker.poll_once(failed, dead-lettered)"]

    fill("tenant/c")
    h = ledger.open_session("tenant/h", b)
    h.admit(WM, [Item(f"m{i}", 650) for i in range(10)])
    for _ in range(b.max_failed_compactions):
        h.compact([], None)  # occupancy stays above the mark: a failed compaction
    worker = Worker(
        ledger,
        WorkerSettings(
            consumer="good", claim_idle_ms=10, compactor="ledger.workers.compactors:simulated"
        ),
    )
    for _ in range(20):  # bounded: a few passes drain every job
        if not worker.poll_once():
            break
    # a slow job kept from looking idle: the loop's XCLAIM JUSTID of the jobs in hand
    fill("tenant/slow")
    slow = ledger.keyspace.partition_of("tenant/slow")
    stream, group = worker.streams.stream(slow), worker.settings.group
    ((_, entries),) = ledger.client.xreadgroup(group, "good", {stream: ">"}, count=1)
    eid = entries[0][0].decode()
    worker.delivery.held[f"p{slow}:{eid}"] = (slow, eid)
    with translated():  # as the loop's guard reports it: PermissionDenied
        worker.delivery.renew()
    worker.delivery.held.clear()
    ledger.client.xack(stream, group, eid)
    done += ["worker.renew (a slow job's XCLAIM JUSTID)"]
    c = ledger.session("tenant/c").snapshot()
    assert not c.compaction_pending and c.raw["kn"] >= 1, "compaction job not applied"
    assert ledger.session("tenant/h").epoch == h.epoch + 1, "hard-reset job not applied"
    worker.sweep()
    worker.take_over()
    worker.observe()
    assert worker.leave_groups() >= 1, "the stopping worker left no group"
    done += ["worker.poll_once(compact, hard_reset)", "worker.sweep", "worker.take_over"]
    done += ["worker.observe", "worker.leave_groups"]

    # Past the op retention: every write rotates the outcome generations (RENAME). The
    # README's agent loop, with the worker's compactions delivered to its turns, then
    # every CLI command that talks to Redis.
    time.sleep(max(0.0, opened + RETENTION_S + 0.1 - time.monotonic()))
    agent = Agent(agent_session, tokens)
    compacting = Worker(
        ledger,
        WorkerSettings(
            consumer="agent-loop",
            claim_idle_ms=10,
            compactor="tests.support.fleet_compactor:SUMMARIZER",
        ),
    )
    prompt: list[object] = [SYSTEM]
    delivered = 0
    for n in range(6):
        with agent.turn(working_set=600) as turn:
            prompt = turn.apply(prompt)
            delivered += len(turn.summaries)
            question = {"id": f"user-{n}", "content": f"What changed in section {n}?"}
            docs = [
                {"id": f"doc-{n}-{i}", "content": f"section {n} part {i}: " + "policy " * 200}
                for i in range(6)
            ]
            prompt += turn.admit("working_memory", [question]).kept
            prompt += turn.admit("retrieval", docs).kept
            turn.prompt(prompt)
        for _ in range(5):
            if not compacting.poll_once():
                break
    assert delivered >= 1, "no summary of the worker reached a turn"
    assert agent_session.snapshot().raw["kn"] >= 1 and agent_session.audit().clean
    assert int(admin.hget(agent_session.keys.session, "gz") or 0) > 0
    if ledger.settings.op_retention_seconds == RETENTION_S:
        assert admin.exists(agent_session.keys.outcomes_old), "the outcomes never rotated"
    done += ["agent loop past the op retention", "worker compaction past the op retention"]
    cli = ["--url", url, "--prefix", p]
    cli_ok(*cli, "inspect", "tenant/agent")
    cli_ok(*cli, "top", "--once")
    # the dead letters: the failing job's, and a copy of it (the admin's) to purge
    dead_stream = f"{ledger.keyspace.tag(part)}:dead"
    [(eid, fields)] = admin.xrange(dead_stream)
    copy = admin.xadd(dead_stream, fields)
    ref, other = (f"p{part}:{e.decode()}" for e in (eid, copy))
    cli_ok(*cli, "dead", "list")
    cli_ok(*cli, "dead", "list", ref)
    cli_ok(*cli, "dead", "show", ref)
    cli_ok(*cli, "dead", "replay", ref)
    cli_ok(*cli, "dead", "purge", other)
    assert admin.xlen(dead_stream) == 0, "the dead letters were not replayed and purged"
    done += ["cli dead list", "cli dead show", "cli dead replay", "cli dead purge"]
    # the worker runs the replayed job (its compactor now works)
    cli_ok(*cli, "worker", "--once", "--compactor", "tests.support.fleet_compactor:SUMMARIZER")
    done += ["cli inspect", "cli top", "cli worker"]

    # the CLI, fenced reset, close
    cli_ok(*cli, "audit")
    s.reset("operator")
    s.refresh()
    assert s.delete().deleted
    done += ["cli audit", "reset", "refresh", "delete"]
    return Exercised(done, dead)


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[servers.RedisProcess]:
    with servers.standalone() as s:
        yield s


@pytest.fixture
def admin(server: servers.RedisProcess) -> Iterator[redis.Redis]:
    r = redis.Redis(port=server.port)
    yield r
    r.close()


# --- ACL -----------------------------------------------------------------------------------


@pytest.mark.redis
def test_acl_user_limited_to_its_prefix_runs_every_operation(
    server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """ACL_LINE, as is, for a fresh user and prefix: every client, CLI and worker
    operation works (scripts flushed first, so SCRIPT LOAD is exercised too)."""
    prefix = new_prefix()
    acl_setuser(admin, "ledger", "pw-ledger", prefix)
    assert admin.acl_getuser("ledger")["enabled"]
    admin.script_flush()
    keys_before = set(admin.scan_iter(match="*", count=1000))
    url = user_url(server, "ledger", "pw-ledger")
    with Ledger.from_settings(acl_settings(url, prefix)) as led:
        res = exercise_everything(led, url, admin)
    assert len(res.ops) >= 20 and res.dead_letters == 1
    # Every key the user made is one of its own prefix's hash-tagged keys.
    made = {k.decode() for k in set(admin.scan_iter(match="*", count=1000)) - keys_before}
    assert made and all(k.startswith(f"{prefix}:{{p") for k in made), made
    print("\n" + ACL_LINE.format(user="ledger", password="<password>", prefix="<prefix>"))


@pytest.mark.redis
def test_acl_key_pattern_does_not_cover_a_longer_prefix(
    server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """Why ACL_LINE's key pattern is '<prefix>:{p*' and not '<prefix>:*': tenant 't'
    with '~t:*' could read tenant 't:x' (a valid prefix too)."""
    short = new_prefix()
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=f"{short}:x")) as x:
        x.open_session("s-1", budget())
    acl_setuser(admin, "short", "pw", short)
    loose = ["ACL", "SETUSER", "short-loose", "reset", "on", ">pw", f"~{short}:*", "+evalsha"]
    admin.execute_command(*loose)
    admin.execute_command("ACL", "SETUSER", "short-loose", "+script|load", "+hgetall", "+time")
    for user, readable in (("short", False), ("short-loose", True)):
        peek = LedgerSettings(redis_url=user_url(server, user, "pw"), prefix=f"{short}:x")
        with Ledger.from_settings(peek) as led:
            if readable:
                assert led.audit("s-1").clean
            else:
                with pytest.raises(LedgerError, match="no permissions"):
                    led.audit("s-1")


@pytest.mark.redis
@pytest.mark.slow
def test_acl_line_is_minimal(server: servers.RedisProcess, admin: redis.Redis) -> None:
    """Without any one of ACL_COMMANDS some operation fails, refused by the ACL."""
    unneeded, first_failure = [], {}
    for cmd in ACL_COMMANDS:
        prefix = new_prefix()
        acl_setuser(admin, "ledger-min", "pw", prefix, cmd)
        admin.script_flush()  # as after a restart: the client must load its scripts
        url = user_url(server, "ledger-min", "pw")
        done: list[str] = []
        with Ledger.from_settings(acl_settings(url, prefix)) as led:
            try:
                exercise_everything(led, url, admin, done)
            except (LedgerError, redis.RedisError, CliFailed) as exc:
                assert acl_denial(exc), repr(exc)
                # a refusal inside a script too: typed, never a bare LedgerError
                assert isinstance(exc, PermissionDenied | CliFailed), repr(exc)
                first_failure[cmd] = f"after {done[-1:]}: {exc}"[:140]
            except AssertionError as exc:  # the worker swallowed a refused job step
                errors = [
                    v.decode()
                    for k in admin.scan_iter(match=f"{prefix}:*:errors")
                    for v in admin.hvals(k)
                ]
                assert any(acl_denial(Exception(e)) for e in errors), (exc, errors)
                first_failure[cmd] = f"worker job after {done[-1:]}: {errors[0]}"[:140]
            else:
                unneeded.append(cmd)
    for cmd, why in first_failure.items():
        print(f"without +{cmd}: {why}")
    assert unneeded == [], f"commands in ACL_LINE that no operation needs: {unneeded}"


@pytest.mark.redis
def test_user_without_access_to_the_prefix_gets_a_clear_error(
    server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """Every script call of a user whose ACL does not cover the prefix is refused with a
    LedgerError saying so, and nothing is written."""
    mine, other = new_prefix(), new_prefix()
    acl_setuser(admin, "other-tenant", "pw-o", other)
    url = user_url(server, "other-tenant", "pw-o")
    settings = LedgerSettings(redis_url=url, prefix=mine, retry_max_seconds=1)
    with Ledger.from_settings(settings) as led:
        calls = {
            "open": lambda: led.open_session("s-1", budget()),
            "audit": lambda: led.audit("s-1"),
            "session": lambda: led.session("s-1"),
        }
        for name, call in calls.items():
            with pytest.raises(LedgerError) as info:
                call()
            assert "no permissions to access one of the keys" in str(info.value), name
            assert not isinstance(info.value, BackendUnavailable), name  # not retried
        cli = ledger_cli.main(["--url", url, "--prefix", mine, "audit", "s-1"])
        assert cli == ledger_cli.EXIT_VIOLATION
    assert not list(admin.scan_iter(match=f"{mine}:*"))


@pytest.mark.redis
def test_acl_refusal_is_named_noperm(server: servers.RedisProcess, admin: redis.Redis) -> None:
    mine, other = new_prefix(), new_prefix()
    acl_setuser(admin, "other-tenant2", "pw-o", other)
    url = user_url(server, "other-tenant2", "pw-o")
    with (
        Ledger.from_settings(LedgerSettings(redis_url=url, prefix=mine)) as led,
        pytest.raises(LedgerError) as info,
    ):
        led.open_session("s-1", budget())
    assert type(info.value) is not LedgerError and "NOPERM" in str(info.value)


@pytest.mark.redis
@pytest.mark.parametrize("call", ["items", "read_spill", "expire_due"])
def test_direct_reads_refused_by_acl_raise_ledger_errors(
    server: servers.RedisProcess, admin: redis.Redis, call: str
) -> None:
    mine, other = new_prefix(), new_prefix()
    acl_setuser(admin, "other-tenant3", "pw-o", other)
    url = user_url(server, "other-tenant3", "pw-o")
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=mine)) as led:
        fn = {
            "items": lambda: led.items("s-1"),
            "read_spill": lambda: led.read_spill("s-1", "call-1"),
            "expire_due": lambda: led.expire_due(0),
        }[call]
        with pytest.raises(LedgerError):
            fn()


@pytest.mark.redis
def test_wrong_password_is_not_reported_as_unavailable(
    server: servers.RedisProcess, admin: redis.Redis
) -> None:
    prefix = new_prefix()
    acl_setuser(admin, "ledger-pw", "right", prefix)
    url = user_url(server, "ledger-pw", "wrong")
    with (
        Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led,
        pytest.raises(LedgerError) as info,
    ):
        led.audit("s-1")
    assert not isinstance(info.value, BackendUnavailable), info.value


# --- TLS -------------------------------------------------------------------------------------


@pytest.mark.redis
def test_tls_rediss_url_with_self_signed_certificate() -> None:
    ok, words = servers.tls_supported()
    if not ok:
        pytest.fail(f"this redis-server build has no TLS support (--tls-port refused): {words}")
    with servers.tls_standalone() as tls:
        prefix = new_prefix()
        urls = {
            "no verification": f"{tls.url}?ssl_cert_reqs=none",
            "verified against the CA": f"{tls.url}?ssl_ca_certs={tls.cert}",
        }
        for how, url in urls.items():
            with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
                s = led.open_session(f"s-{how.split()[0]}", budget())
                assert s.admit(RET, [Item("doc#1", 400)]).charged == 400, how
                assert led.audit(s.id).clean, how
                assert led.client.connection_pool.connection_class.__name__ == "SSLConnection"
            assert ledger_cli.main(["--url", url, "--prefix", prefix, "audit"]) == 0, how
        # The same server refuses plaintext, and a certificate for another name.
        for url in (
            f"redis://127.0.0.1:{tls.port}/0",
            f"rediss://localhost:{tls.port}/0?ssl_ca_certs={tls.cert}",
        ):
            quick = LedgerSettings(
                redis_url=url, prefix=prefix, retry_attempts=2, retry_max_seconds=1
            )
            with Ledger.from_settings(quick) as led, pytest.raises(BackendUnavailable):
                led.audit("s-no")


# --- tenants -----------------------------------------------------------------------------------


def dump_prefix(admin: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key of a tenant with its type and serialized value (DUMP)."""
    return {
        k: (admin.type(k), admin.dump(k))
        for k in sorted(admin.scan_iter(match=f"{prefix}:*", count=1000))
    }


@pytest.mark.redis
def test_tenants_isolated_by_prefix(server: servers.RedisProcess, admin: redis.Redis) -> None:
    """Two tenants, same session ids, same op ids: each runs every operation (as a user
    whose ACL covers only its own prefix, so a read of the other's keys would be
    refused) and the other tenant's keys stay byte-for-byte the same."""
    pa, pb = new_prefix(), new_prefix()
    acl_setuser(admin, "tenant-a", "pw-a", pa)
    acl_setuser(admin, "tenant-b", "pw-b", pb)
    url_a, url_b = user_url(server, "tenant-a", "pw-a"), user_url(server, "tenant-b", "pw-b")
    with (
        # the default op retention: keys that expire on their own would hide a change
        Ledger.from_settings(LedgerSettings(redis_url=url_a, prefix=pa)) as a,
        Ledger.from_settings(LedgerSettings(redis_url=url_b, prefix=pb)) as b,
    ):
        # B first holds sessions with the very ids A is about to use.
        for sid in ("tenant/a", "tenant/c", "tenant/dead", "tenant/h"):
            sb = b.open_session(sid, budget())
            sb.admit(RET, [Item("doc1#1", 300)], op_id="shared-op")
        before_b = dump_prefix(admin, pb)
        assert before_b
        exercise_everything(a, url_a, admin)
        assert dump_prefix(admin, pb) == before_b, "tenant A changed tenant B's keys"
        # The same op id with other arguments is no reuse across tenants.
        sa = a.open_session("tenant/x", budget())
        assert sa.admit(WM, [Item("w", 10)], op_id="shared-op").charged == 10
        before_a = dump_prefix(admin, pa)
        exercise_everything(b, url_b, admin)
        assert dump_prefix(admin, pa) == before_a, "tenant B changed tenant A's keys"
        assert "tenant/x" not in b.session_ids() and "tenant/x" in a.session_ids()
        assert {k.split(b":", 1)[0] for k in dump_prefix(admin, pa)} == {pa.encode()}


@pytest.mark.redis
def test_scan_lets_a_tenant_list_another_tenants_key_names(
    server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """A limit of Redis ACLs, not of the ledger: SCAN (needed by session_ids, the CLI
    audit and the worker's metrics) is not filtered by key patterns, so a user with
    +scan sees the names (not the contents) of every key, other tenants' included."""
    pa, pb = new_prefix(), new_prefix()
    acl_setuser(admin, "tenant-b2", "pw-b", pb)
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=pa)) as a:
        a.open_session("secret-session", budget())
    spy = LedgerSettings(redis_url=user_url(server, "tenant-b2", "pw-b"), prefix=pa)
    with Ledger.from_settings(spy) as b_as_a:
        names = [k.decode() for k in b_as_a.client.scan_iter(match=f"{pa}:*")]
        assert any(n.endswith(":s:secret-session") for n in names)  # names leak via SCAN
        with pytest.raises(PermissionDenied, match="NOPERM"):
            b_as_a.session_ids()  # the ledger checks each session, and is refused
        with pytest.raises(PermissionDenied, match="no permissions"):
            b_as_a.audit("secret-session")  # contents do not leak


# --- hash-tag routing ------------------------------------------------------------------------


BAD_SESSION_IDS = ["a{b}", "{p1}", "x}", "{", "tenant/{x", "", "a b", "é", "a\nb", "x" * 129]


@pytest.mark.parametrize("sid", BAD_SESSION_IDS)
def test_session_ids_that_would_break_hash_tags_are_refused(sid: str) -> None:
    led = Ledger.from_url(f"embedded://{uuid.uuid4().hex}")
    for call in (
        lambda: led.open_session(sid, budget()),
        lambda: led.session(sid),
        lambda: led.audit(sid),
        lambda: led.items(sid),
        lambda: led.read_spill(sid, "c1"),
    ):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert "session id" in str(info.value)
    assert led.client.keys("*") == []


@pytest.mark.parametrize("prefix", ["a{b}", "{x}", "a}", "", "a b", "x" * 65])
def test_prefixes_that_would_break_hash_tags_are_refused(prefix: str) -> None:
    from ledger.keys import KeySpace

    with pytest.raises(InvalidArgument):
        KeySpace(prefix)
    with pytest.raises(ValueError):
        LedgerSettings(prefix=prefix)


@pytest.mark.redis
def test_scripts_refuse_a_session_id_that_does_not_name_their_key(
    server: servers.RedisProcess,
) -> None:
    """A caller bypassing the client's checks: the scripts that take the session id
    (a member of the partition's deadline index) refuse braces, and an id that is not
    the session of KEYS[1], and write nothing."""
    prefix = new_prefix()
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=prefix)) as led:
        s = led.open_session("s-1", budget())
        before = dump_prefix(led.client, prefix)  # type: ignore[arg-type]
        for forged in ("s-1{x}", "s-2", "{p0}"):
            good = protocol.reserve(s.keys, "op-forged", s.epoch, SCR, "r1", 10, 1000)
            args = list(good.args)
            args[2] = forged  # ARGV[3]: the session id
            with pytest.raises(InvalidArgument):
                led.run(protocol.Call(good.script, good.keys, tuple(args), good.parse))
        assert dump_prefix(led.client, prefix) == before  # type: ignore[arg-type]


def test_every_key_of_a_session_shares_one_slot() -> None:
    """Valid ids with every allowed punctuation: the session's keys hash to one slot."""
    from redis.crc import key_slot

    from ledger.keys import KeySpace

    ks = KeySpace("tenant-1", 64)
    for sid in ["a", "tenant/a:b@c.d+e=f#g-h_i", "::", "#", "p0", "0" * 128]:
        k = ks.session(sid)
        names = [k.session, k.deadlines, k.jobs, k.spills, k.spilled, f"{ks.tag(k.partition)}:dead"]
        assert len({key_slot(n.encode()) for n in names}) == 1, names
