"""The repository's layout: no symlinks, one import name for the worker, no file in
tests/ over 700 lines.

The Lua scripts live in the top-level ``lua/`` (the wheel ships them as ``ledger/lua/``);
the worker lives inside the package (``ledger/workers/``), the top-level ``workers/``
holding a README that points there (docs/contributing.md, "Why lua/ holds the scripts
and workers/ is a pointer").
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from ledger import (
    AdmissionRefused,
    Agent,
    AsyncLedger,
    Consumer,
    Item,
    Ledger,
    LedgerSettings,
    Session,
    SessionBudget,
    scripts,
)
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Metrics, Worker, WorkerSettings
from tests.support import servers
from tests.test_imports import LAYERS, layer_of

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = {".git", ".venv"}


def test_the_repository_holds_no_symlink() -> None:
    links = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED or Path(top) != ROOT]
        links += [Path(top, n) for n in [*dirs, *files] if Path(top, n).is_symlink()]
    assert not links, [str(p.relative_to(ROOT)) for p in links]
    # What git tracks too (mode 120000), which a checkout without symlink support
    # would turn into plain files.
    staged = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-s"], check=True, capture_output=True, text=True
    ).stdout
    tracked = [line.split("\t", 1)[1] for line in staged.splitlines() if line.startswith("120000")]
    assert not tracked, tracked


# --- the size of a module ----------------------------------------------------------------

# A module of the package does one job, in at most this many lines.
MODULE_LINES = 500
# Over it by design: the scripts' argument layouts and reply parsers, one table of the
# protocol (docs/protocol.md follows it), and the sync faces, generated (tools/unasync.py).
OVER_BY_DESIGN = {"ledger/protocol.py"}
GENERATED = "ledger/_sync/"
# Over it still, each to be split by its job. This list only shrinks: a module split
# leaves it (the test fails while a module of it is back under the limit), and no module
# joins it.
STILL_OVER: set[str] = set()


def test_no_module_is_over_500_lines() -> None:
    lines = {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
        for p in (ROOT / "ledger").rglob("*.py")
    }
    assert len(lines) >= 80 and "ledger/cli/__init__.py" in lines
    over = {m: n for m, n in lines.items() if n > MODULE_LINES and not m.startswith(GENERATED)}
    unlisted = {m: n for m, n in over.items() if m not in OVER_BY_DESIGN | STILL_OVER}
    assert not unlisted, f"over {MODULE_LINES} lines: {unlisted} (split it by its job)"
    # the allow-list only shrinks: a module under the limit again leaves it
    stale = sorted(m for m in STILL_OVER if m not in over)
    assert not stale, f"under {MODULE_LINES} lines now: take {stale} out of STILL_OVER"


def test_lua_holds_the_scripts_and_workers_is_a_pointer() -> None:
    lua = sorted(p.name for p in (ROOT / "lua").iterdir())
    assert lua == sorted(["README.md", "_common.lua", *(f"{n}.lua" for n in scripts.NAMES)])
    assert scripts.lua_dir().resolve() == (ROOT / "lua").resolve()  # (the editable install)
    assert not (ROOT / "ledger" / "lua").exists()
    assert sorted(p.name for p in (ROOT / "workers").iterdir()) == ["README.md"]
    readme = (ROOT / "workers" / "README.md").read_text()
    assert "ledger/workers/" in readme
    modules = sorted(p.name for p in (ROOT / "ledger" / "workers").glob("*.py"))
    unnamed = [m for m in modules if m != "__init__.py" and f"`{m}`" not in readme]
    assert not unnamed, f"workers/README.md does not name {unnamed}"
    assert (ROOT / "ledger" / "workers" / "runner.py").is_file()


def test_the_worker_is_one_module_object() -> None:
    """Run from the repository root (its folder first on sys.path): the worker is
    ledger.workers, whoever imports it, and there is no `workers` code to import."""
    code = (
        "import sys, ledger\n"
        "assert 'ledger.workers.runner' not in sys.modules  # import ledger: the client alone\n"
        "import ledger.cli, ledger.fleet.run, ledger.workers.runner as r\n"
        "assert ledger.Worker is r.Worker and ledger.WorkerSettings is r.WorkerSettings\n"
        "assert ledger.fleet.run.Worker is r.Worker\n"
        "assert r.Worker.__module__.startswith('ledger.workers.'), r.Worker.__module__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'workers'], sys.modules\n"
        "try:\n"
        "    import workers.runner\n"
        "except ModuleNotFoundError as exc:\n"
        "    assert exc.name == 'workers.runner', exc.name\n"
        "else:\n"
        "    raise AssertionError(f'imported {workers.runner.__file__}')\n"
        "import workers\n"  # the README's folder: at most an empty namespace package
        "assert getattr(workers, '__file__', None) is None, workers.__file__\n"
        "print('ONE WORKER')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "ONE WORKER" in proc.stdout


def test_the_contributing_map_names_every_module_and_folder() -> None:
    """docs/contributing.md's map stays true: every module at the top of the package and
    every folder of it (and of the repository) has its row."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    table = text[text.index("## The map") : text.index("**One operation, followed.**")]
    package = ROOT / "ledger"
    names = [f"ledger/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"]
    names += [f"ledger/{p.name}/" for p in package.iterdir() if p.is_dir() and p.name[0] != "_"]
    names += [f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and p.name[0] not in "._"]
    missing = [n for n in names if f"`{n}" not in table and not n.endswith(".egg-info/")]
    assert not missing, f"not in the map of docs/contributing.md: {missing}"
    # The subpackages' modules, each named in its folder's row (the worker's in its
    # __init__.py, which the row points to).
    rows = {line.split("`")[1]: line for line in table.splitlines() if line.startswith("| `")}
    for folder in ("agent", "adapters", "cli", "fleet", "models", "schema", "views", "workers"):
        row = rows[f"ledger/{folder}/"]
        if folder == "workers":
            row = (package / folder / "__init__.py").read_text()
        modules = sorted(p.name for p in (package / folder).glob("*.py") if p.stem != "__init__")
        unnamed = [m for m in modules if f"`{m}`" not in row]
        assert not unnamed, f"ledger/{folder}/ modules the map does not name: {unnamed}"


def test_no_file_in_tests_is_over_700_lines() -> None:
    """Tests are grouped by subject, a file per subject (docs/contributing.md, "Where
    tests go"): a file past 700 lines is split by subject, its helpers moved to a support
    module, not copied. Every file counts (tests/support/ too), its
    lines as ``wc -l`` counts them."""
    walked = sorted((ROOT / "tests").rglob("*"))
    files = [p for p in walked if p.is_file() and "__pycache__" not in p.parts]
    assert Path(__file__).resolve() in files and len(files) > 50, "the walk missed the tests"
    long = {str(p.relative_to(ROOT)): n for p in files if (n := p.read_bytes().count(b"\n")) > 700}
    assert not long, f"files in tests/ over 700 lines: {long}"


@pytest.mark.redis
def test_one_operation_runs_through_the_files_the_map_names(
    redis_server: servers.RedisProcess,
) -> None:
    """docs/contributing.md's "One operation, followed" stays true: the modules of the
    package whose code runs for ``session.admit`` on a real Redis are the six the
    paragraph walks through (with the scripts, eight files), and a refusal adds only
    ``errors.py``. A new hop on the path fails here until the map says so."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    paragraph = text[text.index("**One operation, followed.**") : text.index("**A compaction")]
    package = str(ROOT / "ledger") + os.sep
    entered: list[str] = []

    def trace(frame: FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            rel = Path(name).relative_to(ROOT).as_posix()
            if not entered or entered[-1] != rel:
                entered.append(rel)

    def traced(admit: Callable[[], object]) -> list[str]:
        entered.clear()
        before = sys.gettrace()  # (a coverage tool's or a debugger's, put back after)
        sys.settrace(trace)
        try:
            admit()
        finally:
            sys.settrace(before)
        return list(entered)

    def refused(s: Session) -> None:
        with pytest.raises(AdmissionRefused):
            s.admit(Consumer.RETRIEVAL, [Item("big", 5_000)])

    settings = LedgerSettings(redis_url=redis_server.url, prefix=f"t{uuid.uuid4().hex[:12]}")
    with Ledger.from_settings(settings) as led:
        s = led.open_session("followed", SessionBudget(window=4_000, system_prompt=100))
        s.admit(Consumer.RETRIEVAL, [Item("warm", 10)])  # scripts loaded, nothing lazy left
        taken = traced(lambda: s.admit(Consumer.RETRIEVAL, [Item("c1", 100)]))
        by_name = traced(lambda: s.admit("retrieval", [Item("c2", 100)]))
        refusal = traced(lambda: refused(s))

    async def asyncio_face() -> list[str]:
        async with AsyncLedger.from_settings(settings) as led:
            s = await led.open_session("followed", SessionBudget(window=4_000, system_prompt=100))
            await s.admit(Consumer.RETRIEVAL, [Item("warm", 10)])
            entered.clear()
            before = sys.gettrace()
            sys.settrace(trace)
            try:
                await s.admit(Consumer.RETRIEVAL, [Item("c3", 100)])
            finally:
                sys.settrace(before)
            return list(entered)

    on_asyncio = asyncio.run(asyncio_face())
    calls = ["ledger/core.py", "ledger/handles.py", "ledger/operations.py", "ledger/protocol.py",
             "ledger/session_calls.py"]  # fmt: skip
    assert sorted(set(on_asyncio)) == sorted([*calls, "ledger/_async/client.py"]), on_asyncio
    face = [*calls, "ledger/_sync/client.py"]
    assert sorted(set(taken)) == sorted(set(by_name)) == sorted(face), (taken, by_name)
    assert len(taken) == 8, taken  # the paragraph's eight stretches
    assert sorted(set(refusal)) == sorted([*face, "ledger/errors.py"]), refusal
    unnamed = sorted(
        f for f in {*refusal, *on_asyncio, "lua/admit.lua"} if f"`{f}`" not in paragraph
    )
    assert not unnamed, f"admit runs code of {unnamed}, which the map's walk does not name"


# --- a compaction, followed ------------------------------------------------------------------


def _words(text: str) -> int:
    return len(text.split())


def _gist(request: CompactionRequest) -> CompactionPlan:
    """A summarizer's plan: the stored texts of every working-memory item but the newest
    replaced by one summary with its text."""
    old = [i for i in request.items if request.text_of(i) is not None][:-1]
    text = "gist of " + " ".join(i.id for i in old)
    summary = Item(f"gist-{request.turn}", _words(text), 1000)
    return CompactionPlan(tuple((i.consumer, i.id) for i in old), summary, text)


# The layers whose modules are the walk's own (the scripts too): those above the client's
# faces. Below them, every call runs through the same call path (docs/contributing.md).
_OWN_FROM = [name for name, _ in LAYERS].index("agent")


@pytest.mark.redis
def test_a_compaction_runs_through_the_files_the_map_names(
    redis_server: servers.RedisProcess,
) -> None:
    """docs/contributing.md's "A compaction job, followed" stays true: a compaction traced
    on a real Redis, from the agent's end of turn through the worker (its job threads
    too) to the agent's next turn, which hands the summary over, runs exactly the files
    the paragraph names; at most 12 of them are the walk's own (the scripts, and the
    modules above the client's faces)."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    paragraph = text[text.index("**A compaction job, followed.**") : text.index("## The import")]
    package = str(ROOT / "ledger") + os.sep
    lua = scripts.lua_dir()
    entered: set[str] = set()

    def trace(frame: FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(package):
            return
        entered.add(Path(name).relative_to(ROOT).as_posix())
        if frame.f_code.co_name == "_evalsha":  # a script sent: its file, and _common.lua's
            script = frame.f_locals["call"].script
            body = (lua / f"{script}.lua").read_text()
            for used in [f"{script}.lua"] + (["_common.lua"] if scripts.prelude(body) else []):
                entered.add((lua / used).relative_to(ROOT).as_posix())

    def traced(step: Callable[[], object]) -> object:
        before = sys.gettrace()
        sys.settrace(trace)
        threading.settrace(trace)  # the worker's job threads, started by this step
        try:
            return step()
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
            sys.settrace(before)

    system = "You are a helpful assistant."
    budget = SessionBudget(window=4_000, system_prompt=_words(system), framing_tolerance=0)
    settings = LedgerSettings(redis_url=redis_server.url, prefix=f"t{uuid.uuid4().hex[:12]}")
    with Ledger.from_settings(settings) as led:
        agent = Agent(led.open_session("walked", budget), _words)
        worker = Worker(led, WorkerSettings(consumer="walk"), Metrics(), compactor=_gist)
        worker.ensure_groups()
        prompt: list[dict[str, str]] = []
        for n in range(20):
            turn = agent.turn()
            t = turn.__enter__()
            message = {"id": f"m{n}", "role": "user", "content": f"turn {n} " + "word " * 600}
            prompt += list(t.admit("working_memory", [message]).kept)
            t.prompt([system, *prompt])
            entered.clear()
            traced(lambda: turn.__exit__(None, None, None))  # noqa: B023 (called at once)
            assert t.report is not None
            if t.report.compaction_due:
                break
        assert t.report.compaction_due, "no compaction came due"
        assert traced(worker.poll_once) == 1
        turn = agent.turn()
        t = traced(turn.__enter__)  # type: ignore[assignment]
        assert t.summaries and t.dropped, "the next turn hands the summary over"
        gone = {id(o) for o in t.dropped}
        prompt = [o for o in prompt if id(o) not in gone] + list(t.summaries)
        t.prompt([system, *prompt])
        turn.__exit__(None, None, None)
        worker.close()
    walked = sorted(entered)
    own = [f for f in walked if f.endswith(".lua") or rank(f) >= _OWN_FROM]
    named = set(re.findall(r"`((?:ledger/|lua/)[\w/]+\.(?:py|lua))`", paragraph))
    assert sorted(named) == walked, f"traced {walked}; the paragraph names {sorted(named)}"
    assert len(own) <= 12, own
    print(f"compaction walk: {len(walked)} files, {len(own)} its own: {own}")


def rank(path: str) -> int:
    """The layer (docs/contributing.md, The import layers) of a module given by path."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    found = layer_of(".".join(parts), LAYERS)
    assert found is not None, path
    return found
