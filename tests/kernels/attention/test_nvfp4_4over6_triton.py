"""The Triton writer's ``nvfp4_4over6`` policy writes the reference codec's bytes
(:func:`vllm.kv_quant.nvfp4_cache.nvfp4_write_cache`, itself pinned to upstream's arithmetic by
tests/kv_quant/test_nvfp4_4over6.py).

The kernel is launched through :func:`plan_reshape_and_cache_flash` (the kernel alone, without
the public entry's compiled-op checks); the compiled writers' bytes are pinned by
tests/kernels/attention/test_cache.py."""

from __future__ import annotations

import os

import pytest
import torch

from vllm.kv_quant.formats import lookup
from vllm.kv_quant.nvfp4_cache import nvfp4_write_cache
from vllm.triton_utils import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET", "0") != "1",
            reason="Triton runs CPU tensors only under its interpreter (TRITON_INTERPRET=1)",
        ),
    ),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def _source(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[5, 2, 64]`` tokens over several binades, with edge groups in token 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2, 64, generator=gen) * torch.logspace(-2, 1, 64)
    x[0, 0, :16] = torch.tensor([6.0] + [4.5] * 15)  # amax / 4 wins
    x[0, 1, :16] = 3.0  # both exact: the tie keeps amax / 6
    x[0, 1, 16:32] = 0.0
    x[1, 0, :16] = torch.tensor([float("nan")] + [1.0] * 15)
    x[1, 0, 16:32] = torch.tensor([float("inf")] + [-2.0] * 15)
    x[1, 1, :16] = 1.0e-9
    x[1, 1, 16:32] = -1.0e30 if dtype == torch.float32 else -6.0e4
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["linear", "interleave4"])
def test_triton_writer_matches_the_codec(device: str, dtype: torch.dtype, layout: str) -> None:
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        plan_reshape_and_cache_flash,
    )

    fmt = lookup("nvfp4_4over6")
    key, value = _source(dtype, 0).to(device), _source(dtype, 1).to(device)
    shape = (2, 4, 2, fmt.last_dim(64))
    key_cache = torch.zeros(shape, dtype=torch.uint8, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 3, 5, -1, 6], device=device)
    k_scale = torch.tensor([0.3], device=device)
    v_scale = torch.tensor([1.7, 0.02], device=device)  # per head
    plan_reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots, fmt.name, k_scale, v_scale, layout, layout
    )()
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        want = torch.zeros_like(cache)
        nvfp4_write_cache(x, want, slots, scale, layout, scale_search=fmt.scale_search)
        assert torch.equal(cache.cpu(), want.cpu())
