"""The code base stays ruff-clean (lint rules in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    try:
        result = subprocess.run([*cmd, "check", "moeserve", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.fail("ruff is a test dependency: pip install -e '.[test]'")
    assert result.returncode == 0, result.stdout + result.stderr
