"""Each rule the demo shows, taken out of the script where it lives: the scenario's
check fails.

The rule is removed from the packaged Lua text itself (the line after its
``-- rule: <name>`` marker in lua/), and the demo's agents and workers load
that text in place of the packaged script (FleetConfig.scripts): no demo flag, no
branch in the production script. Each test also runs the scenario with the packaged
scripts, where the same check passes, so the failure is the rule's absence and
nothing else. On a real redis-server (tests/support/servers.py starts it on a free port),
but scenario 001 on embedded: its agents loop without pausing, so on a Redis URL (OS
processes beside a worker thread, on the wall clock) whether a compaction lands before a
turn's begin gives up waiting for it depends on the machine's load; on embedded its
sessions run on the stepped clock (docs/demo.md#time-in-the-demo), the same figures
however loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ledger import scripts
from ledger.fleet import report, truncation
from ledger.fleet.run import FleetConfig, run
from tests.conftest import make_settings
from tests.support import servers


@pytest.fixture(autouse=True)
def _quiet_worker() -> None:
    logging.getLogger("ledger.worker").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Removal:
    script: str
    marker: str  # the rule's name in its script's `-- rule: <name>` comment
    old: str  # what the marked line says, once
    new: str  # what it says without the rule
    scenario: str
    check: str  # the scenario's check that must fail without the rule
    fleet: tuple[int, int] = (0, 0)  # 001: (sessions, tail sessions past turn 120)


def without(r: Removal) -> str:
    """The full text of `r.script` with the line after its rule's marker rewritten."""
    text = scripts.source(r.script)
    lines = text.split("\n")
    at = [i for i, line in enumerate(lines) if re.match(rf"\s*-- rule: {r.marker}\b", line)]
    assert len(at) == 1, f"{r.script}.lua: marker {r.marker!r} found {len(at)} times"
    line = lines[at[0] + 1]
    assert line.count(r.old) == 1, f"{r.script}.lua, after {r.marker}: {line!r}"
    lines[at[0] + 1] = line.replace(r.old, r.new)
    return "\n".join(lines)


# The system prompt gives up its permission paragraph when a tool result does not fit
# (what a naive allocator does): the floor taken out of admit_tool.
_TAKE_PARAGRAPH = (
    " local s0 = tonumber(redis.call('HGET', key, 'S'))"
    f" if tokens > H.fr + gain and s0 >= {truncation.BUDGET.system_prompt} then"
    f" H.fr = H.fr + {truncation.CLAUSE}"
    f" redis.call('HSET', key, 'S', s0 - {truncation.CLAUSE}, 'fr', H.fr) end"
)

REMOVALS = {
    # The hard post-condition: a compaction that leaves occupancy above H, or frees less
    # than the minimum gain, is a failure (retried, escalated to a hard reset). Without
    # it every summary that fits is taken: the summaries pile up and compactions thrash.
    "001 post-condition": Removal(
        "compact",
        "post-condition",
        "local ok = fits and judged <= H.HW and not deferred",
        "local ok = fits",
        "001",
        "001 ledger late compaction interval >= 0.7 x early",
        fleet=(8, 4),
    ),
    # The compaction charged before the turn's admissions: a begin that waits for a
    # pending compaction is refused until it lands (the agent waits, bounded). Without it
    # an autonomous agent's turns begin against the pending compaction, which its own
    # admissions then make fail: no retrieval while the last one failed.
    "001 pending-compaction credit": Removal(
        "begin_turn",
        "pending-compaction-credit",
        "if await == 1 and H.cd == 1 and not lands and not st then",
        "if false then",
        "001",
        "001 ledger retrieval admission",
        fleet=(8, 4),
    ),
    "000 working-set gate": Removal(
        "begin_turn",
        "working-set-gate",
        "if start_residual < need() then",
        "if false then",
        "000",
        "000 ledger classes starvation, reclaims, restores",
    ),
    "000 reclaim order": Removal(
        "begin_turn",
        "reclaim-order",
        "each_item('s', function(it) return take('s', it) end)",
        # retrieval first, then scratchpad
        "each_item('r', function(it) return take('r', it) end) "
        "each_item('s', function(it) return take('s', it) end)",
        "000",
        "000 ledger classes starvation, reclaims, restores",
    ),
    "002 floor": Removal(
        "admit_tool",
        "system-prompt-floor",
        "math.max(H.a_rm - held, H.F_rm)",
        "math.max(H.a_rm - held, H.F_rm)" + _TAKE_PARAGRAPH,
        "002",
        "002 ledger floor: no compression, no damaged turn, no forbidden call",
    ),
    "002 spill": Removal(
        "admit_tool",
        "spill",
        "size, outcome = math.min(tokens, H.pv), 'spilled'",
        "size = math.min(tokens, H.fr + gain)",  # the head that fits, admitted
        "002",
        "002 ledger no truncation, spills and refusals",
    ),
    "004 guard": Removal(
        "record_span",
        "fanout-guard",
        "if ratio > H.amp then",
        "if false then",
        "004",
        "004 ledger classes fragmentation, pathological, guard ~8",
    ),
}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with servers.standalone() as s:
        yield s.url


def _checks(url: str, config: FleetConfig) -> dict[str, dict[str, object]]:
    if config.only == frozenset({"001"}):
        url = f"embedded://{uuid.uuid4().hex}"  # the stepped clock (the module's docstring)
    summary = report.summarize(run(make_settings(url), config))
    assert summary["off"] is None  # no rule-off column: the ledger column is the point
    return summary["acceptance"]  # type: ignore[no-any-return]


@pytest.mark.redis
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(REMOVALS))
def test_rule_removed_where_it_lives_fails_its_check(name: str, redis_url: str) -> None:
    r = REMOVALS[name]
    base = FleetConfig(seed=1, only=frozenset({r.scenario}))
    if r.fleet != (0, 0):
        base = dataclasses.replace(base, sessions=r.fleet[0], tail=r.fleet[1])
    packaged = _checks(
        redis_url, dataclasses.replace(base, scripts={r.script: scripts.source(r.script)})
    )
    assert packaged[r.check]["pass"] is True, packaged[r.check]
    removed = _checks(redis_url, dataclasses.replace(base, scripts={r.script: without(r)}))
    assert removed[r.check]["pass"] is False, removed[r.check]


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.test_demo_rules [SEED ...]``: each rule's check, measured with the
    packaged scripts and with the rule taken out, per seed (the table in docs/demo.md)."""
    import sys

    logging.getLogger("ledger.worker").setLevel(logging.ERROR)
    seeds = [int(s) for s in (sys.argv[1:] if argv is None else argv)] or [1]
    with servers.standalone() as s:
        for name, r in sorted(REMOVALS.items()):
            for seed in seeds:
                base = FleetConfig(seed=seed, only=frozenset({r.scenario}))
                if r.fleet != (0, 0):
                    base = dataclasses.replace(base, sessions=r.fleet[0], tail=r.fleet[1])
                for label, text in (
                    ("packaged", scripts.source(r.script)),
                    ("removed", without(r)),
                ):
                    c = _checks(s.url, dataclasses.replace(base, scripts={r.script: text}))[r.check]
                    print(f"{name} | seed {seed} | {label}: {c['pass']} | {c['measured']}")


if __name__ == "__main__":
    main()
