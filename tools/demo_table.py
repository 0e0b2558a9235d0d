"""Print docs/demo.md's per-seed table from the JSON of ``ledger demo --json`` runs.

``python tools/demo_table.py seed_1.json seed_2.json large_1.json`` (a script of the
repository, not shipped in the wheel) prints one markdown table, one column per file in
the order given, headed by its run's configuration ("default, seed N" or "--large, seed
N"). Every figure is read from the files: a row whose figures no file has (a scenario
left out with ``--only``) is dropped, and a cell whose figure its file lacks reads "—".
Rates carry their n (sessions/turns) where the JSON has it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledger.fleet.run import CHECKPOINTS, DEFAULT_SESSIONS, LARGE_SESSIONS

J = dict[str, Any]


def header(d: J) -> str:
    c = d["config"]
    size = {DEFAULT_SESSIONS: "default", LARGE_SESSIONS: "--large"}.get(
        c["sessions"], f"--sessions {c['sessions']}"
    )
    return f"{size}, seed {c['seed']}" + (f", without {c['without']}" if c["without"] else "")


def rates(column: str) -> Callable[[J], str]:
    """Retrieval admission at each checkpoint turn, each with its sessions/turns."""

    def at(r: J) -> str:
        return "n/a" if r["rate"] is None else "{rate:.2f} ({sessions}/{turns})".format(**r)

    return lambda d: " / ".join(at(d[column]["retrieval_admission"][str(t)]) for t in CHECKPOINTS)


def refusals(column: str, suffix: str = "") -> Callable[[J], str]:
    def cell(d: J) -> str:
        counts = sorted(d[column]["retrieval_refusals"].items())
        return (", ".join(f"{v} `{k}`" for k, v in counts) or "none") + suffix.format_map(d)

    return cell


def released(d: J) -> str:
    loose = sorted(d["naive"]["starvation"]["released_each_turn"].items())
    return ", ".join(f"{c} {x['short_turns']} ({x['short_regular_steps']})" for c, x in loose)


def passed(d: J) -> str:
    checks = d["acceptance"].values()
    return f"{sum(1 for c in checks if c['pass'])}/{len(checks)}"


def fan(column: str, suffix: str = "") -> Callable[[J], str]:
    """Medians over sessions, turns 1-10 → 51-60 (the ratio's peak: median / p90 over
    sessions), and the p99 of those turns pooled."""

    def cell(d: J) -> str:
        a = d[column]["fanout"]
        pk = a["ratio_peak"]
        return (
            f"{a['spans_first']:.1f} → {a['spans_last']:.1f}; {a['ratio_first']:.1f} → "
            f"{a['ratio_last']:.1f} (peak {pk['median']:.1f} / {pk['p90']:.1f}); "
            f"{a['utilization_first']:.2f} → {a['utilization_last']:.2f}; "
            f"{a['p99_first_ms'] / 1000:.1f} → {a['p99_last_ms'] / 1000:.1f} s"
        ) + suffix.format_map(d)

    return cell


def forgot(column: str) -> Callable[[J], str]:
    """000: repeats / tool calls again / syntheses finished, each count's per-session
    median and p90."""

    def cell(d: J) -> str:
        a = d[column]["starvation"]
        per = a["per_session"]
        rep, again = per["repeated"], per["reissued"]
        return (
            f"{a['repeated']} ({rep['median']:.0f}, {rep['p90']:.0f}) / {a['reissued']} "
            f"({again['median']:.0f}, {again['p90']:.0f}) / "
            f"{a['syntheses_finished']} of {a['syntheses']}"
        )

    return cell


def of(column: str, fmt: str) -> str:
    """``fmt``'s fields ``{c[...]}`` read from this column (naive, ledger, off)."""
    return fmt.replace("{c[", "{" + column + "[")


RESET = (
    "{c[cure_costs][resets]} ({c[cure_costs][reset_sessions]}); "
    "{c[cure_costs][discarded_tokens][median]:.0f} / {c[cure_costs][discarded_tokens][p90]:.0f}"
)
WAIT = "{c[cure_costs][waited_turns]} ({c[cure_costs][waited_ms_total]:.0f} ms)"
MEM = (
    "{c[truncation_loop][memory_evicted]} / {c[truncation_loop][memory_refused]} / "
    "{c[truncation_loop][read_back]} ({c[truncation_loop][read_back_tokens]}) / "
    "{c[truncation_loop][results_refused]}"
)
IV = "{c[compaction_interval][early]:.1f} / {c[compaction_interval][late]:.1f}"
SLO = "{c[slo][over_share]:.2%} of {c[turns]} (p95 {c[slo][p95_ms]:.0f} ms)"
TRUNC = "{c[truncation_loop][compression_events]} / {c[truncation_loop][truncated]} / "
TRUNC += "{c[truncation_loop][repeated_calls]}"
# (row label, cell): a format string over one run's JSON, or a function of it; a missing
# key (KeyError) or a null figure (TypeError, ValueError): the cell is not there
ROWS: list[tuple[str, str | Callable[[J], str]]] = [
    (
        "001 fleet sessions + tail sessions (alive at turn 120, the tail included)",
        "{ledger[sessions]} + {ledger[tail_sessions]} ({ledger[sessions_at_120]})",
    ),
    ("001 retrieval @10/60/120 (sessions/turns), naive", rates("naive")),
    ("001 retrieval @10/60/120 (sessions/turns), ledger", rates("ledger")),
    ("001 retrieval @10/60/120 (sessions/turns), without compaction credit", rates("off")),
    ("001 compaction interval early / late, naive", of("naive", IV)),
    ("001 compaction interval early / late, ledger", of("ledger", IV)),
    ("001 compaction interval early / late, without credit", of("off", IV)),
    (
        "001 post-compaction occupancy first / late, naive",
        "{naive[post_compaction_occupancy][first]:.2f} / "
        "{naive[post_compaction_occupancy][late]:.2f}",
    ),
    (
        "001 retrieval refusals, naive (headroom min)",
        refusals("naive", " ({naive[refusal_latency_headroom_ms][min]:.0f} ms)"),
    ),
    ("001 retrieval refusals, ledger", refusals("ledger")),
    ("001 retrieval refusals, without credit", refusals("off")),
    ("001 turns over 900 ms, naive", of("naive", SLO)),
    (
        "001 turns over 900 ms, ledger (not a compaction or reset turn)",
        of("ledger", SLO) + " ({ledger[slo][over_not_compaction_or_reset]})",
    ),
    ("001 hard resets: ledger / without credit", "{ledger[resets]} / {off[resets]}"),
    (
        "001 ledger: resets (sessions); tokens each discarded, median / p90 (tail included)",
        of("ledger", RESET),
    ),
    ("001 turns waiting for a compaction at a begin (in all), ledger", of("ledger", WAIT)),
    ("001 ... without credit", of("off", WAIT)),
    (
        "001 retrieval tokens refused: ledger / without credit",
        "{ledger[cure_costs][retrieval_refused_tokens]} / "
        "{off[cure_costs][retrieval_refused_tokens]}",
    ),
    (
        "001 naive synchronous compactions: turns (share of latency)",
        "{naive[cure_costs][sync_compaction_turns]} "
        "({naive[cure_costs][sync_compaction_latency_share]:.1%})",
    ),
    (
        "000 short of the working set after turn 5: naive (silent) / ledger / without",
        "{naive[starvation][short_turns]} / {ledger[starvation][short_turns]} / "
        "{off[starvation][short_turns]} of {ledger[starvation][turns_after_5]}",
    ),
    ("000 naive, one consumer released each turn: short (regular steps among them)", released),
    (
        "000 naive utilization; residual vs working set",
        "{naive[starvation][utilization][0]:.2f}-{naive[starvation][utilization][1]:.2f}; "
        "{naive[starvation][residual_mean]:.0f} vs {naive[starvation][working_set_mean]:.0f}",
    ),
    (
        "000 ledger reclaimed scratchpad, retrieval; of the turn before, fetched again (tokens)",
        "{ledger[starvation][reclaimed_scratchpad]}, {ledger[starvation][reclaimed_retrieval]}; "
        "{ledger[starvation][fetched_again]} ({ledger[starvation][fetched_again_tokens]})",
    ),
    (
        "000 repeats / tool calls again (median, p90 a session) / syntheses finished, naive",
        forgot("naive"),
    ),
    ("000 ... ledger", forgot("ledger")),
    ("000 ... without a declared working set", forgot("off")),
    (
        "002 compressions / truncations / repeats (forbidden calls): naive",
        of("naive", TRUNC) + " ({naive[truncation_loop][forbidden_calls]})",
    ),
    (
        "002 ... ledger (spilled, refused)",
        of("ledger", TRUNC)
        + " ({ledger[truncation_loop][spilled]}, {ledger[truncation_loop][refusals]})",
    ),
    ("002 ... without spill", of("off", TRUNC)),
    (
        "002 memory chunks evicted / not admitted / read back (tokens) / refused, naive",
        of("naive", MEM),
    ),
    ("002 ... ledger", of("ledger", MEM)),
    ("002 ... without spill", of("off", MEM)),
    (
        "002 damaged turns (forbidden calls): naive / ledger",
        "{naive[truncation_loop][damaged_turns]} ({naive[truncation_loop][forbidden_calls]}) / "
        "{ledger[truncation_loop][damaged_turns]} ({ledger[truncation_loop][forbidden_calls]})",
    ),
    (
        "004 spans; ratio (peak median / p90); utilization; p99, naive",
        fan("naive", "; alerts {naive[fanout][alerts]}"),
    ),
    ("004 ... ledger", fan("ledger", "; guard in {ledger[fanout][guard_stops]} turns")),
    (
        "004 ledger: the guard's summarize spans, median ms, share of those turns' latency",
        "{ledger[fanout][cure_costs][guard_summarize][spans]}, "
        "{ledger[fanout][cure_costs][guard_summarize][ms][median]:.0f} ms, "
        "{ledger[fanout][cure_costs][guard_summarize][latency_share]:.1%}",
    ),
    ("004 ... without the guard", fan("off")),
    (
        "004 ledger: turns from ratio > 3 to fragmentation; sessions pathological / past 8",
        "{ledger[fanout][fragmentation_lag_min]}-{ledger[fanout][fragmentation_lag_max]}; "
        "{ledger[fanout][sessions_pathological]} / {ledger[fanout][sessions_over_8]}",
    ),
    ("audits clean; over-allocations", "{audits_clean}/{audits_total}; {over_allocations}"),
    ("acceptance checks passed", passed),
    ("wall time (the run's `elapsed_s`)", "{elapsed_s:.0f} s"),
]


def cell(make: str | Callable[[J], str], d: J) -> str | None:
    try:
        return make.format_map(d) if isinstance(make, str) else make(d)
    except (KeyError, TypeError, ValueError):
        return None


def render(runs: list[J]) -> str:
    """The markdown table of these runs' figures, one column per run."""
    out = ["| | " + " | ".join(map(header, runs)) + " |", "|---" * (len(runs) + 1) + "|"]
    for label, make in ROWS:
        cells = [cell(make, d) for d in runs]
        if any(c is not None for c in cells):
            out.append(f"| {label} | " + " | ".join(c or "—" for c in cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python tools/demo_table.py RUN.json [RUN.json ...]", file=sys.stderr)
        return 2
    print(render([json.loads(Path(p).read_text()) for p in argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
