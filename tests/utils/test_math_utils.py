"""vllm.utils.math_utils: the integer helpers upstream code imports from that path, exact for
large ints, and the one home of the spec modules' ``cdiv`` / ``round_up``."""

from __future__ import annotations

import pytest

from vllm.utils import math_utils
from vllm.utils.math_utils import (
    cdiv,
    largest_power_of_2_divisor,
    next_power_of_2,
    round_down,
    round_up,
)
from vllm.v1 import kv_cache_interface


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (2**70 + 1, 2**35, 2**35 + 1)],
)
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


def test_rounding() -> None:
    assert [round_up(x, 16) for x in (0, 1, 16, 17)] == [0, 16, 16, 32]
    assert [round_down(x, 16) for x in (0, 15, 16, 33)] == [0, 0, 16, 32]
    assert round_up(656, 576) == 1152  # a fp8_ds_mla row padded to FlashMLA's alignment


def test_powers_of_two() -> None:
    assert [next_power_of_2(n) for n in (-3, 0, 1, 2, 3, 64, 65)] == [1, 1, 1, 2, 4, 64, 128]
    assert [largest_power_of_2_divisor(n) for n in (1, 12, 576, 2**40)] == [1, 4, 64, 2**40]


def test_the_specs_use_these_helpers() -> None:
    assert kv_cache_interface.cdiv is math_utils.cdiv
    assert kv_cache_interface.round_up is math_utils.round_up
