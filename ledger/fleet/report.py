"""What the demo measured, per incident scenario: one summary (the JSON) and the plot.

The rows of the summary, as one wide table or as text for a narrow terminal, are
:mod:`ledger.fleet.table`'s; every one of its public names is here too.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ledger.extras import need
from ledger.fleet import costs, decay, fanout, starvation, truncation
from ledger.fleet.checks import acceptance
from ledger.fleet.run import CHECKPOINTS, LARGE_SESSIONS, WINDOW_TURNS, DemoReport
from ledger.fleet.table import COLUMNS as COLUMNS
from ledger.fleet.table import Row as Row
from ledger.fleet.table import footer as footer
from ledger.fleet.table import narrow as narrow
from ledger.fleet.table import rows as rows
from ledger.fleet.table import table as table
from ledger.fleet.table import title as title

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
    w = decay.WINDOW
    # each session's first post-compaction occupancy, and the mean of its own from turn
    # LATE: distributions over sessions, as shares of the window
    firsts = [
        next(r.post_compaction for r in run.records if r.post_compaction is not None) / w
        for run in runs
        if any(r.post_compaction is not None for r in run.records)
    ]
    late_posts = [r.post_compaction for r in records if r.post_compaction and r.turn >= LATE]
    late_by_session = [
        statistics.fmean(ps) / w
        for run in runs
        if (ps := [r.post_compaction for r in run.records if r.post_compaction and r.turn >= LATE])
    ]
    # shares of the fleet's turns: the fleet alone (the tail sessions would weigh late
    # turns too much); per-turn figures: every session alive at that turn
    fleet = [r for run in runs if not run.tail for r in run.records]
    over = [r for r in fleet if r.over_slo]
    lat = sorted(r.latency_ms for r in fleet)
    headroom = [r.headroom_ms for r in records if r.headroom_ms is not None]
    # the reasons retrieval was refused (with the ledger's bound), and every refusal the
    # ledger gave this fleet's agents (recall and begin_turn's too)
    refusals = Counter(r.refusal + (f"_{r.bound}" if r.bound else "") for r in records if r.refusal)
    every: Counter[str] = Counter()
    for run in runs:
        for k, v in run.counts.items():
            if k.startswith("refused_"):
                every[k.removeprefix("refused_")] += v
    pts = [(t, c) for t, c in enumerate(curve) if alive[t] and t >= CHECKPOINTS[0]]
    slope = None
    if len(pts) > 2:
        mt, mc = _mean(t for t, _ in pts) or 0.0, _mean(c for _, c in pts) or 0.0
        den = sum((t - mt) ** 2 for t, _ in pts)
        slope = 100 * sum((t - mt) * (c - mc) for t, c in pts) / den if den else 0.0
    # the lowest retrieval admission over turn +- WINDOW_TURNS (a whole window: not in
    # the last turns), where 10 or more sessions are alive (the curve the plot draws)
    smooth = _smooth(curve, alive)
    low = [
        (c, t)
        for t, c in enumerate(smooth)
        if CHECKPOINTS[0] <= t <= max_turn - WINDOW_TURNS and alive[t] >= 10  # whole windows
    ]
    first_post = _mean(firsts)
    late_post = _mean(late_posts)
    return {
        "retrieval_admission": {str(c): _checkpoint(runs, c) for c in CHECKPOINTS},
        "retrieval_trend_per_100_turns": slope,
        "retrieval_trend_turns": len(pts),  # the turns (curve points) the slope is fit on
        "retrieval_min": {
            "rate": min(low)[0],
            "turn": min(low)[1],
            "sessions": alive[min(low)[1]],  # alive at that turn
        }
        if low
        else None,
        "retrieval_refusals": dict(refusals),
        "refusals": dict(every),
        "refusal_latency_headroom_ms": {
            "min": min(headroom),
            "median": statistics.median(headroom),
            "refusals": len(headroom),
        }
        if headroom
        else None,
        "compactions": len(iv),
        "compaction_interval": _interval_summary(runs, iv),
        "post_compaction_occupancy": {
            # the mean over sessions of each one's first; the mean of every compaction
            # from turn LATE (the checks' figures), each with its spread over sessions
            "first": first_post,
            "late": late_post / w if late_post else None,
            "first_sessions": _spread(firsts),
            "late_compactions": len(late_posts),
            "late_sessions": _spread(late_by_session),
        },
        "slo": {
            "turns": len(fleet),
            "sessions": sum(1 for run in runs if not run.tail),
            "over_share": len(over) / len(fleet) if fleet else 0.0,
            "over_turns": len(over),
            "over_not_compaction_or_reset": sum(
                1 for r in over if not (r.compaction or r.reset or r.waited)
            ),
            "p95_ms": lat[int(0.95 * (len(lat) - 1))] if lat else None,
        },
        "resets": sum(r.reset for r in fleet),
        "reset_sessions": sum(
            1 for run in runs if not run.tail and any(r.reset for r in run.records)
        ),
        "turns": len(fleet),
        "sessions": sum(1 for run in runs if not run.tail),
        "tail_sessions": sum(1 for run in runs if run.tail),
        "sessions_at_120": sum(1 for run in runs if len(run.records) >= 120),
        "cure_costs": costs.decay_costs(runs),  # every session's, the tail's too
        "curve": {"retrieval": curve, "alive": alive, "interval": _interval_curve(iv, max_turn)},
    }


def _interval_summary(
    runs: Sequence[decay.SessionRun], iv: Sequence[tuple[int, int]]
) -> dict[str, Any]:
    """The mean interval of the compactions before turn EARLY and from turn LATE (the
    checks' figures), each with the compactions and sessions it rests on; and the same
    two on one sample: the sessions alive at turn 120 (the last checkpoint) with
    compactions both before EARLY and from LATE, each one's mean early and late
    interval, spread over those sessions."""
    early = [d for t, d in iv if t < EARLY]
    late = [d for t, d in iv if t >= LATE]
    per_run = [_intervals([run]) for run in runs]
    pairs = [
        (e, lt)
        for run, p in zip(runs, per_run, strict=True)
        if len(run.records) >= CHECKPOINTS[-1]
        and (e := _mean(d for t, d in p if t < EARLY)) is not None
        and (lt := _mean(d for t, d in p if t >= LATE)) is not None
    ]
    return {
        "early": _mean(early),
        "late": _mean(late),
        "early_compactions": len(early),
        "late_compactions": len(late),
        "early_sessions": sum(1 for p in per_run if any(t < EARLY for t, _ in p)),
        "late_sessions": sum(1 for p in per_run if any(t >= LATE for t, _ in p)),
        "same_sessions": {
            "early": _spread([e for e, _ in pairs]),
            "late": _spread([lt for _, lt in pairs]),
        },
    }


def _interval_curve(iv: Sequence[tuple[int, int]], max_turn: int) -> list[float]:
    """Mean interval of the compactions within +- WINDOW_TURNS of each turn."""
    out = []
    for t in range(max_turn + 1):
        near = [d for u, d in iv if abs(u - t) <= WINDOW_TURNS]
        out.append(statistics.fmean(near) if near else math.nan)
    return out


# --- scenarios 000, 002, 004 -----------------------------------------------------------


def _longest_short_run(rows: Sequence[starvation.TurnRow]) -> int:
    """The most consecutive turns of one session short of their working set."""
    best = run = 0
    last = 0
    for r in rows:
        run = 0 if r.turn <= last else run  # a new session starts at turn 1
        run = run + 1 if r.residual < r.working_set else 0
        best, last = max(best, run), r.turn
    return best


def _starvation(rows: Sequence[starvation.TurnRow], ledger: bool) -> dict[str, Any]:
    after = [r for r in rows if r.turn > 5]
    regimes = Counter(str(r.regime) for r in after)
    short = [r for r in after if r.residual < r.working_set]
    out: dict[str, Any] = {
        "turns_after_5": len(after),
        "regimes": dict(regimes),
        "short_turns": len(short),
        "longest_short_run": _longest_short_run(after),
        # short turns that are not one of the large steps (starvation that persists)
        "short_regular_steps": sum(1 for r in short if r.working_set < starvation.LARGE_STEP),
        "utilization": [min(r.utilization for r in after), max(r.utilization for r in after)],
        "residual_mean": _mean(r.residual for r in after),
        "working_set_mean": _mean(r.working_set for r in after),
    }
    out |= _forgetting(rows)
    if ledger:
        reclaimed = [r.reclaimed for r in after if r.reclaimed]
        out["reclaimed_scratchpad"] = sum(1 for x in reclaimed for i in x if i.startswith("s:"))
        out["reclaimed_retrieval"] = sum(1 for x in reclaimed for i in x if i.startswith("r:"))
        out["reclaim_order_ok"] = all(
            [i[0] for i in x] == sorted((i[0] for i in x), key="sr".index) for x in reclaimed
        )
        out["restored"] = sum(1 for r in after if r.residual >= r.working_set)
        # what the cure cost: items reclaimed from the turn just before, fetched again
        out["fetched_again"] = sum(r.fetched_again for r in rows)
        out["fetched_again_tokens"] = sum(r.fetched_again_tokens for r in rows)
        out["fetched_again_per_session"] = _spread(
            [sum(r.fetched_again for r in s) for s in _sessions(rows)]
        )
    return out


def _sessions(rows: Sequence[Any]) -> list[list[Any]]:
    """The rows of each session (a session's rows start at turn 1)."""
    out: list[list[Any]] = []
    for r in rows:
        if r.turn == 1 or not out:
            out.append([])
        out[-1].append(r)
    return out


def _spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median and p90 over sessions (nearest rank), with their number."""
    return costs.spread(xs, "sessions")


def _forgetting(rows: Sequence[starvation.TurnRow]) -> dict[str, Any]:
    """What the turns short of their working set did (every turn of every session):
    repetitions, tool calls issued again, syntheses left unfinished."""
    sessions = _sessions(rows)
    synth = [starvation.syntheses(s) for s in sessions]
    return {
        "sessions": len(sessions),
        "turns": len(rows),
        "repeated": sum(r.repeated for r in rows),
        "reissued": sum(r.reissued for r in rows),
        "reissued_tokens": sum(r.reissued_tokens for r in rows),
        "turns_again": sum(1 for r in rows if r.reissued),
        "syntheses_finished": sum(d for d, _ in synth),
        "syntheses": sum(t for _, t in synth),
        "per_session": {
            "repeated": _spread([sum(r.repeated for r in s) for s in sessions]),
            "reissued": _spread([sum(r.reissued for r in s) for s in sessions]),
            "unfinished_share": _spread([(t - d) / t for d, t in synth if t]),
        },
    }


def _truncation(c: truncation.Counts) -> dict[str, Any]:
    """The counts, over every turn of the scenario's sessions (their number with them)."""
    n = truncation.SESSIONS
    return dict(c.__dict__) | {"sessions": n, "turns": n * truncation.TURNS}


def _window(sessions: list[list[fanout.TurnRow]], span: tuple[int, int]) -> dict[str, Any]:
    """Turns `span` (first, last) of every session: each session's mean spans, ratio and
    utilization, spread over sessions; the p99 of the turns' latencies, pooled."""
    rows = [[r for r in s if span[0] <= r.turn <= span[1]] for s in sessions]
    rows = [s for s in rows if s]
    lat = sorted(r.latency_ms for s in rows for r in s)

    def per(f: Any) -> dict[str, Any]:
        return _spread([statistics.fmean(f(r) for r in s) for s in rows])

    return {
        "turns": list(span),
        "spans": per(lambda r: r.spans),
        "ratio": per(lambda r: r.ratio),
        "utilization": per(lambda r: r.utilization),
        # nearest rank, over every turn of the window of every session
        "p99_ms": lat[math.ceil(0.99 * len(lat)) - 1] if lat else None,
        "latency_turns": len(lat),
    }


def _fanout(rows: Sequence[fanout.TurnRow], ledger: bool) -> dict[str, Any]:
    sessions = _sessions(rows)
    early, late = _window(sessions, fanout.EARLY), _window(sessions, fanout.LATE)
    out: dict[str, Any] = {
        "sessions": len(sessions),
        "turns": len(rows),
        "early": early,
        "late": late,
        # the medians over sessions of the windows' means, and the pooled p99s
        "ratio_first": early["ratio"]["median"],
        "ratio_last": late["ratio"]["median"],
        "utilization_first": early["utilization"]["median"],
        "utilization_last": late["utilization"]["median"],
        "spans_first": early["spans"]["median"],
        "spans_last": late["spans"]["median"],
        "p99_first_ms": early["p99_ms"],
        "p99_last_ms": late["p99_ms"],
        # each session's highest ratio (its peak), spread over sessions
        "ratio_peak": _spread([max(r.ratio for r in s) for s in sessions]),
        "alerts": sum(r.alert for r in rows),
        "cure_costs": costs.fanout_costs(rows),
    }
    if ledger:

        def first(s: list[fanout.TurnRow], cond: Any) -> int | None:
            return next((r.turn for r in s if cond(r)), None)

        classes = Counter(str(r.classification) for r in rows)
        cross = [
            {
                "ratio_over_3": first(s, lambda r: r.ratio > 3.0),
                "fragmentation": first(s, lambda r: r.classification == "fragmentation"),
                "ratio_over_8": first(s, lambda r: r.ratio > 8.0),
                "pathological": first(s, lambda r: r.classification == "pathological"),
            }
            for s in sessions
        ]
        lags = [
            (c["fragmentation"] or 999) - (c["ratio_over_3"] or 0)
            for c in cross
            if c["ratio_over_3"] is not None
        ]
        out |= {
            "classes": dict(classes),
            "crossings": cross,  # per session: the first turn of each
            "fragmentation_lag_max": max(lags) if lags else None,
            "fragmentation_lag_min": min(lags) if lags else None,
            "sessions_over_8": sum(1 for c in cross if c["ratio_over_8"] is not None),
            # sessions whose ratio passed 8 and that were classed pathological, not before
            "sessions_pathological": sum(
                1
                for c in cross
                if c["ratio_over_8"] is not None
                and c["pathological"] is not None
                and c["pathological"] >= c["ratio_over_8"]
            ),
            # the turn of each crossing, spread over the sessions that made it
            "crossing_turns": {
                k: _spread([t for c in cross if (t := c[k]) is not None])
                for k in ("ratio_over_3", "fragmentation", "ratio_over_8", "pathological")
            },
            "guard_stops": sum(r.guard_stops for r in rows),
            "ratio_after_guard_max": max((r.ratio for r in rows if r.guard_stops), default=None),
            # every turn of every session: what the guard holds down, not where it acted
            "ratio_max": max((r.ratio for r in rows), default=None),
        }
    return out


def summarize(r: DemoReport) -> dict[str, Any]:
    """Every figure of the run: per arbiter (naive, ledger, and the ledger without each
    scenario's rule, ``off``; None with ``--without``), per scenario run."""
    naive: dict[str, Any] = {}
    led: dict[str, Any] = {}
    off: dict[str, Any] | None = {} if r.config.off_column else None
    if r.decay_ledger:
        naive |= _decay_summary(r.decay_naive, ledger=False)
        led |= _decay_summary(r.decay_ledger, ledger=True)
        led["failed_compactions"] = r.notes.get("failed_compactions", 0)
        if off is not None and r.decay_off is not None:
            off |= _decay_summary(r.decay_off, ledger=True)
    if r.starvation is not None:
        naive["starvation"] = _starvation(r.starvation.naive, ledger=False)
        naive["starvation"]["released_each_turn"] = {
            c: _starvation(rows, ledger=False) for c, rows in r.starvation.naive_loose.items()
        }
        led["starvation"] = _starvation(r.starvation.ledger, ledger=True)
        if off is not None and r.starvation.off is not None:
            off["starvation"] = _starvation(r.starvation.off, ledger=True)
    if r.truncation is not None:
        naive["truncation_loop"] = _truncation(r.truncation.naive)
        led["truncation_loop"] = _truncation(r.truncation.ledger)
        if off is not None and r.truncation.off is not None:
            off["truncation_loop"] = _truncation(r.truncation.off)
    if r.fanout is not None:
        naive["fanout"] = _fanout(r.fanout.naive, ledger=False)
        led["fanout"] = _fanout(r.fanout.ledger, ledger=True)
        led["fanout"]["control_classes"] = dict(
            Counter(str(x.classification) for x in r.fanout.control)
        )
        if off is not None and r.fanout.off is not None:
            off["fanout"] = _fanout(r.fanout.off, ledger=True)
    config = dict(r.config.__dict__)
    config["only"] = sorted(config["only"]) if config["only"] else None
    config["scripts"] = sorted(config["scripts"])  # the names of the scripts replaced
    out = {
        "config": config,
        "backend": r.backend,
        "naive": naive,
        "ledger": led,
        "off": off,
        "elapsed_s": r.elapsed,
        "ledger_calls": r.ledger_calls,
        "over_allocations": r.over_allocations,
        "audits_clean": r.audits_clean,
        "audits_total": r.audits_total,
        "worker": r.worker_jobs,
    }
    out["acceptance"] = acceptance(out, large=r.config.sessions >= LARGE_SESSIONS)
    return out


# --- the plot -------------------------------------------------------------------------


def plot(s: dict[str, Any], path: str) -> None:
    need("matplotlib", "plot", "ledger demo --plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    arbiters = [("naive", "--", "naive"), ("ledger", "-", "ledger")]
    if (s.get("off") or {}).get("curve"):
        arbiters.append(("off", ":", "ledger without compaction credit"))
    for name, style, label in arbiters:
        curve = s[name]["curve"]
        smooth = _smooth(curve["retrieval"], curve["alive"])
        top.plot(range(len(smooth)), smooth, style, label=label)
        bottom.plot(range(len(curve["interval"])), curve["interval"], style, label=label)
    # the record's own figures (not measured here), and each checkpoint's sample
    top.axhspan(0.88, 0.94, color="tab:green", alpha=0.12, label="the record's cure: 0.88-0.94")
    top.plot(
        list(CHECKPOINTS),
        [0.91, 0.34, 0.07],
        "kx",
        markersize=9,
        label="the record's naive figures",
    )
    for turn in CHECKPOINTS:
        n = s["ledger"]["retrieval_admission"][str(turn)]["sessions"]
        top.annotate(f"n={n}", (turn, 0.02), ha="center", fontsize=8)
    top.set_ylabel(f"turns with retrieval admitted\n(turn ±{WINDOW_TURNS})")
    top.set_ylim(-0.05, 1.05)
    top.legend(fontsize=8)
    bottom.set_ylabel(f"turns between compactions\n(compactions at turn ±{WINDOW_TURNS})")
    bottom.set_xlabel("turn")
    bottom.legend()
    cfg = s["config"]
    fig.suptitle(
        f"scenario 001 (compaction-decay), {cfg['sessions']} sessions and "
        f"{cfg['tail']} beyond turn 120, seed {cfg['seed']}"
    )
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
