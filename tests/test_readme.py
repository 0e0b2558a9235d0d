"""The README and docs/*.md stay true: every code block in them runs as written.

Each fenced block is tagged with its language, and the tag says how it is checked:

* ``python``: executed as written (in a fresh module, against the embedded backend the
  block names), twice in a row in one process, so that a block is idempotent across
  runs (it deletes what it opens, or uses ids of its own);
* ``bash``: every command is checked without side effects: ``ledger ...`` lines are
  parsed by the CLI's own parser, ``python -m M`` modules must exist, ``pip install``
  extras must be defined in pyproject.toml, environment variables must be ones the
  package reads, ``docker compose`` profiles must exist in docker-compose.yml;
* ``text``: not run (program output, a key layout, a Redis ACL line): the tag says so.

A block without a tag, or with another one, fails.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import yaml

from ledger import cli
from ledger.settings import LedgerSettings
from ledger.workers.runner import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LANGS = {"python", "bash", "text"}


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, line of the opening fence) of every fenced block of a page."""
    text = page.read_text()
    return [
        (m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1)
        for m in FENCE.finditer(text)
    ]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_tagged_with_how_it_is_checked(page: Path) -> None:
    tags = [(lang, line) for lang, _, line in blocks(page) if lang not in LANGS]
    assert not tags, f"{page_id(page)}: blocks tagged {tags}; use one of {sorted(LANGS)}"


RUNNABLE = [p for p in PAGES if any(lang == "python" for lang, _, _ in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_blocks_run_as_written_twice(page: Path) -> None:
    for lang, code, line in blocks(page):
        if lang != "python":
            continue
        for run in (1, 2):
            # A real module: typing annotations (a graph's state) resolve in its namespace.
            module = types.ModuleType(f"docs_{page.stem}_{line}_{run}")
            sys.modules[module.__name__] = module
            try:
                # Line numbers in tracebacks are the page's own.
                source = "\n" * line + code
                exec(compile(source, f"{page_id(page)} (run {run})", "exec"), module.__dict__)
            finally:
                del sys.modules[module.__name__]


# --- shell blocks ------------------------------------------------------------------------------

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROFILES = {p for svc in COMPOSE["services"].values() for p in svc.get("profiles", [])}
# Every environment variable the package reads is named in its source.
ENV_VARS = {
    name
    for path in (ROOT / "ledger").rglob("*.py")
    for name in re.findall(r"\bLEDGER_[A-Z0-9_]+\b", path.read_text())
}
ENV_VARS |= {f"LEDGER_{field.upper()}" for field in LedgerSettings.model_fields}
ENV_VARS |= {f"LEDGER_WORKER_{field.upper()}" for field in WorkerSettings.model_fields}
UNCHECKED = {"apt-get", "redis-cli", "redis-server", "curl"}  # system tools, not ours


def check_command(argv: list[str]) -> None:
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # NAME=value cmd
        check_env(argv.pop(0))
    if not argv:
        return
    prog = argv[0].removeprefix(".venv/bin/")
    if prog == "export":
        for assignment in argv[1:]:
            check_env(assignment)
    elif prog == "ledger":
        try:
            cli.build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            if exc.code == 0 and {"--version", "--help", "-h"} & set(argv):
                return  # it prints and exits 0, as it should
            pytest.fail(f"`{shlex.join(argv)}` is not a valid ledger command line ({exc})")
    elif prog in ("python", "python3") and argv[1].endswith(".py"):
        # a script of the repository, with options its own parser takes
        script = ROOT / argv[1]
        assert script.is_file(), f"no script {argv[1]}"
        flags = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
        if flags:  # the options its own parser prints
            shown = subprocess.run(
                [sys.executable, str(script), "--help"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                check=True,
            ).stdout
            for flag in flags:
                assert re.search(rf"{re.escape(flag)}\b", shown), f"{argv[1]} has no option {flag}"
    elif prog in ("python", "python3"):
        assert argv[1] == "-m", argv
        if argv[2] != "venv":
            assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
    elif prog == "pip":
        assert argv[1] == "install", argv
        for spec in argv[2:]:
            for extras in re.findall(r"\[([^\]]+)\]", spec):
                missing = set(extras.split(",")) - EXTRAS
                assert not missing, f"`{spec}`: no extra {missing} in pyproject.toml"
    elif prog == "pytest":
        for arg in argv[1:]:
            if not arg.startswith("-") and arg.startswith("tests"):
                assert (ROOT / arg.split("::")[0]).exists(), arg
    elif prog == "promtool":  # the files it checks are the repository's
        assert argv[1] in ("check", "test"), argv
        for arg in argv[3:]:
            assert (ROOT / arg).is_file(), f"no file {arg}"
    elif prog == "docker":
        assert argv[1] == "compose", argv
        if "--profile" in argv:
            profile = argv[argv.index("--profile") + 1]
            assert profile in PROFILES, f"no profile {profile} in docker-compose.yml"
    else:
        assert prog in UNCHECKED, f"`{shlex.join(argv)}`: no check for {prog}"


def check_env(assignment: str) -> None:
    name = assignment.split("=", 1)[0]
    assert name in ENV_VARS, f"{name} is not an environment variable the ledger reads"


SHELL = [p for p in PAGES if any(lang == "bash" for lang, _, _ in blocks(p))]


@pytest.mark.parametrize("page", SHELL, ids=page_id)
def test_shell_blocks_name_real_commands_options_and_settings(page: Path) -> None:
    for lang, code, _ in blocks(page):
        if lang != "bash":
            continue
        for line in code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                check_command(argv)


# --- the README's shape ------------------------------------------------------------------------


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", README, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def test_readme_fits_on_a_screen_or_two() -> None:
    assert len(README.splitlines()) <= 250


def test_quick_start_is_two_commands() -> None:
    block = re.search(r"```bash\n(.*?)```", sections()["Quick start"], re.S)
    assert block is not None
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("ledger demo") and '-e ".[dev]"' in commands[0]
    assert commands[1] == ".venv/bin/pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci and '-e ".[dev]"' in ci


def test_agent_loop_follows_quick_start_and_is_short() -> None:
    titles = list(sections())
    assert titles[titles.index("Quick start") + 1] == "The agent loop"
    code = re.search(r"```python\n(.*?)```", sections()["The agent loop"], re.S)
    assert code is not None
    # Open a session, begin a turn, admit, end the turn with the real prompt's size.
    for step in ("open_session(", "agent.turn(", "turn.admit(", "turn.prompt("):
        assert step in code.group(1), step
    assert len(code.group(1).splitlines()) <= 30


RULE_REF = re.compile(r"rules\.md#([a-z0-9-]+)")


def anchors(page: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in heads}


def test_references_to_the_rules_name_real_sections() -> None:
    known = anchors(ROOT / "docs" / "rules.md")
    refs: dict[str, set[str]] = {}
    for folder in ("ledger", "workers", "lua", "bench", "tests", "docs", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".lua", ".md"):
                for ref in RULE_REF.findall(path.read_text()):
                    refs.setdefault(ref, set()).add(str(path.relative_to(ROOT)))
    for ref in RULE_REF.findall(README):
        refs.setdefault(ref, set()).add("README.md")
    assert refs
    unknown = {ref: sorted(where) for ref, where in refs.items() if ref not in known}
    assert not unknown, f"no such section in docs/rules.md: {unknown}"
