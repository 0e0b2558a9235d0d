"""The demo's summary (:func:`ledger.fleet.report.summarize`) as rows, one a measure: one
wide table, or blocks of text for a narrow terminal, and the footer under either."""

from __future__ import annotations

import math
import textwrap
from typing import Any

from rich.table import Table

from ledger.fleet.run import CHECKPOINTS, WINDOW_TURNS


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _rate(a: dict[str, Any], turn: int) -> str:
    c = a["retrieval_admission"][str(turn)]
    if c["rate"] is None:
        return "n/a (no session that long)"
    return f"{c['rate']:.2f} ({c['sessions']} sessions, {c['turns']} turns)"


COLUMNS = (
    "scenario",
    "measure",
    "the record's figures",
    "naive arbiter",
    "ledger",
    "ledger without its rule",
)
Row = tuple[str, str, str, str, str, str]


def _refusals(a: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(a["retrieval_refusals"].items())) or "none"


def _interval(a: dict[str, Any]) -> str:
    iv = a["compaction_interval"]
    same = iv["same_sessions"]
    return (
        f"{_f(iv['early'], '.1f')} ({iv['early_compactions']} compactions, "
        f"{iv['early_sessions']} sessions) / {_f(iv['late'], '.1f')} "
        f"({iv['late_compactions']} compactions, {iv['late_sessions']} sessions); the "
        f"{same['early']['sessions']} sessions alive at turn 120, median of each one's: "
        f"{_f(same['early']['median'], '.1f')} / {_f(same['late']['median'], '.1f')}"
    )


def _post(a: dict[str, Any]) -> str:
    post = a["post_compaction_occupancy"]
    first, late = post["first_sessions"], post["late_sessions"]
    return (
        f"{_f(post['first'])} (mean of {first['sessions']} sessions' first; median "
        f"{_f(first['median'])}, p90 {_f(first['p90'])}) / {_f(post['late'])} "
        f"({post['late_compactions']} compactions of {late['sessions']} sessions; median "
        f"{_f(late['median'])}, p90 {_f(late['p90'])} a session)"
    )


def _slo(a: dict[str, Any]) -> str:
    slo = a["slo"]
    return (
        f"{100 * slo['over_share']:.2f}% (p95 {_f(slo['p95_ms'], '.0f')} ms; "
        f"{slo['turns']} turns of {slo['sessions']} sessions)"
    )


def _decay_rows(n: dict[str, Any], lg: dict[str, Any], o: dict[str, Any] | None) -> list[Row]:
    def off(f: Any) -> str:
        return f(o) if o else ""

    t: list[Row] = []
    rec_rates = {10: "0.91 -> 0.88-0.94", 60: "0.34 -> 0.88-0.94", 120: "0.07 -> 0.88-0.94"}
    for turn in CHECKPOINTS:
        t.append(
            (
                "001 compaction-decay" if turn == CHECKPOINTS[0] else "",
                f"turns with retrieval in the prompt, turn {turn}±{WINDOW_TURNS}",
                rec_rates[turn],
                _rate(n, turn),
                _rate(lg, turn),
                _rate(o, turn) if o else "",
            )
        )

    def lowest(a: dict[str, Any]) -> str:
        low = a["retrieval_min"]
        if low is None:
            return "n/a"
        return f"{low['rate']:.2f} (turn {low['turn']}, {low['sessions']} sessions alive)"

    t.append(
        (
            "",
            "lowest of those, any turn with 10+ sessions alive",
            "0.07 -> 0.88 (the cure holds throughout)",
            lowest(n),
            lowest(lg),
            off(lowest),
        )
    )
    t.append(
        (
            "",
            "compaction interval, early / after turn 80 (turns)",
            "~9 / ~3 -> ~18",
            _interval(n),
            _interval(lg),
            off(_interval),
        )
    )
    t.append(
        (
            "",
            "occupancy after compaction, first / late (window)",
            "creeps upward",
            _post(n),
            _post(lg),
            off(_post),
        )
    )
    head = n["refusal_latency_headroom_ms"]
    t.append(
        (
            "",
            "retrieval refusals (reason)",
            "token_budget_exhausted with ~180 ms headroom -> compaction_pending",
            _refusals(n)
            + (f"; headroom >= {head['min']:.0f} ms ({head['refusals']} refusals)" if head else ""),
            _refusals(lg),
            off(_refusals),
        )
    )
    t.append(
        (
            "",
            "turns over the 900 ms SLO",
            "none (p95 780-860) -> ~1.4%, the reset turns",
            _slo(n),
            f"{_slo(lg)}; {lg['slo']['over_not_compaction_or_reset']} not a compaction "
            "or reset turn",
            off(_slo),
        )
    )
    t.append(
        (
            "",
            "hard resets / failed compactions",
            "escalate after 3 failures",
            f"0 / {n['compactions']} compactions never checked",
            f"{lg['resets']} (in {lg['reset_sessions']} of {lg['sessions']} sessions) / "
            f"{lg['failed_compactions']}",
            off(lambda a: f"{a['resets']} (in {a['reset_sessions']} sessions) / none judged"),
        )
    )
    if "cure_costs" in lg:
        t.append(
            (
                "",
                "what the cure cost: context hard resets discarded; turns that waited for "
                "a compaction; retrieval refused (naive: its synchronous compactions)",
                "",
                _sync(n),
                _cure(lg),
                off(_cure),
            )
        )
    return t


def _cure(a: dict[str, Any]) -> str:
    """Scenario 001's costs of the cure (every session's, the tail's too)."""
    c = a["cure_costs"]
    tok, items, w = c["discarded_tokens"], c["discarded_items"], c["waited_ms"]
    return (
        f"{c['resets']} resets (in {c['reset_sessions']} of {c['sessions']} sessions) "
        f"discarded median {_f(tok['median'], '.0f')}, p90 {_f(tok['p90'], '.0f')} tokens, "
        f"{_f(items['median'], '.0f')} / {_f(items['p90'], '.0f')} items; "
        f"{c['waited_turns']} of {c['turns']} turns waited at their begin, "
        f"{c['waited_ms_total'] / 1000:.1f} s in all (p90 {_f(w['p90'], '.0f')} ms); "
        f"retrieval refused {c['retrieval_refused_tokens']} tokens in "
        f"{c['retrieval_refused_turns']} turns"
    )


def _sync(a: dict[str, Any]) -> str:
    c = a["cure_costs"]
    ms = c["sync_compaction_ms"]
    return (
        f"{c['sync_compaction_turns']} of {c['turns']} turns ran a compaction, "
        f"{c['sync_compaction_ms_total'] / 1000:.1f} s in all (median "
        f"{_f(ms['median'], '.0f')}, p90 {_f(ms['p90'], '.0f')} ms), "
        f"{100 * (c['sync_compaction_latency_share'] or 0):.1f}% of their latency"
    )


def _per(x: dict[str, Any], fmt: str = ".0f") -> str:
    return f"median {_f(x['median'], fmt)}, p90 {_f(x['p90'], fmt)} a session"


def _forgot(a: dict[str, Any]) -> str:
    """Repetitions; tool calls issued again; syntheses finished, with their spreads."""
    per = a["per_session"]
    return (
        f"{a['repeated']} repeats ({_per(per['repeated'])}); {a['reissued']} tool calls "
        f"again ({_per(per['reissued'])}; {a['reissued_tokens']} tokens, in "
        f"{a['turns_again']} turns); syntheses finished {a['syntheses_finished']}/"
        f"{a['syntheses']} (unfinished share {_per(per['unfinished_share'], '.2f')})"
    )


def _starvation_rows(
    ns: dict[str, Any], ls: dict[str, Any], os_: dict[str, Any] | None
) -> list[Row]:
    loose = ns["released_each_turn"]
    return [
        (
            "000 starvation",
            f"turns after turn 5 short of their working set ({ns['sessions']} "
            f"sessions, {ns['turns_after_5']} turns)",
            "utilization 0.58-0.64, residual 2-3k vs ~6k",
            f"{ns['short_turns']}/{ns['turns_after_5']} silent (up to "
            f"{ns['longest_short_run']} in a row), utilization "
            f"{ns['utilization'][0]:.2f}-{ns['utilization'][1]:.2f}, residual "
            f"{ns['residual_mean']:.0f} vs {ns['working_set_mean']:.0f}; one consumer "
            "released each turn: "
            + ", ".join(
                f"{c} {x['short_turns']} ({x['short_regular_steps']} not a large step)"
                for c, x in sorted(ns["released_each_turn"].items())
            ),
            f"{ls['regimes'].get('starvation', 0)} classed starvation, "
            f"{ls['regimes'].get('loud', 0)} loud; reclaimed {ls['reclaimed_scratchpad']} "
            f"scratchpad then {ls['reclaimed_retrieval']} retrieval; residual >= working set "
            f"{ls['restored']}/{ls['turns_after_5']}",
            f"{os_['short_turns']}/{os_['turns_after_5']} short, residual "
            f"{os_['residual_mean']:.0f} vs {os_['working_set_mean']:.0f}, nothing reclaimed "
            "(no working set declared)"
            if os_
            else "",
        ),
        (
            "",
            f"repeats; tool calls again; syntheses finished ({ns['sessions']} sessions, "
            f"{ns['turns']} turns)",
            "re-derived facts, identical tool calls re-issued, a multi-step synthesis "
            "never completed",
            _forgot(ns)
            + "; one consumer released each turn: "
            + "; ".join(f"{c}: {_forgot(x)}" for c, x in sorted(loose.items())),
            _forgot(ls) + f"; reclaimed items of the turn before fetched again "
            f"{ls['fetched_again']} ({ls['fetched_again_tokens']} tokens; "
            f"{_per(ls['fetched_again_per_session'])})",
            _forgot(os_) if os_ else "",
        ),
    ]


def _truncation_rows(
    nt: dict[str, Any], lt: dict[str, Any], ot: dict[str, Any] | None
) -> list[Row]:
    return [
        (
            "002 truncation-loop",
            f"prompt compressions; truncated results; repeated calls ({nt['sessions']} "
            f"sessions, {nt['turns']} turns each column)",
            "a forbidden call gets through, its 20k result is cut, the call repeats",
            f"{nt['compression_events']}; {nt['truncated']}; {nt['repeated_calls']} "
            f"({nt['forbidden_calls']} forbidden calls)",
            f"{lt['compression_events']}; {lt['truncated']}; {lt['repeated_calls']} "
            f"(spilled {lt['spilled']}, refused {lt['refusals']})",
            f"{ot['compression_events']}; {ot['truncated']}; {ot['repeated_calls']} "
            "(truncating, not spilling)"
            if ot
            else "",
        ),
        (
            "",
            "what the cure cost: memory chunks evicted for a result; not admitted; "
            "spilled results read back; results refused (tokens)",
            "",
            _memory(nt),
            _memory(lt),
            _memory(ot) if ot else "",
        ),
    ]


def _memory(a: dict[str, Any]) -> str:
    return (
        f"{a['memory_evicted']} ({a['memory_evicted_tokens']}); {a['memory_refused']} "
        f"({a['memory_refused_tokens']}); {a['read_back']} ({a['read_back_tokens']}); "
        f"{a['results_refused']} ({a['results_refused_tokens']})"
    )


def _fan(a: dict[str, Any]) -> str:
    pk = a["ratio_peak"]
    return (
        f"{_f(a['spans_first'], '.1f')} -> {_f(a['spans_last'], '.1f')}; "
        f"{_f(a['ratio_first'], '.1f')} -> {_f(a['ratio_last'], '.1f')} (peak median "
        f"{_f(pk['median'], '.1f')}, p90 {_f(pk['p90'], '.1f')}); "
        f"{_f(a['utilization_first'])} -> {_f(a['utilization_last'])}; "
        f"{a['p99_first_ms'] / 1000:.1f} -> {a['p99_last_ms'] / 1000:.1f} s"
    )


def _summarize(a: dict[str, Any]) -> str:
    """What summarize-and-proceed cost: the summarize spans of the guard's turns."""
    g = a["cure_costs"]["guard_summarize"]
    return (
        f"their summarize spans {g['spans']}, {_f(g['ms']['median'], '.0f')} ms median, "
        f"{100 * (g['latency_share'] or 0):.1f}% of their latency"
    )


def _fanout_rows(nf: dict[str, Any], lf: dict[str, Any], of: dict[str, Any] | None) -> list[Row]:
    cls = ", ".join(f"{k}={v}" for k, v in sorted(lf["classes"].items()))
    ctl = ", ".join(f"{k}={v}" for k, v in sorted(lf["control_classes"].items()))
    early, late = nf["early"]["turns"], nf["late"]["turns"]
    return [
        (
            "004 fan-out",
            f"spans; ratio; utilization (medians over sessions); p99 latency (pooled), "
            f"turns {early[0]}-{early[1]} -> {late[0]}-{late[1]} ({nf['sessions']} sessions, "
            f"{nf['turns']} turns)",
            "4 -> 23; 1.3 -> 11.8; 0.61 -> 0.44; 3.1 -> 9.4 s",
            _fan(nf) + f"; gauge alerts {nf['alerts']}",
            _fan(lf)
            + f" (guard: {lf['guard_stops']} turns summarized and proceeded; "
            + _summarize(lf)
            + ")",
            _fan(of) if of else "",
        ),
        (
            "",
            f"classes; ratio 3 to fragmentation; pathological / past 8 ({lf['sessions']} sessions)",
            "fragmentation > 3, pathological > 8",
            "not measured",
            f"{cls}; fragmentation {lf['fragmentation_lag_min']}-"
            f"{lf['fragmentation_lag_max']} turns after; pathological "
            f"{lf['sessions_pathological']}/{lf['sessions_over_8']}; turn of ratio 3 / "
            "fragmentation / ratio 8 / pathological, median over the sessions that "
            "crossed: "
            + " / ".join(
                f"{_f(x['median'], '.0f')} (n={x['sessions']})"
                for x in lf["crossing_turns"].values()
            )
            + f"; control: {ctl}",
            f"{', '.join(f'{k}={v}' for k, v in sorted(of['classes'].items()))}; pathological "
            f"{of['sessions_pathological']}/{of['sessions_over_8']}"
            if of
            else "",
        ),
    ]


def rows(s: dict[str, Any]) -> list[Row]:
    """The demo's figures, one row per measure: the record's own figures (as the incident
    record gives them: not measured here), then what this run measured: the naive
    arbiter, the ledger, and the ledger without the scenario's rule."""
    n, lg, o = s["naive"], s["ledger"], s.get("off") or {}
    t: list[Row] = []
    if "retrieval_admission" in lg:
        t += _decay_rows(n, lg, o if "retrieval_admission" in o else None)
    for key, make in (
        ("starvation", _starvation_rows),
        ("truncation_loop", _truncation_rows),
        ("fanout", _fanout_rows),
    ):
        if key in lg:
            t += make(n[key], lg[key], o.get(key))
    t.append(
        (
            "all",
            "over-allocations; audits",
            "",
            "",
            f"{s['over_allocations']}; {s['audits_clean']}/{s['audits_total']} clean",
            "",
        )
    )
    return t


def title(s: dict[str, Any]) -> str:
    return (
        f"seed {s['config']['seed']}: each incident's figure, its naive arbiter, the ledger, "
        "the ledger without its rule"
    )


def table(s: dict[str, Any]) -> Table:
    """The rows as one wide table (a terminal of about 140 columns or more)."""
    t = Table(title=title(s))
    for name in COLUMNS:
        t.add_column(name, overflow="fold", style="bold" if name == "scenario" else None)
    for row in rows(s):
        t.add_row(*row)
    return t


def narrow(s: dict[str, Any], width: int = 80) -> str:
    """The rows as blocks for a narrow terminal: a heading per measure, then one line per
    column, wrapped at spaces only, so that no number is ever split across lines."""
    out = [textwrap.fill(title(s), width, break_long_words=False), ""]
    scenario = ""
    for row in rows(s):
        scenario = row[0] or scenario
        out.append(
            textwrap.fill(
                f"{scenario}: {row[1]}", width, subsequent_indent="    ", break_long_words=False
            )
        )
        for name, value in zip(COLUMNS[2:], row[2:], strict=True):
            if value:
                out.append(
                    textwrap.fill(
                        value,
                        width,
                        initial_indent=f"  {name}: ",
                        subsequent_indent="    ",
                        break_long_words=False,
                        break_on_hyphens=False,
                    )
                )
    return "\n".join(out)


def footer(s: dict[str, Any]) -> str:
    jobs = ", ".join(f"{k}={v:g}" for k, v in sorted(s["worker"].items()) if v)
    checks = s["acceptance"]
    missed = [k for k, v in checks.items() if not v["pass"]]
    misses = "; ".join(f"{k} ({checks[k]['measured']})" for k in missed)
    verdict = f"{len(checks) - len(missed)}/{len(checks)} checks pass" + (
        f"; missed: {misses}" if missed else ""
    )
    return (
        f"acceptance (docs/demo.md): {verdict}\n"
        f"ledger calls {s['ledger_calls']}; background worker: {jobs or 'no jobs'}; "
        f"{s['elapsed_s']:.1f} s on {s['backend']}"
    )
