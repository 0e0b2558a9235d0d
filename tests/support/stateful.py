"""What the stateful property tests share: a recorded call, a state machine that drives
one ledger session beside a Python model and compares every outcome, and its runner."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from ledger import Ledger, Session
from tests.conftest import make_settings

Outcome = Any  # a result dataclass, or a tuple for a refusal or an error


@dataclass(frozen=True)
class Op:
    """One ledger call: its kind, op id and arguments (what the fingerprint covers)."""

    kind: str
    op_id: str
    args: tuple[Any, ...]


class ModelMachine(RuleBasedStateMachine):
    """One fresh session (fresh key prefix) per example, on the backend at `url`. A
    subclass sets self.session and self.model (with ``apply(op) -> Outcome``) in its
    initialize rule, and defines send(); do() then checks each call against the model."""

    url = "embedded://"

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger.from_settings(make_settings(self.url))
        self.session: Session | None = None
        self.model: Any = None
        self.history: list[Op] = []
        self.ops = 0

    def teardown(self) -> None:
        self.ledger.close()

    def new_op_id(self) -> str:
        self.ops += 1
        return f"op-{self.ops}"

    def send(self, op: Op) -> Outcome:
        raise NotImplementedError

    def same(self, actual: Outcome, expected: Outcome) -> bool:
        return bool(actual == expected)

    def seen(self, op: Op, actual: Outcome) -> None:
        """After a call agreed with the model."""

    def do(self, op: Op) -> Outcome:
        assert self.session is not None and self.model is not None
        expected = self.model.apply(op)
        actual = self.send(op)
        assert self.same(actual, expected), f"{op}: ledger gave {actual!r}, model says {expected!r}"
        self.seen(op, actual)
        self.history.append(op)
        return actual


def run_machine(machine: type[ModelMachine], url: str, max_examples: int, steps: int) -> None:
    run_state_machine_as_test(
        type("Machine", (machine,), {"url": url}),
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            # the same examples on every run (CI is reproducible); a search with fresh
            # random examples is `HYPOTHESIS_RANDOM=1 pytest tests/test_properties_rules.py`
            derandomize=not os.environ.get("HYPOTHESIS_RANDOM"),
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
