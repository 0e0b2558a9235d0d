"""Regressions of the defects an outside attack found in the client and the scripts.

Each test names its defect; each failed before its fix. The worker's defects are in
``test_worker_faults.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

import pytest
import redis

from ledger import (
    AsyncLedger,
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    LedgerClosed,
    LedgerSettings,
    OperationIdReused,
    SessionBudget,
    SessionConflict,
    StaleEpoch,
    protocol,
    scripts,
)
from ledger.keys import KeySpace
from ledger.views import view
from tests.conftest import make_settings
from tests.support import jobs

RET, SCR, WM = Consumer.RETRIEVAL, Consumer.SCRATCHPAD, Consumer.WORKING_MEMORY

# A small window: a 10k-token tool result spills with a 50-token preview.
SMALL = SessionBudget(
    window=4_000,
    system_prompt=100,
    working_memory_floor=500,
    min_memory=0,
    tool_framing=0,
    output_reserve=200,
    spill_preview_tokens=50,
)


def _sid(tag: str) -> str:
    return f"rel/{tag}-{uuid.uuid4().hex[:8]}"


def _dump(led: Ledger) -> dict[bytes, Any]:
    """Every key of the ledger's prefix with its value (hashes, sets, strings)."""
    out: dict[bytes, Any] = {}
    for key in led.client.scan_iter(match=f"{led.keyspace.prefix}:*", count=500):
        kind = led.client.type(key)
        if kind == b"hash":
            out[key] = led.client.hgetall(key)
        elif kind == b"zset":
            out[key] = led.client.zrange(key, 0, -1, withscores=True)
        elif kind == b"string":
            out[key] = led.client.get(key)
        else:
            out[key] = kind
    return out


# --- 1. spill keys of two sessions never collide ------------------------------------------


def test_1_spill_keys_of_two_sessions_do_not_collide(settings: LedgerSettings) -> None:
    """Session S with call 'B:c' and session 'S:B' with call 'c', in one partition:
    each reads back its own spill, and neither overwrites the other's."""
    with Ledger.from_settings(make_settings(settings.redis_url, partitions=1)) as led:
        base = _sid("agent349")
        s, t = led.open_session(base, SMALL), led.open_session(f"{base}:B", SMALL)
        assert s.keys.partition == t.keys.partition
        assert s.admit_tool_result("B:c", 10_000, b"secret of S").outcome == "spilled"
        assert led.read_spill(f"{base}:B", "c") is None  # before: S's content
        assert t.admit_tool_result("c", 10_000, b"content of S:B").outcome == "spilled"
        assert led.read_spill(base, "B:c") == b"secret of S"  # before: overwritten
        assert led.read_spill(f"{base}:B", "c") == b"content of S:B"
        assert s.audit().clean and t.audit().clean


def test_1_no_two_ids_name_one_key() -> None:
    """Every key of sessions whose ids share the ':'-split ambiguity (and look like a key
    kind: 'ed:x' after 'spill:' reads like 'spilled:x'): no two are one."""
    ks = KeySpace("tenant", 1)
    ids = ["a", "a:b", "b:c", "a:b:c", "ed:x", "x", "s:a", "content:a", "d:a", "led:a"]
    keys = [k for sid in ids for k in (ks.session(sid).session, *ks.session(sid).data)]
    keys += [ks.session(sid).outcomes for sid in ids] + [
        ks.session(sid).outcomes_old for sid in ids
    ]
    assert len(set(keys)) == len(keys)


# --- 5. the op retention covers the retry window -------------------------------------------


def test_5_retention_shorter_than_the_retry_window_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="op_retention_seconds 5 is shorter"):
        LedgerSettings(op_retention_seconds=5)
    with pytest.raises(ConfigurationError, match=r">= 66\b"):
        LedgerSettings(op_retention_seconds=60, retry_max_seconds=60, socket_timeout=5)
    # The defaults hold; no retries, no window.
    assert LedgerSettings().op_retention_seconds >= 16
    with pytest.raises(ConfigurationError, match=r">= 16\b"):  # the backoff counts too
        LedgerSettings(op_retention_seconds=15, socket_timeout=5, retry_max_seconds=10)
    assert LedgerSettings(op_retention_seconds=1, retry_attempts=1).op_retention_seconds == 1


# --- 7. a ledger sends only calls built for its own key space -------------------------------


def test_7_calls_built_under_another_prefix_are_refused(
    settings: LedgerSettings, budget: SessionBudget
) -> None:
    with (
        Ledger.from_settings(make_settings(settings.redis_url)) as a,
        Ledger.from_settings(make_settings(settings.redis_url)) as b,
    ):
        sb = b.open_session(_sid("tenant-b"), budget)
        before = _dump(b)
        for call in (sb.admit_call(RET, [Item("x", 10)]), sb.snapshot_call(), sb.delete_call()):
            with pytest.raises(InvalidArgument, match="not a session of this ledger"):
                a.run(call)
            with pytest.raises(InvalidArgument, match="not a session of this ledger"):
                a.run_many([call])
        assert _dump(b) == before
        assert sb.snapshot().used[RET] == 0


def test_7_calls_built_with_another_partition_count_are_refused(
    settings: LedgerSettings, budget: SessionBudget
) -> None:
    """Same prefix, other partitions: the call would open a second session of the same id."""
    with Ledger.from_settings(settings) as led:
        sid = next(
            s
            for s in (_sid(f"p{i}") for i in range(1000))
            if KeySpace(settings.prefix, 7).partition_of(s) != led.keyspace.partition_of(s)
        )
        led.open_session(sid, budget)
        other = LedgerSettings(redis_url=settings.redis_url, prefix=settings.prefix, partitions=7)
        with Ledger.from_settings(other) as wrong:
            call = wrong.open_call(sid, budget, None)
            with pytest.raises(InvalidArgument, match="not a session of this ledger"):
                led.run(call)
        assert led.session_ids() == [sid]


async def test_7_async_calls_of_another_prefix_are_refused(
    settings: LedgerSettings, budget: SessionBudget
) -> None:
    async with (
        AsyncLedger.from_settings(make_settings(settings.redis_url)) as a,
        AsyncLedger.from_settings(make_settings(settings.redis_url)) as b,
    ):
        sb = await b.open_session(_sid("tenant-b"), budget)
        with pytest.raises(InvalidArgument):
            await a.run(sb.admit_call(RET, [Item("x", 10)]))
        with pytest.raises(InvalidArgument):
            await a.run_many([sb.admit_call(RET, [Item("x", 10)])])
        assert (await sb.snapshot()).used[RET] == 0


# --- 8. the session id in ARGV is exactly KEYS[1]'s ------------------------------------------


@pytest.mark.parametrize("script", ["reserve", "reset", "compact", "delete"])
def test_8_a_session_id_that_is_only_a_suffix_of_the_key_is_refused(
    ledger: Ledger, budget: SessionBudget, script: str
) -> None:
    """KEYS[1] names session 'x:s:y'; ARGV says 'y' (a suffix after ':s:')."""
    s = ledger.open_session(f"{_sid('x')}:s:y", budget)
    suffix = ledger.keyspace.session("y")
    built = {
        "reserve": protocol.reserve(suffix, "op-8", s.epoch, SCR, "lease-1", 10, 60_000),
        "reset": protocol.reset(suffix, "op-8", s.epoch, "why"),
        "compact": protocol.compact(suffix, "op-8", s.epoch, [], None),
        "delete": protocol.delete(suffix, "op-8", s.epoch),
    }[script]
    keys = [s.keys.session, *(_same_kind(s.keys, k) for k in built.keys[1:])]
    before = _dump(ledger)
    with pytest.raises(redis.exceptions.ResponseError, match=r"^LEDGER_BADARG session id y "):
        ledger._scripts[script](keys=keys, args=list(built.args))
    assert _dump(ledger) == before
    assert ledger.client.zcard(s.keys.deadlines) == 0


def _same_kind(keys: Any, other: str) -> str:
    """The session's own key of the kind `other` is (deadlines, jobs, a data key or an
    outcome hash)."""
    kinds = {":deadlines": keys.deadlines, ":jobs": keys.jobs, ":tally": keys.tally}
    kinds.update({":out:": keys.outcomes, ":old:": keys.outcomes_old})
    kinds.update({":content:": keys.content, ":compacted:": keys.compacted})
    kinds.update({":history:": keys.history, ":spilled:": keys.spilled, ":spill:": keys.spills})
    kinds.update({":order:": keys.order})
    return str(next(k for kind, k in kinds.items() if kind in other))


# --- 9. the server computes the fingerprint ----------------------------------------------------


def test_9_an_op_id_sent_again_with_any_other_argument_is_refused(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """No client-sent fingerprint: changing any argument after the op id, through the
    raw script, gets OperationIdReused (or a refusal of the argument itself)."""
    s = ledger.open_session(_sid("fp"), budget)
    first = s.admit_call(RET, [Item("doc", 100, priority=2)], op_id="op-9")
    done = ledger.run(first)
    script = ledger._scripts["admit"]
    for pos in range(1, len(first.args)):
        args = list(first.args)
        args[pos] = {1: f"{protocol.VERSION}:7", 2: "w", 3: "prefix", 4: "2", 5: "doc2"}.get(
            pos, "7"
        )
        assert args[pos] != first.args[pos]
        with pytest.raises(redis.exceptions.ResponseError, match=r"^LEDGER_(OPREUSED|BADARG)"):
            script(keys=list(first.keys), args=args)
    assert ledger.run(first) == done  # the same arguments replay the outcome
    assert s.snapshot().used[RET] == 100 and s.snapshot().used[WM] == 0
    # The fingerprint a script stores is its own: 12 hex digits of SHA-1 over the
    # script's name and the arguments after the op id, joined by \x1f (ARGV[2] as its epoch
    # only, without the protocol version).
    [stored] = [fp for k, fp in jobs.stored_fingerprints(ledger, s.id) if k == jobs.op_key("op-9")]
    signed = [str(first.args[1]).partition(":")[2], *first.args[2:]]
    want = hashlib.sha1(b"\x1f".join([b"admit", *(str(a).encode() for a in signed)]))
    assert stored == want.hexdigest()[:12]


def test_9b_an_outcome_takes_the_same_room_whatever_the_op_ids_length(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """A record keeps 14 hex digits of the op id's SHA-1, not the op id, and its epoch as
    a difference to the generation's: a 128-character op id and a 1-character one
    store records of one size, each is replayed (with its epoch whole) and refused with
    other arguments on its own, and neither answers for the other."""
    s = ledger.open_session(_sid("len"), budget)
    ops = {"short": "z", "long": "x" * 127 + "y"}
    sizes, done = {}, {}
    for name, op in ops.items():
        bucket, key = scripts.outcome_key(op)
        before = len(ledger.client.hget(s.keys.outcomes, bucket) or b"")
        got = done[name] = s.admit(SCR, [Item(f"doc-{len(op):03d}", 10)], op_id=op)
        raw = ledger.client.hget(s.keys.outcomes, bucket) or b""
        sizes[name] = len(raw) - before
        assert ("\x1e" + key).encode() in raw and op.encode() not in raw
        # the epoch is written relative to the generation's base 'e' (the session's): 0
        assert ledger.client.hget(s.keys.outcomes, "e") == str(got.epoch).encode()
        coded = f"\x01ok\x0710\x081\x090\x0a\x04{got.free}\x050\x06{got.turn}"
        assert sizes[name] == 1 + 14 + 12 + len(coded)
    assert sizes["short"] == sizes["long"]
    for name, op in ops.items():
        assert s.admit(SCR, [Item(f"doc-{len(op):03d}", 10)], op_id=op) == done[name]
        with pytest.raises(OperationIdReused):
            s.admit(SCR, [Item("other", 10)], op_id=op)
    assert s.snapshot().used[SCR] == 20


def test_9d_a_generation_begun_by_an_expiry_takes_the_sessions_epoch_as_its_base(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """The worker's expiry answers with no epoch: when its outcome is the first of a
    generation, the base is the session's epoch, so later outcomes still store 0."""
    s = ledger.open_session(_sid("exp"), budget)
    s.reserve(SCR, "lease", 10, lease_ms=1)
    time.sleep(0.01)
    ledger.client.hset(s.keys.session, "gz", 0)  # the next call rotates the generations
    assert ledger.expire_due(ledger.keyspace.partition_of(s.id)) == 1
    assert ledger.client.hget(s.keys.outcomes, "e") == str(s.epoch).encode()
    call = s.admit_call(SCR, [Item("after", 10)])
    done = ledger.run(call)
    bucket, key = scripts.outcome_key(call.args[0])
    raw = (ledger.client.hget(s.keys.outcomes, bucket) or b"").decode()
    record = raw[raw.index("\x1e" + key) :].split("\x1e")[1]
    assert f"\x050\x06{done.turn}" in record
    assert ledger.run(call) == done


def test_9c_a_retry_gets_its_own_epoch_back_across_resets_and_incarnations(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """Stored epochs are relative to the generation's first one: calls stored before a
    reset (epoch E), after it (E + 1) and in the next incarnation (a delete, then an
    open: a new epoch, the same outcome generation) each replay with their own epoch."""
    sid = _sid("ep")
    s = ledger.open_session(sid, budget)
    before = s.admit_call(SCR, [Item("a", 10)])
    first = ledger.run(before)
    reset = ledger.run(s.reset_call("test"))
    s.refresh()
    after = s.admit_call(SCR, [Item("b", 10)])
    second = ledger.run(after)
    assert (first.epoch + 1, first.epoch + 1) == (reset.epoch, second.epoch)
    bye = s.delete_call()
    gone = ledger.run(bye)
    again = ledger.open_session(sid, budget)
    assert again.epoch not in (first.epoch, second.epoch)
    later = again.admit_call(SCR, [Item("c", 10)])
    third = ledger.run(later)
    # one generation holds all of them, its base the first one's epoch
    assert ledger.client.hget(s.keys.outcomes, "e") == str(first.epoch).encode()
    assert ledger.run(before) == first and ledger.run(after) == second
    assert ledger.run(bye) == gone and ledger.run(later) == third
    assert again.snapshot().used[SCR] == 10
    views_journal = [e.reply for e in view(ledger, sid, journal=100).journal]
    for r in (first, second, third):
        assert any(f"epoch={r.epoch}|" in reply for reply in views_journal), r


def test_9_tool_content_takes_part_in_the_fingerprint(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = ledger.open_session(_sid("fp-tool"), SMALL)
    s.admit_tool_result("call-1", 10_000, b"first content", op_id="op-tool")
    with pytest.raises(OperationIdReused):
        s.admit_tool_result("call-1", 10_000, b"other content", op_id="op-tool")
    assert ledger.read_spill(s.id, "call-1") == b"first content"


# --- 10. small API defects ---------------------------------------------------------------------


def test_10_run_many_refuses_what_is_not_a_call(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session(_sid("batch"), budget)
    with pytest.raises(InvalidArgument, match="expected a ledger Call, got str"):
        ledger.run_many(["admit"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        ledger.run_many([s.admit_call(RET, [Item("a", 1)]), None])  # type: ignore[list-item]
    assert s.snapshot().used[RET] == 0  # nothing of the batch was sent


def test_10_calls_after_close_raise_instead_of_reconnecting(
    settings: LedgerSettings, budget: SessionBudget
) -> None:
    led = Ledger.from_settings(settings)
    s = led.open_session(_sid("closed"), budget)
    led.close()
    for call in (
        lambda: s.admit(RET, [Item("a", 1)]),
        lambda: led.run_many([s.snapshot_call()]),
        lambda: led.session_ids(),
        lambda: led.items(s.id),
        lambda: led.read_spill(s.id, "c"),
        lambda: led.expire_due(0),
    ):
        with pytest.raises(LedgerClosed):
            call()
    with Ledger.from_settings(settings) as again:
        assert again.session(s.id).snapshot().used[RET] == 0


async def test_10_async_calls_after_close_raise(
    settings: LedgerSettings, budget: SessionBudget
) -> None:
    led = AsyncLedger.from_settings(settings)
    s = await led.open_session(_sid("closed"), budget)
    await led.aclose()
    with pytest.raises(LedgerClosed):
        await s.admit(RET, [Item("a", 1)])
    with pytest.raises(LedgerClosed):
        await led.items(s.id)
    await asyncio.sleep(0)


def test_10_compaction_missing_are_consumer_id_pairs(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session(_sid("missing"), budget)
    s.admit(WM, [Item("t1", 100)])
    done = s.compact(["t1", "t9", (RET, "doc-gone")], Item("sum", 10))
    assert done.missing == ((WM, "t9"), (RET, "doc-gone"))
    released = s.release(WM, ["sum", "never"])
    assert released.missing == ("never",)  # one consumer: bare ids


def test_10_eviction_threshold_below_the_high_water_mark_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"eviction_threshold 0\.6 is below"):
        SessionBudget(
            window=10_000, system_prompt=100, high_water_mark=0.72, eviction_threshold=0.6
        )
    SessionBudget(window=10_000, system_prompt=100, high_water_mark=0.72, eviction_threshold=0.72)


# --- 11. a reservation cannot take an id its consumer holds as an item -------------------------


def test_11_reserve_for_a_held_item_id_is_refused_before_holding_tokens(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = ledger.open_session(_sid("resv"), budget)
    s.admit(SCR, [Item("call-1", 300)])
    free = s.snapshot().free
    with pytest.raises(SessionConflict, match="already holds an item call-1"):
        s.reserve(SCR, "call-1", 500)
    snap = s.snapshot()
    assert (snap.free, snap.open_reservations) == (free, 0)
    # Another consumer's item of that id is no obstacle; settle names the item after
    # the reservation by default.
    s.reserve(RET, "call-1", 500)
    done = s.settle("call-1", 450)
    assert (done.item, done.charged) == ("call-1", 450)
    assert s.audit().clean


# --- 12. a session re-created after its keys were lost ------------------------------------------


def test_12_an_op_acknowledged_before_a_data_loss_is_not_charged_again(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """The session's keys vanish (a restart without persistence, an eviction) and the
    session is opened again: a retry of an op acknowledged before, from a handle of the
    lost incarnation, is refused as stale instead of being charged to the new one."""
    sid = _sid("lost")
    s = ledger.open_session(sid, budget)
    call = s.admit_call(RET, [Item("doc", 1_000)], op_id="op-acked")
    assert ledger.run(call).charged == 1_000
    ledger.client.delete(s.keys.session, s.keys.outcomes, s.keys.outcomes_old)  # the loss
    time.sleep(0.002)  # a lost incarnation is told apart from one opened 1 ms later or more
    again = ledger.open_session(sid, budget)
    assert again.epoch > s.epoch
    with pytest.raises(StaleEpoch):
        ledger.run(call)
    with pytest.raises(StaleEpoch):
        s.admit(RET, [Item("doc2", 10)])
    assert again.snapshot().used[RET] == 0
    assert again.audit().clean


# --- found by reviewing the change -------------------------------------------------------------


def test_a_spilled_tool_result_seen_again_is_still_the_preview(ledger: Ledger) -> None:
    """A retry (or another worker) admitting a result the session already holds as a
    spill's preview gets the preview and the handle back, not the whole text."""
    from ledger.agent import Agent, EstimatingCounter

    s = ledger.open_session(_sid("dup-spill"), SMALL)
    agent = Agent(s, EstimatingCounter())
    result = {"id": "call-big", "content": "r," * 20_000}
    with agent.turn() as t:
        first = t.tool_result(result)
        again = t.tool_result(result)
        assert first.spilled and again.spilled
        assert (again.handle, again.text) == (first.handle, first.text)
        t.prompt(again.text)
    assert s.snapshot().used[SCR] == first.charged == 50


def test_a_hard_reset_clears_the_drift_flag(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session(_sid("drift-reset"), budget.model_copy(update={"framing_tolerance": 0}))
    s.admit(WM, [Item("t1", 1_000)])
    with pytest.warns(Warning):
        s.end_turn(s.begin_turn(0).turn, 5_000)
    assert s.snapshot().drift_flagged
    s.reset("operator")
    s.refresh()
    assert not s.snapshot().drift_flagged and s.audit().clean


async def test_the_span_processor_refuses_an_async_session(
    aledger: AsyncLedger, budget: SessionBudget
) -> None:
    from ledger.adapters.otel import LedgerSpanProcessor

    s = await aledger.open_session(_sid("otel"), budget)
    with pytest.raises(InvalidArgument, match="sync Session"):
        LedgerSpanProcessor(s)  # type: ignore[arg-type]


def test_an_agents_failed_compaction_while_a_job_is_queued_adds_no_second_job(
    ledger: Ledger,
) -> None:
    b = SessionBudget(window=10_000, system_prompt=500, output_reserve=500, compaction="worker")
    s = ledger.open_session(_sid("dup-job"), b)
    s.admit(WM, [Item(f"m{k}", 1_000) for k in range(8)])
    assert s.end_turn(s.begin_turn(0).turn, 9_000).compaction_due
    assert ledger.client.xlen(s.keys.jobs) == 1
    assert not s.compact(["m0"], Item("sum1", 10)).compacted  # still above the mark
    assert ledger.client.xlen(s.keys.jobs) == 1
