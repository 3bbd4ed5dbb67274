"""Kernel test helpers with upstream vLLM's names (``tests/kernels/utils.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest.mock import patch

import torch

import vllm._custom_ops  # noqa: F401  (registers torch.ops._C_cache_ops, as upstream's imports do)

DEFAULT_OPCHECK_TEST_UTILS: tuple[str, ...] = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
)
"""The torch.library.opcheck checks that every cache op must pass."""

ALL_OPCHECK_TEST_UTILS: tuple[str, ...] = (*DEFAULT_OPCHECK_TEST_UTILS, "test_aot_dispatch_dynamic")
"""The default checks plus AOT dispatch with dynamic shapes."""


_FLOAT8_DTYPES = frozenset(
    {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
)
_torch_allclose = torch.allclose


def _allclose_with_float8(
    a: torch.Tensor,
    b: torch.Tensor,
    rtol: float = 1e-05,
    atol: float = 1e-08,
    equal_nan: bool = False,
) -> bool:
    """``torch.allclose`` that also compares float8 tensors (in float64): CPU torch has no float8
    arithmetic, and opcheck's schema check compares every mutated argument with allclose."""
    if a.dtype in _FLOAT8_DTYPES or b.dtype in _FLOAT8_DTYPES:
        close = torch.isclose(
            a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol, equal_nan=equal_nan
        )
        return bool(close.all())
    return _torch_allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)


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

    The checks run the op, so mutated arguments are written as by a normal call. As upstream's
    helper, ``torch.allclose`` takes float8 tensors meanwhile (upstream's opcheck of convert_fp8
    writes a float8_e4m3fn tensor, which CPU torch could not compare).
    """
    if not cond:
        return {}
    with patch("torch.allclose", new=_allclose_with_float8):
        return torch.library.opcheck(
            op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception
        )
