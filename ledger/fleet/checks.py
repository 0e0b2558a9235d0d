"""The demo's acceptance checks: does each scenario show its failure under the
naive arbiter and its cure under the ledger, with the figures docs/demo.md states? Read from the
summary (the JSON of ``ledger demo --json``), so a run can be judged after the fact."""

from __future__ import annotations

from typing import Any

Check = dict[str, Any]  # {"pass": bool, "measured": str}


def _c(ok: bool, measured: str) -> Check:
    return {"pass": bool(ok), "measured": measured}


def _rate(a: dict[str, Any], turn: int) -> float:
    r = a["retrieval_admission"][str(turn)]["rate"]
    return float("nan") if r is None else float(r)


def acceptance(s: dict[str, Any], large: bool = False) -> dict[str, Check]:
    """The checks of each scenario that ran; the rule-off checks when its column ran."""
    n, lg, off = s["naive"], s["ledger"], s.get("off")
    out: dict[str, Check] = {}
    if "retrieval_admission" in lg:
        _decay(n, lg, off, out)
    if "starvation" in lg:
        _starvation(n, lg, off, out)
    if "truncation_loop" in lg:
        _truncation(n, lg, off, out)
    if "fanout" in lg:
        _fanout(n, lg, off, out)
    out["all: 0 over-allocations, clean audits"] = _c(
        s["over_allocations"] == 0 and s["audits_clean"] == s["audits_total"],
        f"{s['over_allocations']} over-allocations, {s['audits_clean']}/{s['audits_total']} clean",
    )
    if "retrieval_admission" in lg:
        # every column of 001 that ran: its own sessions alive at turn 120, each counted
        cols = [("naive", n), ("ledger", lg)]
        if off is not None and "retrieval_admission" in off:
            cols.append(("without its rule", off))
        out["001 turn-120 figures on >= 30 sessions"] = _c(
            all(a["sessions_at_120"] >= 30 for _, a in cols),
            ", ".join(
                f"{name} {a['sessions_at_120']} ({a['tail_sessions']} from the tail)"
                for name, a in cols
            ),
        )
    return out


Summary = dict[str, Any]


def _decay(n: Summary, lg: Summary, off: Summary | None, out: dict[str, Check]) -> None:
    r10, r60, r120 = (_rate(n, t) for t in (10, 60, 120))
    out["001 naive retrieval admission"] = _c(
        r10 >= 0.85 and 0.25 <= r60 <= 0.45 and r120 <= 0.15,
        f"{r10:.2f} / {r60:.2f} / {r120:.2f} at turns 10/60/120",
    )
    e, late = n["compaction_interval"]["early"], n["compaction_interval"]["late"]
    out["001 naive compaction interval"] = _c(
        e is not None and late is not None and e >= 7 and late <= 4,
        f"early {e:.1f}, after turn 80 {late:.1f}" if e and late else f"{e} / {late}",
    )
    post = n["post_compaction_occupancy"]
    known = post["first"] is not None and post["late"] is not None
    out["001 naive post-compaction occupancy rises"] = _c(
        known and post["late"] - post["first"] >= 0.2,
        f"{post['first']:.2f} -> {post['late']:.2f} of the window" if known else "n/a",
    )
    head = n["refusal_latency_headroom_ms"]
    out["001 naive refusals token_budget_exhausted with headroom"] = _c(
        set(n["retrieval_refusals"]) == {"token_budget_exhausted"}
        and head is not None
        and head["min"] > 0,
        f"{n['retrieval_refusals']}, headroom min {head['min']:.0f} ms" if head else "none",
    )
    out["001 naive SLO"] = _c(
        n["slo"]["over_share"] <= 0.001, f"{100 * n['slo']['over_share']:.3f}% over 900 ms"
    )
    l10, l60, l120 = (_rate(lg, t) for t in (10, 60, 120))
    trend = lg["retrieval_trend_per_100_turns"] or 0.0
    low = lg["retrieval_min"] or {"rate": float("nan"), "turn": None}
    out["001 ledger retrieval admission"] = _c(
        min(l10, l60, l120) >= 0.88
        and low["rate"] >= 0.88
        and trend >= -0.05
        and l120 >= l10 - 0.05,
        f"{l10:.2f} / {l60:.2f} / {l120:.2f}, lowest {low['rate']:.2f} (turn {low['turn']}), "
        f"trend {trend:+.3f} per 100 turns",
    )
    out["001 ledger retrieval refusals: some, all compaction_pending"] = _c(
        bool(lg["retrieval_refusals"])
        and all(k.startswith("compaction_pending") for k in lg["retrieval_refusals"]),
        str(lg["retrieval_refusals"] or "none"),
    )
    le, ll = lg["compaction_interval"]["early"], lg["compaction_interval"]["late"]
    out["001 ledger late compaction interval >= 0.7 x early"] = _c(
        le is not None and ll is not None and ll >= 0.7 * le,
        f"early {le:.1f}, after turn 80 {ll:.1f}" if le and ll else f"{le} / {ll}",
    )
    out["001 ledger hard resets present"] = _c(lg["resets"] > 0, f"{lg['resets']} resets")
    slo = lg["slo"]
    # The breach the rule trades for retrieval: visible (some turns over), bounded (at most
    # 3%), and only where a compaction was waited for or a hard reset rebuilt the context.
    out["001 ledger SLO: some turns over, at most 3%, only compaction or reset turns"] = _c(
        0 < slo["over_share"] <= 0.03 and slo["over_not_compaction_or_reset"] == 0,
        f"{100 * slo['over_share']:.2f}% over, {slo['over_not_compaction_or_reset']} other",
    )
    if off is not None and "retrieval_admission" in off:
        o60, o120 = _rate(off, 60), _rate(off, 120)
        exhausted = off["retrieval_refusals"].get("token_budget_exhausted", 0)
        # Compactions come sooner late than early, on one sample: the sessions alive at
        # turn 120, each one's own mean interval before turn 40 and from turn 80 (pooled
        # figures mix the whole fleet's early compactions with the long sessions' late
        # ones). Without the credit the ledger still compacts off the request path, so
        # the ratchet is slower than the naive arbiter's (its own check asks <= 4 late).
        same = off["compaction_interval"]["same_sessions"]
        se, sl = same["early"]["median"], same["late"]["median"]
        olow = off["retrieval_min"] or {"rate": float("nan"), "turn": None}
        out["001 without compaction credit: retrieval starves, compactions come sooner"] = _c(
            olow["rate"] <= low["rate"] - 0.3
            and se is not None
            and sl is not None
            and sl < se
            and exhausted > 0,
            f"retrieval {o60:.2f} / {o120:.2f} at turns 60/120, lowest {olow['rate']:.2f} "
            f"(turn {olow['turn']}); interval on the {same['early']['sessions']} sessions "
            f"alive at turn 120, median early {_n(se)}, after turn 80 {_n(sl)}; "
            f"token_budget_exhausted={exhausted}",
        )


def _n(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _starvation(n: Summary, lg: Summary, off: Summary | None, out: dict[str, Check]) -> None:
    ns, ls = n["starvation"], lg["starvation"]
    loose = ns["released_each_turn"]
    out["000 naive starvation is transient when a consumer is released each turn"] = _c(
        all(x["short_regular_steps"] <= 0.05 * x["turns_after_5"] for x in loose.values())
        and ns["short_regular_steps"] > ns["turns_after_5"] / 2,
        ", ".join(
            f"{c}: {x['short_turns']}/{x['turns_after_5']} short, "
            f"{x['short_regular_steps']} of them regular steps"
            for c, x in sorted(loose.items())
        )
        + f"; both sticky: {ns['short_regular_steps']} regular steps short",
    )
    util = ns["utilization"]
    out["000 naive silent starvation"] = _c(
        ns["regimes"].get("silent", 0) > ns["turns_after_5"] / 2
        and util[0] >= 0.58
        and util[1] <= 0.64
        and ns["residual_mean"] < ns["working_set_mean"],
        f"{ns['regimes'].get('silent', 0)}/{ns['turns_after_5']} turns, utilization "
        f"{util[0]:.2f}-{util[1]:.2f}, residual {ns['residual_mean']:.0f} < working set "
        f"{ns['working_set_mean']:.0f}",
    )
    reclaimed = ls["reclaimed_scratchpad"] + ls["reclaimed_retrieval"]
    out["000 ledger classes starvation, reclaims, restores"] = _c(
        ls["regimes"].get("starvation", 0) > ls["turns_after_5"] / 2
        and ls["regimes"].get("loud", 0) == 0
        and ls["reclaimed_scratchpad"] > 0
        and ls["reclaimed_retrieval"] > 0
        and ls["reclaim_order_ok"]
        and ls["restored"] == ls["turns_after_5"]
        # the order's cost: items of the turn just before, reclaimed and fetched again
        and ls["fetched_again"] <= reclaimed / 4,
        f"starvation {ls['regimes'].get('starvation', 0)}, loud {ls['regimes'].get('loud', 0)}"
        f", reclaimed {ls['reclaimed_scratchpad']} scratchpad then "
        f"{ls['reclaimed_retrieval']} retrieval, restored {ls['restored']}/"
        f"{ls['turns_after_5']}, fetched again {ls['fetched_again']} of {reclaimed}",
    )
    out["000 naive short turns repeat, re-issue calls, leave syntheses unfinished"] = _c(
        ns["repeated"] > 0
        and ns["reissued"] > 0
        and ns["syntheses_finished"] <= ns["syntheses"] / 2,
        _forgot(ns),
    )
    out["000 ledger: a tenth of the naive repeats and re-issued calls, 90% syntheses"] = _c(
        ls["repeated"] + ls["reissued"] <= (ns["repeated"] + ns["reissued"]) / 10
        and ls["syntheses_finished"] >= 0.9 * ls["syntheses"],
        _forgot(ls),
    )
    if off is not None and "starvation" in off:
        os_ = off["starvation"]
        out["000 without a declared working set: silent starvation again"] = _c(
            os_["short_turns"] > os_["turns_after_5"] / 2
            and os_["reclaimed_scratchpad"] + os_["reclaimed_retrieval"] == 0
            and os_["repeated"] + os_["reissued"] > (ns["repeated"] + ns["reissued"]) / 2
            and os_["syntheses_finished"] <= os_["syntheses"] / 2,
            f"{os_['short_turns']}/{os_['turns_after_5']} turns short of their working set, "
            f"{os_['reclaimed_scratchpad'] + os_['reclaimed_retrieval']} reclaimed; "
            + _forgot(os_),
        )


def _forgot(a: Summary) -> str:
    return (
        f"{a['repeated']} repeats, {a['reissued']} tool calls again, syntheses finished "
        f"{a['syntheses_finished']}/{a['syntheses']} ({a['sessions']} sessions, "
        f"{a['turns']} turns)"
    )


def _truncation(n: Summary, lg: Summary, off: Summary | None, out: dict[str, Check]) -> None:
    nt, lt = n["truncation_loop"], lg["truncation_loop"]
    ev = nt["compression_events"]
    out["002 naive loop per compression event"] = _c(
        ev > 0
        and nt["truncated"] >= ev
        and nt["repeated_calls"] >= ev
        and nt["forbidden_calls"] > 0
        # (not one a compression event: a compression undone at the next turn's start,
        # when an old result leaves the scratchpad, damages no turn)
        and nt["damaged_turns"] > 0,
        f"{ev} events, {nt['damaged_turns']} damaged turns, {nt['forbidden_calls']} "
        f"forbidden calls, {nt['truncated']} truncations, {nt['repeated_calls']} repeats",
    )
    # the floor half: the system prompt keeps its permission paragraph on every turn
    out["002 ledger floor: no compression, no damaged turn, no forbidden call"] = _c(
        lt["compression_events"] == 0 and lt["damaged_turns"] == 0 and lt["forbidden_calls"] == 0,
        f"{lt['compression_events']} compressions, {lt['damaged_turns']} damaged turns, "
        f"{lt['forbidden_calls']} forbidden calls",
    )
    # the spill half: a result that does not fit is spilled whole, never cut
    out["002 ledger no truncation, spills and refusals"] = _c(
        lt["truncated"] == 0
        and lt["repeated_calls"] == 0
        and lt["spilled"] > 0
        and lt["refusals"] > 0,
        f"truncated {lt['truncated']}, repeats {lt['repeated_calls']}, spilled "
        f"{lt['spilled']}, refused {lt['refusals']}",
    )
    if off is not None and "truncation_loop" in off:
        ot = off["truncation_loop"]
        out["002 without spill: results cut, calls repeated"] = _c(
            ot["truncated"] > 0 and ot["repeated_calls"] > 0,
            f"truncated {ot['truncated']}, repeats {ot['repeated_calls']}",
        )


def _fanout(n: Summary, lg: Summary, off: Summary | None, out: dict[str, Check]) -> None:
    nf, lf = n["fanout"], lg["fanout"]
    out["004 naive gauge raises nothing while p99 rises"] = _c(
        nf["alerts"] == 0
        and nf["ratio_peak"]["median"] > 8
        and nf["utilization_last"] < nf["utilization_first"]
        and nf["p99_last_ms"] > 2 * nf["p99_first_ms"],
        f"alerts {nf['alerts']}, ratio {nf['ratio_first']:.1f} -> {nf['ratio_last']:.1f} "
        f"(peak median {nf['ratio_peak']['median']:.1f}), utilization "
        f"{nf['utilization_first']:.2f} -> {nf['utilization_last']:.2f}, p99 "
        f"{nf['p99_first_ms'] / 1000:.1f} -> {nf['p99_last_ms'] / 1000:.1f} s "
        f"({nf['sessions']} sessions, {nf['turns']} turns)",
    )
    lag_lo, lag_hi = lf["fragmentation_lag_min"], lf["fragmentation_lag_max"]
    ctl = lf["control_classes"]
    out["004 ledger classes fragmentation, pathological, guard ~8"] = _c(
        lag_lo is not None
        and lag_lo >= 0
        and lag_hi <= 3
        and lf["sessions_over_8"] > 0
        and lf["sessions_pathological"] == lf["sessions_over_8"]
        and (lf["ratio_max"] or 99) <= 9.0
        and ctl.get("saturation", 0) > sum(ctl.values()) / 2,
        f"fragmentation {lag_lo}-{lag_hi} turns after ratio 3; pathological, not before "
        f"ratio 8, in {lf['sessions_pathological']} of the {lf['sessions_over_8']} sessions "
        f"past 8; guarded max {lf['ratio_after_guard_max']}, highest ratio {lf['ratio_max']} "
        f"over {lf['turns']} turns of {lf['sessions']} sessions; control {ctl}",
    )
    if off is not None and "fanout" in off:
        of = off["fanout"]
        out["004 without the guard: amplification past 9 unchecked"] = _c(
            of["guard_stops"] == 0 and (of["ratio_peak"]["median"] or 0) > 9.0,
            f"ratio {of['ratio_first']:.1f} -> {of['ratio_last']:.1f} (peak median "
            f"{of['ratio_peak']['median']:.1f}), {of['guard_stops']} turns stopped, p99 "
            f"{of['p99_last_ms'] / 1000:.1f} s",
        )
