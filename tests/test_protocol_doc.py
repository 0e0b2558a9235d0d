"""The parts of docs/protocol.md that the scripts' specs give are generated from them
(``tools/protocol_doc.py``): the table of KEYS counts and a block in each script's
section; a script with no section gets one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ledger import scripts
from tests.support import tools

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "protocol_doc.py"

protocol_doc = tools.load("protocol_doc")


def test_the_doc_is_generated_from_the_specs() -> None:
    assert protocol_doc.main(["--check"]) == 0
    doc = (ROOT / "docs" / "protocol.md").read_text()
    for name in scripts.NAMES:
        assert protocol_doc.block(scripts.spec(name)) in doc, name
    run = [sys.executable, str(TOOL), "--check"]
    assert subprocess.run(run, cwd=ROOT, timeout=60).returncode == 0


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of docs/protocol.md, the generator pointed at it."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "protocol.md", tmp_path / "docs" / "protocol.md")
    monkeypatch.setattr(protocol_doc, "ROOT", tmp_path)
    return tmp_path / "docs" / "protocol.md"


def test_a_hand_edit_of_a_block_is_caught(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tree.read_text()
    tree.write_text(good.replace("(mutating; KEYS[-1]", "(read-only; KEYS[-1]", 1))
    assert protocol_doc.main(["--check"]) == 1
    assert "docs/protocol.md is stale" in capsys.readouterr().err
    assert tree.read_text() != good  # the check writes nothing
    assert protocol_doc.main([]) == 0
    assert tree.read_text() == good and protocol_doc.main(["--check"]) == 0


def test_a_missing_section_is_written_and_a_section_of_no_script_refused(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tree.read_text()
    start = good.index("### `renew_turn`")
    cut = good[:start] + good[good.index("### ", start + 4) :]
    tree.write_text(cut)
    assert protocol_doc.main(["--check"]) == 1
    assert protocol_doc.main([]) == 0
    fresh = tree.read_text()
    spec = scripts.spec("renew_turn")
    section = fresh[fresh.index("### `renew_turn`") :]
    assert section.startswith(protocol_doc.new_section(spec) + "\n" + protocol_doc.block(spec))
    assert "| `renew_turn` | 5 |" in fresh and protocol_doc.main(["--check"]) == 0
    tree.write_text(good.replace("### `renew_turn`", "### `renew_turns`"))
    assert protocol_doc.main(["--check"]) == 1
    assert "sections of no script: renew_turns" in capsys.readouterr().err
