"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. The flag is read
# when a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from vllm.utils.torch_utils import create_kv_caches_with_random, create_kv_caches_with_random_flash


@pytest.fixture
def single_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one thread: the tensors of these tests are small, and a loaded machine
    makes the intra-op thread pool orders of magnitude slower than one thread. Opt in with
    ``pytestmark = pytest.mark.usefixtures("single_intra_op_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kv_cache_factory():
    """Upstream's fixture: :func:`vllm.utils.torch_utils.create_kv_caches_with_random`."""
    return create_kv_caches_with_random


@pytest.fixture
def kv_cache_factory_flashinfer():
    """Upstream's fixture: :func:`vllm.utils.torch_utils.create_kv_caches_with_random_flash`."""
    return create_kv_caches_with_random_flash
