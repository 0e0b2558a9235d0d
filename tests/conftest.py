"""Fixtures: one table of backends, turned into parametrized `ledger` fixtures.

embedded  fakeredis with Lua, in this process
redis     a real redis-server started on a free port for this test run
cluster   a real 3-primary Redis Cluster started for this test run
Each test gets a fresh key prefix (and, embedded, a fresh server), so no test
sees another's keys and nothing is ever flushed.

Below them, the fixtures that the files of one subject share (tests grouped by subject,
docs/contributing.md): the CLI tests' ``prefix``, the bad-input tests' ``session``, the
worker tests' ``led``. A test file's own fixture of the same name takes precedence.

Last, the qualities: ``QUALITIES`` gives every test file one or more of the markers that
pyproject.toml declares for what a test checks (``pytest -m fleet``, ``-m "contract and
not slow"``); tests/test_suite.py fails on a test file the table leaves out.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ledger import (
    AsyncLedger,
    Item,
    Ledger,
    LedgerSettings,
    Session,
    SessionBudget,
)
from tests.support import servers
from tests.support.bad_input import BUDGET, SID, state
from tests.support.servers import RedisProcess
from tests.support.worker_scenarios import new_ledger

BACKENDS = [
    pytest.param("embedded", marks=pytest.mark.embedded, id="embedded"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("cluster", marks=pytest.mark.cluster, id="cluster"),
]


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """The root logger as each test found it: `ledger worker` run in-process configures
    logging (``basicConfig(force=True)``, a JSON handler on the stderr pytest captured
    for that test), which would otherwise format every later test's log lines in that
    process, and write them to a closed stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[servers.RedisProcess]:
    with servers.standalone() as s:
        yield s


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[list[servers.RedisProcess]]:
    with servers.cluster(3) as nodes:
        yield nodes


def backend_url(request: pytest.FixtureRequest, kind: str) -> str:
    if kind == "embedded":
        return f"embedded://{uuid.uuid4().hex}"
    if kind == "redis":
        return request.getfixturevalue("redis_server").url
    nodes = request.getfixturevalue("redis_cluster")
    return f"redis+cluster://127.0.0.1:{nodes[0].port}"


def make_settings(url: str, **kw: object) -> LedgerSettings:
    return LedgerSettings(redis_url=url, prefix=f"t{uuid.uuid4().hex[:12]}", **kw)  # type: ignore[arg-type]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def settings(request: pytest.FixtureRequest, backend: str) -> LedgerSettings:
    return make_settings(backend_url(request, backend))


@pytest.fixture
def ledger(settings: LedgerSettings) -> Iterator[Ledger]:
    with Ledger.from_settings(settings) as led:
        yield led


@pytest.fixture
async def aledger(settings: LedgerSettings) -> AsyncIterator[AsyncLedger]:
    async with AsyncLedger.from_settings(settings) as led:
        yield led


@pytest.fixture
def budget() -> SessionBudget:
    """The truncation-loop scenario's pipeline (docs/demo.md): 32k window, 2.1k system prompt."""
    return SessionBudget(
        window=32_000,
        system_prompt=2_100,
        working_memory_floor=6_000,
        min_memory=0,
        tool_framing=150,
        output_reserve=1_024,
    )


def _open_many(led: Ledger, ids: list[str]) -> None:
    budget = SessionBudget(window=100_000, system_prompt=10)
    for i in range(0, len(ids), 100):
        led.run_many([led.open_call(sid, budget, None) for sid in ids[i : i + 100]])


@pytest.fixture
def prefix() -> str:
    return f"cli{uuid.uuid4().hex[:10]}"


@pytest.fixture
def session(ledger: Ledger) -> Session:
    """A session with items for two consumers and one open reservation."""
    s = ledger.open_session(SID, BUDGET)
    s.admit("retrieval", [Item("doc1", 400), Item("doc2", 300, priority=5)])
    s.admit("working_memory", [Item("turn1", 200)])
    s.reserve("scratchpad", "res1", 500, lease_ms=600_000)
    h, z = state(ledger, s)
    assert b"i:r:doc1" in h and b"r:res1" in h and len(z) == 1
    return s


@pytest.fixture
def led(redis_server: RedisProcess) -> Iterator[Ledger]:
    with new_ledger(redis_server) as ledger:
        yield ledger


# --- the qualities -----------------------------------------------------------------------

# What each test file checks: a quality (a marker declared in pyproject.toml) and the files
# (tests/test_<name>.py) whose every test it marks. A file has one quality or more.
QUALITIES: dict[str, str] = {
    "contract": """adapter_ceilings agent batch billing ceilings child_pools contract
        contract_async contract_model contract_once contract_reservations counting drift models
        order_index owner_token protocol recount reset_staged rules rules_amplification
        rules_compaction rules_starvation rules_tool_results smoke staging turn_agents
        turn_regressions turns two_call_turn""",
    "bad_input": "agent bad_input bad_input_scripts fuzz reset_staged",
    "security": "hardening owner_token reliability security",
    "property": "fuzz properties properties_rules",
    "fault": """cluster concurrency_lost_replies durability faults history reliability soak
        worker_faults worker_once worker_processes""",
    "concurrency": "cluster concurrency concurrency_lost_replies concurrency_race",
    "fleet": """agent_reset compaction demo_rules fleet fleet_async fleet_ceilings fleet_costs
        fleet_counting fleet_nopause fleet_turns two_call_turn upgrade""",
    "adapter": """adapter_ceilings adapters agent_reset async_adapters billing fleet_async
        fleet_ceilings fleet_counting fleet_turns langgraph_turns otel_turns""",
    "worker": """compaction fleet_nopause ownership recount soak staging worker_dead_letters
        worker_faults worker_in_process worker_lifecycle worker_loop worker_once
        worker_processes worker_reads worker_regressions""",
    "ops": """cli cli_audit cli_top compose deploy drift health replay_across_releases scope_ops
        upgrade views""",
    "docs": "demo_rules fleet layout protocol protocol_doc readme",
    "repo": """imports layout operations packaging protocol_doc schema scripts specs suite
        typing unasync""",
    "bench_smoke": "bench_full_smoke bench_smoke",
}


def qualities_of(path: Path) -> list[str]:
    """The qualities the table gives the test file at `path`."""
    subject = path.stem.removeprefix("test_")
    return [q for q, files in QUALITIES.items() if subject in files.split()]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for quality in qualities_of(item.path):
            item.add_marker(quality)
