"""Fixtures for the bench tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The server's packages are optional (the GPU machine lacks them): without them, skip the tests
# that import them. The clock sampler's tests need none, and one of them runs only on a GPU.
_NEEDED = ("openai", "zmq", "fastapi", "uvicorn", "msgspec", "prometheus_client")
_STANDALONE = {"test_gpu_clocks.py"}
if any(importlib.util.find_spec(m) is None for m in _NEEDED):
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in _STANDALONE]
