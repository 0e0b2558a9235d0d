"""The agent layer (ledger.agent): app objects in and out, ids, spill, credit ordering,
bad input, on both faces and on embedded, a real Redis and a cluster."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Consumer,
    ContextDrift,
    ContextDriftWarning,
    InvalidArgument,
    Item,
    Ledger,
    LedgerSettings,
    SessionBudget,
    TurnInProgress,
)
from ledger.agent import Agent, AsyncAgent, EstimatingCounter, TiktokenCounter, ledger_id
from ledger.agent.counters import Calibrated
from tests.conftest import make_settings

TOK = TiktokenCounter()
SYSTEM = "You are a careful analyst."


def budget(**kw: Any) -> SessionBudget:
    base: dict[str, Any] = {
        "window": 6_000,
        "system_prompt": TOK(SYSTEM),
        "output_reserve": 500,
        "working_memory_floor": 300,
        "framing_tolerance": 0,
        "spill_preview_tokens": 80,
    }
    return SessionBudget(**{**base, **kw})


def doc(i: int, words: int = 100) -> dict[str, Any]:
    return {
        "id": f"https://example.com/docs/{i}?q=x&y=z#chunk-{i}",
        "content": "alpha beta " * words,
    }


def state(led: Ledger, sid: str) -> dict[bytes, bytes]:
    return led.client.hgetall(led.keyspace.session(sid).session)  # type: ignore[no-any-return]


def test_ledger_id_is_a_stable_digest_across_processes() -> None:
    url = "https://example.com/a very long id/?with=query&and#fragment" + "x" * 200
    here = [ledger_id(url), ledger_id(uuid.UUID(int=7)), ledger_id("plain-id:1"), ledger_id(12)]
    code = (
        "import uuid,sys; from ledger.agent import ledger_id; "
        f"print(ledger_id({url!r}), ledger_id(uuid.UUID(int=7)), ledger_id('plain-id:1'), "
        "ledger_id(12))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert here == there
    assert here[0].startswith("h.") and len(here[0]) == 34
    assert here[2] == "plain-id:1" and here[3] == "12"
    assert ledger_id(here[0]) == here[0]  # idempotent on its own digests
    assert ledger_id("h.not-a-digest") != "h.not-a-digest"
    for bad in (None, "", b"x", 1.5, True):
        with pytest.raises(InvalidArgument):
            ledger_id(bad)


def test_turn_admits_app_objects_and_hands_back_reclaimed_ones(ledger: Ledger) -> None:
    s = ledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget(window=3_000))
    agent = Agent(s, TOK)
    docs = [doc(i) for i in range(30)]
    with agent.turn(working_set=200) as t1:
        got = t1.admit("retrieval", docs)
        assert got.kept and got.refused and got.reason == "token_budget_exhausted"
        assert list(got.kept) == docs[: len(got.kept)]  # the app's own objects
        t1.prompt([SYSTEM, *got.kept])
    assert t1.report is not None and t1.report.drift == 0 and t1.report.flag == "none"
    # The next turn needs more working memory: earlier chunks are reclaimed and handed
    # back as the app's objects.
    with agent.turn(working_set=1_800) as t2:
        assert t2.dropped and all(d in got.kept for d in t2.dropped)
        left = [d for d in got.kept if d not in t2.dropped]
        t2.prompt([SYSTEM, *left])
    assert t2.report is not None and t2.report.drift == 0
    assert s.audit().clean


def test_a_turns_first_admissions_go_in_the_round_trip_that_begins_it(ledger: Ledger) -> None:
    """agent.turn(admit=...): begin_turn and the admissions in one round trip (one
    run_many, no other call), the same Admission results as turn.admit, in the turn (a
    rollback takes them back); a begin refused by another owner's turn admits nothing."""
    s = ledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget(window=3_000))
    agent = Agent(s, TOK, store_content=False)
    sent: list[list[str]] = []
    run, run_many = ledger.run, ledger.run_many

    def one(call: Any, **kw: Any) -> Any:
        sent.append([call.script])
        return run(call, **kw)

    def many(calls: Any, **kw: Any) -> Any:
        sent.append([c.script for c in calls])
        return run_many(calls, **kw)

    ledger.run, ledger.run_many = one, many  # type: ignore[method-assign]
    user = {"id": "u1", "content": "What changed?"}
    docs = [doc(i) for i in range(30)]
    with agent.turn(200, admit={"working_memory": [user], "retrieval": docs}) as t:
        # (the agent's first turn asks once whether a worker compacts the session)
        assert sent == [["snapshot"], ["begin_turn", "admit", "admit"]]
        w, r = t.admissions
        assert w.kept == (user,) and r.kept and r.refused and r.reason == "token_budget_exhausted"
        assert list(r.kept) == docs[: len(r.kept)]
        t.prompt([SYSTEM, user, *r.kept])
    assert t.report is not None and t.report.drift == 0 and len(sent) == 3  # + end_turn
    with pytest.raises(RuntimeError), agent.turn(0, admit={"retrieval": [doc(99)]}):
        raise RuntimeError("the model call failed")
    assert ledger_id(doc(99)["id"]) not in {i.id for i in ledger.items(s.id)}  # rolled back
    other = ledger.session(s.id, owner="other-process")
    held = other.begin_turn(0)
    before = state(ledger, s.id)
    with pytest.raises(TurnInProgress), agent.turn(0, admit={"retrieval": [doc(98)]}):
        pass
    assert state(ledger, s.id) == before  # nothing admitted into the other owner's turn
    other.end_turn(held.turn, other.snapshot().occupancy)
    ledger.run, ledger.run_many = run, run_many  # type: ignore[method-assign]
    assert s.audit().clean


class CountingCounter:
    """TOK, its calls counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        return TOK(text)


def test_each_objects_text_is_counted_once_per_process(ledger: Ledger) -> None:
    """The counter runs once per distinct text: admitting, building the prompt and ending
    turn after turn with the same objects counts only the new ones; the counts are the
    counter's own (the cache changes no number)."""
    s = ledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget(window=6_000))
    counter = CountingCounter()
    agent = Agent(s, counter)
    docs = [{"id": f"d{i}", "content": f"chunk {i} " * (20 + i)} for i in range(8)]
    seen: list[dict[str, Any]] = []
    for turn in range(4):
        new = docs[2 * turn : 2 * turn + 2]
        before = counter.calls
        with agent.turn(working_set=100) as t:
            t.admit("retrieval", new)
            seen += new
            t.prompt([SYSTEM, *seen])
        assert t.report is not None and t.report.drift == 0
        assert counter.calls - before <= len(new) + (1 if turn == 0 else 0)  # + SYSTEM once
    assert counter.calls == len(docs) + 1
    assert s.snapshot().used[Consumer.RETRIEVAL] == sum(agent.core.tokens(d) for d in docs)
    assert counter.calls == len(docs) + 1  # counting again for the check: from the cache


def test_a_prompt_of_parts_counted_before_is_the_sum_of_their_counts(ledger: Ledger) -> None:
    """A prompt's parts read from the count cache count what the counter would (scaled by
    the calibration factor, each to the nearest token; the system prompt given as a string
    as the budget counts it); a part whose text is not valid Unicode is
    refused."""
    agent = Agent(ledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget()), TOK)
    core = agent.core
    parts: list[Any] = [SYSTEM, *({"id": f"p{i}", "content": f"part {i} " * i} for i in range(9))]
    for factor in (1.0, 1.37):
        core.counter.factor = factor
        fresh = sum(  # (a plain string, the system prompt, as the budget counts it)
            (TOK(p) if isinstance(p, str) else math.floor(TOK(core.text_of(p)) * factor + 0.5))
            + core.item_overhead
            for p in parts
        )
        assert core.prompt_tokens(parts) == fresh  # counted
        assert core.prompt_tokens(parts) == fresh  # from the cache
    with pytest.raises(InvalidArgument, match="a prompt part is not valid Unicode"):
        core.prompt_tokens([SYSTEM, {"id": "x", "content": "half of a pair: \ud800"}])


def test_spill_preview_is_cut_to_the_budget_and_read_back_by_another_worker(
    ledger: Ledger, settings: LedgerSettings
) -> None:
    sid = f"s-{uuid.uuid4().hex[:8]}"
    s = ledger.open_session(sid, budget())
    agent = Agent(s, TOK)
    rows = "\n".join(f"{i},name-{i},{i * 3.5}" for i in range(3_000))
    result = {"id": "call-https://tools.example.com/sql?id=42", "content": rows}
    with agent.turn() as t:
        out = t.tool_result(result)
        assert out.spilled and out.result is result
        assert TOK(out.text) <= out.charged == s.snapshot().used[ledger_consumer("scratchpad")]
        assert out.handle in out.text and out.text.endswith(
            rows[: len(out.text) - out.text.index("\n") - 1]
        )
        t.prompt([SYSTEM, out.text])
    with Ledger.from_settings(settings) as other:  # another worker, same session
        assert Agent(other.session(sid), TOK).read_spill(out.handle or "") == rows


def ledger_consumer(name: str) -> Any:
    from ledger import Consumer

    return Consumer(name)


def test_bad_input_is_typed_and_changes_nothing(ledger: Ledger) -> None:
    sid = f"s-{uuid.uuid4().hex[:8]}"
    s = ledger.open_session(sid, budget())
    agent = Agent(s, TOK)

    def raising(text: str) -> int:
        raise RuntimeError("tokenizer crashed")

    def with_counter(counter: Any, call: Any) -> object:
        saved = agent.core.counter
        agent.core.counter = Calibrated(counter)  # (as the agent wraps every counter)
        try:
            return call()
        finally:
            agent.core.counter = saved

    with agent.turn() as t:
        before = state(ledger, sid)
        cases = [
            lambda: t.admit("retrieval", [doc(1), {"content": "no id here"}]),
            lambda: t.admit("retrieval", [doc(1), {"id": None, "content": "x"}]),
            lambda: t.admit("retrieval", [doc(1), object()]),
            lambda: with_counter(raising, lambda: t.admit("retrieval", [doc(1)])),
            lambda: with_counter(lambda _: -3, lambda: t.admit("retrieval", [doc(1)])),
            lambda: with_counter(lambda _: 2.5, lambda: t.admit("retrieval", [doc(1)])),
            lambda: with_counter(lambda _: True, lambda: t.admit("retrieval", [doc(1)])),
            lambda: with_counter(raising, lambda: t.tool_result({"id": "c1", "content": "x"})),
            lambda: with_counter(lambda _: -1, lambda: t.prompt("the prompt")),
            lambda: t.tool_result({"content": "no id"}),
            lambda: t.tool_result({"id": "c1"}, text=b"bytes"),  # type: ignore[arg-type]
            lambda: t.prompt(-1),
            lambda: t.admit("nonsense", [doc(1)]),
            lambda: Agent(s, TOK, item_overhead=-1),
        ]
        for i, case in enumerate(cases):
            with pytest.raises(InvalidArgument) as caught:
                case()
                pytest.fail(f"case {i} was accepted")
            assert str(caught.value), i
            assert state(ledger, sid) == before, f"case {i} changed the session"
        t.prompt(TOK(SYSTEM))


def test_drift_is_flagged_by_setting_and_reconcile_sets_the_ledger_to_the_prompt(
    settings: LedgerSettings,
) -> None:
    strict = settings.model_copy(update={"drift_action": "raise"})
    with Ledger.from_settings(strict) as led:
        s = led.open_session(f"s-{uuid.uuid4().hex[:8]}", budget(framing_tolerance=5))
        agent = Agent(s, TOK)
        with agent.turn() as t:
            got = t.admit("retrieval", [doc(1), doc(2)])
            t.prompt([SYSTEM, *got.kept])
        behind = {"id": "note-1", "content": "an unlogged note " * 40}
        with pytest.raises(ContextDrift) as caught, agent.turn() as t:
            t.prompt([SYSTEM, *got.kept, behind])
        report = caught.value.report
        assert t.report is report  # the turn ended: its report is kept though end raised
        assert report.flag == "drift" and report.drift == TOK(behind["content"])  # type: ignore[attr-defined]
        assert not s.audit().clean and s.snapshot().drift_flagged
        done = agent.reconcile({"retrieval": [*got.kept], "working_memory": [behind]})
        assert done.added == 1 and done.kept == 2 and not done.removed
        assert s.audit().clean and not s.snapshot().drift_flagged
        occupancy = s.snapshot().occupancy
        assert occupancy == agent.core.prompt_tokens([SYSTEM, *got.kept, behind])


def test_drift_warns_by_default(ledger: Ledger) -> None:
    s = ledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget(framing_tolerance=5))
    warns = pytest.warns(ContextDriftWarning, match="differs from the ledger's occupancy")
    with warns, Agent(s, TOK).turn() as t:
        t.prompt(TOK(SYSTEM) + 100)


def test_the_next_turn_waits_for_a_pending_compaction_before_it_begins(ledger: Ledger) -> None:
    """Credit ordering from the caller's side: a compaction commits only between turns
    (never under a running one), so the turn after the one that made it due waits for it
    (bounded, before taking the lease), then admits its retrieval on the compacted
    history."""
    s = ledger.open_session(
        f"s-{uuid.uuid4().hex[:8]}", budget(high_water_mark=0.2, framing_tolerance=None)
    )
    agent = Agent(s, TOK, await_compaction=5.0, poll_interval=0.02)
    with agent.turn() as t:
        wm = [{"id": f"m{i}", "content": "gamma delta " * 100} for i in range(8)]
        assert not t.admit("working_memory", wm).refused
        t.prompt([SYSTEM, *wm])
    assert t.report is not None and t.report.compaction_due

    # Another process commits the compaction a moment later (between turns).
    def compactor() -> None:
        time.sleep(0.2)
        ledger.session(s.id).compact([w["id"] for w in wm[:7]], Item("summary", 50))

    th = threading.Thread(target=compactor)
    th.start()
    started = time.monotonic()
    with agent.turn() as t:
        assert time.monotonic() - started >= 0.15  # it waited before beginning
        got = t.admit("retrieval", [doc(5)])
        assert got.kept and not got.refused
        # the compaction is delivered to this turn: its replaced items leave the prompt
        assert {o["id"] for o in t.dropped} == {w["id"] for w in wm[:7]}
        t.prompt(100)
    th.join()


def test_with_no_worker_only_the_first_turn_after_the_request_waits(ledger: Ledger) -> None:
    """A compaction no worker picks up is waited for until compaction_pickup after it was
    requested (the session's ``cq``, Redis's clock), not after each turn's own wait: the
    turn right after the request waits, the next ones begin at once. Without the request's
    time (a session stamped before ``cq`` existed) every turn waits again."""
    s = ledger.open_session(
        f"s-{uuid.uuid4().hex[:8]}", budget(high_water_mark=0.2, framing_tolerance=None)
    )
    # a pickup of 2 s: a loaded machine's delay before the next turn (up to half a second
    # seen in CI) still leaves some of it to wait
    agent = Agent(s, TOK, await_compaction=5.0, compaction_pickup=2.0, poll_interval=0.02)
    with agent.turn() as t:
        t.admit(
            "working_memory", [{"id": f"m{i}", "content": "gamma delta " * 100} for i in range(8)]
        )
        t.prompt(100)
    assert t.report is not None and t.report.compaction_due
    asked = int(ledger.client.hget(s.keys.session, "cq") or 0)
    now_ms = int(ledger.client.time()[0]) * 1000
    assert abs(now_ms - asked) < 5_000  # stamped from the job entry's id

    def waited() -> float:
        with agent.turn() as t:
            t.prompt(100)
        assert t.state is not None
        return t.state.waited_compaction

    sec, usec = ledger.client.time()
    began = int(sec) * 1000 + int(usec) // 1000
    left = 2.0 - (began - asked) / 1000  # what the pickup leaves of the wait, on Redis's clock
    first = waited()
    assert left > 0.1, "the machine stalled past the pickup before the next turn began"
    assert first > 0.0 and left - 1.0 <= first < left + 1.0  # the request is fresh: wait
    assert waited() == 0.0  # requested long ago, never picked up: none is running
    assert waited() == 0.0
    ledger.client.hdel(s.keys.session, "cq")
    assert waited() >= 0.9  # without it each turn's wait is all it can time


def test_retrieval_refused_honestly_when_the_compaction_does_not_come(ledger: Ledger) -> None:
    s = ledger.open_session(
        f"s-{uuid.uuid4().hex[:8]}", budget(high_water_mark=0.2, framing_tolerance=None)
    )
    agent = Agent(s, TOK, await_compaction=0.2, poll_interval=0.05)
    with agent.turn() as t:
        t.admit(
            "working_memory", [{"id": f"m{i}", "content": "gamma delta " * 100} for i in range(8)]
        )
        t.prompt(100)
    started = time.monotonic()
    with agent.turn() as t:
        assert time.monotonic() - started >= 0.2  # the bounded wait, then the turn
        got = t.admit("retrieval", [doc(5, words=2_300)])
        assert not got.kept and got.reason == "compaction_pending"
        t.prompt(100)


async def test_async_face_is_the_same_layer(aledger: AsyncLedger) -> None:
    s = await aledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget())
    agent = AsyncAgent(s, TOK)
    async with agent.turn(working_set=100, admit={"retrieval": [doc(3)]}) as t:
        assert t.admissions[0].kept == (doc(3),)
        got = await t.admit("retrieval", [doc(1), doc(2)])
        out = await t.tool_result({"id": "call-1", "content": "r," * 20_000})
        assert out.spilled and TOK(out.text) <= out.charged
        with pytest.raises(InvalidArgument):
            await t.admit("retrieval", [{"content": "no id"}])
        t.prompt([SYSTEM, doc(3), *got.kept, out.text])
    assert t.report is not None and t.report.drift == 0
    assert await agent.read_spill(out.handle or "") == "r," * 20_000
    assert (await s.audit()).clean


def test_estimating_counter_says_it_is_an_estimate() -> None:
    c = EstimatingCounter()
    assert "estimate" in c.name and c("abcdefgh") == 2 and c("") == 0


def test_the_tokenizer_runs_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import socket

    def no_network(*a: object, **k: object) -> None:
        raise AssertionError("the tokenizer tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    c = TiktokenCounter()
    assert c("hello world") == 2 and c("tiktoken is great!") == 6
    assert c.truncate("one two three four", 2) == "one two"


def test_importing_ledger_imports_no_framework() -> None:
    code = (
        "import sys, ledger, ledger.agent; "
        "bad = [m for m in ('langgraph', 'langchain_core', 'agents', 'tiktoken', 'openai') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("ledger.adapters.langgraph", "langchain_core", "langgraph"),
        ("ledger.adapters.openai_agents", "agents", "openai-agents"),
    ],
)
def test_a_missing_extra_names_its_install_line(module: str, blocked: str, extra: str) -> None:
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        f"try:\n    import {module}\nexcept Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("MissingExtra")  # a ConfigurationError
    assert f'pip install "redis-token-ledger[{extra}]"' in out.stdout


def test_tokenizer_extra_missing_names_its_install_line() -> None:
    code = (
        "import sys; sys.modules['tiktoken'] = None\n"
        "from ledger.agent import TiktokenCounter\n"
        "try:\n    TiktokenCounter()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "redis-token-ledger[tokenizer]"' in out.stdout


def test_settings_fixture_is_fresh(settings: LedgerSettings) -> None:
    assert make_settings(settings.redis_url).prefix != settings.prefix
