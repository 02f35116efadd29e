"""Fixtures for the shipped demo model: one engine per session, and a network that is not there."""

from __future__ import annotations

import socket

import pytest

from moeserve import LLM
from moeserve.assets import default_model_path


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the default model must work offline, but something opened a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="session")
def demo_llm() -> LLM:
    """The default model on CPU in float32 (a small KV pool: tests score short prompts)."""
    return LLM(default_model_path(), dtype="float32", device="cpu", num_kv_pages=256)
