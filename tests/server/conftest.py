"""One server with an API key and a request-size limit, shared by the API and error tests."""

from __future__ import annotations

import importlib.util

import pytest

from tests.server.launcher import API_KEY, make_serve_checkpoint, start_server

# The server's packages are optional (the GPU machine lacks them): without them, skip these tests.
_NEEDED = ("openai", "zmq", "fastapi", "uvicorn", "msgspec", "prometheus_client")
if any(importlib.util.find_spec(m) is None for m in _NEEDED):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory):
    """The tiny V3 checkpoint with a 4096-token context."""
    return make_serve_checkpoint(tmp_path_factory.mktemp("serve") / "v3")


@pytest.fixture(scope="package")
def server(serve_checkpoint, tmp_path_factory):
    """A running server (killed at the end, whatever happened)."""
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    proc = start_server(serve_checkpoint, log, "--api-key", API_KEY, "--max-request-bytes", "65536")
    yield proc
    proc.stop()
