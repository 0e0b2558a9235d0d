"""The wheel: built from the repo, installed into fresh venvs outside it, and used.

The development venv has the package installed editable, where the scripts are
found in the checkout's lua/; only a real install proves the wheel ships them (mapped
into the package as ledger/lua/). Two venvs
in a temporary directory: ``core`` with the package alone (the client's dependencies
only) and ``demo`` with the ``demo`` extra (embedded, cli, worker). Every command runs
with its cwd in that directory, so nothing is imported from the repo. Dependencies come
from the package index, so the installs take a while.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ledger import scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
DIST = "redis-token-ledger"
CORE = {"redis", "pydantic", "pydantic-settings", "tenacity"}
# Distributions (and their import names) that only extras may bring in.
EXTRA_ONLY = {"fakeredis", "lupa", "rich", "prometheus-client", "pygments", "hiredis"}
EXTRA_MODULES = ("fakeredis", "lupa", "rich", "prometheus_client", "pygments", "hiredis")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("LEDGER_")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


def run(
    cmd: list[str],
    *,
    cwd: Path,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    code: int = 0,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=clean_env() if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == code, (
        f"{cmd} exited {proc.returncode}, not {code}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def ledger(self) -> str:
        return str(self.root / "bin" / "ledger")

    @property
    def site(self) -> Path:
        (site,) = self.root.glob("lib/python*/site-packages")
        return site

    @property
    def cwd(self) -> Path:
        """A directory beside the venv, outside the repo: nothing of the repo on sys.path."""
        return self.root.parent

    def distributions(self) -> dict[str, metadata.Distribution]:
        return {
            canonicalize_name(d.metadata["Name"]): d
            for d in metadata.distributions(path=[str(self.site)])
        }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)], cwd=out)
    (whl,) = out.glob("redis_token_ledger-*.whl")
    return whl


def install(tmp: Path, requirement: str) -> Venv:
    assert not tmp.resolve().is_relative_to(ROOT)
    venv = Venv(tmp / "venv")
    run([sys.executable, "-m", "venv", str(venv.root)], cwd=tmp, timeout=120)
    run([venv.python, "-m", "pip", "install", "-q", requirement], cwd=tmp, timeout=600)
    return venv


@pytest.fixture(scope="module")
def core(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """The package alone: what a client installs."""
    return install(tmp_path_factory.mktemp("core"), str(wheel))


@pytest.fixture(scope="module")
def demo(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """The package with the `demo` extra: the embedded backend, the cli and the worker."""
    return install(tmp_path_factory.mktemp("demo"), f"{DIST}[demo] @ {wheel.as_uri()}")


def test_wheel_ships_the_scripts(wheel: Path) -> None:
    """The repository's lua/*.lua, and nothing else of lua/, in the wheel's ledger/lua/;
    ledger/workers/ as in the repository."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        expected = {"ledger/lua/_common.lua", "ledger/py.typed"}
        expected |= {f"ledger/lua/{n}.lua" for n in scripts.NAMES}
        assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
        # The wheel's files under ledger/lua/ and ledger/workers/ are the repo's (lua/ and
        # ledger/workers/), no more, no less.
        for folder, repo in (("ledger/lua", "lua"), ("ledger/workers", "ledger/workers")):
            shipped = {n for n in names if n.startswith(folder + "/")}
            in_repo = {
                f"{folder}/{p.name}"
                for p in (ROOT / repo).iterdir()
                if p.is_file() and p.suffix in (".lua", ".py")
            }
            assert shipped == in_repo, (folder, shipped ^ in_repo)
            for name in sorted(shipped):
                source = ROOT / repo / Path(name).name
                assert z.read(name) == source.read_bytes(), f"{name} differs from {source}"
        assert len({n for n in names if n.startswith("ledger/lua/")}) == len(scripts.NAMES) + 1
        assert "ledger/workers/runner.py" in names
        assert not any(n.startswith("lua/") for n in names), "lua/ only as ledger/lua/"
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "ledger = ledger.cli:main" in z.read(entry_points).decode()


def test_sdist_holds_lua_and_builds_the_same_wheel(tmp_path: Path) -> None:
    """The sdist holds the repository's lua/ (the scripts and the README), and a wheel
    built from it ships the scripts in ledger/lua/."""
    run([sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)], cwd=tmp_path)
    (sdist,) = tmp_path.glob("redis_token_ledger-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    repo = {f"lua/{p.name}" for p in (ROOT / "lua").iterdir() if p.is_file()}
    assert {n for n in names if n.startswith("lua/")} == repo
    assert "lua/README.md" in repo and "lua/_common.lua" in repo
    (built,) = tmp_path.glob("redis_token_ledger-*.whl")  # (build makes it from the sdist)
    with zipfile.ZipFile(built) as z:
        shipped = {n for n in z.namelist() if n.startswith("ledger/lua/")}
    assert shipped == {f"ledger/{n}" for n in repo if n.endswith(".lua")}


def test_wheel_has_one_import_name(wheel: Path) -> None:
    """RECORD lists every file the wheel installs: all of them under ledger/, nothing at
    the top of site-packages (no workers/, no lua/) that would shadow a user's module."""
    with zipfile.ZipFile(wheel) as z:
        (record,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        paths = [line.rsplit(",", 2)[0] for line in z.read(record).decode().splitlines()]
        dist_info = record.split("/")[0]
    tops = {p.split("/")[0] for p in paths if p} - {dist_info}
    assert tops == {"ledger"}, tops


def test_wheel_ships_the_generated_faces_not_their_generator(wheel: Path) -> None:
    """ledger/_sync/ is generated from ledger/_async/ by tools/unasync.py, a script of the
    repository: the wheel carries both faces as checked in, and no generator."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for face in ("client", "agent"):
            for side in ("_async", "_sync"):
                name = f"ledger/{side}/{face}.py"
                assert z.read(name) == (ROOT / name).read_bytes(), name
    assert not [n for n in names if "unasync" in n or n.startswith("tools/")]


def test_wheel_requires_only_the_client(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    reqs = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    core = {canonicalize_name(r.name) for r in reqs if r.marker is None}
    assert core == CORE
    extras = {line.split(":", 1)[1].strip() for line in lines if line.startswith("Provides-Extra:")}
    assert {"embedded", "cli", "worker", "demo", "all", "dev", "plot", "summarizer"} <= extras


def closure(dists: Mapping[str, metadata.Distribution], name: str) -> set[str]:
    """``name`` and what its requirements (no extras) pull in, recursively."""
    seen: set[str] = set()
    todo = [canonicalize_name(name)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for line in dists[n].requires or []:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return seen


def test_core_install_is_the_client_closure(core: Venv) -> None:
    dists = core.distributions()
    installed = set(dists) - {"pip", "setuptools"}
    assert installed == closure(dists, DIST), installed ^ closure(dists, DIST)
    assert installed >= CORE
    assert not installed & EXTRA_ONLY, installed & EXTRA_ONLY
    pip_list = run([core.python, "-m", "pip", "list", "--format=freeze"], cwd=core.cwd).stdout
    listed = {canonicalize_name(line.split("==")[0]) for line in pip_list.split()}
    assert listed - {"pip", "setuptools"} == installed


IMPORTS = textwrap.dedent(
    f"""
    import sys
    import ledger, ledger.agent, ledger.aio, ledger.client, ledger.testing
    from ledger import Agent, AsyncAgent, Item, Ledger, Session, SessionBudget
    bad = [m for m in {EXTRA_MODULES!r} if m in sys.modules]
    assert not bad, bad
    assert ledger.__file__.startswith(sys.prefix), ledger.__file__
    """
)


def test_import_loads_no_extra(core: Venv) -> None:
    run([core.python, "-c", IMPORTS], cwd=core.cwd)


AGENT_LOOP = textwrap.dedent(
    """
    import sys

    from ledger import Agent, EstimatingCounter, Ledger, SessionBudget, UnknownSession
    from ledger.testing import standalone

    tokens = EstimatingCounter()
    SYSTEM = "You answer questions about the handbook."
    budget = SessionBudget(window=4_000, system_prompt=tokens(SYSTEM), output_reserve=500,
                           working_memory_floor=500, framing_tolerance=0)
    with standalone() as server, Ledger.from_url(server.url) as led:
        session = led.open_session("pkg/agent-1", budget)
        agent = Agent(session, tokens)
        prompt = {}
        for n in range(3):
            with agent.turn(working_set=300) as turn:
                for gone in turn.dropped:
                    del prompt[gone["id"]]
                question = {"id": f"user-{n}", "content": f"question {n}? " * 20}
                turn.admit("working_memory", [question])
                docs = turn.admit("retrieval", [{"id": f"doc-{n}-{i}", "content": "text " * 120}
                                                for i in range(4)])
                prompt |= {d["id"]: d for d in [question, *docs.kept]}
                turn.prompt([SYSTEM, *prompt.values()])
            assert turn.report.turn == n + 1 and turn.report.drift == 0, turn.report
        assert session.audit().clean
        assert session.delete().deleted
        try:
            session.snapshot()
        except UnknownSession:
            pass
        else:
            raise AssertionError("the session outlived delete()")
    bad = [m for m in ("fakeredis", "lupa", "rich", "prometheus_client") if m in sys.modules]
    assert not bad, bad
    print("AGENT LOOP OK")
    """
)


def test_agent_loop_on_real_redis_with_the_core_install(core: Venv) -> None:
    assert "AGENT LOOP OK" in run([core.python, "-c", AGENT_LOOP], cwd=core.cwd).stdout


MISSING = textwrap.dedent(
    """
    from ledger import Ledger, MissingExtra
    try:
        Ledger.from_url("embedded://")
    except MissingExtra as exc:
        print(exc)
    else:
        raise AssertionError("embedded:// worked without fakeredis")
    """
)


def test_a_missing_extra_names_its_install_line(core: Venv) -> None:
    out = run([core.python, "-c", MISSING], cwd=core.cwd).stdout
    assert 'pip install "redis-token-ledger[embedded]"' in out
    for argv, extra in [
        (["demo"], "demo"),
        (["--url", "redis://127.0.0.1:1/0", "top", "--once"], "cli"),
        (["--url", "redis://127.0.0.1:1/0", "audit"], "cli"),
        (["--url", "redis://127.0.0.1:1/0", "worker", "--once", "--compactor", "none"], "worker"),
    ]:
        proc = run([core.ledger, *argv], cwd=core.cwd, code=2)
        assert f'pip install "redis-token-ledger[{extra}]"' in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
    assert "worker" in run([core.ledger, "--help"], cwd=core.cwd).stdout


USE = textwrap.dedent(
    """
    import sysconfig
    from pathlib import Path

    import ledger
    from ledger import Item, Ledger, SessionBudget, scripts

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    lua = scripts.lua_dir().resolve()
    assert lua.is_relative_to(site), (lua, site)
    assert Path(ledger.__file__).resolve().is_relative_to(site), ledger.__file__
    common = (lua / "_common.lua").read_text()
    for name in scripts.NAMES:
        src = scripts.source(name)
        body = (lua / f"{name}.lua").read_text()
        assert src == scripts.wrap(scripts.prelude(body) + "\\n" + body), name
        assert all(d.text in common for d in scripts.definitions())
        assert "local function fail(" in src, name  # the prelude came from the wheel's file

    with Ledger.from_url("embedded://packaging") as led:
        s = led.open_session("pkg/s-1", SessionBudget(window=8_000, system_prompt=500))
        got = s.admit("retrieval", [Item("doc1#0", 321)])
        assert got.charged == 321 and got.admitted == 1, got
        assert s.audit().clean
    print("LUA_DIR", lua)
    """
)


def test_installed_wheel_works_outside_the_repo(demo: Venv) -> None:
    out = run([demo.python, "-c", USE], cwd=demo.cwd).stdout
    lua_dir = Path(out.split("LUA_DIR", 1)[1].strip())
    assert not lua_dir.is_relative_to(ROOT)
    for name in ("_common", *scripts.NAMES):
        repo_file = ROOT / "lua" / f"{name}.lua"
        assert (lua_dir / f"{name}.lua").read_bytes() == repo_file.read_bytes()

    # The console script the Dockerfile and docker-compose.yml run.
    assert "worker" in run([demo.ledger, "--help"], cwd=demo.cwd).stdout
    run(
        [demo.ledger, "--url", "embedded://", "worker", "--once", "--compactor", "none"],
        cwd=demo.cwd,
        timeout=60,
    )


def test_demo_runs_with_the_demo_extra(demo: Venv) -> None:
    # The options of tests/test_cli.py's demo: a fleet too small for the late-turn
    # checks, so it exits 1 (a check failed) after printing every figure.
    argv = ["demo", "--sessions", "4", "--workers", "2", "--max-turns", "25", "--json"]
    proc = run([demo.ledger, *argv], cwd=demo.cwd, timeout=300, code=1)
    assert '"acceptance"' in proc.stdout, proc.stdout[-2000:]
    dists = demo.distributions()
    assert {"fakeredis", "lupa", "rich", "prometheus-client"} <= set(dists)
    assert "matplotlib" not in dists  # plot is an extra of its own
    proc = run([demo.ledger, "demo", "--plot", "x.png"], cwd=demo.cwd, code=2)
    assert 'pip install "redis-token-ledger[plot]"' in proc.stderr, proc.stderr


def test_a_users_workers_package_changes_nothing(demo: Venv) -> None:
    """A top-level `workers` of the user's, first on sys.path, is theirs: the ledger's
    worker is ledger.workers and never imports `workers`."""
    user = demo.cwd / "user"
    (user / "workers").mkdir(parents=True)
    (user / "workers" / "__init__.py").write_text("")
    (user / "workers" / "runner.py").write_text("raise RuntimeError('the user runner')\n")
    env = clean_env(PYTHONPATH=str(user))
    assert "--compactor" in run([demo.ledger, "worker", "--help"], cwd=demo.cwd, env=env).stdout
    code = (
        "import ledger.workers.runner as r, workers, sys\n"
        "assert r.__file__.startswith(sys.prefix), r.__file__\n"
        f"assert workers.__file__.startswith({str(user)!r}), workers.__file__\n"
    )
    run([demo.python, "-c", code], cwd=demo.cwd, env=env)
    run(
        [demo.ledger, "--url", "embedded://", "worker", "--once", "--compactor", "none"],
        cwd=demo.cwd,
        env=env,
        timeout=60,
    )
    # The user's module is really first on the path: importing it raises.
    proc = run([demo.python, "-c", "import workers.runner"], cwd=demo.cwd, env=env, code=1)
    assert "the user runner" in proc.stderr
