"""The alert rules and the Grafana dashboard in deploy/: valid PromQL (promtool), rules
that fire when they should (promtool test rules), and only metrics the worker exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ledger.workers.runner import Metrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ledger.json"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is needed (apt-get install prometheus; .ci/run installs it)"
    return found


def exported() -> set[str]:
    """Every sample name the worker's registry can export (counters' _total, a
    histogram's _bucket, _sum and _count)."""
    names = set()
    for metric in Metrics().registry.collect():
        names.add(metric.name)
        kind = metric.type
        if kind == "counter":
            names.add(f"{metric.name}_total")
        elif kind == "histogram":
            names |= {f"{metric.name}_{s}" for s in ("bucket", "sum", "count")}
        elif kind == "info":
            names.add(f"{metric.name}_info")
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bledger_[a-z_]+\b", expr))


def dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in data["panels"] for t in p["targets"]]


def test_alert_rules_pass_promtool() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_alert_rules_fire_when_they_should() -> None:
    """A stalled job loop and an unreachable Redis page; a fleet with an observer does
    not alert; workers that cannot be scraped page (the cases in alerts_test.yml)."""
    done = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


DOWN_GROUP = "ledger-workers-down"  # rules on Prometheus's `up`, in a group of their own


def test_workers_down_pages_when_every_scrape_fails(tmp_path: Path) -> None:
    """Every scrape of the workers failing: their metrics are gone and every rule on
    them stays silent (alerts_test.yml asserts it), so the rules on `up` page: each
    worker down, none up, none known (absent), no worker metrics at all. Without the
    group those same cases fail: nothing else would have paged."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    down = next(g for g in groups if g["name"] == DOWN_GROUP)
    names = {r["alert"] for r in down["rules"]}
    assert names == {
        "LedgerWorkerDown",
        "LedgerWorkersAllDown",
        "LedgerWorkersAbsent",
        "LedgerWorkerMetricsAbsent",
    }
    exprs = " ".join(r["expr"] for r in down["rules"])
    assert 'up{job="ledger-worker"} == 0' in exprs and 'absent(up{job="ledger-worker"})' in exprs
    # the same unit tests against the rules without the group
    without = {"groups": [g for g in groups if g["name"] != DOWN_GROUP]}
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(without))
    shutil.copy(RULES.parent / "alerts_test.yml", tmp_path / "alerts_test.yml")
    done = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    missed = set(re.findall(r"alertname: (\w+)", done.stdout + done.stderr))
    assert missed == names, done.stdout + done.stderr


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each panel's query, as a recording rule, passes promtool's parser."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"ledger:panel_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_only_metrics_the_worker_exports(source: str) -> None:
    if source == "alerts":
        groups = yaml.safe_load(RULES.read_text())["groups"]
        exprs = [r["expr"] for g in groups for r in g["rules"]]
    else:
        exprs = dashboard_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, "no ledger metric in the queries"
    assert used <= exported(), used - exported()
