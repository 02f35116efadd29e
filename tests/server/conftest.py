"""One server with an API key and a request-size limit, shared by the API and error tests."""

from __future__ import annotations

import pytest

from tests.server.launcher import API_KEY, make_serve_checkpoint, start_server


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
