"""``_allocate_kv_cache`` / ``_reshape_kv_cache``: page math of the views, the DeepSeek-V4
compressed worked example (docs/design.md §7), padding, kernel-block splitting, Mamba state
views, ``UniformTypeKVCacheSpecs`` groups, and validation before allocation (the buffers'
coverage and sizes: test_kv_cache_buffers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from kv_cache_test_utils import attn_spec, dsv4_spec, one_group

from vllm.kv_quant import ScaleLayout
from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim
from vllm.v1.attention.backends import (
    FlashInferBackend,
    KVCacheScaleLayouts,
    MLACommonBackend,
    ReferenceAttentionBackend,
    kv_cache_layout,
    split_kv_cache,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.gpu.attn_utils import (
    _allocate_kv_cache,
    _paged_view,
    _reshape_kv_cache,
    get_kv_cache_scale_layouts,
    init_layer_kv_caches,
    select_kernel_block_size,
    spec_cache_dtype_str,
)


def view_nbytes(t: torch.Tensor) -> int:
    """Bytes of storage a view needs: (offset of its last element + 1) * itemsize."""
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


# ------------------------------------------------------------------ DeepSeek-V4 (docs/design.md §7)


def test_dsv4_c128_view_fits_its_buffer() -> None:
    spec = dsv4_spec(128)
    assert (spec.storage_block_size, spec.real_page_size_bytes, spec.page_size_bytes) == (
        2,
        1168,
        1728,
    )
    config = one_group(spec, 53_255_232)
    raw = _allocate_kv_cache(config, "cpu")
    view = _reshape_kv_cache(config, raw, {"l0": MLACommonBackend})["l0"]
    num_blocks = 53_255_232 // 1728
    assert num_blocks == 30_819
    assert view.dtype == torch.uint8
    assert tuple(view.shape) == (30_819, 2, 584)
    assert view.stride() == (1728, 584, 1)
    assert view.untyped_storage().data_ptr() == raw["l0"].untyped_storage().data_ptr()
    assert view_nbytes(view) == 53_254_672 <= raw["l0"].numel()
    # The old formula (block_size // kernel_block_size = 256 // 2 = 128 kernel pages per page)
    # asks for 128x the pages at the same page stride: far more than the buffer holds.
    old_kernel_blocks = num_blocks * (spec.block_size // spec.storage_block_size)
    old_needed = (old_kernel_blocks - 1) * 1728 + 2 * 584
    assert old_needed == 6_816_669_136
    with pytest.raises(RuntimeError):
        raw["l0"].view(torch.uint8).as_strided((old_kernel_blocks, 2, 584), (1728, 584, 1))
    # Each page's two records are addressed at page * 1728 + slot * 584.
    view[5, 1, 0] = 7
    assert int(raw["l0"][5 * 1728 + 584]) == 7


def test_dsv4_c4_view() -> None:
    spec = dsv4_spec(4)
    assert (spec.storage_block_size, spec.real_page_size_bytes, spec.page_size_bytes) == (
        64,
        37_376,
        37_440,
    )
    config = one_group(spec, 37_440 * 100)
    view = _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [MLACommonBackend])["l0"]
    assert tuple(view.shape) == (100, 64, 584)
    assert view.stride() == (37_440, 584, 1)
    assert view_nbytes(view) == 99 * 37_440 + 37_376


def test_mla_unquantized_padded_view() -> None:
    spec = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, alignment=4096
    )
    assert spec.page_size_bytes == round_up(64 * 576 * 2, 4096)
    config = one_group(spec, spec.page_size_bytes * 3)
    view = _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [MLACommonBackend])["l0"]
    assert view.dtype == torch.bfloat16
    assert tuple(view.shape) == (3, 64, 576)
    assert view.stride() == (spec.page_size_bytes // 2, 576, 1)


def round_up(x: int, a: int) -> int:
    return -(-x // a) * a


# ---------------------------------------------------------------------- attention views


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8", "nvfp4"])
def test_attention_view_shape_and_physical_order(layout: str, cache_dtype: str) -> None:
    mode = {"bfloat16": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_PER_TENSOR}.get(
        cache_dtype, KVQuantMode.NVFP4
    )
    dtype = torch.bfloat16 if mode == KVQuantMode.NONE else torch.uint8
    spec = attn_spec(dtype=dtype, kv_quant_mode=mode)
    config = one_group(spec, spec.page_size_bytes * 5)
    with kv_cache_layout(layout):
        raw = _allocate_kv_cache(config, "cpu")
        view = _reshape_kv_cache(config, raw, {"l0": FlashInferBackend})["l0"]
        expected_shape = FlashInferBackend.get_kv_cache_shape(5, 16, 8, 128, cache_dtype)
        order = FlashInferBackend.get_kv_cache_stride_order()
    last = nvfp4_kv_cache_full_dim(128) if mode == KVQuantMode.NVFP4 else 128
    assert tuple(view.shape) == expected_shape == (5, 2, 16, 8, last)
    assert view.dtype == dtype
    # Exactly the logical tensor of a contiguous physical buffer permuted by the stride order.
    physical = raw["l0"].view(dtype).view(tuple(expected_shape[i] for i in order))
    inverse = [order.index(i) for i in range(5)]
    assert view.stride() == physical.permute(*inverse).stride()
    assert view.data_ptr() == raw["l0"].data_ptr()
    assert view_nbytes(view) == raw["l0"].numel()


def test_views_of_shared_buffer_alias() -> None:
    full = attn_spec()
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=128
    )
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(size=4 * full.page_size_bytes, shared_by=["f", "s"])],
        kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["s"], swa)],
    )
    raw = _allocate_kv_cache(config, "cpu")
    assert raw["f"] is raw["s"]
    views = _reshape_kv_cache(config, raw, [ReferenceAttentionBackend, FlashInferBackend])
    views["f"][2, 1, 3, 4, 5] = 1.5
    assert float(views["s"][2, 1, 3, 4, 5]) == 1.5


def test_padded_attention_page_uses_page_stride() -> None:
    spec = attn_spec(page_size_padded=65_536 + 4096)
    config = one_group(spec, spec.page_size_bytes * 3)
    with kv_cache_layout("HND"):
        view = _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [FlashInferBackend])[
            "l0"
        ]
    assert tuple(view.shape) == (3, 2, 16, 8, 128)
    assert view.stride() == ((65_536 + 4096) // 2, 16 * 8 * 128, 128, 16 * 128, 1)


def test_kernel_block_split_uses_storage_block_size() -> None:
    spec = attn_spec(block_size=256)
    config = one_group(spec, spec.page_size_bytes * 3)
    raw = _allocate_kv_cache(config, "meta")
    view = _reshape_kv_cache(config, raw, [FlashInferBackend])["l0"]
    # FlashInfer kernel pages are 16, 32 or 64 tokens: the largest divisor of 256 is 64.
    assert tuple(view.shape) == (3 * 4, 2, 64, 8, 128)
    assert view_nbytes(view) == raw["l0"].numel()
    explicit = _reshape_kv_cache(config, raw, [FlashInferBackend], kernel_block_sizes=[16])["l0"]
    assert tuple(explicit.shape) == (3 * 16, 2, 16, 8, 128)


def test_padding_with_kernel_block_split_rejected() -> None:
    spec = attn_spec(block_size=128, page_size_padded=128 * 8 * 256 * 2 + 64)
    config = one_group(spec, spec.page_size_bytes * 2)
    with pytest.raises(ValueError, match="padded page.*cannot be split into 2 kernel blocks"):
        _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [FlashInferBackend])


def test_head_size_v_views_are_separate_regions() -> None:
    spec = attn_spec(
        head_size=128, head_size_v=64, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4
    )
    assert spec.page_size_bytes == 16 * 8 * (72 + 36)
    config = one_group(spec, spec.page_size_bytes * 4)
    for layout in ("NHD", "HND"):
        with kv_cache_layout(layout):
            raw = _allocate_kv_cache(config, "cpu")
            key_cache, value_cache = _reshape_kv_cache(config, raw, [ReferenceAttentionBackend])[
                "l0"
            ]
        assert tuple(key_cache.shape) == (4, 16, 8, 72)
        assert tuple(value_cache.shape) == (4, 16, 8, 36)
        assert key_cache.stride(0) == value_cache.stride(0) == spec.page_size_bytes
        assert value_cache.storage_offset() == 16 * 8 * 72
        assert view_nbytes(value_cache) == raw["l0"].numel()
        assert split_kv_cache((key_cache, value_cache)) == (key_cache, value_cache)
    with pytest.raises(ValueError, match="head_size_v=64 != head_size=128"):
        _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [FlashInferBackend])


def test_mamba_state_views() -> None:
    spec = MambaSpec(
        block_size=1,
        shapes=((3, 8), (4, 16, 2)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=4096,
    )
    config = one_group(spec, 4096 * 5)
    raw = _allocate_kv_cache(config, "cpu")
    conv, ssm = _reshape_kv_cache(config, raw, {})["l0"]
    assert (tuple(conv.shape), conv.dtype, conv.stride(0)) == ((5, 3, 8), torch.bfloat16, 2048)
    assert (tuple(ssm.shape), ssm.dtype, ssm.stride(0)) == ((5, 4, 16, 2), torch.float32, 1024)
    assert ssm.storage_offset() * 4 == 3 * 8 * 2
    ssm[2].fill_(1.0)
    assert int(raw["l0"].view(torch.uint8)[2 * 4096 + 48 + 3]) == 0x3F  # 1.0f high byte
    misaligned = MambaSpec(block_size=1, shapes=((3,), (2,)), dtypes=(torch.uint8, torch.float32))
    config = one_group(misaligned, misaligned.page_size_bytes * 10)
    with pytest.raises(ValueError, match="not aligned"):
        _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), {})


def test_uniform_type_group_uses_each_layers_spec() -> None:
    a = attn_spec(num_kv_heads=8)
    b = attn_spec(num_kv_heads=2)
    group = UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b})
    assert group is not None
    config = KVCacheConfig(
        num_blocks=6,
        kv_cache_tensors=[
            KVCacheTensor(size=6 * a.page_size_bytes, shared_by=["a"]),
            KVCacheTensor(size=6 * b.page_size_bytes, shared_by=["b"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], group)],
    )
    views = _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [FlashInferBackend])
    assert tuple(views["a"].shape) == (6, 2, 16, 8, 128)
    assert tuple(views["b"].shape) == (6, 2, 16, 2, 128)


def test_kernel_block_size_selection() -> None:
    assert select_kernel_block_size([FlashInferBackend], 16) == 16
    assert select_kernel_block_size([FlashInferBackend], 96) == 32
    assert select_kernel_block_size([FlashInferBackend, ReferenceAttentionBackend], 512) == 64
    assert select_kernel_block_size([ReferenceAttentionBackend], 48) == 48
    assert select_kernel_block_size([MLACommonBackend], 2) == 2
    with pytest.raises(ValueError, match=r"FLASHINFER: 16, 32, 64.*block size of 8 slots"):
        select_kernel_block_size([FlashInferBackend], 8)


def test_spec_cache_dtype_str() -> None:
    assert spec_cache_dtype_str(attn_spec()) == "auto"
    fp8 = attn_spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert spec_cache_dtype_str(fp8) == "fp8"
    assert spec_cache_dtype_str(fp8, "fp8_e5m2") == "fp8_e5m2"
    # A layer kept unquantized by kv_cache_dtype_skip_layers stays unquantized.
    assert spec_cache_dtype_str(attn_spec(), "nvfp4") == "auto"
    assert spec_cache_dtype_str(dsv4_spec(4)) == "fp8_ds_mla"


# ------------------------------------------------------------------------------ errors


def test_reshape_errors() -> None:
    spec = attn_spec()
    config = one_group(spec, spec.page_size_bytes * 2, layers=("a", "b"))
    raw = _allocate_kv_cache(config, "meta")
    with pytest.raises(ValueError, match=r"no backend for attention layer\(s\) b"):
        _reshape_kv_cache(config, raw, {"a": FlashInferBackend})
    with pytest.raises(ValueError, match=r"no buffer for layer\(s\) b"):
        _reshape_kv_cache(config, {"a": raw["a"]}, [FlashInferBackend])
    with pytest.raises(ValueError, match="one backend per KV-cache group"):
        _reshape_kv_cache(config, raw, [FlashInferBackend, FlashInferBackend])
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'int4'"):
        _reshape_kv_cache(config, raw, [FlashInferBackend], cache_dtype="int4")
    with pytest.raises(ValueError, match=r"kernel_block_sizes\[0\]: 8 is not a kernel block"):
        _reshape_kv_cache(config, raw, [FlashInferBackend], kernel_block_sizes=[8])
    with pytest.raises(ValueError, match=r"positive divisor of the group's storage block size"):
        _reshape_kv_cache(config, raw, [FlashInferBackend], kernel_block_sizes=[5])
    with pytest.raises(ValueError, match="expected a 1-D torch.int8 buffer"):
        _reshape_kv_cache(
            config, {"a": raw["a"].view(torch.uint8), "b": raw["b"]}, [FlashInferBackend]
        )
    # A backend whose shape disagrees with the spec's page (MLA shape for an attention spec).
    with pytest.raises(ValueError, match=r"needs a \(B, 2, N, H, D'\) cache|MLA cache holds"):
        _reshape_kv_cache(config, raw, [MLACommonBackend])


def test_init_kv_cache_validates_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = attn_spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4)
    config = one_group(spec, spec.page_size_bytes * 4)
    allocations: list[str] = []
    real_zeros = torch.zeros

    def counting_zeros(*args, **kwargs):
        allocations.append(str(kwargs.get("device")))
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting_zeros)
    with pytest.raises(ValueError, match=r"layer 'l0'.*FlashInfer needs an NVIDIA GPU.*REFERENCE"):
        init_layer_kv_caches(config, [FlashInferBackend], "cpu")
    assert allocations == []
    caches = init_layer_kv_caches(config, [ReferenceAttentionBackend], "cpu")
    assert allocations == ["meta", "cpu"]
    assert tuple(caches["l0"].shape) == (4, 2, 16, 8, 72)
    assert math.prod(caches["l0"].shape) == spec.page_size_bytes * 4


def test_init_kv_cache_mla_and_mamba_hybrid() -> None:
    mla = dsv4_spec(4)
    mamba = MambaSpec(block_size=256, shapes=((4, 8),), dtypes=(torch.float32,))
    config = KVCacheConfig(
        num_blocks=3,
        kv_cache_tensors=[
            KVCacheTensor(size=3 * mla.page_size_bytes, shared_by=["mla"]),
            KVCacheTensor(size=3 * mamba.page_size_bytes, shared_by=["ssm"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["mla"], mla), KVCacheGroupSpec(["ssm"], mamba)],
    )
    caches = init_layer_kv_caches(config, {"mla": MLACommonBackend}, "cpu")
    assert tuple(caches["mla"].shape) == (3, 64, 584)
    assert [tuple(t.shape) for t in caches["ssm"]] == [(3, 4, 8)]
    with pytest.raises(ValueError, match=r"layer 'mla'.*FlashInfer needs an NVIDIA GPU"):
        init_layer_kv_caches(config, {"mla": FlashInferBackend}, "cpu")
    with pytest.raises(ValueError, match=r"layer 'mla'.*REFERENCE serves no MLA layers"):
        init_layer_kv_caches(config, {"mla": ReferenceAttentionBackend}, "cpu")


# ------------------------------------------------------------------------ scale layouts


def test_scale_layouts_are_recorded_per_layer_from_each_backend() -> None:
    """The NVFP4 scale layout is a property of the cache chosen with its backend: FlashInfer
    layers get interleave4, REFERENCE layers the op's default for their geometry (interleave4
    for head 128, linear for head 80); MLA and Mamba layers have none."""
    nvfp4 = attn_spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4)
    nvfp4_80 = attn_spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4, head_size=80)
    mla = dsv4_spec(4)
    mamba = MambaSpec(block_size=256, shapes=((4, 8),), dtypes=(torch.float32,))
    config = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[
            KVCacheTensor(size=2 * nvfp4.page_size_bytes, shared_by=["fi"]),
            KVCacheTensor(size=2 * nvfp4.page_size_bytes, shared_by=["ref"]),
            KVCacheTensor(size=2 * nvfp4_80.page_size_bytes, shared_by=["ref80"]),
            KVCacheTensor(size=2 * mla.page_size_bytes, shared_by=["mla"]),
            KVCacheTensor(size=2 * mamba.page_size_bytes, shared_by=["ssm"]),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["fi", "ref"], nvfp4),
            KVCacheGroupSpec(["mla"], mla),
            KVCacheGroupSpec(["ssm"], mamba),
            KVCacheGroupSpec(["ref80"], nvfp4_80),
        ],
    )
    backends = {
        "fi": FlashInferBackend,
        "ref": ReferenceAttentionBackend,
        "mla": MLACommonBackend,
        "ref80": ReferenceAttentionBackend,
    }
    layouts = get_kv_cache_scale_layouts(config, backends)
    assert layouts == {
        "fi": KVCacheScaleLayouts(ScaleLayout.INTERLEAVE4, ScaleLayout.INTERLEAVE4),
        "ref": KVCacheScaleLayouts(ScaleLayout.INTERLEAVE4, ScaleLayout.INTERLEAVE4),
        "ref80": KVCacheScaleLayouts(ScaleLayout.LINEAR, ScaleLayout.LINEAR),
    }
    assert layouts["fi"] == FlashInferBackend.get_kv_cache_scale_layouts(16, 128)
    k_layout, v_layout = layouts["fi"]  # unpacks as (k, v)
    assert (k_layout, v_layout) == (layouts["fi"].k_scale_layout, layouts["fi"].v_scale_layout)
    # One backend per group works too, and a layer without a backend is an error.
    per_group = get_kv_cache_scale_layouts(
        config,
        [FlashInferBackend, MLACommonBackend, ReferenceAttentionBackend, ReferenceAttentionBackend],
    )
    assert set(per_group) == {"fi", "ref", "ref80"}
    assert per_group["ref"].k_scale_layout is ScaleLayout.INTERLEAVE4
    with pytest.raises(ValueError, match=r"no backend for attention layer\(s\) ref, mla"):
        get_kv_cache_scale_layouts(config, {"fi": FlashInferBackend})


# ------------------------------------------------------------------- remaining errors


class _ThreeDimBackend(ReferenceAttentionBackend):
    """Gives an attention layer a cache shape without the K/V dim."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, block_size, 2 * num_kv_heads * head_size)


class _WideBackend(ReferenceAttentionBackend):
    """A (B, 2, N, H, D+1) shape: one element per token too many for the spec's page."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size + 1)


class _WideMLABackend(MLACommonBackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        shape = MLACommonBackend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )
        return (*shape[:-1], shape[-1] + 1)


@dataclass(frozen=True, kw_only=True)
class _OpaqueSpec(KVCacheSpec):
    """Neither an attention nor a Mamba spec: no view exists for it."""

    @property
    def page_size_bytes(self) -> int:
        return 64

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return 64


def test_group_mixing_storage_block_sizes_is_an_error() -> None:
    a, b = attn_spec(block_size=16), attn_spec(block_size=32)
    group = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": a, "b": b})
    config = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[
            KVCacheTensor(size=a.page_size_bytes, shared_by=["a"]),
            KVCacheTensor(size=b.page_size_bytes, shared_by=["b"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], group)],
    )
    with pytest.raises(ValueError, match=r"group 0 mixes storage block sizes \[16, 32\]"):
        _reshape_kv_cache(config, _allocate_kv_cache(config, "meta"), [ReferenceAttentionBackend])


def test_view_and_kernel_block_errors() -> None:
    spec = attn_spec()
    config = one_group(spec, spec.page_size_bytes * 2)
    raw = _allocate_kv_cache(config, "meta")
    with pytest.raises(
        ValueError, match=r"kernel_block_sizes: expected one per KV-cache group \(1\)"
    ):
        _reshape_kv_cache(config, raw, [FlashInferBackend], kernel_block_sizes=[16, 16])
    with pytest.raises(ValueError, match="storage_block_size: expected a positive int, got 0"):
        select_kernel_block_size([FlashInferBackend], 0)
    with pytest.raises(ValueError, match=r"needs a \(B, 2, N, H, D'\) cache"):
        _reshape_kv_cache(config, raw, [_ThreeDimBackend])
    with pytest.raises(ValueError, match=r"shape \(2, 2, 16, 8, 129\).*does not match the spec"):
        _reshape_kv_cache(config, raw, [_WideBackend])
    split_spec = attn_spec(head_size_v=64)
    split = one_group(split_spec, split_spec.page_size_bytes * 2)
    with pytest.raises(ValueError, match=r"K side .* \+ V side .* do not match the spec's"):
        _reshape_kv_cache(split, _allocate_kv_cache(split, "meta"), [_WideBackend])
    odd = attn_spec(page_size_padded=spec.page_size_bytes + 1)
    odd_config = one_group(odd, odd.page_size_bytes * 2)
    with pytest.raises(ValueError, match=r"not a whole number of torch.bfloat16 elements"):
        _reshape_kv_cache(odd_config, _allocate_kv_cache(odd_config, "meta"), [FlashInferBackend])
    mla = one_group(dsv4_spec(4), dsv4_spec(4).page_size_bytes * 2)
    with pytest.raises(ValueError, match=r"backend MLA_COMMON shape .* does not match the spec"):
        _reshape_kv_cache(mla, _allocate_kv_cache(mla, "meta"), [_WideMLABackend])
    opaque = one_group(_OpaqueSpec(block_size=16), 128)
    with pytest.raises(ValueError, match="layer 'l0': no cache view for spec type _OpaqueSpec"):
        _reshape_kv_cache(opaque, _allocate_kv_cache(opaque, "meta"), {})


def test_paged_view_errors() -> None:
    raw = torch.zeros(64, dtype=torch.int8)
    assert _paged_view(raw, torch.int8, (4, 2, 8), (0, 2, 1), 16, 0, "x").shape == (4, 2, 8)
    with pytest.raises(ValueError, match=r"x: stride order \(1, 0, 2\) is not a permutation"):
        _paged_view(raw, torch.int8, (4, 2, 8), (1, 0, 2), 16, 0, "x")
    with pytest.raises(ValueError, match="x: a page of 16 elements does not fit the page stride"):
        _paged_view(raw, torch.int8, (4, 2, 8), (0, 1, 2), 8, 0, "x")
    with pytest.raises(ValueError, match=r"x: the view \(5, 2, 8\).*needs 80 bytes.*has 64"):
        _paged_view(raw, torch.int8, (5, 2, 8), (0, 1, 2), 16, 0, "x")
