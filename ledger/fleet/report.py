"""What the demo measured, per incident scenario: one summary (the JSON), the table and the plot."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from rich.table import Table

from ledger.extras import need
from ledger.fleet import decay, fanout, starvation, truncation
from ledger.fleet.checks import acceptance
from ledger.fleet.run import CHECKPOINTS, LARGE_SESSIONS, WINDOW_TURNS, DemoReport

EARLY, LATE = 40, 80  # compaction intervals: compactions before turn 40, from turn 80


# --- scenario 001 ------------------------------------------------------------------------


def _admission(runs: Sequence[decay.SessionRun], max_turn: int) -> tuple[list[float], list[int]]:
    got, alive = [0] * (max_turn + 1), [0] * (max_turn + 1)
    for run in runs:
        for r in run.records:
            alive[r.turn] += 1
            got[r.turn] += r.retrieval
    return [g / a if a else math.nan for g, a in zip(got, alive, strict=True)], alive


def _checkpoint(runs: Sequence[decay.SessionRun], turn: int) -> dict[str, Any]:
    """Fraction of turns within turn +- WINDOW_TURNS whose final prompt had retrieval."""
    rows = [r for run in runs for r in run.records if abs(r.turn - turn) <= WINDOW_TURNS]
    alive = sum(1 for run in runs if len(run.records) >= turn)
    rate = sum(r.retrieval for r in rows) / len(rows) if rows else None
    return {"rate": rate, "sessions": alive, "turns": len(rows)}


def _intervals(runs: Sequence[decay.SessionRun]) -> list[tuple[int, int]]:
    """(turn, turns since the previous compaction or the session's start) per compaction."""
    out = []
    for run in runs:
        last = 0
        for r in run.records:
            if r.compaction:
                out.append((r.turn, r.turn - last))
                last = r.turn
    return out


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def _decay_summary(runs: Sequence[decay.SessionRun], ledger: bool) -> dict[str, Any]:
    records = [r for run in runs for r in run.records]
    max_turn = max((r.turn for r in records), default=0)
    curve, alive = _admission(runs, max_turn)
    iv = _intervals(runs)
    firsts = [
        next(r.post_compaction for r in run.records if r.post_compaction is not None)
        for run in runs
        if any(r.post_compaction is not None for r in run.records)
    ]
    late_posts = [r.post_compaction for r in records if r.post_compaction and r.turn >= LATE]
    over = [r for r in records if r.over_slo]
    lat = sorted(r.latency_ms for r in records)
    refusals: Counter[str] = Counter()
    headroom = [r.headroom_ms for r in records if r.headroom_ms is not None]
    if ledger:
        for run in runs:
            for k, v in run.counts.items():
                if k.startswith("refused_"):
                    refusals[k.removeprefix("refused_")] += v
    else:
        refusals.update(r.refusal for r in records if r.refusal)
    pts = [(t, c) for t, c in enumerate(curve) if alive[t] and t >= CHECKPOINTS[0]]
    slope = None
    if len(pts) > 2:
        mt, mc = _mean(t for t, _ in pts) or 0.0, _mean(c for _, c in pts) or 0.0
        den = sum((t - mt) ** 2 for t, _ in pts)
        slope = 100 * sum((t - mt) * (c - mc) for t, c in pts) / den if den else 0.0
    early = _mean(d for t, d in iv if t < EARLY)
    late = _mean(d for t, d in iv if t >= LATE)
    w = decay.WINDOW
    first_post = _mean(firsts)
    late_post = _mean(late_posts)
    return {
        "retrieval_admission": {str(c): _checkpoint(runs, c) for c in CHECKPOINTS},
        "retrieval_trend_per_100_turns": slope,
        "retrieval_refusals": dict(refusals),
        "refusal_latency_headroom_ms": {"min": min(headroom), "median": statistics.median(headroom)}
        if headroom
        else None,
        "compactions": len(iv),
        "compaction_interval": {"early": early, "late": late},
        "post_compaction_occupancy": {
            "first": first_post / w if first_post else None,
            "late": late_post / w if late_post else None,
        },
        "slo": {
            "over_share": len(over) / len(records) if records else 0.0,
            "over_turns": len(over),
            "over_not_compaction_or_reset": sum(
                1 for r in over if not (r.compaction or r.reset or r.waited)
            ),
            "p95_ms": lat[int(0.95 * (len(lat) - 1))] if lat else None,
        },
        "resets": sum(r.reset for r in records),
        "turns": len(records),
        "sessions_at_120": sum(1 for run in runs if len(run.records) >= 120),
        "curve": {"retrieval": curve, "alive": alive, "interval": _interval_curve(iv, max_turn)},
    }


def _interval_curve(iv: Sequence[tuple[int, int]], max_turn: int) -> list[float]:
    """Mean interval of the compactions within +- WINDOW_TURNS of each turn."""
    out = []
    for t in range(max_turn + 1):
        near = [d for u, d in iv if abs(u - t) <= WINDOW_TURNS]
        out.append(statistics.fmean(near) if near else math.nan)
    return out


# --- scenarios 000, 002, 004 -----------------------------------------------------------


def _starvation(rows: Sequence[starvation.TurnRow], ledger: bool) -> dict[str, Any]:
    after = [r for r in rows if r.turn > 5]
    regimes = Counter(r.regime for r in after)
    short = [r for r in after if r.residual < r.working_set]
    out: dict[str, Any] = {
        "turns_after_5": len(after),
        "regimes": dict(regimes),
        "short_turns": len(short),
        "utilization": [min(r.utilization for r in after), max(r.utilization for r in after)],
        "residual_mean": _mean(r.residual for r in after),
        "working_set_mean": _mean(r.working_set for r in after),
    }
    if ledger:
        reclaimed = [r.reclaimed for r in after if r.reclaimed]
        out["reclaimed_scratchpad"] = sum(1 for x in reclaimed for i in x if i.startswith("s:"))
        out["reclaimed_retrieval"] = sum(1 for x in reclaimed for i in x if i.startswith("r:"))
        out["reclaim_order_ok"] = all(
            [i[0] for i in x] == sorted((i[0] for i in x), key="sr".index) for x in reclaimed
        )
        out["restored"] = sum(1 for r in after if r.residual >= r.working_set)
    return out


def _truncation(c: truncation.Counts) -> dict[str, Any]:
    return dict(c.__dict__)


def _fanout(rows: Sequence[fanout.TurnRow], ledger: bool) -> dict[str, Any]:
    def first(cond: Any) -> int | None:
        return next((r.turn for r in rows if cond(r)), None)

    sessions = fanout.SESSIONS
    per = len(rows) // sessions if sessions else 0
    first_rows = rows[:per]
    out: dict[str, Any] = {
        "ratio_first": first_rows[0].ratio if first_rows else None,
        "ratio_last": first_rows[-1].ratio if first_rows else None,
        "utilization_first": first_rows[0].utilization if first_rows else None,
        "utilization_last": first_rows[-1].utilization if first_rows else None,
        "alerts": sum(r.alert for r in rows),
    }
    if ledger:
        classes = Counter(r.classification for r in rows)
        out |= {
            "classes": dict(classes),
            "first_ratio_over_3": first(lambda r: r.ratio > 3.0),
            "first_fragmentation": first(lambda r: r.classification == "fragmentation"),
            "first_ratio_over_8": first(lambda r: r.ratio > 8.0),
            "first_pathological": first(lambda r: r.classification == "pathological"),
            "guard_stops": sum(r.guard_stops for r in rows),
            "ratio_after_guard_max": max((r.ratio for r in rows if r.guard_stops), default=None),
        }
    return out


def summarize(r: DemoReport) -> dict[str, Any]:
    naive = _decay_summary(r.decay_naive, ledger=False)
    led = _decay_summary(r.decay_ledger, ledger=True)
    naive["starvation"] = _starvation(r.starvation.naive, ledger=False)
    led["starvation"] = _starvation(r.starvation.ledger, ledger=True)
    naive["truncation_loop"] = _truncation(r.truncation.naive)
    led["truncation_loop"] = _truncation(r.truncation.ledger)
    naive["fanout"] = _fanout(r.fanout.naive, ledger=False)
    led["fanout"] = _fanout(r.fanout.ledger, ledger=True)
    led["fanout"]["control_classes"] = dict(Counter(x.classification for x in r.fanout.control))
    led["failed_compactions"] = r.notes.get("failed_compactions", 0)
    out = {
        "config": r.config.__dict__,
        "backend": r.backend,
        "naive": naive,
        "ledger": led,
        "elapsed_s": r.elapsed,
        "ledger_calls": r.ledger_calls,
        "over_allocations": r.over_allocations,
        "audits_clean": r.audits_clean,
        "audits_total": r.audits_total,
        "worker": r.worker_jobs,
    }
    out["acceptance"] = acceptance(out, large=r.config.sessions >= LARGE_SESSIONS)
    return out


# --- the table ------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _rate(a: dict[str, Any], turn: int) -> str:
    c = a["retrieval_admission"][str(turn)]
    if c["rate"] is None:
        return "n/a (no session that long)"
    return f"{c['rate']:.2f} ({c['sessions']} sessions, {c['turns']} turns)"


COLUMNS = ("scenario", "measure", "the record's figures", "naive arbiter", "ledger")
Row = tuple[str, str, str, str, str]


def rows(s: dict[str, Any]) -> list[Row]:
    """The demo's figures, one row per measure: the record's own figures (as the incident
    record gives them: not measured here), then what this run measured."""
    n, lg = s["naive"], s["ledger"]
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
            )
        )
    t.append(
        (
            "",
            "compaction interval, early / after turn 80 (turns)",
            "~9 / ~3 -> ~18",
            f"{_f(n['compaction_interval']['early'], '.1f')} / "
            f"{_f(n['compaction_interval']['late'], '.1f')}",
            f"{_f(lg['compaction_interval']['early'], '.1f')} / "
            f"{_f(lg['compaction_interval']['late'], '.1f')}",
        )
    )
    t.append(
        (
            "",
            "occupancy after compaction, first / late (window)",
            "creeps upward",
            f"{_f(n['post_compaction_occupancy']['first'])} / "
            f"{_f(n['post_compaction_occupancy']['late'])}",
            f"{_f(lg['post_compaction_occupancy']['first'])} / "
            f"{_f(lg['post_compaction_occupancy']['late'])}",
        )
    )
    head = n["refusal_latency_headroom_ms"]
    t.append(
        (
            "",
            "retrieval refusals (reason)",
            "token_budget_exhausted with ~180 ms headroom -> compaction_pending",
            ", ".join(f"{k}={v}" for k, v in sorted(n["retrieval_refusals"].items()))
            + (f"; headroom >= {head['min']:.0f} ms" if head else ""),
            ", ".join(f"{k}={v}" for k, v in sorted(lg["retrieval_refusals"].items())) or "none",
        )
    )
    t.append(
        (
            "",
            "turns over the 900 ms SLO",
            "none (p95 780-860) -> ~1.4%, the reset turns",
            f"{100 * n['slo']['over_share']:.2f}% (p95 {n['slo']['p95_ms']:.0f} ms)",
            f"{100 * lg['slo']['over_share']:.2f}% (p95 {lg['slo']['p95_ms']:.0f} ms; "
            f"{lg['slo']['over_not_compaction_or_reset']} not a compaction or reset turn)",
        )
    )
    t.append(
        (
            "",
            "hard resets / failed compactions",
            "escalate after 3 failures",
            f"0 / {n['compactions']} compactions never checked",
            f"{lg['resets']} / {lg['failed_compactions']}",
        )
    )
    ns, ls = n["starvation"], lg["starvation"]
    t.append(
        (
            "000 starvation",
            "turns after turn 5 short of their working set",
            "utilization 0.58-0.64, residual 2-3k vs ~6k",
            f"{ns['short_turns']}/{ns['turns_after_5']} silent, utilization "
            f"{ns['utilization'][0]:.2f}-{ns['utilization'][1]:.2f}, residual "
            f"{ns['residual_mean']:.0f} vs {ns['working_set_mean']:.0f}",
            f"{ls['regimes'].get('starvation', 0)} classed starvation, "
            f"{ls['regimes'].get('loud', 0)} loud; reclaimed {ls['reclaimed_scratchpad']} "
            f"scratchpad then {ls['reclaimed_retrieval']} retrieval; residual >= working set "
            f"{ls['restored']}/{ls['turns_after_5']}",
        )
    )
    nt, lt = n["truncation_loop"], lg["truncation_loop"]
    t.append(
        (
            "002 truncation-loop",
            "prompt compressions; truncated results; repeated calls",
            "a forbidden call gets through, its 20k result is cut, the call repeats",
            f"{nt['compression_events']}; {nt['truncated']}; {nt['repeated_calls']} "
            f"({nt['forbidden_calls']} forbidden calls)",
            f"{lt['compression_events']}; {lt['truncated']}; {lt['repeated_calls']} "
            f"(spilled {lt['spilled']}, refused {lt['refusals']})",
        )
    )
    nf, lf = n["fanout"], lg["fanout"]
    t.append(
        (
            "004 fan-out",
            "spans 4 -> 23: ratio; final-prompt utilization",
            "1.3 -> 11.8; 0.61 -> 0.44",
            f"{_f(nf['ratio_first'], '.1f')} -> {_f(nf['ratio_last'], '.1f')}; "
            f"{_f(nf['utilization_first'])} -> {_f(nf['utilization_last'])}; "
            f"gauge alerts {nf['alerts']}",
            f"{_f(lf['ratio_first'], '.1f')} -> {_f(lf['ratio_last'], '.1f')} (guard, "
            f"{lf['guard_stops']} spans stopped)",
        )
    )
    cls = ", ".join(f"{k}={v}" for k, v in sorted(lf["classes"].items()))
    ctl = ", ".join(f"{k}={v}" for k, v in sorted(lf["control_classes"].items()))
    t.append(
        (
            "",
            "classes (ratio > 3 at turn / classed at turn)",
            "fragmentation > 3, pathological > 8",
            "not measured",
            f"{cls}; fragmentation {lf['first_ratio_over_3']}/{lf['first_fragmentation']}, "
            f"pathological {lf['first_ratio_over_8']}/{lf['first_pathological']}; control: {ctl}",
        )
    )
    t.append(
        (
            "all",
            "over-allocations; audits",
            "",
            "",
            f"{s['over_allocations']}; {s['audits_clean']}/{s['audits_total']} clean",
        )
    )
    return t


def title(s: dict[str, Any]) -> str:
    return f"seed {s['config']['seed']}: each incident's figure, its naive arbiter, the ledger"


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
    out = [title(s), ""]
    scenario = ""
    for row in rows(s):
        scenario = row[0] or scenario
        out.append(f"{scenario}: {row[1]}")
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


def plot(s: dict[str, Any], path: str) -> None:
    need("matplotlib", "plot", "ledger demo --plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, style in (("naive", "--"), ("ledger", "-")):
        curve = s[name]["curve"]
        smooth = _smooth(curve["retrieval"], curve["alive"])
        top.plot(range(len(smooth)), smooth, style, label=f"{name}")
        bottom.plot(range(len(curve["interval"])), curve["interval"], style, label=name)
    top.set_ylabel(f"turns with retrieval admitted\n(turn ±{WINDOW_TURNS})")
    top.set_ylim(-0.05, 1.05)
    top.legend()
    bottom.set_ylabel(f"turns between compactions\n(compactions at turn ±{WINDOW_TURNS})")
    bottom.set_xlabel("turn")
    bottom.legend()
    cfg = s["config"]
    fig.suptitle(f"scenario 001 (compaction-decay), {cfg['sessions']} sessions, seed {cfg['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _smooth(curve: Sequence[float], alive: Sequence[int]) -> list[float]:
    out = []
    for t in range(len(curve)):
        lo, hi = max(0, t - WINDOW_TURNS), min(len(curve), t + WINDOW_TURNS + 1)
        w = sum(alive[lo:hi])
        out.append(
            sum(curve[u] * alive[u] for u in range(lo, hi) if alive[u]) / w if w else math.nan
        )
    return out
