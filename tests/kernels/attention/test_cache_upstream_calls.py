"""The cache ops called exactly as upstream vLLM's engine and kernel tests call them.

Caches come from ``create_kv_caches_with_random_flash`` (the ``kv_cache_factory_flashinfer``
fixture), per-tensor scales are 0-d reductions (``key.amax() / 64``), per-head scales
``key.amax(dim=(0, 2)) / 64``, NVFP4 sides are unpacked as ``(data,), (scale,) =
nvfp4_kv_cache_split_views(side)``, and the op gets upstream's eight arguments. The written
caches must equal, byte for byte, a clone written by the reference codecs of vllm.kv_quant.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant import ScaleLayout, fp8_write_cache, nvfp4_read_cache, nvfp4_write_cache
from vllm.kv_quant.scale_layout import to_layout
from vllm.utils.torch_utils import (
    is_quantized_kv_cache,
    nvfp4_kv_cache_split_views,
    set_random_seed,
)

from ..quantization.nvfp4_utils import (
    dequant_nvfp4_kv_cache,
    dequant_nvfp4_kv_cache_nhd,
    unswizzle_4x4,
)
from ..utils import DEFAULT_OPCHECK_TEST_UTILS, opcheck

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]
NUM_HEADS = 8
NUM_TOKENS = 21
NUM_BLOCKS = 48


def _scales(kind: str, scale_type: str, key: torch.Tensor, value: torch.Tensor):
    """Scales the way upstream's tests build them (0-d per tensor, ``[H]`` per head)."""
    if kind == "nvfp4":
        code_max = 448.0 * 6.0 if scale_type == "attn_head" else 448.0
        dims = (0, 2) if scale_type == "attn_head" else None
        amax = (lambda x: x.abs().amax(dim=dims)) if dims else (lambda x: x.abs().amax())
        return (amax(key) / code_max).float(), (amax(value) / code_max).float()
    if scale_type == "tensor":
        return (key.amax() / 64.0).float(), (value.amax() / 64.0).float()
    return (key.amax(dim=(0, 2)) / 64.0).float(), (value.amax(dim=(0, 2)) / 64.0).float()


def _reference_write(side, x, slots, kind, scale) -> None:
    if kind == "nvfp4":
        nvfp4_write_cache(x, side, slots, scale)
    elif is_quantized_kv_cache(kind):
        fp8_write_cache(x, side, slots, scale, kind)
    else:
        side[slots // side.shape[1], slots % side.shape[1]] = x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)  # upstream's
@pytest.mark.parametrize("head_size", [64, 80, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("cache_layout", ["NHC", "HNC"])  # upstream's test spelling
@pytest.mark.parametrize("scale_type", ["tensor", "attn_head"])
@torch.inference_mode()
def test_reshape_and_cache_flash(
    kv_cache_factory_flashinfer,
    device: str,
    kind: str,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    cache_layout: str,
    scale_type: str,
) -> None:
    if kind == "nvfp4" and head_size % 16:
        pytest.skip("NVFP4 needs a head size that is a multiple of 16")
    set_random_seed(0)
    slot_mapping = torch.tensor(
        random.sample(range(NUM_BLOCKS * block_size), NUM_TOKENS), dtype=torch.long, device=device
    )
    qkv = torch.randn(NUM_TOKENS, 3, NUM_HEADS, head_size, dtype=dtype, device=device)
    _, key, value = qkv.unbind(dim=1)  # rows 3*H*D apart, as a fused QKV projection gives
    key_caches, value_caches = kv_cache_factory_flashinfer(
        NUM_BLOCKS, block_size, 1, NUM_HEADS, head_size, kind, dtype,
        device=device, cache_layout=cache_layout,
    )  # fmt: skip
    key_cache, value_cache = key_caches[0], value_caches[0]
    k_scale, v_scale = _scales(kind, scale_type, key, value)
    assert k_scale.dim() == (0 if scale_type == "tensor" else 1)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    _reference_write(expected_key, key, slot_mapping, kind, k_scale)
    _reference_write(expected_value, value, slot_mapping, kind, v_scale)

    args = (key, value, key_cache, value_cache, slot_mapping, kind, k_scale, v_scale)
    opcheck(
        torch.ops._C_cache_ops.reshape_and_cache_flash,
        args,
        test_utils=DEFAULT_OPCHECK_TEST_UTILS,
        cond=head_size == 64 and block_size == 16,
    )
    ops.reshape_and_cache_flash(*args)

    for got, expected in ((key_cache, expected_key), (value_cache, expected_value)):
        raw = got.view(torch.uint8) if got.dtype != torch.uint8 else got
        assert torch.equal(
            raw, expected.view(torch.uint8) if got.dtype != torch.uint8 else expected
        )
    if kind == "nvfp4":
        # Upstream's check: split views, permuted to HND, upstream's dequant (which
        # un-swizzles the scales: the default layout must be upstream's wherever it fits).
        for side, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
            (data,), (block_scale,) = nvfp4_kv_cache_split_views(side)
            if scale_type == "tensor" and ScaleLayout.default_for(block_size, head_size) is (
                ScaleLayout.INTERLEAVE4
            ):
                # Our views are logical (B, N, H, .) for NHC and HNC alike: permute to HND.
                data, block_scale = data.permute(0, 2, 1, 3), block_scale.permute(0, 2, 1, 3)
                hnd = dequant_nvfp4_kv_cache(data, block_scale, scale.item(), head_size, block_size)
                deq = hnd.permute(0, 2, 1, 3)
            else:  # per-head scales or a geometry upstream cannot write (linear default)
                deq = dequant_nvfp4_kv_cache_nhd(data, block_scale, scale, head_size, block_size)
            got = deq.reshape(-1, NUM_HEADS, head_size)[slot_mapping]
            torch.testing.assert_close(got, x.float(), atol=1.5, rtol=0.5)


@pytest.mark.parametrize("kind", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@torch.inference_mode()
def test_swap_blocks(
    kv_cache_factory, kind: str, dtype: torch.dtype, head_size: int, block_size: int
) -> None:
    """Upstream's CPU->CPU swap of the (B, H, D/x, N, x) / (B, H, D, N) caches."""
    if kind == "fp8" and head_size % 16:
        pytest.skip("upstream's paged FP8 layout needs a head size that is a multiple of 16")
    set_random_seed(0)
    num_blocks, num_mappings = 64, 16
    src_blocks = random.sample(range(num_blocks), num_mappings)
    dst_blocks = random.sample(sorted(set(range(num_blocks)) - set(src_blocks)), num_mappings)
    mapping = list(zip(src_blocks, dst_blocks, strict=True))
    mapping_tensor = torch.tensor(mapping, dtype=torch.int64).view(-1, 2)
    src_k, src_v = kv_cache_factory(num_blocks, block_size, 1, 8, head_size, kind, dtype, 0, "cpu")
    dst_k, dst_v = kv_cache_factory(num_blocks, block_size, 1, 8, head_size, kind, dtype, 1, "cpu")
    before_k, before_v = src_k[0].clone(), src_v[0].clone()
    block_size_in_bytes = src_k[0].element_size() * src_k[0].stride(0)
    for src, dst in ((src_k[0], dst_k[0]), (src_v[0], dst_v[0])):
        opcheck(
            torch.ops._C_cache_ops.swap_blocks,
            (src, dst, block_size_in_bytes, mapping_tensor),
            cond=head_size == 64,
        )
        ops.swap_blocks(src, dst, block_size_in_bytes, mapping_tensor)
    for s, d in mapping:
        assert torch.equal(before_k[s], dst_k[0][d])
        assert torch.equal(before_v[s], dst_v[0][d])


@pytest.mark.parametrize("kind", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kv_lora_rank", [256, 512])
@torch.inference_mode()
def test_swap_blocks_mla(kind: str, dtype: torch.dtype, kv_lora_rank: int) -> None:
    """Upstream's MLA swap: (B, N, kv_lora_rank + rope) pages, FP8 filled via convert_fp8."""
    set_random_seed(0)
    num_blocks, block_size, entry_size = 8, 16, kv_lora_rank + 64
    cache_dtype = torch.uint8 if kind == "fp8" else dtype
    caches = []
    for _ in range(2):
        cache = torch.zeros(num_blocks, block_size, entry_size, dtype=cache_dtype)
        values = torch.randn(*cache.shape, dtype=torch.float16 if kind == "fp8" else dtype)
        if kind == "fp8":
            ops.convert_fp8(cache, values, 1.0, kv_dtype=kind)
        else:
            cache.copy_(values)
        caches.append(cache)
    src_cache, dst_cache = caches
    before = src_cache.clone()
    src_blocks = random.sample(range(num_blocks), 2)
    dst_blocks = random.sample(sorted(set(range(num_blocks)) - set(src_blocks)), 2)
    mapping = torch.tensor(list(zip(src_blocks, dst_blocks, strict=True)), dtype=torch.int64)
    block_size_in_bytes = src_cache.element_size() * src_cache.stride(0)
    args = (src_cache, dst_cache, block_size_in_bytes, mapping)
    opcheck(torch.ops._C_cache_ops.swap_blocks, args, test_utils=DEFAULT_OPCHECK_TEST_UTILS)
    ops.swap_blocks(*args)
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(before[s], dst_cache[d])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_convert_fp8_round_trip(dtype: torch.dtype, kv_dtype: str) -> None:
    """Upstream's conversion check: fp -> FP8 bytes -> fp stays within FP8 precision."""
    set_random_seed(0)
    cache = torch.empty(16, 8, 64, 16, dtype=dtype).uniform_(-224.0, 224.0)
    cache_fp8 = torch.empty_like(cache, dtype=torch.uint8)
    ops.convert_fp8(cache_fp8, cache, kv_dtype=kv_dtype)
    converted = torch.empty_like(cache)
    ops.convert_fp8(converted, cache_fp8, kv_dtype=kv_dtype)
    rtol = 0.07 if kv_dtype == "fp8" else 0.13  # half an ulp of 3 / 2 mantissa bits
    torch.testing.assert_close(cache, converted, atol=0.001, rtol=rtol)
    with pytest.raises(RuntimeError, match=r"dst_cache: expected src_cache's shape"):
        ops.convert_fp8(cache_fp8[:1], cache)


# ----------------------------------------------------------------- NVFP4 default scale layout


def test_interleave4_is_upstreams_swizzle() -> None:
    """Our INTERLEAVE4 placement is the order upstream's dequant un-swizzles (re-stated
    independently in nvfp4_utils.unswizzle_4x4)."""
    for block_size, head_size in ((4, 64), (16, 128), (32, 256), (8, 192)):
        linear = torch.randint(0, 256, (3, 2, block_size, head_size // 16), dtype=torch.uint8)
        stored = to_layout(linear, ScaleLayout.INTERLEAVE4)
        assert not torch.equal(stored, linear)
        assert torch.equal(unswizzle_4x4(stored), linear)


def _nvfp4_write_pair(block_size: int, head_size: int, *layouts):
    """(caches written by the op with ``layouts`` appended to upstream's eight arguments,
    key, value, slot_mapping, k_scale, v_scale)."""
    generator = torch.Generator().manual_seed(block_size * 1000 + head_size)
    num_blocks, heads, tokens = 3, 2, 2 * block_size + 1
    key = torch.randn(tokens, heads, head_size, generator=generator, dtype=torch.bfloat16)
    value = torch.randn(tokens, heads, head_size, generator=generator, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    width = head_size // 2 + head_size // 16
    key_cache = torch.zeros(num_blocks, block_size, heads, width, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    k_scale = (key.abs().amax() / 448.0).float()
    v_scale = (value.abs().amax() / 448.0).float()
    torch.ops._C_cache_ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots, "nvfp4", k_scale, v_scale, *layouts
    )
    return key_cache, value_cache, key, value, slots, k_scale, v_scale


def _reference_pair(block_size: int, head_size: int, k_layout, v_layout):
    _, _, key, value, slots, k_scale, v_scale = _nvfp4_write_pair(block_size, head_size, "linear")
    key_cache = torch.zeros(3, block_size, 2, head_size // 2 + head_size // 16, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    nvfp4_write_cache(key, key_cache, slots, k_scale, k_layout)
    nvfp4_write_cache(value, value_cache, slots, v_scale, v_layout)
    return key_cache, value_cache


@pytest.mark.parametrize("block_size", [1, 2, 4, 6, 8, 12, 16, 32])
@pytest.mark.parametrize("head_size", [16, 32, 48, 64, 80, 128, 192, 256])
def test_default_scale_layout_grid(block_size: int, head_size: int) -> None:
    """The compiled op's default (C++ default_scale_layout) is ScaleLayout.default_for for
    every geometry: upstream's interleave4 where block_size % 4 == 0 and head_size % 64 == 0,
    linear elsewhere; the reference codecs' defaults agree."""
    rule = ScaleLayout.default_for(block_size, head_size)
    fits = block_size % 4 == 0 and head_size % 64 == 0
    assert rule is (ScaleLayout.INTERLEAVE4 if fits else ScaleLayout.LINEAR)
    key_cache, value_cache, *_ = _nvfp4_write_pair(block_size, head_size)
    expected = _reference_pair(block_size, head_size, rule, rule)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    assert torch.equal(key_cache, _reference_pair(block_size, head_size, None, None)[0])
    if fits:  # the two layouts give different bytes, so the check above can fail
        linear = _reference_pair(block_size, head_size, "linear", "linear")
        assert not torch.equal(key_cache, linear[0])


def test_default_scale_layout_upstream_geometry_and_head_80() -> None:
    """Upstream's geometry (block 16, head 128) defaults to interleave4 through the op, the
    Python wrapper and the reference reader; head 80 (S = 5) falls back to linear."""
    key_cache, value_cache, key, value, slots, k_scale, v_scale = _nvfp4_write_pair(16, 128)
    assert torch.equal(key_cache, _reference_pair(16, 128, "interleave4", "interleave4")[0])
    via_wrapper = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    ops.reshape_and_cache_flash(key, value, *via_wrapper, slots, "nvfp4", k_scale, v_scale)
    assert torch.equal(via_wrapper[0], key_cache) and torch.equal(via_wrapper[1], value_cache)
    assert torch.equal(
        nvfp4_read_cache(key_cache, k_scale, 128),
        nvfp4_read_cache(key_cache, k_scale, 128, ScaleLayout.INTERLEAVE4),
    )
    key_cache_80, *_ = _nvfp4_write_pair(6, 80)
    assert torch.equal(key_cache_80, _reference_pair(6, 80, "linear", "linear")[0])


@pytest.mark.parametrize(
    ("layouts", "k_expected", "v_expected"),
    [
        (("linear",), "linear", "linear"),  # V follows a named K
        (("interleave4", "linear"), "interleave4", "linear"),
        (("linear", "interleave4"), "linear", "interleave4"),
        ((None, "linear"), "interleave4", "linear"),  # unnamed K gets the default
    ],
)
def test_explicit_scale_layouts_override_default(layouts, k_expected, v_expected) -> None:
    key_cache, value_cache, *_ = _nvfp4_write_pair(16, 128, *layouts)
    expected = _reference_pair(16, 128, k_expected, v_expected)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
