"""The README's hello world runs as the README says, and does what it says."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(120)
def test_hello_world_trains_two_workers_to_the_same_weights(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bpsctl.cli", "--state-dir", str(tmp_path),
                           "run", "-np", "2", "--", sys.executable, str(EXAMPLES / "train.py")],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "[0] step  50  loss" in done.stdout
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2: weights match rank 0's" in done.stdout
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert "bpsctl run -np 2 -- python examples/train.py" in readme
