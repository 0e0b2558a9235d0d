"""What the benchmarks share: server time from INFO commandstats, phases interleaved over
rounds, a median ratio with its min-max, the machine they ran on, and their output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import redis

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def evalsha_usec(r: redis.Redis) -> float:
    """Server usec per EVALSHA since the last CONFIG RESETSTAT."""
    st = r.info("commandstats")["cmdstat_evalsha"]
    return float(st["usec"]) / float(st["calls"])


def phase_usec(r: redis.Redis, body: Callable[[], object]) -> float:
    """CONFIG RESETSTAT, body(), then the server usec per EVALSHA it sent."""
    r.config_resetstat()
    body()
    return evalsha_usec(r)


def commandstats(r: redis.Redis, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """{command: (calls, usec)} since the last CONFIG RESETSTAT, `skip` left out."""
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in r.info("commandstats").items()
        if name.removeprefix("cmdstat_").split("|")[0] not in skip
    }


def interleaved(rounds: int, phases: Mapping[str, Callable[[], T]]) -> dict[str, list[T]]:
    """Every phase once per round, their order rotated from round to round (drift
    cancels out); each phase's results in round order."""
    names = list(phases)
    out: dict[str, list[T]] = {n: [] for n in names}
    for rnd in range(rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(phases[name]())
    return out


def ratio_row(name: str, num: list[float], den: list[float], what: str) -> str:
    """One printed figure beside its reference: medians, median ratio (min-max)."""
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    n, d = statistics.median(num), statistics.median(den)
    return (
        f"{name:<44} {n:10.1f} {d:10.1f} {statistics.median(ratios):6.2f}x "
        f"({ratios[0]:.2f}-{ratios[-1]:.2f})  {what}"
    )


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_ticks() -> tuple[int, int, int]:
    """(steal, busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return f[7], sum(f[:8]) - f[3] - f[4], sum(f[:8])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def environment(r: redis.Redis) -> dict[str, Any]:
    """The server's version and the machine: what a figure depends on."""
    cfg = r.config_get("hash-max-listpack-*")
    return {
        "redis_version": r.info("server").get("redis_version"),
        "hash_max_listpack_entries": int(cfg.get("hash-max-listpack-entries") or -1),
        "hash_max_listpack_value": int(cfg.get("hash-max-listpack-value") or -1),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "hiredis": bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False)),
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def machine(env: dict[str, Any]) -> str:
    """The environment in two lines, for a report's head."""
    return (
        f"redis-server {env['redis_version']}  nproc={env['nproc']}  cpu={env['cpu_model']}  "
        f"python {env['python']}, redis-py {env['redis_py']} (hiredis {env['hiredis']}), "
        f"{env['platform']}\nload avg before/after {env['loadavg']}/{env.get('loadavg_after')}, "
        f"CPU steal during run {env.get('cpu_steal_pct_during_run', 'n/a')} %, "
        f"hash-max-listpack-entries/value {env['hash_max_listpack_entries']}/"
        f"{env['hash_max_listpack_value']}"
    )


@contextlib.contextmanager
def steal_during(env: dict[str, Any]) -> Any:
    """Adds the share of CPU time stolen by the hypervisor during the block to env."""
    t0 = cpu_ticks()
    yield
    t1 = cpu_ticks()
    if t1[2] > t0[2]:
        env["cpu_steal_pct_during_run"] = round(100 * (t1[0] - t0[0]) / (t1[2] - t0[2]), 2)
    env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]


def emit(res: Any, as_json: bool, show: Callable[[Any], None]) -> None:
    """Prints the result as one JSON object, or for a reader."""
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        show(res)


def table(
    title: str,
    header: list[str],
    rows: list[list[str]],
    left: tuple[str, ...] = (),
    width: int = 160,
) -> None:
    """A rich table: the first column and those in `left` left-aligned, the rest right."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for k, h in enumerate(header):
        t.add_column(h, justify="left" if k == 0 or h in left else "right")
    for row in rows:
        t.add_row(*row)
    console = Console()
    (console if console.is_terminal else Console(width=width)).print(t)
