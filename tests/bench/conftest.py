"""Fixtures for the bench tests."""

from __future__ import annotations

import importlib.util

# The server's packages are optional (the GPU machine lacks them): without them, skip these tests.
_NEEDED = ("openai", "zmq", "fastapi", "uvicorn", "msgspec", "prometheus_client")
if any(importlib.util.find_spec(m) is None for m in _NEEDED):
    collect_ignore_glob = ["test_*.py"]
