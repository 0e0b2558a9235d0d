"""The closed sets of the wire protocol as enums, and results built by name.

Each enum's values are exactly the strings the Lua scripts write (read from the scripts'
code, and from real replies on the embedded backend); a wrong string is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import ledger
from ledger import (
    Classification,
    CompactionMode,
    CompactionOutcome,
    ConfigurationError,
    DriftFlag,
    Item,
    JobKind,
    Ledger,
    Regime,
    SessionBudget,
    ToolResultOutcome,
    TurnReport,
    TurnStarted,
    scripts,
)
from ledger.protocol import Call, Reply
from ledger.scripts import lua_dir, strip_comments

ENUMS: tuple[type[enum.StrEnum], ...] = (
    CompactionMode,
    Regime,
    Classification,
    DriftFlag,
    CompactionOutcome,
    ToolResultOutcome,
    JobKind,
)


def code(script: str) -> str:
    """A script as sent: with the _common.lua definitions it uses (compact's judgement is
    compaction_effect, shared with begin_turn)."""
    return strip_comments(scripts.source(script))


def assigned(script: str, var: str) -> set[str]:
    """The string literals a script assigns to a variable (``[local] var[, x] = ...``)."""
    line = re.compile(rf"^\s*(?:local\s+)?{var}\b(?:\s*,\s*\w+)*\s*=(?!=)(.*)$", re.M)
    return {s for rest in line.findall(code(script)) for s in re.findall(r"'(\w+)'", rest)}


def literals(script: str) -> set[str]:
    return set(re.findall(r"'(\w+)'", code(script))) | set(re.findall(r"=(\w+)'", code(script)))


def test_enum_values_are_the_strings_the_scripts_assign() -> None:
    assert assigned("begin_turn", "regime") == {r.value for r in Regime}
    assert assigned("end_turn", "class") == {c.value for c in Classification}
    assert assigned("end_turn", "flag") == {f.value for f in DriftFlag}


def test_outcome_values_are_strings_of_their_scripts() -> None:
    # open.lua accepts exactly the modes (any other string is refused there)
    assert {m.value for m in CompactionMode} <= literals("open")
    assert {o.value for o in CompactionOutcome} <= literals("compact")
    assert {o.value for o in ToolResultOutcome} <= literals("admit_tool")
    # the job kinds the scripts enqueue (enqueue(KEYS[2], '<kind>', ...)), and no other
    enqueue = re.compile(r"enqueue\((?:\w+\[2\]|K\.jobs), '(\w+)'")
    sources = [strip_comments(p.read_text()) for p in lua_dir().glob("*.lua")]
    enqueued = {k for src in sources for k in enqueue.findall(src)}
    assert enqueued == {k.value for k in JobKind}


def raw(call: Call[Any]) -> Call[tuple[Reply, Any]]:
    """The call, answering its reply as sent besides the result parsed from it."""
    parse: Callable[[Reply], Any] = call.parse
    return Call(
        script=call.script, keys=call.keys, args=call.args, parse=lambda r: (dict(r), parse(r))
    )


def test_real_replies_parse_into_the_enums() -> None:
    led = Ledger.from_url(f"embedded://{uuid.uuid4().hex}")
    budget = SessionBudget(
        window=32_000, system_prompt=2_100, tool_framing=150, output_reserve=1_024,
        compaction="agent",
    )  # fmt: skip
    s = led.open_session("tenant-a/s-enums", budget)
    assert led.audit(s.id).clean
    begin = s.begin_turn_call(working_set=1_000)
    r, started = led.run(raw(begin))
    assert r["regime"] == "ok" and started.regime is Regime.OK
    turn = started.turn
    with pytest.raises(ValueError, match="'fine' is not a valid Regime"):
        begin.parse({**r, "regime": "fine"})  # a string outside the set is no result

    r, tool = led.run(raw(s.admit_tool_result_call("call-1", 500, "x", turn=turn)))
    assert r["outcome"] == "admitted" and tool.outcome is ToolResultOutcome.ADMITTED
    r, tool = led.run(raw(s.admit_tool_result_call("call-1", 500, "x", turn=turn)))
    assert r["outcome"] == "duplicate" and tool.outcome is ToolResultOutcome.DUPLICATE
    r, tool = led.run(raw(s.admit_tool_result_call("call-2", 40_000, "big", turn=turn)))
    assert r["outcome"] == "spilled" and tool.outcome is ToolResultOutcome.SPILLED
    assert tool.spilled

    with pytest.warns(ledger.ContextDriftWarning):
        r, report = led.run(raw(s.end_turn_call(turn, 40_000)))
    assert (r["class"], r["flag"]) == (report.classification, report.flag)
    assert isinstance(report.classification, Classification)
    assert report.flag is DriftFlag.OVER_WINDOW and report.flagged

    s.admit("working_memory", [Item("t1", 1_000)])
    r, done = led.run(raw(s.compact_call(["t1"], Item("sum-1", 100))))
    assert r["outcome"] == "compacted" and done.outcome is CompactionOutcome.COMPACTED
    s.delete()


def test_members_are_their_wire_strings() -> None:
    for e in ENUMS:
        for m in e:
            assert m == m.value and str(m) == m.value and f"{m}" == m.value
            assert json.dumps(m) == json.dumps(m.value)
            assert e(m.value) is m
        assert e.__name__ in ledger.__all__ and getattr(ledger, e.__name__) is e


def test_a_wrong_string_is_refused_by_the_budget_with_the_allowed_ones() -> None:
    assert SessionBudget(window=1_000, system_prompt=10).compaction is CompactionMode.WORKER
    b = SessionBudget(window=1_000, system_prompt=10, compaction="agent")
    assert b.compaction is CompactionMode.AGENT
    assert json.loads(b.canonical_json())["compaction"] == "agent"
    with pytest.raises(ConfigurationError, match=r"compaction\n.*'worker' or 'agent'"):
        SessionBudget(window=1_000, system_prompt=10, compaction="agnet")


def test_results_of_four_fields_or_more_are_built_by_name() -> None:
    fields = {f.name for f in dataclasses.fields(TurnStarted)}
    assert {"regime", "turn", "residual", "need"} <= fields
    with pytest.raises(TypeError, match="positional"):
        TurnReport(1, 0.5)  # type: ignore[misc]
    for name in ledger.models.__all__:
        cls = getattr(ledger, name)
        if dataclasses.is_dataclass(cls) and len(dataclasses.fields(cls)) >= 4:
            assert all(f.kw_only for f in dataclasses.fields(cls)), name


def test_every_model_of_the_models_modules_is_exported() -> None:
    """ledger/models/ is one module a kind of model, and ``ledger.models`` names each
    class they define (in ``__all__``, exported by ``ledger``): one left out fails here."""
    import importlib
    import inspect
    import pkgutil

    defined = set()
    for info in pkgutil.iter_modules(ledger.models.__path__):
        module = importlib.import_module(f"ledger.models.{info.name}")
        defined |= {
            name
            for name, obj in vars(module).items()
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and name[0] != "_"
        }
    assert len(defined) >= 40
    assert defined == set(ledger.models.__all__)
    for name in defined:
        assert getattr(ledger.models, name) is getattr(ledger, name)
