"""The bad-inputs catalogue (docs/bad-inputs*.md) stays true: every test it cites exists, and the
rows that no other test file covers are checked here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bpsctl.cli import app

REPO = Path(__file__).resolve().parents[1]
#: the catalogue's pages: configuration (bad-inputs.md), launching, the engine
CATALOGUE = sorted((REPO / "docs").glob("bad-inputs*.md"))
CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[([\w.-]+)\])?")


def _rows() -> list[list[str]]:
    rows = []
    lines = [line for page in CATALOGUE for line in page.read_text().splitlines()]
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0] not in ("Bad input", "---"):
            rows.append(cells)
    return rows


def test_every_row_of_the_catalogue_cites_tests_that_exist():
    assert [page.name for page in CATALOGUE] == [
        "bad-inputs-engine.md", "bad-inputs-horovod.md", "bad-inputs-launch.md",
        "bad-inputs.md"]
    rows = _rows()
    assert len(rows) > 50
    for bad_input, example, message, tests in rows:
        assert bad_input and example and message, f"an empty cell in the row {bad_input!r}"
        cited = CITATION.findall(tests)
        assert cited and len(cited) == tests.count("::"), f"row {bad_input!r} cites {tests!r}"
        for path, name, param in cited:
            source = (REPO / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{path}::{name} is gone"
            # a parametrized id names a case the file defines (a check function, a value)
            assert not param or param in source, f"{path}::{name}[{param}] is gone"


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BPSCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BPSCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))     # no tuned file
    return tmp_path / "state"


@pytest.mark.parametrize("args, message", [
    (["run", "-np", "1"], "Missing argument 'CMD'."),
    (["up", "--nic", "1gbit"],
     "--nic: a NIC rate only applies to an emulated cluster; add --emulate"),
    (["up", "--emulate", "--hosts", "h.yaml"], "--emulate builds its own hosts; drop --hosts"),
    (["bench", "comm", "--size", "16", "--tensors", "8"],
     "--size: 16 bytes is too small for 8 float32 tensors (at least 32 bytes)"),
    (["bench", "comm", "--sweep", "cores=2"], "--sweep: expected workers=2,4,6,8, got 'cores=2'"),
    (["bench", "comm", "--workers", "1", "--compare", "allreduce"],
     "--compare allreduce with one worker: an allreduce of one rank moves nothing"),
    (["run", "--attach", "-np", "1", "--", "true"], "--attach: no job is running from"),
    (["run", "--attach", "--max-workers", "4", "--", "true"],
     "--max-workers: set when the job started; --attach joins it as it is, so drop it"),
])
def test_flag_mistakes_exit_2_saying_what_is_expected(state_dir, args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (state_dir / "cluster.json").exists()
