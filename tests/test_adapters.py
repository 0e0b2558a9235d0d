"""The framework adapters against the real packages (stub models, no network): the
LangGraph agent, the LangChain create_agent agent and the OpenAI Agents SDK agent of
examples/, 30 turns each with retrieval and oversized tool results and a worker
compacting, on embedded in one process (tests/test_fleet_turns.py runs them as a fleet
of two processes on a real Redis).

After every turn: no prompt the model was sent exceeds the window; the ledger's
occupancy equals the real prompt within the budget's framing tolerance; drift injected
on purpose (context added behind the ledger's back) is flagged on that turn's end_turn
and on no other."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import ContextOverflow, InvalidArgument

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "langgraph": ROOT / "examples" / "langgraph_agent.py",
    "langchain": ROOT / "examples" / "langchain_agent.py",
    "openai_agents": ROOT / "examples" / "openai_agents_agent.py",
}
TURNS, DRIFT_AT, TOLERANCE = 30, 17, 8


def run_example(name: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES[name]),
            "--json",
            "--turns",
            str(TURNS),
            "--drift-at",
            str(DRIFT_AT),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def check(rows: list[dict[str, Any]]) -> None:
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    for r in rows:
        assert r["max_sent"] <= r["window"], r  # the real prompt never exceeds the window
        assert r["prompt"] <= r["window"], r
        if r["turn"] == DRIFT_AT:
            assert r["flag"] == "drift" and r["drift"] > TOLERANCE and r["warned"] == 1, r
        else:
            assert abs(r["drift"]) <= TOLERANCE, r
            assert r["flag"] == "none" and r["warned"] == 0, r
        assert r["audit_clean"], r  # a flagged drift was repaired (gov.reconcile)
        assert not any(r["billing_flagged"]), r  # the provider's count agrees
    # The workload really exercised the ledger: oversized results spilled, the worker's
    # summaries were delivered (the history held went down again).
    assert sum(r["spilled"] for r in rows) >= 6
    assert max(r["tool_tokens"] for r in rows) >= 22_000
    delivered = [s for r in rows for s in r["delivered"]]
    assert len(delivered) >= 5 and len(set(delivered)) == len(delivered)


@pytest.mark.embedded
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_on_embedded(name: str) -> None:
    check(run_example(name))


def load(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "examples"))  # (the examples share examples/fleet.py)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES[name])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the graph's state annotations resolve in the module
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_glue_is_at_most_ten_lines(name: str) -> None:
    """Every line a user writes to plug the ledger in is marked `# ledger` in the example
    (imports, budget, session, adapter, turn, and the lines changed in the graph/run)."""
    glue = [line for line in EXAMPLES[name].read_text().splitlines() if line.endswith("# ledger")]
    assert 5 <= len(glue) <= 10, glue
    # A marked statement is one line (a formatter splitting one would hide glue lines).
    assert not [
        line for line in glue if line.rstrip().removesuffix("# ledger").rstrip()[-1] in "(,[{"
    ]
    mod = load(name)  # the budget's system prompt is the real one's size
    assert mod.BUDGET.system_prompt == mod.TOKENS(mod.SYSTEM) + 4
    # and the docstring says how many lines the glue is
    assert f"glue that plugs the ledger in ({len(glue)} lines" in " ".join(
        mod.__doc__.split()
    ) or f"the glue ({len(glue)} lines" in " ".join(mod.__doc__.split())


@pytest.mark.embedded
def test_langgraph_guard_refuses_a_prompt_over_the_window_before_the_call(tmp_path: Path) -> None:
    mod = load("langgraph")
    w = mod.Server(f"embedded://{uuid.uuid4().hex}", "guard", str(tmp_path / "db.sqlite"))
    big = [mod.SystemMessage(content="filler " * 16_000)]
    calls = len(mod.SEEN)
    with pytest.raises(ContextOverflow) as caught, w.gov.turn():
        w.gov.model(mod.StubModel()).invoke(big)
    assert caught.value.prompt > caught.value.limit == 15_000
    assert len(mod.SEEN) == calls  # the model was never called


@pytest.mark.embedded
def test_langgraph_node_with_a_bad_document_changes_nothing(tmp_path: Path) -> None:
    mod = load("langgraph")
    w = mod.Server(f"embedded://{uuid.uuid4().hex}", "bad", str(tmp_path / "db.sqlite"))
    session = w.gov.agent.session
    node = w.gov.node(lambda state: {"docs": [mod.Document(page_content="no id")]})
    with w.gov.turn():
        w.gov.node(lambda state: {})({"messages": [], "docs": []}, {})  # the turn's first node
        before = session.ledger.client.hgetall(session.keys.session)
        with pytest.raises(InvalidArgument, match="without a usable id"):
            node({"messages": [], "docs": []}, {})
        assert session.ledger.client.hgetall(session.keys.session) == before
        w.gov.last_prompt = 19  # (the turn made no model call: end it with the system prompt)


@pytest.mark.embedded
def test_agents_sdk_guard_refuses_a_prompt_over_the_window_before_the_call() -> None:
    mod = load("openai_agents")
    w = mod.Server(f"embedded://{uuid.uuid4().hex}", "guard")  # (its own event loop)
    # Instructions that grew behind the ledger's back: not an item, but counted.
    agent = mod.Agent(name="big", instructions="filler " * 16_000, model=mod.StubModel())
    calls = len(mod.SEEN)

    async def run() -> None:
        async with w.gov.turn():
            question = {"role": "user", "content": "Q1: revenue?"}
            await mod.Runner.run(agent, [question], run_config=w.gov.run_config())

    with pytest.raises(ContextOverflow):
        w.loop.run_until_complete(run())
    assert len(mod.SEEN) == calls


@pytest.mark.embedded
def test_otel_span_processor_records_genai_spans_after_the_fact() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from ledger import Ledger, SessionBudget
    from ledger.adapters.otel import LedgerSpanProcessor

    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        budget = SessionBudget(window=8_000, system_prompt=100, amplification_pathological=1.0)
        s = led.open_session("otel", budget)
        t = s.begin_turn(0)
        proc = LedgerSpanProcessor(s)
        provider = TracerProvider()
        provider.add_span_processor(proc)
        tracer = provider.get_tracer("test")
        for tokens in (3_000, 6_000, 9_000):
            with tracer.start_as_current_span("chat") as span:
                span.set_attribute("gen_ai.operation.name", "chat")
                span.set_attribute("gen_ai.usage.input_tokens", tokens)
                span.set_attribute("gen_ai.usage.output_tokens", 50)
        with tracer.start_as_current_span("not genai"):
            pass
        report = s.end_turn(t.turn, 4_000)
        # Recorded until the amplification passed the pathological threshold; the spans
        # after it were refused, kept in errors, never raised into the tracer.
        assert proc.recorded >= 1 and proc.errors and proc.recorded + len(proc.errors) == 3
        assert (
            report.spans == proc.recorded and report.span_input == [3_000, 9_000][proc.recorded - 1]
        )
        assert all(type(e).__name__ == "FanoutRefused" for e in proc.errors)


def test_otel_missing_extra_names_its_install_line() -> None:
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"
        "sys.modules['opentelemetry.sdk.trace'] = None\n"
        "try:\n    import ledger.adapters.otel\nexcept Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "redis-token-ledger[otel]"' in out.stdout
