"""The per-seed table of docs/demo.md: one column per run of ``ledger demo --json``.

``python -m ledger.fleet.table RUN.json ...`` prints the markdown table from the JSON
of each run (``ledger demo --json --seed N > RUN.json``, ``--large`` for the large
fleet); each figure with its n. ``--run SEED ...`` (and ``--large SEED``) runs the
demos first, on embedded, and writes their JSON beside the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ledger.fleet.checks import acceptance

S = dict[str, Any]
COLUMNS = (("naive", "naive"), ("ledger", "ledger"), ("off", "without its rule"))


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _cols(s: S, scenario: str, fig: Callable[[S], str]) -> list[tuple[str, str]]:
    out = []
    for key, name in COLUMNS:
        a = s.get(key)
        if a and scenario in a:
            out.append((name, fig(a)))
    return out


def _rate(a: S) -> str:
    r = a["retrieval_admission"]
    return " / ".join(_f(r[t]["rate"]) for t in ("10", "60", "120")) + (
        f" (n {r['10']['sessions']} / {r['60']['sessions']} / {r['120']['sessions']} sessions)"
    )


def _low(a: S) -> str:
    low = a["retrieval_min"]
    return "n/a" if low is None else f"{low['rate']:.2f} (turn {low['turn']})"


def _spread(a: S) -> str:
    q = a["per_session_retrieval_after_40"]
    if not q["n"]:
        return "n/a"
    return f"{q['p10']:.2f} / {q['p50']:.2f} / {q['p90']:.2f} (n {q['n']})"


def _interval(a: S) -> str:
    iv = a["compaction_interval"]
    return f"{_f(iv['early'], '.1f')} / {_f(iv['late'], '.1f')} (n {a['compactions']})"


def _post(a: S) -> str:
    p = a["post_compaction_occupancy"]
    return f"{_f(p['first'])} / {_f(p['late'])}"


def _slo(a: S) -> str:
    slo = a["slo"]
    return (
        f"{100 * slo['over_share']:.2f}% of {slo['turns']} (p95 {_f(slo['p95_ms'], '.0f')} ms; "
        f"{slo['waited_turns']} waited, median {_f(slo['waited_ms_median'], '.0f')} ms)"
    )


def _refusals(a: S) -> str:
    r = a["retrieval_refusals"]
    return ", ".join(f"{k}={v}" for k, v in sorted(r.items())) or "none"


def _resets(a: S) -> str:
    return (
        f"{a['resets']} resets, {a['context_discarded']} tokens discarded "
        f"(median {_f(a['discarded_per_reset_median'], '.0f')})"
    )


def _starv(a: S) -> str:
    st = a["starvation"]
    f = st.get("failures", {})
    out = (
        f"{st['short_turns']}/{st['turns_after_5']} short; failed "
        f"{sum(f.values())} ({', '.join(f'{k} {v}' for k, v in sorted(f.items())) or 'none'})"
    )
    if "fetched_again" in st:
        out += f"; fetched again {st['fetched_again']} ({st['fetched_again_tokens']} tokens)"
    return out


def _trunc(a: S) -> str:
    t = a["truncation_loop"]
    return (
        f"{t['compression_events']} / {t['damaged_turns']} / {t['forbidden_calls']} / "
        f"{t['truncated']} / {t['repeated_calls']} ({t.get('spilled', 0)} spilled)"
    )


def _fan(a: S) -> str:
    f = a["fanout"]
    return (
        f"{f['ratio_first']:.1f} → {f['ratio_last']:.1f}; {f['utilization_first']:.2f} → "
        f"{f['utilization_last']:.2f}; p99 {f['p99_first_ms'] / 1000:.1f} → "
        f"{f['p99_last_ms'] / 1000:.1f} s"
    )


ROWS: tuple[tuple[str, str, Callable[[S], str]], ...] = (
    ("001 retrieval @10/60/120", "retrieval_admission", _rate),
    ("001 lowest retrieval (turn)", "retrieval_admission", _low),
    ("001 per session, retrieval from turn 40: p10 / p50 / p90", "retrieval_admission", _spread),
    ("001 compaction interval early / late (n compactions)", "retrieval_admission", _interval),
    ("001 post-compaction occupancy first / late", "retrieval_admission", _post),
    ("001 turns over 900 ms (turns that waited)", "retrieval_admission", _slo),
    ("001 retrieval refusals", "retrieval_admission", _refusals),
    ("001 hard resets, context discarded", "retrieval_admission", _resets),
    ("000 short turns; failures; fetched again", "starvation", _starv),
    (
        "002 compressions / damaged turns / forbidden calls / truncations / repeats",
        "truncation_loop",
        _trunc,
    ),
    ("004 amplification; utilization; p99 (first → last turn)", "fanout", _fan),
)


def _label(s: S) -> str:
    c = s["config"]
    return f"{'--large' if c['sessions'] >= 330 else 'default'}, seed {c['seed']}"


def table(runs: Sequence[S]) -> str:
    head = "| figure | column | " + " | ".join(_label(s) for s in runs) + " |"
    lines = [head, "|" + "---|" * (len(runs) + 2)]
    for name, scenario, fig in ROWS:
        cells = [dict(_cols(s, scenario, fig)) for s in runs]
        for _, col in COLUMNS:
            if any(col in c for c in cells):
                lines.append(
                    f"| {name} | {col} | " + " | ".join(c.get(col, "") for c in cells) + " |"
                )
    checks = []
    for s in runs:
        acc = acceptance(s)
        checks.append(f"{sum(c['pass'] for c in acc.values())}/{len(acc)}")
    lines.append("| acceptance checks passed | | " + " | ".join(checks) + " |")
    lines.append("| wall time | | " + " | ".join(f"{s['elapsed_s']:.0f} s" for s in runs) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ledger.fleet.table", description=__doc__)
    p.add_argument("json", nargs="*", help="the JSON of `ledger demo --json` runs")
    p.add_argument("--run", type=int, nargs="*", default=[], help="run the default demo: seeds")
    p.add_argument("--large", type=int, nargs="*", default=[], help="run --large: seeds")
    p.add_argument("--out", default=".", help="where --run writes each run's JSON")
    args = p.parse_args(argv)
    paths = [Path(x) for x in args.json]
    for seed, large in [(s, False) for s in args.run] + [(s, True) for s in args.large]:
        path = Path(args.out) / f"demo-{'large-' if large else ''}{seed}.json"
        cmd = [sys.executable, "-m", "ledger.cli", "--url", f"embedded://table{seed}", "demo"]
        cmd += ["--json", "--seed", str(seed)] + (["--large"] if large else [])
        with path.open("w") as out:
            subprocess.run(cmd, stdout=out, check=False)
        paths.append(path)
    print(table([json.loads(x.read_text()) for x in paths]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
