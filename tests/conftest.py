"""Shared fixtures: tiny checkpoints built once per session."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (small shapes only).
# It must be chosen before any kernel is defined, hence here, before test modules import them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """{variant: path} for every tiny checkpoint variant."""
    root = tmp_path_factory.mktemp("ckpt")
    return {v: make_checkpoint(root / v, v) for v in ("v2", "v2_greedy", "v3")}


@pytest.fixture(scope="session")
def v3_checkpoint(checkpoints):
    """The DeepSeek-V3 tiny checkpoint."""
    return checkpoints["v3"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
