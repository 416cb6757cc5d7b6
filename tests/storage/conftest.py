"""Fixtures of the storage tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def restore_root():
    """Whatever a test does to the root logger and the ``vllm`` logger is undone afterwards."""
    root, vllm = logging.getLogger(), logging.getLogger("vllm")
    saved = (list(root.handlers), root.level, list(vllm.handlers), vllm.level, vllm.propagate)
    yield
    root.handlers[:], vllm.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    vllm.setLevel(saved[3])
    vllm.propagate = saved[4]
    logging.captureWarnings(False)
