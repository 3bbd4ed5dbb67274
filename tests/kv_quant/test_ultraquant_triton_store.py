"""The ``ultraquant_4bit`` Triton store (``triton_ultraquant_store``) byte for byte against the
reference codec, under Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU) or on a GPU: head dims 32 to 256, fp32 / bf16 / fp16 rows, zero, NaN, Inf,
subnormal and huge groups, values on every rounding boundary, skipped slots and slots past the
cache, padding bytes, a cache whose blocks are not adjacent; and its compile cases."""

from __future__ import annotations

import os

import pytest
import torch

from vllm.kv_quant.ultraquant_codec import rotate_keys
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.ultraquant.format import slot_size
from vllm.v1.attention.ops.ultraquant.triton_slot_store import (
    triton_compile_cases,
    triton_ultraquant_store,
)

from .test_ultraquant_paged import _codec_slots, _edge_rows, _snap_boundary_rows

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytestmark = pytest.mark.skip(reason="Triton runs CPU tensors only under its interpreter")


@pytest.mark.parametrize("d", [32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_is_the_codecs_bytes(d: int, dtype: torch.dtype) -> None:
    k, v = _edge_rows(d, dtype)
    storage = torch.full((5, 4, 2, slot_size(d) + 3), 0xA5, dtype=torch.uint8, device=DEVICE)
    cache = storage[::2]  # blocks not adjacent
    slots = torch.tensor([0, 9, 5, 11, 2, 12], device=DEVICE)  # 12: past the cache, skipped
    triton_ultraquant_store(rotate_keys(k.to(DEVICE)), v.to(DEVICE), cache, slots)
    want = _codec_slots(k, v)
    flat = cache.cpu().reshape(12, 2, -1)
    for i, s in enumerate(slots.tolist()[:5]):
        assert torch.equal(flat[s, :, : slot_size(d)], want[i]), (i, s)
    assert flat[:, :, slot_size(d) :].eq(0xA5).all()
    assert flat[[1, 3, 4, 6, 7, 8, 10]].eq(0xA5).all()


def test_constant_c_and_no_tokens() -> None:
    k, v = _edge_rows(64, torch.float32)
    cache = torch.zeros(3, 4, 2, slot_size(64), dtype=torch.uint8, device=DEVICE)
    triton_ultraquant_store(
        rotate_keys(k).to(DEVICE), v.to(DEVICE), cache, torch.arange(6, device=DEVICE), 0.3
    )
    assert torch.equal(cache.cpu().reshape(12, 2, -1)[:6], _codec_slots(k, v, 0.3))
    v = _snap_boundary_rows()
    triton_ultraquant_store(
        rotate_keys(k).to(DEVICE), v.to(DEVICE), cache, torch.arange(6, device=DEVICE), 1.0
    )
    assert torch.equal(cache.cpu().reshape(12, 2, -1)[:6], _codec_slots(k, v, 1.0))
    empty = torch.zeros(0, 2, 64, device=DEVICE)
    triton_ultraquant_store(empty, empty, cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))


def test_compile_cases() -> None:
    assert [c.name for c in triton_compile_cases()] == [
        "ultraquant_store/d128",
        "ultraquant_store/d64",
    ]
    assert all(not c.enable_fp_fusion for c in triton_compile_cases())
