"""The naive arbiter: what people build today, short and honest.

It judges every admission by total utilization only, truncates to fit, and
compacts when occupancy passes the high-water mark. Working memory has no claim
of its own: it gets whatever is left. Parallel tool results of one turn are each
judged by the worker that received them against the total it read (no atomic
check-and-charge across workers). When even an emptied memory cannot make room,
it truncates the tool result and, as in record 002, "compresses" the system
prompt's boilerplate. It uses the same summarizer as the ledger's worker and
never checks its result. Nothing here is made worse on purpose; the oracle counts
(``silent_starvation``, ``failed_compactions``, ``over_allocations``) measure what
the arbiter itself cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ledger.fleet.workload import SYSTEM_BOILERPLATE, SessionPlan, TurnPlan
from ledger.models import Consumer, HeldItem, SessionBudget
from workers.compactors import CompactionRequest, Compactor

WM, RET, SCR = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL, Consumer.SCRATCHPAD


@dataclass
class NaiveSession:
    budget: SessionBudget
    plan: SessionPlan
    compactor: Compactor
    system: int = 0
    items: list[HeldItem] = field(default_factory=list)  # oldest first
    counts: dict[str, int] = field(default_factory=dict)
    retrieval_by_turn: dict[int, float] = field(default_factory=dict)  # share admitted
    residual_by_turn: dict[int, int] = field(default_factory=dict)
    seq: int = 0

    def __post_init__(self) -> None:
        self.system = self.budget.system_prompt

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _add(self, c: Consumer, item: str, tokens: int, turn: int) -> None:
        self.seq += 1
        self.items.append(HeldItem(c, item, tokens, turn, 0, self.seq))

    def held(self, *consumers: Consumer) -> int:
        return sum(i.tokens for i in self.items if i.consumer in consumers)

    def used(self) -> int:
        return self.system + self.budget.tool_framing + sum(i.tokens for i in self.items)

    def room(self) -> int:
        return self.budget.window - self.budget.output_reserve - self.used()

    def _evict_oldest(self, *consumers: Consumer) -> bool:
        for i, it in enumerate(self.items):
            if it.consumer in consumers:
                del self.items[i]
                return True
        return False

    def turn(self, p: TurnPlan) -> None:
        b = self.budget
        self._add(WM, f"t{p.turn}", p.message, p.turn)
        while self.room() < 0 and self._evict_oldest(RET, SCR):  # loud: evict the oldest
            pass
        # Oracle: record 000's residual against the working set; the arbiter never looks.
        residual = b.window - self.system - b.tool_framing - b.output_reserve - self.held(RET, SCR)
        self.residual_by_turn[p.turn] = residual
        need = max(p.working_set, self.held(WM))  # the same requirement the ledger gates on
        if residual < need and self.used() < b.eviction_tokens:
            self._count("silent_starvation")
        admitted = 0
        for k, c in enumerate(p.chunks):  # feasibility on the current occupancy only
            if c <= self.room():
                self._add(RET, f"c{p.turn}-{k}", c, p.turn)
                admitted += c
        self.retrieval_by_turn[p.turn] = admitted / sum(p.chunks) if p.chunks else 1.0
        snapshot_room = self.room()  # each parallel result is judged against this reading
        for k, t in enumerate(p.tools):
            name = f"tool{p.turn}-{k}"
            if t <= snapshot_room:
                self._add(SCR, name, t, p.turn)
                continue
            self.items = [i for i in self.items if i.consumer is not RET]  # memory goes first
            if t <= self.room():
                self._add(SCR, name, t, p.turn)
                continue
            if self.room() < b.spill_preview_tokens and self.system == b.system_prompt:
                self.system -= SYSTEM_BOILERPLATE  # "compress" the system prompt to fit
                self._count("system_prompt_compressions")
            self._add(SCR, name, max(0, self.room()), p.turn)  # truncated mid-result
            self._count("truncated_tool_results")
        if self.room() < 0:
            self._count("over_allocations")
        if self.system < b.system_prompt:
            self._count("system_prompt_damage")  # turns run with a damaged system prompt
        if self.used() > b.high_water_tokens:
            self._compact(p.turn)

    def _compact(self, turn: int) -> None:
        plan = self.compactor(
            CompactionRequest(
                self.plan.session_id,
                1,
                turn,
                tuple(self.items),
                self.used(),
                self.budget.high_water_tokens,
                self.budget.window,
            )
        )
        if not plan.replaced:
            return
        gone = set(plan.replaced)
        self.items = [i for i in self.items if (i.consumer, i.id) not in gone]
        if plan.summary is not None:
            self._add(WM, plan.summary.id, plan.summary.tokens, turn)
        self._count("compactions")
        if self.used() > self.budget.high_water_tokens:
            self._count("failed_compactions")  # the arbiter does not check: silent


def run_session(budget: SessionBudget, plan: SessionPlan, compactor: Compactor) -> NaiveSession:
    s = NaiveSession(budget, plan, compactor)
    for p in plan.turns:
        s.turn(p)
    return s
