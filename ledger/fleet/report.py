"""The comparison table, its footer and the optional plot."""

from __future__ import annotations

import math

from rich.table import Table

from ledger.fleet.run import CHECKPOINTS, ArbiterSummary, FleetReport


def _rate(a: ArbiterSummary, turn: int) -> str:
    rate, alive = a.retrieval_rate.get(turn, (math.nan, 0))
    return "n/a (no session that long)" if not alive else f"{rate:.2f} ({alive} sessions)"


def _per100(n: int, turns: int) -> str:
    return f"{n} ({100 * n / turns:.1f} per 100 turns)" if turns else str(n)


def table(r: FleetReport) -> Table:
    n, lg = r.naive, r.ledger
    nc, lc = n.counts, lg.counts
    t = Table(title=f"{r.config.sessions} sessions, {n.turns} turns, seed {r.config.seed}")
    t.add_column("", style="bold")
    t.add_column("naive arbiter")
    t.add_column("ledger")
    t.add_column("record")
    for turn in CHECKPOINTS:
        t.add_row(
            f"retrieval admitted @ turn {turn} (share of the turn's chunks)",
            _rate(n, turn),
            _rate(lg, turn),
            "001",
        )
    detected = (
        lc.get("starvation_detected_starvation", 0)
        + lc.get("starvation_detected_loud", 0)
        + lc.get("starvation_refused", 0)
    )
    t.add_row(
        "starvation turns",
        f"{nc.get('silent_starvation', 0)} silent",
        f"{detected} detected ({lc.get('reclaimed_items', 0)} items reclaimed), 0 silent",
        "000",
    )
    t.add_row(
        "tool results truncated",
        str(nc.get("truncated_tool_results", 0)),
        str(lc.get("tool_truncated", 0)),
        "002",
    )
    t.add_row("tool results spilled", "0 (no spill)", str(lc.get("tool_spilled", 0)), "002")
    t.add_row(
        "system-prompt damage (turns)",
        str(nc.get("system_prompt_damage", 0)),
        str(lc.get("system_prompt_damage", 0)),
        "002",
    )
    t.add_row(
        "compactions",
        _per100(nc.get("compactions", 0), n.turns),
        _per100(lc.get("compactions", 0), lg.turns),
        "001",
    )
    t.add_row(
        "failed compactions",
        f"{nc.get('failed_compactions', 0)} (unchecked, silent)",
        f"{lc.get('failed_compactions', 0)} (counted)",
        "001",
    )
    t.add_row("hard resets", "0 (no escalation)", str(lc.get("resets", 0)), "001")
    refusals = "; ".join(
        f"{k.split('_refused_')[0]}: {k.split('_refused_')[1]}={v}"
        for k, v in sorted(lc.items())
        if "_refused_" in k
    )
    t.add_row("refusals (operation: reason)", "none (truncates instead)", refusals or "0", "")
    classes = ", ".join(f"{k}={v}" for k, v in sorted(lg.classes.items()))
    t.add_row(
        "amplification classes",
        "not measured",
        f"{classes}; fan-out stopped {lc.get('fanout_guard_stops', 0)}x",
        "004",
    )
    t.add_row("over-allocations", str(nc.get("over_allocations", 0)), str(r.over_allocations), "")
    t.add_row(
        "ledger calls",
        "",
        f"{r.ledger_calls} at {r.ops_per_second:,.0f} ops/s, "
        f"p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms",
        "",
    )
    return t


def footer(r: FleetReport) -> str:
    jobs = ", ".join(f"{k}={v:g}" for k, v in sorted(r.worker_jobs.items()) if v)
    verdict = "clean" if r.audits_clean == r.audits_total else "VIOLATIONS"
    return (
        f"audit: {r.audits_clean}/{r.audits_total} sessions {verdict}; background worker: "
        f"{jobs or 'no jobs'}; {r.elapsed:.1f} s on {r.backend}"
    )


def plot(r: FleetReport, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional extra
        raise SystemExit("--plot needs matplotlib: pip install '.[plot]'") from exc
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    turns = range(len(r.naive.retrieval_curve))
    for a, style in ((r.naive, "--"), (r.ledger, "-")):
        top.plot(turns, a.retrieval_curve, style, label=a.name)
        bottom.plot(turns, a.residual_curve, style, label=a.name)
    top.set_ylabel("retrieval admitted (share)")
    top.set_ylim(-0.05, 1.05)
    top.legend()
    bottom.set_ylabel("residual working memory (tokens)")
    bottom.set_xlabel("turn")
    bottom.legend()
    fig.suptitle(f"{r.config.sessions} sessions, seed {r.config.seed}: naive vs ledger")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
