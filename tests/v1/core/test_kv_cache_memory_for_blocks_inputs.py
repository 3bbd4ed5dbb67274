"""``kv_cache_memory_for_blocks`` names a ``kv_cache_specs`` that is not a dict of layer names to
specs (``ValueError``, the module's ``<arg>: expected X, got Y``); it used to fail inside the
grouping with ``AttributeError`` / ``TypeError``."""

from __future__ import annotations

import re

import pytest
import torch

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_sizing import kv_cache_memory_for_blocks
from vllm.v1.kv_cache_interface import FullAttentionSpec

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"a": 5}, "kv_cache_specs['a']: expected a KVCacheSpec, got 5 (int)"),
        (
            {"a": SPEC, "b": None},
            "kv_cache_specs['b']: expected a KVCacheSpec, got None (NoneType)",
        ),
        ({1: SPEC}, "kv_cache_specs: expected layer names (str) as keys, got 1 (int)"),
        (None, "kv_cache_specs: expected a dict of layer name -> KVCacheSpec, got None (NoneType)"),
        ([SPEC], "kv_cache_specs: expected a dict of layer name -> KVCacheSpec, got [Full"),
    ],
    ids=["int_spec", "none_spec", "int_name", "none", "list"],
)
def test_kv_cache_specs_of_the_wrong_type_are_named(specs: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        kv_cache_memory_for_blocks(VllmConfig(), specs, 4)  # type: ignore[arg-type]


def test_good_specs_still_size() -> None:
    assert kv_cache_memory_for_blocks(VllmConfig(), {"a": SPEC}, 4) == 4 * SPEC.page_size_bytes
