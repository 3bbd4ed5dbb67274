"""The check catches broken NVFP4 implementations.

Each test injects one classic bug between writing and reading (through ``run_check``'s
``tamper`` hook, which sees the written :class:`PagedCache`) and asserts that the NVFP4
cosine bound of test_accuracy_synthetic.py now fails. A no-op tamper is the control.
"""

from __future__ import annotations

import pytest
import torch

from vllm.accuracy.cache_io import PagedCache
from vllm.accuracy.formats import parse_formats
from vllm.accuracy.runner import CheckReport, run_check
from vllm.accuracy.samples import KVSample
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.utils.torch_utils import nvfp4_kv_cache_split_views

from .test_accuracy_synthetic import NVFP4_COS_BOUND


def _run(sample: KVSample, formats: str, tamper) -> CheckReport:
    return run_check(
        [sample], parse_formats(formats), source="synthetic", description="break", tamper=tamper
    )


def swap_nibbles(cache: PagedCache) -> None:
    """Wrong nibble order: the even element in the high nibble instead of the low one."""
    (k_data, v_data), _ = nvfp4_kv_cache_split_views(cache.kv_cache)
    for data in (k_data, v_data):
        data.copy_(((data & 0x0F) << 4) | (data >> 4))


def read_scales_as_linear(cache: PagedCache) -> PagedCache:
    """Wrong scale layout: written interleave4, read as linear."""
    assert cache.k_scale_layout is ScaleLayout.INTERLEAVE4
    return cache.replace(k_scale_layout=ScaleLayout.LINEAR, v_scale_layout=ScaleLayout.LINEAR)


def invert_global_scale(cache: PagedCache) -> PagedCache:
    """Global scale inverted: the reader multiplies by 1/scale (a quantization scale taken
    for the dequantization scale)."""
    one = torch.ones_like(cache.k_scale)
    return cache.replace(k_scale=one / cache.k_scale, v_scale=one / cache.v_scale)


def test_control_untampered_passes(synth: KVSample) -> None:
    seen: list[PagedCache] = []
    m = _run(synth, "nvfp4/head@interleave4", seen.append).formats[0].metrics
    assert len(seen) == 1 and seen[0].writer in ("op", "reference")
    assert m.out_cos_mean >= NVFP4_COS_BOUND


def test_wrong_nibble_order_fails(synth: KVSample) -> None:
    m = _run(synth, "nvfp4", swap_nibbles).formats[0].metrics
    assert m.out_cos_mean < NVFP4_COS_BOUND
    assert m.k_rel_rms > 0.5


def test_wrong_scale_layout_fails(synth: KVSample) -> None:
    formats = "nvfp4@interleave4"
    # N = 16 tokens per page and S = 128/16 = 8 scales per token: both multiples of 4.
    m = _run(synth, formats, read_scales_as_linear).formats[0].metrics
    assert m.out_cos_mean < NVFP4_COS_BOUND
    assert m.k_rel_rms > 0.5


@pytest.mark.parametrize("formats", ["nvfp4", "nvfp4/head"])
def test_inverted_global_scale_fails(synth: KVSample, formats: str) -> None:
    m = _run(synth, formats, invert_global_scale).formats[0].metrics
    assert m.out_cos_mean < NVFP4_COS_BOUND
    assert m.out_rel_err > 1.0
