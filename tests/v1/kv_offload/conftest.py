"""Shared fixtures of the KV-offload tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one thread: the copies here are small, and a loaded machine makes the
    intra-op thread pool orders of magnitude slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
