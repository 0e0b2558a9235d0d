"""`ledger audit`, `ledger dead` and `ledger inspect` end to end on a real Redis."""

from __future__ import annotations

import json
import re
import time

import pytest
import redis

from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from tests.conftest import _open_many
from tests.support.servers import RedisProcess

pytestmark = pytest.mark.redis


def test_audit_fails_on_corrupted_counters(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        s = led.open_session("victim", SessionBudget(window=1000, system_prompt=10))
        s.admit("retrieval", [Item("a", 5)])
        led.open_session("healthy", SessionBudget(window=1000, system_prompt=10))
        assert cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"]) == 0
        redis.Redis.from_url(redis_server.url).hset(s.keys.session, "u_r", 6)  # corrupt
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "--verbose"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert "retrieval used is 6, items say 5" in out
    assert "healthy: clean" in out
    # by default only what is wrong, then the summary; --json the same as one object
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION and "healthy: clean" not in out
    assert "2 session(s) audited: 1 clean, 1 with violations" in out
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_VIOLATION and not got["ok"]
    assert (got["audited"], got["clean"], list(got["violations"])) == (2, 1, ["victim"])
    assert got["warnings"]  # this test server has no persistence
    # --strict: the Redis settings' warnings fail too
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit", "healthy"]
    assert cli.main(argv) == cli.EXIT_OK
    assert cli.main([*argv, "--strict"]) == cli.EXIT_VIOLATION


def test_audit_in_batches_names_every_session(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger import views

    ids = [f"s{i:04d}" for i in range(views.BATCH * 2 + 7)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
        victim = led.session(ids[views.BATCH + 3])
        victim.admit("retrieval", [Item("a", 5)])
        redis.Redis.from_url(redis_server.url).hset(victim.keys.session, "u_r", 6)
        led.session(ids[-1]).delete()  # listed by name below: refused
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "-v"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert out.count(": clean") == len(ids) - 2
    assert f"{ids[views.BATCH + 3]}: " in out and "retrieval used is 6, items say 5" in out
    assert f"{len(ids) - 1} session(s) audited: {len(ids) - 2} clean, 1 with violations" in out
    # a missing id asked for by name is named, and the others are still audited
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit", ids[-1], ids[0], "-v"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert f"{ids[-1]}: no such session" in out and f"{ids[0]}: clean" in out
    assert "1 session(s) audited: 1 clean, 0 with violations, 1 missing" in out


# Each way a session hash can be damaged, and the words the audit names it with.
DAMAGES = {
    "missing": (lambda r, key: r.hdel(key, "u_r"), "damaged: field 'u_r' is missing"),
    "not a number": (
        lambda r, key: r.hset(key, "W", "abc"),
        "damaged: field 'W' holds 'abc', not a whole number",
    ),
    "bad item": (
        lambda r, key: r.hset(key, "i:r:a", "5|x"),
        "damaged: field 'i:r:a' holds '5?x', not 4 numbers (tokens, turn, priority, seq)",
    ),
    "no consumer": (
        lambda r, key: r.hset(key, "i:z:a", "5|1|0|1"),
        "damaged: field 'i:z:a' names no consumer",
    ),
    "bad lease": (
        lambda r, key: r.hset(key, "r:x", "q|1|2"),
        "damaged: field 'r:x' holds 'q?1?2', not a consumer, tokens and a deadline",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_audit_of_1000_sessions_names_the_damaged_one_and_judges_the_others(
    redis_server: RedisProcess, prefix: str, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One session hash damaged (a field missing, a number that is not one, an item or a
    lease not of the layout): the 999 others get their verdicts, the damaged one is
    named with its field, in the text and in --json (still one JSON object), exit 1.
    Before, audit.lua met the damage with a Lua error and no session got a verdict.
    (1,000 sessions for a field missing; 600, still six round trips, for the others.)"""
    corrupt, words = DAMAGES[damage]
    n = 1000 if damage == "missing" else 600
    ids = [f"fleet-{i:04d}" for i in range(n)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)  # pipelined
        victim = led.session(ids[500])
        victim.admit("retrieval", [Item("a", 5)])
        led.session(ids[7]).admit("retrieval", [Item("b", 5)])
        r = redis.Redis.from_url(redis_server.url)
        r.hset(led.keyspace.session(ids[7]).session, "u_r", 6)  # a violation, not damage
        corrupt(r, victim.keys.session)
        r.close()
    base = ["--url", redis_server.url, "--prefix", prefix, "audit"]
    started = time.monotonic()
    code = cli.main(base)
    took = time.monotonic() - started
    out = " ".join(capsys.readouterr().out.split())
    assert code == cli.EXIT_VIOLATION
    assert f"{ids[500]}: {words}" in out and "not audited" in out, out
    assert f"{ids[7]}: retrieval used is 6, items say 5" in out
    assert (
        f"{n - 1} session(s) audited: {n - 2} clean, 1 with violations, 1 damaged (not audited)"
        in out
    )
    assert took < 30, took  # a round trip per 100 audits
    with capsys.disabled():  # shown with -s
        print(f"\nledger audit, {n} sessions, one damaged ({damage}): {took:.2f} s")
    assert cli.main([*base, "--json"]) == cli.EXIT_VIOLATION
    got = json.loads(capsys.readouterr().out)
    assert (got["audited"], got["clean"], got["ok"]) == (n - 1, n - 2, False)
    assert list(got["violations"]) == [ids[7]]
    assert list(got["damaged"]) == [ids[500]] and words in got["damaged"][ids[500]][0]
    # the damaged session alone, by name: named, exit 1, no verdict
    assert cli.main([*base, ids[500], ids[0], "-v"]) == cli.EXIT_VIOLATION
    out = capsys.readouterr().out
    assert f"{ids[0]}: clean" in out and "1 session(s) audited: 1 clean" in out


def _dead_letter(led: Ledger, session: str, age_ms: int, error: str) -> str:
    """A dead letter as the worker writes it (schema.DeadLetterEntry), dead-lettered
    `age_ms` ago by Redis's clock (its entry id); its ref."""
    from ledger import schema

    secs, micros = led.client.time()
    at = int(secs) * 1000 + int(micros) // 1000 - age_ms
    p = led.keyspace.partition_of(session)
    entry = schema.DeadLetterEntry(
        {"kind": "compact", "session": session, "epoch": "1"}, "1-0", "max deliveries", error
    )
    eid = led.client.xadd(led.keyspace.dead_letters(p), entry.to_fields(), id=f"{at}-0")
    return f"p{p}:{eid.decode() if isinstance(eid, bytes) else eid}"


def test_dead_show_list_by_name_and_age(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dead show` prints named letters whole (before: no such command, exit 2);
    `dead list <ref>` lists only those named (before: every letter); each row has its
    age on Redis's clock (before: none)."""
    long_error = "RuntimeError: summarizer down; " + "detail " * 60 + "END-OF-ERROR"
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        old = _dead_letter(led, "dl-old", 2 * 3600_000 + 5_000, long_error)
        new = _dead_letter(led, "dl-new", 5 * 60_000 + 5_000, "ValueError: bad plan")
    argv = ["--url", redis_server.url, "--prefix", prefix, "dead"]
    assert cli.main([*argv, "list"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("p")}
    assert rows[old][1] == "2h" and rows[new][1] == "5m", out
    assert "END-OF-ERROR" not in out  # list cuts the error
    assert cli.main([*argv, "list", new]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert new in out and old not in out and "dl-old" not in out
    assert cli.main([*argv, "show", old]) == cli.EXIT_OK
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert f"{old} dead for 2h" in flat and "END-OF-ERROR" in flat and new not in out
    assert "session: dl-old" in flat and "why: max deliveries" in flat and "kind: compact" in flat
    assert cli.main([*argv, "show"]) == cli.EXIT_USAGE  # names, or --all
    assert cli.main([*argv, "show", "p0:1-1"]) == cli.EXIT_VIOLATION  # no such letter
    assert cli.main([*argv, "show", "--all"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert old in out and new in out
    assert cli.main([*argv, "list", "--json"]) == cli.EXIT_OK
    got = {r["ref"]: r for r in json.loads(capsys.readouterr().out)["letters"]}
    assert 2 * 3600 <= got[old]["age_s"] < 2 * 3600 + 60 and got[new]["session"] == "dl-new"


def test_audit_names_a_session_with_a_dead_letter(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ledger audit` names each session one of whose jobs was dead-lettered, with the
    letters' refs (text and --json); the other sessions are not named."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        for sid in ("held-1", "fine-1"):
            led.open_session(sid, SessionBudget(window=8000, system_prompt=10))
        ref = _dead_letter(led, "held-1", 60_000, "RuntimeError: summarizer down")
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit"]
    cli.main(argv)
    out = capsys.readouterr().out
    assert f"held-1: a job dead-lettered ({ref})" in " ".join(out.split()), out
    assert "fine-1" not in out
    cli.main([*argv, "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["dead_letters"] == {"held-1": [ref]}


def test_inspect_items_newest_first(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--items N shows the N newest items, the newest first, as its help and title say
    (before: the title said oldest first, and the help newest)."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("items", SessionBudget(window=10_000, system_prompt=10))
        for n in range(5):
            s.admit("retrieval", [Item(f"doc-{n}", 10)])
    argv = ["--url", redis_server.url, "--prefix", prefix, "inspect", "items", "--items", "2"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    shown = re.findall(r"\bdoc-\d\b", out)
    assert shown == ["doc-4", "doc-3"], out
    assert "items (5; the newest 2, newest first)" in " ".join(out.split())


def test_inspect_shows_a_staged_reset(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hard reset waiting for the open turn's end is shown, with its reason and when it
    is due; none is shown without one."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("rz", SessionBudget(window=10_000, system_prompt=10))
        t = s.begin_turn(0)
        argv = ["--url", redis_server.url, "--prefix", prefix, "inspect", "rz"]
        assert cli.main(argv) == cli.EXIT_OK
        assert "RESET STAGED" not in capsys.readouterr().out
        done = led.session("rz").reset("ops_asked", wait_ms=600_000)
        assert cli.main(argv) == cli.EXIT_OK
        out = " ".join(capsys.readouterr().out.split())
        assert (
            f"RESET STAGED (ops_asked): applied when turn {t.turn} ends, or by a reset call "
            f"from {done.due_ms} ms (in "
        ) in out, out
