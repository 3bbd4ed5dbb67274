"""Kernel test helpers with upstream vLLM's names (``tests/kernels/utils.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

DEFAULT_OPCHECK_TEST_UTILS: tuple[str, ...] = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
)
"""The torch.library.opcheck checks that every cache op must pass."""

ALL_OPCHECK_TEST_UTILS: tuple[str, ...] = (*DEFAULT_OPCHECK_TEST_UTILS, "test_aot_dispatch_dynamic")
"""The default checks plus AOT dispatch with dynamic shapes."""


def opcheck(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    test_utils: str | Sequence[str] = ALL_OPCHECK_TEST_UTILS,
    raise_exception: bool = True,
    cond: bool = True,
) -> dict[str, str]:
    """``torch.library.opcheck(op, args, kwargs)`` when ``cond`` holds, else nothing (``{}``).

    The checks run the op, so mutated arguments are written as by a normal call.
    """
    if not cond:
        return {}
    return torch.library.opcheck(
        op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception
    )
