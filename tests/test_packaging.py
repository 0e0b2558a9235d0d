"""The wheel: built from the repo, installed into a fresh venv outside it, and used.

The development venv has the package installed editable, where the scripts are
found in the repo's lua/; only a real install proves the wheel ships them.
Dependencies come from the package index, so the install takes a while.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ledger import scripts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], *, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("LEDGER_")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)], cwd=out)
    (whl,) = out.glob("redis_token_ledger-*.whl")
    return whl


def test_wheel_ships_the_scripts(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        expected = {"ledger/lua/_common.lua", "ledger/py.typed"}
        expected |= {f"ledger/lua/{n}.lua" for n in scripts.NAMES}
        assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
        for name in sorted(n for n in names if n.startswith("ledger/lua/")):
            repo_file = ROOT / "lua" / name.removeprefix("ledger/lua/")
            assert z.read(name) == repo_file.read_bytes(), f"{name} differs from the repo's"
        assert "ledger/workers/runner.py" in names
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "ledger = ledger.cli:main" in z.read(entry_points).decode()


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


def test_installed_wheel_works_outside_the_repo(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    py = venv / "bin" / "python"
    run([str(py), "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path, timeout=600)

    out = run([str(py), "-c", USE], cwd=tmp_path).stdout
    lua_dir = Path(out.split("LUA_DIR", 1)[1].strip())
    assert not lua_dir.is_relative_to(ROOT)
    for name in ("_common", *scripts.NAMES):
        assert (lua_dir / f"{name}.lua").read_bytes() == (ROOT / "lua" / f"{name}.lua").read_bytes()

    # The console script the Dockerfile and docker-compose.yml run.
    ledger_cmd = str(venv / "bin" / "ledger")
    assert "worker" in run([ledger_cmd, "--help"], cwd=tmp_path).stdout
    run(
        [ledger_cmd, "--url", "embedded://", "worker", "--once", "--compactor", "none"],
        cwd=tmp_path,
        timeout=60,
    )
