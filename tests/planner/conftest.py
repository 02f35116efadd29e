"""Shared fixtures of the planner tests: built-in shapes and a parser holding only `plan`."""

from __future__ import annotations

import argparse

import pytest

from moeserve.planner.cli import add_plan_parser
from moeserve.planner.model_shape import ModelShape, load_model_shape


@pytest.fixture(scope="session")
def v3() -> ModelShape:
    return load_model_shape("deepseek-v3")


@pytest.fixture(scope="session")
def v2_lite() -> ModelShape:
    return load_model_shape("deepseek-v2-lite")


@pytest.fixture
def plan_parser() -> argparse.ArgumentParser:
    # Same shape as moeserve/cli.py's parser, without importing the engine.
    parser = argparse.ArgumentParser(prog="moeserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return parser
