"""Fixtures of the KV-offload connector tests."""

from __future__ import annotations

import pytest
from kv_offload_test_utils import IMPLS


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    """The copy implementation under test (see ``IMPLS``)."""
    return request.param
