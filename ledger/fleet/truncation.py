"""Scenario 002, truncation loop: token-count-valid but broken contexts.

The pipeline of this scenario (docs/demo.md): a 32k window, a 2.1k system prompt whose 600-token
permission paragraph forbids one file-read tool, a memory retriever returning 20-40
chunks of ~300 tokens a turn, tool results of median 4.5k with a p99 near 28k (the
last two kept in the scratchpad), and now and then a file read of ~24k.

The naive arbiter treats everything as slack: when a result does not fit it evicts
memory, then "compresses" the system prompt by dropping the permission paragraph
(a compression event), then truncates the result to fit. With the paragraph gone the
agent issues the forbidden read (~20k) on its next turn; truncated, the agent lacks
it and issues the same call again (at most twice more), until the paragraph is
restored when room allows. The ledger's agent keeps the same policies; the system
prompt is a reserved floor, a result is admitted whole or spilled with a preview,
memory gets the longest run of chunks that fits, and is refused what does not.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ledger.client import Ledger
from ledger.errors import AdmissionRefused
from ledger.fleet.agent import REAL, Clock, Doc, SimAgent
from ledger.models import Consumer, SessionBudget

RET = Consumer.RETRIEVAL
SESSIONS, TURNS = 6, 30
CHUNK = 300  # tokens of a memory chunk
CLAUSE = 600  # the permission paragraph a naive allocator drops
FORBIDDEN = 20_000  # what the forbidden read returns
REPEATS = 2  # the agent re-issues a truncated call at most this many times
KEEP_RESULTS = 2
BUDGET = SessionBudget(
    window=32_000,
    system_prompt=2_100,
    tool_framing=150,
    working_memory_floor=2_000,
    output_reserve=1_024,
    spill_preview_tokens=300,
    high_water_mark=0.90,  # the naive pipeline compacts nothing; the ledger side compacts above it
    eviction_threshold=0.95,
)


@dataclass(frozen=True, slots=True)
class TurnPlan:
    turn: int
    chunks: int  # memory chunks of 300 tokens this turn
    tool: int  # the turn's tool result (0: none)


def plan(seed: int, index: int) -> tuple[TurnPlan, ...]:
    rng = random.Random(seed * 104_729 + index)
    big = set(rng.sample(range(4, TURNS - 4), 2))  # two large file reads a session
    sigma = math.log(28_000 / 4_500) / 2.326
    out = []
    for t in range(1, TURNS + 1):
        tool = 0
        if t in big:
            tool = rng.randint(23_000, 25_000)
        elif rng.random() < 0.6:
            tool = min(28_000, max(300, round(rng.lognormvariate(math.log(4_500), sigma))))
        out.append(TurnPlan(t, rng.randint(20, 40), tool))
    return tuple(out)


@dataclass
class Counts:
    compression_events: int = 0  # the system prompt lost its permission paragraph
    damaged_turns: int = 0  # turns run with it missing
    forbidden_calls: int = 0
    truncated: int = 0
    repeated_calls: int = 0
    spilled: int = 0
    refusals: int = 0
    admitted_whole: int = 0
    # what the cures cost. Memory cut short: chunks (of CHUNK tokens) a result took the
    # room of (evicted for it; naive: memory emptied for it), and chunks not admitted at
    # a turn's begin (the room held by the results kept).
    memory_evicted: int = 0
    memory_evicted_tokens: int = 0
    memory_refused: int = 0
    memory_refused_tokens: int = 0
    # spilled results read back (the agent reads the whole result back by its handle,
    # read_spill, in the turn it spilled: the tokens that came back); results refused
    # (the ledger's note in their place: the agent does not ask again), their tokens
    read_back: int = 0
    read_back_tokens: int = 0
    results_refused: int = 0
    results_refused_tokens: int = 0


@dataclass
class Result:
    naive: Counts = field(default_factory=Counts)
    ledger: Counts = field(default_factory=Counts)
    off: Counts | None = None  # the ledger without its rule (ledger/fleet/variants.py)
    calls: int = 0
    session_ids: list[str] = field(default_factory=list)


@dataclass
class Reaction:
    """The agent's side, the same under every arbiter: which tool call it makes in a
    turn. A result that came back cut is asked for again on the next turn (the agent
    lacks it), at most REPEATS times; a prompt without its permission paragraph lets
    the forbidden read through; otherwise the turn's own tool call, if any."""

    cut: int = 0  # tokens of the result that came back cut (0: none)
    tries: int = 0  # times that call was made

    def call(self, p: TurnPlan, clause: bool, c: Counts) -> int:
        if self.cut:
            c.repeated_calls += 1  # lacking the result, the agent asks again
            return self.cut
        if not clause:
            c.forbidden_calls += 1  # nothing in the prompt forbids it any more
            return FORBIDDEN
        return p.tool

    def got(self, tokens: int, whole: bool) -> None:
        """The call's result arrived whole (or spilled: the agent has its handle), or cut."""
        if whole:
            self.cut, self.tries = 0, 0
            return
        self.tries += 1
        self.cut = tokens if self.tries <= REPEATS else 0
        if not self.cut:
            self.tries = 0  # the agent gives up on it


def run_naive(turns: tuple[TurnPlan, ...], c: Counts) -> None:
    b = BUDGET
    system, memory = b.system_prompt, 0
    results: list[int] = []  # the scratchpad, oldest first
    agent = Reaction()

    def room() -> int:
        return b.window - b.output_reserve - b.tool_framing - system - memory - sum(results)

    def take(tokens: int) -> bool:
        """Admit a result; False when it had to be truncated."""
        nonlocal memory, system
        if tokens > room():
            c.memory_evicted += -(-memory // CHUNK)  # a chunk cut counts
            c.memory_evicted_tokens += memory
            memory = 0  # memory goes first
        if tokens > room() and system == b.system_prompt:
            system -= CLAUSE  # "redundant boilerplate": the permission paragraph
            c.compression_events += 1
        if tokens <= room():
            results.append(tokens)
            c.admitted_whole += 1
            return True
        results.append(max(0, room()))  # cut mid-JSON
        c.truncated += 1
        return False

    for p in turns:
        memory = min(p.chunks * CHUNK, max(0, room()))  # memory is slack: what fits
        c.memory_refused += p.chunks - memory // CHUNK  # chunks not admitted whole
        c.memory_refused_tokens += p.chunks * CHUNK - memory
        if system < b.system_prompt and room() >= CLAUSE:
            system = b.system_prompt  # room to spare: the full prompt is back
        clause = system == b.system_prompt
        c.damaged_turns += not clause
        tokens = agent.call(p, clause, c)
        if tokens:
            agent.got(tokens, take(tokens))
        del results[: max(0, len(results) - KEEP_RESULTS)]


def run_ledger(agent: SimAgent, turns: tuple[TurnPlan, ...], c: Counts, rule: bool = True) -> None:
    """The same pipeline and the same agent; without the rule a result that does not
    fit is truncated (its head admitted) instead of spilled."""
    results: list[Doc] = []
    memory: list[Doc] = []
    react = Reaction()
    whole = True  # the system prompt held its permission paragraph at the last turn
    for p in turns:
        t = agent.begin(2_000)
        gone = {i for _, i in (*t.reclaimed, *t.dropped)}
        results = [r for r in results if r.id not in gone]
        agent.release([m for m in memory if m.id not in gone])
        got = agent.admit(RET, [Doc(f"m{p.turn}-{k}", CHUNK) for k in range(p.chunks)])
        memory = list(got.kept)
        if got.refused:
            c.refusals += 1  # memory, the only elastic source, is what gives way
            c.memory_refused += len(got.refused)
            c.memory_refused_tokens += sum(d.tokens for d in got.refused)
        # read back from the ledger: the system prompt is a reserved floor, so it holds its
        # permission paragraph on every turn, unless that rule is gone (the rule tests)
        clause = agent.snapshot().system_prompt >= BUDGET.system_prompt
        c.compression_events += whole and not clause
        c.damaged_turns += not clause
        whole = clause
        tokens = react.call(p, clause, c)
        if tokens and not rule:
            head = _truncating(agent, Doc(f"tool{p.turn}", tokens), c)
            results += [head] if head.tokens else []
            react.got(tokens, head.tokens >= tokens)
        elif tokens:
            try:
                res = agent.tool_result(Doc(f"tool{p.turn}", tokens))
            except AdmissionRefused:
                c.refusals += 1
                c.results_refused += 1
                c.results_refused_tokens += tokens
            else:
                c.results_refused += res.refused
                c.results_refused_tokens += tokens if res.refused else 0
                c.memory_evicted += len(res.evicted)
                c.memory_evicted_tokens += sum(d.tokens for d in res.evicted)
                if res.spilled:
                    c.spilled += 1
                    _read_back(agent, res.handle, c)
                elif res.charged == tokens:
                    c.admitted_whole += 1
                cut = res.charged < tokens and not res.spilled and not res.refused
                c.truncated += cut  # never: admitted whole, spilled, or refused with a note
                react.got(tokens, not cut)
                memory = [m for m in memory if m not in res.evicted]
                results.append(res.result)
        drop = results[: max(0, len(results) - KEEP_RESULTS)]
        agent.release(drop)
        results = results[len(drop) :]
        agent.end(max(1, agent.snapshot().occupancy))


def _read_back(agent: SimAgent, handle: str | None, c: Counts) -> None:
    """The agent works from a spilled result: it reads the whole of it back by its
    handle (outside the prompt), once; counted by the tokens that came back."""
    text = agent.agent.read_spill(handle) if handle else None
    if text is not None:
        c.read_back += 1
        c.read_back_tokens += len(text)  # one token a character (the demo's counter)


def _truncating(agent: SimAgent, doc: Doc, c: Counts) -> Doc:
    """A tool result admitted by its head: what fits is kept, the rest is cut."""
    head = Doc(doc.id, max(0, min(doc.tokens, agent.snapshot().free)))
    if head.tokens and not agent.admit(Consumer.SCRATCHPAD, [head]).kept:
        head = Doc(doc.id, 0)
    if head.tokens >= doc.tokens:
        c.admitted_whole += 1
    else:
        c.truncated += 1
    return head


def run(
    ledger: Ledger, seed: int, tag: str, rule: bool = True, off: bool = True, clock: Clock = REAL
) -> Result:
    """Naive and ledger (`rule`: with its rule) on each session; `off`: the ledger
    without its rule too. The ledger's agents wait in `clock`: on a stepped clock
    (``ledger.fleet.run``) a compaction their turns request is done by the next wait
    after it, however loaded the machine is."""
    out = Result(off=Counts() if off else None)
    for i in range(SESSIONS):
        turns = plan(seed, i)
        run_naive(turns, out.naive)
        for with_rule, counts in ((rule, out.ledger), (False, out.off)):
            if counts is None:
                continue
            sid = f"truncation-{seed}-{i}{'' if with_rule else '-off'}@{tag}"
            agent = SimAgent(ledger, sid, BUDGET, clock=clock)
            run_ledger(agent, turns, counts, with_rule)
            out.calls += agent.calls
            out.session_ids.append(sid)
    return out
