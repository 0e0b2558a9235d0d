"""The defects a second attack from outside found (leaks across incarnations, lost texts,
epochs ahead of the clock, hostile text, handles after a reset, overdue leases, a
foreign client's inputs, a cluster client built while a node is down): one test each,
written to fail on the code before its fix, on every backend where it applies."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger import (
    Agent,
    AsyncLedger,
    BackendUnavailable,
    Consumer,
    InvalidArgument,
    Item,
    KeySpace,
    Ledger,
    LedgerError,
    LedgerSettings,
    SessionBudget,
    SessionConflict,
    StaleEpoch,
    cli,
    protocol,
    scripts,
)
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Worker, WorkerSettings
from tests.support import servers

WM, RET = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL
SECRET = "SECRET-" + "x" * 40


def small() -> SessionBudget:
    """1,000 tokens; high-water mark 720."""
    return SessionBudget(window=1_000, system_prompt=100, idle_ttl_seconds=600)


def sid() -> str:
    return f"h-{uuid.uuid4().hex[:8]}"


class Recorder:
    """A compactor that records what it is handed and summarizes every item."""

    def __init__(self) -> None:
        self.requests: list[CompactionRequest] = []
        self.during: Any = None  # called while the compactor "runs"

    def __call__(self, request: CompactionRequest) -> CompactionPlan:
        self.requests.append(request)
        if self.during is not None:
            self.during()
        return CompactionPlan(
            replaced=[(i.consumer, i.id) for i in request.items],
            summary=Item("summary-1", 50),
            summary_text="summary of " + ",".join(sorted(request.contents)),
        )


RECORDER = Recorder()


def compact_now(ledger: Ledger, session_id: str) -> None:
    worker = Worker(
        ledger,
        WorkerSettings(consumer="h", claim_idle_ms=10, compactor="tests.test_hardening:RECORDER"),
    )
    for _ in range(5):
        if not worker.poll_once():
            break


def session_keys_left(ledger: Ledger, session_id: str) -> dict[str, int]:
    """Every key of the session that exists, with its TTL (ms; -1 none)."""
    k = ledger.keyspace.session(session_id)
    names = [k.session, *k.data, k.outcomes, k.outcomes_old]
    return {n: int(ledger.client.pttl(n)) for n in names if ledger.client.exists(n)}


# --- 1. delete leaves the content store (leak) ---------------------------------------


def test_delete_leaves_no_text_and_a_new_incarnation_gets_none(ledger: Ledger) -> None:
    s_id = sid()
    s = ledger.open_session(s_id, small())
    s.admit(WM, [Item("m0", 100)], texts=[SECRET])
    s.admit_tool_result("call-1", 5_000, SECRET.encode())  # spilled
    s.admit_tool_result("call-2", 10, SECRET.encode(), keep_text=True)
    s.compact([], Item("w0", 10), summary_text=SECRET)
    k = s.keys
    assert ledger.client.exists(*k.data) >= 3  # content, compacted, spill and its index
    assert s.delete().deleted
    left = session_keys_left(ledger, s_id)
    # a scan of the whole key space finds nothing else of the session
    scanned = {k.decode() for k in ledger.client.scan_iter(match=f"*{s_id}*", count=1000)}
    assert scanned == set(left), scanned
    # what stays for retries: the tombstone and the outcomes, no text, TTLs within reach
    assert set(left) <= {k.session, k.outcomes, k.outcomes_old}, left
    retention = ledger.settings.op_retention_seconds * 1000
    assert all(0 < ttl <= retention + 1_000 for ttl in left.values()), left
    for name in left:
        raw = ledger.client.hgetall(name)
        assert not any(SECRET.encode() in v for v in raw.values()), name
    # the next incarnation of the id starts with no text of the last one
    again = ledger.open_session(s_id, small())
    again.admit(WM, [Item("m0", 100)])
    assert ledger.client.hgetall(k.content) == {}
    assert ledger.read_spill(s_id, "call-1") is None


@pytest.mark.embedded
def test_the_compactor_of_a_new_incarnation_is_not_handed_the_deleted_text() -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as ledger:
        s_id = sid()
        s = ledger.open_session(s_id, small())
        s.admit(WM, [Item("m0", 100)], texts=[SECRET])
        s.delete()
        again = ledger.open_session(s_id, small())
        again.admit(WM, [Item("m0", 700)])  # plainly: no text
        again.end_turn(again.begin_turn(0).turn, 800)  # above the mark: a job
        RECORDER.requests.clear()
        compact_now(ledger, s_id)
        [request] = RECORDER.requests
        assert SECRET not in request.contents.values() and "w:m0" not in request.contents


def test_a_reset_leaves_no_summary_record(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    s.admit(WM, [Item("m0", 100)], texts=["old"])
    s.compact(["m0"], Item("w1", 10), summary_text="the summary")
    assert ledger.client.hget(s.keys.compacted, "w1") is not None
    s.reset("operator")
    assert ledger.client.exists(s.keys.compacted, s.keys.content) == 0


def test_a_reset_of_a_session_missing_a_floor_changes_nothing(ledger: Ledger) -> None:
    """A session hash without a field reset reads (one written by an earlier draft of the
    protocol, before F_m was F_rm) is refused before reset's first write: its texts, its
    counters and the partition's tally are as they were."""
    s = ledger.open_session(sid(), small())
    s.admit(WM, [Item("m0", 100)], texts=["old"])
    ledger.client.hdel(s.keys.session, "F_rm")
    before = (ledger.client.hgetall(s.keys.session), ledger.client.hgetall(s.keys.tally))
    with pytest.raises(LedgerError):
        s.reset("operator")
    assert ledger.client.hget(s.keys.content, "w:m0") == b"old"
    assert (ledger.client.hgetall(s.keys.session), ledger.client.hgetall(s.keys.tally)) == before


# --- 2. a compaction drops a re-admitted item's new text -----------------------------


def test_a_compaction_replaces_only_the_version_it_read(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    s.admit(WM, [Item("m0", 100)], texts=["old text"])
    [seen] = [i for i in ledger.items(s.keys.session_id) if i.id == "m0"]
    # meanwhile the agent releases m0 and admits a new m0 with other text
    s.release(WM, ["m0"])
    s.admit(WM, [Item("m0", 120)], texts=["new text"])
    done = s.compact([(WM, "m0", seen.seq)], Item("w1", 10), summary_text="summary of old")
    assert done.missing == ("w:m0",) or "m0" in str(done.missing)
    assert ledger.client.hget(s.keys.content, "w:m0") == b"new text"
    assert {i.id for i in ledger.items(s.keys.session_id)} >= {"m0", "w1"}


@pytest.mark.embedded
def test_a_worker_compaction_keeps_the_text_of_an_item_admitted_while_it_ran() -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as ledger:
        s = ledger.open_session(sid(), small())
        s.admit(WM, [Item("m0", 400), Item("m1", 400)], texts=["old m0", "old m1"])
        s.end_turn(s.begin_turn(0).turn, 900)

        def readmit() -> None:
            s.release(WM, ["m0"])
            s.admit(WM, [Item("m0", 50)], texts=["new m0"])

        RECORDER.during = readmit
        try:
            compact_now(ledger, s.keys.session_id)
        finally:
            RECORDER.during = None
        assert ledger.client.hget(s.keys.content, "w:m0") == b"new m0"
        assert ledger.client.hget(s.keys.content, "w:m1") is None  # replaced: gone
        held = {i.id for i in ledger.items(s.keys.session_id)}
        assert "m0" in held and "m1" not in held


# --- 3. epochs ahead of Redis's clock ------------------------------------------------


def test_an_epoch_newer_than_the_sessions_is_stale(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    ahead = protocol.admit(s.keys, "op-ahead", s.epoch + 5, WM, [Item("x", 1)])
    with pytest.raises(StaleEpoch, match="newer than the session epoch"):
        ledger.run(ahead)


def test_a_tombstone_outlives_an_epoch_ahead_of_the_clock(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    for _ in range(3):  # each reset adds 1 to the epoch
        ledger.run_many([s.reset_call("burst")])
        s.refresh()
    # as if 10 s of resets: the epoch 10,000 ahead of Redis's clock
    ledger.client.hset(s.keys.session, "ep", s.epoch + 10_000)
    s.refresh()
    old = s.epoch
    s.delete()
    ttl = ledger.client.pttl(s.keys.session)
    assert ttl > ledger.settings.op_retention_seconds * 1000 + 5_000, ttl
    again = ledger.open_session(s.keys.session_id, small())
    assert again.epoch > old


# --- 4. a lone surrogate --------------------------------------------------------------


def test_a_lone_surrogate_is_an_invalid_argument(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    agent = Agent(s, lambda text: len(text) // 4 + 1)
    with pytest.raises(InvalidArgument, match=r"UTF-8|surrogate"):  # noqa: SIM117
        with agent.turn(working_set=0) as turn:
            turn.admit("working_memory", [{"id": "m0", "content": "lone \ud800"}])
    with pytest.raises(InvalidArgument):
        s.admit(WM, [Item("m1", 1)], texts=["lone \udfff"])


# --- 8. reset and the handle ---------------------------------------------------------


def test_reset_moves_the_handle_to_the_new_epoch(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), small())
    done = s.reset("operator")
    assert s.epoch == done.epoch
    assert s.admit(WM, [Item("after", 10)]).charged == 10  # no StaleEpoch, no refresh()


# --- 9. an overdue lease is a note, not a violation ------------------------------------


@pytest.mark.redis
def test_cli_audit_passes_an_expired_unswept_lease(redis_server: servers.RedisProcess) -> None:
    prefix = f"h{uuid.uuid4().hex[:8]}"
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as ledger:
        s = ledger.open_session(sid(), small())
        s.reserve(RET, "r1", 10, lease_ms=1)
        time.sleep(0.01)
        assert s.audit().clean and s.audit().overdue
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"])
    assert code == cli.EXIT_OK


# --- 6, 7, 10: what a foreign client sends, through raw EVAL of the dumped text ----------


@pytest.fixture
def dumped(tmp_path: Path) -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in scripts.dump(tmp_path)}


_KS = KeySpace("hard", 64)


@pytest.mark.redis
def test_raw_eval_open_verifies_the_budget(
    redis_server: servers.RedisProcess, dumped: dict[str, bytes]
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    keys = _KS.session(f"raw-{uuid.uuid4().hex[:8]}")
    eight, nine = (
        SessionBudget(window=8_000, system_prompt=500),
        SessionBudget(window=9_000, system_prompt=500),
    )
    names = list(protocol.open_session(keys, "op-0", eight, 120_000).keys)
    good = list(protocol.open_session(keys, "op-1", eight, 120_000).args)
    spoiled = {
        # 6: the fingerprint of another text, and the ARGV window beside another JSON
        "fingerprint": [*good[:12], hashlib.sha256(b"{}").hexdigest(), *good[13:]],
        "window": [good[0], good[1], "9000", *good[3:]],
        "json": [*good[:13], nine.canonical_json(), *good[14:]],
        # 10: one number, two spellings
        "leading zero": [good[0], good[1], "08000", *good[3:]],
    }
    for what, argv in spoiled.items():
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_BADARG "):
            r.eval(dumped["open"], len(names), *names, *argv)
        assert r.exists(*names) == 0, what
    assert b"created=1" in r.eval(dumped["open"], len(names), *names, *good)
    # 7: attaching with another op retention is refused
    other = list(protocol.open_session(keys, "op-2", eight, 1_000).args)
    with pytest.raises(redis.ResponseError, match=r"^LEDGER_CONFLICT .*retention"):
        r.eval(dumped["open"], len(names), *names, *other)
    r.delete(*names)


@pytest.mark.redis
def test_attaching_with_another_op_retention_is_a_conflict(
    redis_server: servers.RedisProcess,
) -> None:
    prefix = f"h{uuid.uuid4().hex[:8]}"
    node = LedgerSettings(redis_url=redis_server.url, prefix=prefix, op_retention_seconds=20)
    py = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(node) as a, Ledger.from_settings(py) as b:
        a.open_session("shared", small())
        with pytest.raises(SessionConflict, match="retention"):
            b.open_session("shared", small())


# --- 13. a cluster client built while a node is down ------------------------------------


@pytest.mark.cluster
async def test_a_cluster_url_with_a_node_down_is_backend_unavailable() -> None:
    with servers.cluster(3) as nodes:
        nodes[0].kill()  # the first node of the slot map
        url = f"redis+cluster://127.0.0.1:{nodes[1].port}/0"
        with pytest.raises(BackendUnavailable):
            Ledger.from_url(url)
        settings = LedgerSettings(redis_url=url, retry_attempts=1)
        async with AsyncLedger.from_settings(settings) as aled:
            with pytest.raises(BackendUnavailable):
                await aled.open_session("s", small())


def test_json_reply_of_compacted_record(ledger: Ledger) -> None:
    """The summary's record is the JSON the doc names, written by the script."""
    s = ledger.open_session(sid(), small())
    s.admit(WM, [Item("m0", 100)], texts=["old"])
    s.compact(["m0"], Item("w1", 10), summary_text='a "quoted" summary')
    rec = json.loads(ledger.client.hget(s.keys.compacted, "w1"))
    assert rec["text"] == 'a "quoted" summary' and rec["replaced"] == ["w:m0"]
    assert ledger.client.hget(s.keys.content, "w:m0") is None
    assert ledger.client.hget(s.keys.content, "w:w1") == b'a "quoted" summary'
