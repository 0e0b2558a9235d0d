"""The two-call turn (protocol 3, docs/protocol.md#finish_turn, docs/agent.md): a turn's
tool results admitted whole and the turn ended in one call, with the promises of the calls
it replaces (every input checked before the first write, op ids, the turn fence and its
owner token); one that does not go in whole changes nothing and the agent falls back to
admit_tool and end_turn; an agent's governed turn is two round trips."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.connection

from ledger import (
    AdmissionRefused,
    Agent,
    AsyncAgent,
    AsyncLedger,
    InvalidArgument,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    SessionBudget,
    TurnInProgress,
    TurnLost,
    protocol,
)
from ledger.client import Session
from ledger.core import new_op_id
from ledger.testing import spawn_worker
from tests.support.servers import RedisProcess

ROOT = Path(__file__).resolve().parent.parent

BUDGET = SessionBudget(
    window=20_000, system_prompt=500, tool_framing=100, output_reserve=1_000,
    working_memory_floor=1_000, spill_preview_tokens=100,
)  # fmt: skip
# an agent's: its prompt is the system prompt and the items, drift judged to the token
AGENT = BUDGET.model_copy(update={"tool_framing": 0, "framing_tolerance": 0})
# what differs between two sessions that did the same thing by different calls: their
# outcomes and clocks
CLOCKS = {"ep", "inc", "xp", "gz", "ox", "cq", "cfg"}


def _sid() -> str:
    return f"two/{uuid.uuid4().hex[:12]}"


def _hash(led: Ledger, s: Session) -> dict[str, str]:
    raw = led.client.hgetall(s.keys.session)
    return {k.decode(): v.decode() for k, v in raw.items() if k.decode() not in CLOCKS}


def _loaded(led: Ledger) -> Session:
    s = led.open_session(_sid(), BUDGET)
    s.admit("working_memory", [Item("w1", 900)])
    s.admit("retrieval", [Item("r1", 800), Item("r2", 600, 2)])
    return s


def test_finish_turn_is_admit_tool_then_end_turn_in_one_call(ledger: Ledger) -> None:
    """The same turn ended both ways leaves the same session and the same report."""
    a, b = _loaded(ledger), _loaded(ledger)
    tools = [("call-1", 300, "grep: 3 matches"), ("call-2", 200, b'{"rows": 2}')]
    prompt = 500 + 100 + 900 + 800 + 600 + 300 + 200
    ta, tb = a.begin_turn(0).turn, b.begin_turn(0).turn
    for cid, n, text in tools:
        a.admit_tool_result(cid, n, text, keep_text=True)
    ended = a.end_turn(ta, prompt, mark="v1")
    done = b.finish_turn(tb, prompt, tools, keep_text=True, mark="v1")
    assert (
        replace(done.report, epoch=ended.epoch) == ended
        and done.report.drift == 0
        and not done.report.flagged
    )
    assert done.tools == (("call-1", 300), ("call-2", 200))
    assert done.free == a.snapshot().free == b.snapshot().free
    assert _hash(ledger, a) == _hash(ledger, b)
    assert b.turn is None and b.snapshot().turn_owner is None
    content = {k: ledger.client.hgetall(s.keys.content) for k, s in (("a", a), ("b", b))}
    assert content["a"] == content["b"] and content["b"][b"s:call-2"] == b'{"rows": 2}'
    # the next turn begins as after any ended turn
    assert b.begin_turn(0).turn == tb + 1


def test_a_result_that_does_not_go_in_whole_changes_nothing(ledger: Ledger) -> None:
    s = _loaded(ledger)
    turn = s.begin_turn(0).turn
    free = s.snapshot().free
    big = free + 10_000  # more than memory giving way would make room for: spilled
    before = _hash(ledger, s)
    content = ledger.client.hgetall(s.keys.content)
    with pytest.raises(AdmissionRefused) as info:
        s.finish_turn(turn, 5_000, [("call-1", 10, "ok"), ("call-2", big, "x" * 100)])
    assert info.value.reason == "not_whole" and info.value.detail["item"] == "call-1"
    assert info.value.requested == 10 + big and info.value.free == free
    after = _hash(ledger, s)
    # only the turn's list of its outcomes grew (a rollback drops them), and the refusal
    # was counted
    assert after.pop("uo") != before.pop("uo", None) and after.pop("x:refused") == "1"
    assert after == before
    assert ledger.client.hgetall(s.keys.content) == content
    assert s.turn == turn  # still open: the results one by one, then end_turn
    assert s.admit_tool_result("call-2", big, "x" * 100).outcome.value == "spilled"
    s.admit_tool_result("call-1", 10, "ok")
    assert s.end_turn(turn, 5_000).turn == turn
    # a result held as a smaller spilled preview does not go in whole either
    turn = s.begin_turn(0).turn
    with pytest.raises(AdmissionRefused) as info:
        s.finish_turn(turn, 5_000, [("call-2", big, "x" * 100)])
    assert info.value.detail["item"] == "call-2"
    done = s.finish_turn(turn, 5_000, [("call-1", 10, "ok")])  # held whole: charged 0
    assert done.tools == (("call-1", 0),)


@pytest.mark.parametrize(
    "bad",
    [
        {"tools": [("call-1", 10, "a"), ("call-1", 20, "b")]},  # one id twice
        {"tools": [("call-1", 0, "a")]},  # 0 tokens
        {"tools": [("call-1", 100_000_001, "a")]},
        {"final_prompt_tokens": 0},
        {"p99_trend": 2},
        {"tools": [("bad id!", 1, "a")]},
    ],
)
def test_bad_input_is_refused_before_any_write(ledger: Ledger, bad: dict[str, Any]) -> None:
    s = _loaded(ledger)
    turn = s.begin_turn(0).turn
    args: dict[str, Any] = {"final_prompt_tokens": 2_000, "tools": [("call-9", 5, "x")], **bad}
    whole = ledger.client.hgetall(s.keys.session), ledger.client.hgetall(s.keys.outcomes)
    with pytest.raises(InvalidArgument):  # (some refused by the client, the rest by the script)
        prompt, tools = args.pop("final_prompt_tokens"), args.pop("tools")
        ledger.run(s.finish_turn_call(turn, prompt, tools, **args))
    assert (ledger.client.hgetall(s.keys.session), ledger.client.hgetall(s.keys.outcomes)) == whole


def test_the_script_checks_its_argument_count_before_any_write(ledger: Ledger) -> None:
    s = _loaded(ledger)
    turn = s.begin_turn(0).turn
    call = s.finish_turn_call(turn, 2_000, [("call-9", 5, "x")])
    short = protocol.Call(call.script, call.keys, call.args[:-1], call.parse)
    keep = protocol.Call(call.script, call.keys, (*call.args[:7], "2", *call.args[8:]), call.parse)
    before = ledger.client.hgetall(s.keys.session)
    for wrong in (short, keep):
        with pytest.raises(InvalidArgument, match=r"arguments|keep text"):
            ledger.run(wrong)
    assert ledger.client.hgetall(s.keys.session) == before


def test_a_retry_gets_the_first_reply_and_other_arguments_are_refused(ledger: Ledger) -> None:
    s = _loaded(ledger)
    turn = s.begin_turn(0).turn
    op = new_op_id()
    first = s.finish_turn(turn, 3_100, [("call-1", 300, "x")], op_id=op)
    after = _hash(ledger, s)
    s.turn = turn  # (the handle forgot its ended turn: as a client retrying after a lost reply)
    assert s.finish_turn(turn, 3_100, [("call-1", 300, "x")], op_id=op) == first
    assert _hash(ledger, s) == after
    s.turn = turn
    with pytest.raises(LedgerError, match="already used"):
        s.finish_turn(turn, 3_200, [("call-1", 300, "x")], op_id=op)


def test_only_the_open_turn_and_its_owner_can_finish_it(ledger: Ledger) -> None:
    s = _loaded(ledger)
    turn = s.begin_turn(0).turn
    other = ledger.session(s.id)  # another handle: another owner token
    before = _hash(ledger, s)
    with pytest.raises(TurnInProgress):
        ledger.run(other.finish_turn_call(turn, 2_000, [("call-1", 5, "x")]))
    assert _hash(ledger, s) == before
    s.finish_turn(turn, 3_000)
    with pytest.raises(TurnLost):
        ledger.run(s.finish_turn_call(turn, 3_000, [("call-1", 5, "x")]))


def _send_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sent = [0]
    send = redis.connection.Connection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
    return sent


@pytest.mark.redis
def test_an_agent_turn_is_two_round_trips(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """begin with its admissions, then the tool result, the prompt and the commit."""
    settings = LedgerSettings(redis_url=redis_server.url, prefix=f"t2{uuid.uuid4().hex[:6]}")
    with Ledger.from_settings(settings) as led:
        s = led.open_session(_sid(), AGENT)
        agent = Agent(s, lambda text: len(text.split()), store_content=True)
        system = "w " * 500
        with agent.turn(0) as t:  # (the first turn asks once who compacts the session)
            t.prompt([system])
        sent = _send_counter(monkeypatch)
        user = {"id": "u1", "content": "what changed " * 10}
        chunks = [{"id": f"c{k}", "content": "chunk text " * 50} for k in range(4)]
        with agent.turn(0, admit={"working_memory": [user], "retrieval": chunks}) as t:
            out = t.tool_result({"id": "call-1", "content": "grep: 3 matches"}, defer=True)
            t.prompt([system, user, *chunks, out.text])
        assert sent[0] == 2
        assert t.report is not None and t.report.drift == 0 and not t.report.flagged
        assert t.tools[0].deferred and not t.tools[0].spilled
        assert led.client.hget(s.keys.content, "s:call-1") == b"grep: 3 matches"
        assert led.client.hget(s.keys.session, "i:s:call-1") is not None


def test_a_deferred_result_that_does_not_fit_whole_is_spilled_at_the_end(ledger: Ledger) -> None:
    s = ledger.open_session(_sid(), AGENT)
    agent = Agent(s, lambda text: len(text.split()))
    system = "w " * 500
    big = {"id": "call-big", "content": "word " * 30_000}
    with agent.turn(0) as t:
        out = t.tool_result(big, defer=True)
        assert out.text == big["content"] and out.deferred
        t.prompt([system, out.text])
    got = t.tools[0]
    assert got.spilled and got.handle == "call-big" and len(got.text) < len(big["content"])
    assert t.report is not None and t.report.drift == 0  # counted with its preview
    assert agent.read_spill("call-big") == big["content"]


async def test_the_asyncio_face_defers_alike(aledger: AsyncLedger) -> None:
    s = await aledger.open_session(_sid(), AGENT)
    agent = AsyncAgent(s, lambda text: len(text.split()))
    async with agent.turn(0) as t:
        out = await t.tool_result({"id": "call-1", "content": "three words here"}, defer=True)
        t.prompt(["w " * 500, out.text])
    assert t.report is not None and t.report.drift == 0 and t.tools[0].deferred
    snap = await s.snapshot()
    assert snap.turn_owner is None and snap.items["scratchpad"] == 1


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_two_processes_share_a_session_in_two_call_turns_with_a_worker(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    """Two agent processes take turns of one session, each turn two round trips, while a
    real `ledger worker` compacts it between turns: every turn commits once (the turn
    numbers of both are one sequence without gaps), every deferred tool result goes in
    whole, the worker compacts, and the audit is clean."""
    prefix, sid, turns = f"tf{uuid.uuid4().hex[:6]}", "fleet-2call", 12
    env = {"LEDGER_REDIS_URL": redis_server.url, "LEDGER_PREFIX": prefix,
           "LEDGER_WORKER_POLL_INTERVAL": "0.02", "LEDGER_WORKER_CLAIM_IDLE_MS": "300"}  # fmt: skip
    worker = spawn_worker("w-2call", env, tmp_path / "worker.log")
    worker.wait_started()
    try:
        agents = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "support" / "two_call_agent.py"),
                    redis_server.url,
                    prefix,
                    f"a{i}",
                    str(turns),
                    sid,
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        results = []
        for p in agents:
            out, err = p.communicate(timeout=200)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        deadline = time.monotonic() + 30
        while not worker.messages("job done"):  # (its last job may still be running)
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.05)
    finally:
        assert worker.stop() == 0, worker.tail()
    for r in results:
        assert r["errors"] == [] and len(r["committed"]) == turns, r
        assert all(deferred and not spilled for deferred, spilled, _ in r["tools"]), r
    numbers = sorted(n for r in results for n in r["committed"])
    assert numbers == list(range(numbers[0], numbers[0] + 2 * turns))
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        snap = led.session(sid).snapshot()
        assert snap.turn_owner is None and snap.last_ended_turn == numbers[-1]
        assert snap.raw["kn"] >= 1  # the worker compacted it
        assert led.audit(sid).clean
