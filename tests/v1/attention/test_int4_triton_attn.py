"""``TRITON_ATTN`` over ``int4_per_token_head`` caches (upstream v0.33's INT4 format): the
backend's writer (``reshape_and_cache_int4``) stores the reference codec's bytes, its forward
equals REFERENCE's (the codec's decoded values, attention in fp32 torch) up to fp32 summation
order with fp32 queries, and its pages hold upstream's packed bytes per token and head (the
registry's page math; ``customize_spec`` keeps the spec). Without a GPU the kernels run under
Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant.formats import lookup
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backends import (
    AttentionLayerScales,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from vllm.v1.attention.ops import int4_per_token_head as int4_ops
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here"),
    pytest.mark.usefixtures("single_intra_op_thread"),
]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INT4 = "int4_per_token_head"
BLOCK = 16


def _cache(num_blocks: int, heads: int, head_size: int, head_size_v: int, layout: str):
    """A cache of stale bytes: ``(B, 2, N, H, D/2 + 4)`` (NHD or HND strides) when the head
    sizes agree, else the ``(key_cache, value_cache)`` pair."""
    fmt = lookup(INT4)

    def side(d: int) -> torch.Tensor:
        shape = (num_blocks, heads, BLOCK, fmt.last_dim(d))
        x = torch.full(shape, 0x5A, dtype=torch.uint8, device=DEVICE)
        return x.transpose(1, 2) if layout == "HND" else x.permute(0, 2, 1, 3).contiguous()

    if head_size != head_size_v:
        return side(head_size), side(head_size_v)
    rows = fmt.last_dim(head_size)
    shape = (num_blocks, 2, heads, BLOCK, rows) if layout == "HND" else (
        num_blocks, 2, BLOCK, heads, rows)  # fmt: skip
    x = torch.full(shape, 0x5A, dtype=torch.uint8, device=DEVICE)
    return x.transpose(2, 3) if layout == "HND" else x


def _clone(cache):
    if isinstance(cache, tuple):
        return tuple(_clone(c) for c in cache)
    return cache.clone()


def _sides(cache) -> list[torch.Tensor]:
    return list(cache) if isinstance(cache, tuple) else [cache[:, 0], cache[:, 1]]


def _run(
    *,
    layout: str = "NHD",
    head_size: int = 64,
    head_size_v: int = 64,
    num_kv_heads: int = 2,
    group: int = 2,
    seq_lens: tuple[int, ...] = (21, 37, 9),
    query_lens: tuple[int, ...] = (21, 4, 1),
    query_dtype: torch.dtype = torch.float32,
    causal: bool = True,
    num_splits: int | None = None,
    **impl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the sequences with both impls' writers (bytes compared), then the Triton and the
    reference forwards over the same cache; returns (triton, reference) outputs."""
    gen = torch.Generator().manual_seed(head_size + head_size_v + len(layout))
    num_heads = num_kv_heads * group
    pages = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    num_blocks = max(pages) * len(seq_lens) + 1
    table = torch.randperm(num_blocks, generator=gen)[: num_blocks - 1]
    table = table.reshape(len(seq_lens), max(pages)).to(torch.int32).to(DEVICE)
    kwargs = dict(num_kv_heads=num_kv_heads, kv_cache_dtype=INT4, head_size_v=head_size_v,
                  **impl_kwargs)  # fmt: skip
    reference = ReferenceAttentionImpl(num_heads, head_size, **kwargs)
    triton_impl = TritonAttentionImpl(num_heads, head_size, **kwargs)
    triton_impl.num_splits = num_splits
    layer = AttentionLayerScales()
    total = sum(seq_lens)
    key = (torch.randn(total, num_kv_heads, head_size, generator=gen) * 2).to(DEVICE)
    value = torch.randn(total, num_kv_heads, head_size_v, generator=gen).to(DEVICE)
    full = ReferenceAttentionMetadata.build(list(seq_lens), list(seq_lens), table, BLOCK)
    cache = _cache(num_blocks, num_kv_heads, head_size, head_size_v, layout)
    codec_cache = _clone(cache)
    triton_impl.do_kv_cache_update(layer, key, value, cache, full.slot_mapping)
    reference.do_kv_cache_update(layer, key, value, codec_cache, full.slot_mapping)
    for mine, theirs in zip(_sides(cache), _sides(codec_cache), strict=True):
        assert torch.equal(mine, theirs)  # the codec's bytes, stale bytes elsewhere kept
    metadata = ReferenceAttentionMetadata.build(
        list(seq_lens), list(query_lens), table, BLOCK, causal=causal
    )
    query = torch.randn(metadata.num_actual_tokens, num_heads, head_size, generator=gen)
    query = query.to(DEVICE, query_dtype)
    got = triton_impl.forward(layer, query, None, None, cache, metadata)
    expected = reference.forward(layer, query, None, None, cache, metadata)
    assert got.dtype == query_dtype and got.shape == expected.shape
    return got.float(), expected.float()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp32_forward_is_attention_over_decoded_values(layout: str) -> None:
    """Prefill, chunked prefill and decode in one batch, GQA: fp32 queries differ from the
    codec + fp32 torch attention only by summation order."""
    got, expected = _run(layout=layout)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_window_sinks_soft_cap_head_size_v_non_causal() -> None:
    """A window, sinks, a soft cap, head sizes 40 / 24 (blocks 8: not powers of two) with
    their separate K / V regions, group 3; then the same cache read non-causally."""
    sinks = torch.linspace(-1.0, 1.0, 3, device=DEVICE)
    extra = dict(head_size=40, head_size_v=24, num_kv_heads=1, group=3, sliding_window=7,
                 logits_soft_cap=3.0, sinks=sinks)  # fmt: skip
    got, expected = _run(**extra)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    got, expected = _run(**extra, causal=False, seq_lens=(12, 20), query_lens=(12, 20))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_fp16_queries() -> None:
    """fp16 queries: the rotated query, the kernel's dot operands and the rotated output are
    rounded to fp16 (upstream's steps), ~2^-11 relative each."""
    got, expected = _run(query_dtype=torch.float16, layout="HND")
    torch.testing.assert_close(got, expected, atol=6e-3, rtol=6e-3)


def test_split_k_only_for_single_query_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's INT4 launcher runs multi-query batches 2D only: a forced split count reaches
    the reader for decode batches, a batch with a multi-token query runs unsplit."""
    seen: list[int | None] = []
    real = int4_ops.int4_paged_attention

    def spy(*args, **kwargs) -> None:
        seen.append(kwargs["num_splits"])
        real(*args, **kwargs)

    monkeypatch.setattr(int4_ops, "int4_paged_attention", spy)
    got, expected = _run(seq_lens=(70, 33), query_lens=(1, 1), num_splits=3)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    got, expected = _run(seq_lens=(40, 9), query_lens=(2, 1), num_splits=3)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert seen == [3, 1]


def test_forward_writes_the_new_tokens_first() -> None:
    """``forward`` with key / value writes them (the codec's bytes) before reading."""
    num_heads, head_size = 2, 32
    impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads=1, kv_cache_dtype=INT4)
    reference = ReferenceAttentionImpl(num_heads, head_size, num_kv_heads=1, kv_cache_dtype=INT4)
    layer = AttentionLayerScales()
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
    metadata = ReferenceAttentionMetadata.build([20], [20], table, BLOCK)
    key = torch.randn(20, 1, head_size, device=DEVICE)
    value = torch.randn(20, 1, head_size, device=DEVICE)
    query = torch.randn(20, num_heads, head_size, device=DEVICE)
    cache = _cache(2, 1, head_size, head_size, "NHD")
    codec_cache = cache.clone()
    got = impl.forward(layer, query, key, value, cache, metadata)
    expected = reference.forward(layer, query, key, value, codec_cache, metadata)
    assert torch.equal(cache, codec_cache)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_bad_key_raises_before_any_write() -> None:
    impl = TritonAttentionImpl(2, 32, num_kv_heads=1, kv_cache_dtype=INT4)
    cache = _cache(1, 1, 32, 32, "NHD")
    before = cache.clone()
    slots = torch.tensor([0, 1], device=DEVICE)
    key = torch.randn(2, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"value: expected shape \[T_pad = 2, 1, 32\]"):
        impl.do_kv_cache_update(AttentionLayerScales(), key, key[..., :16], cache, slots)
    with pytest.raises(ValueError, match="slot_mapping: expected slots < 16"):
        impl.do_kv_cache_update(AttentionLayerScales(), key, key, cache, slots + 15)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("mode", "head_size", "head_size_v", "content"),
    [
        (KVQuantMode.INT4_PER_TOKEN_HEAD, 64, 64, 64 // 2 + 64 // 2 + 8),
        (KVQuantMode.INT4_PER_TOKEN_HEAD, 128, 40, 128 // 2 + 40 // 2 + 8),
        (KVQuantMode.INT8_PER_TOKEN_HEAD, 64, 32, 64 + 32 + 8),
    ],
)
def test_page_size_and_shape_are_the_registry_page_math(
    mode: KVQuantMode, head_size: int, head_size_v: int, content: int
) -> None:
    """Per token and head a page holds K's row and V's row with their scale words (upstream's
    packed content); ``customize_spec`` keeps the spec (its encoding already sizes the page),
    and ``get_kv_cache_shape`` spans the same bytes."""
    dtype = torch.int8 if mode is KVQuantMode.INT8_PER_TOKEN_HEAD else torch.uint8
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=head_size,
                             head_size_v=head_size_v, dtype=dtype, kv_quant_mode=mode)  # fmt: skip
    assert TritonAttentionBackend.customize_spec(spec) is spec
    assert spec.page_size_bytes == BLOCK * 4 * content
    if head_size == head_size_v:
        name = spec.kv_cache_format.name
        shape = TritonAttentionBackend.get_kv_cache_shape(3, BLOCK, 4, head_size, name)
        assert shape == (3, 2, BLOCK, 4, content // 2)
        assert torch.Size(shape).numel() * dtype.itemsize == 3 * spec.page_size_bytes


def test_backend_lists_int4() -> None:
    assert INT4 in TritonAttentionBackend.supported_kv_cache_dtypes


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU path without Triton's interpreter")
def test_cpu_cache_without_the_interpreter_is_written_by_the_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where Triton cannot run on the cache's device, ``do_kv_cache_update`` writes the same
    bytes through the codec (REFERENCE's writer), not the Triton kernel."""
    from vllm.v1.attention.backends import triton_attn

    def no_triton(*args, **kwargs) -> None:
        raise AssertionError("reshape_and_cache_int4 must not run")

    monkeypatch.setattr(triton_attn, "triton_interpreted", lambda: False)
    monkeypatch.setattr(int4_ops, "reshape_and_cache_int4", no_triton)
    impl = TritonAttentionImpl(2, 32, num_kv_heads=1, kv_cache_dtype=INT4)
    reference = ReferenceAttentionImpl(2, 32, num_kv_heads=1, kv_cache_dtype=INT4)
    key = torch.randn(3, 1, 32)
    slots = torch.tensor([4, 0, 9])
    cache, codec_cache = _cache(1, 1, 32, 32, "NHD"), _cache(1, 1, 32, 32, "NHD")
    impl.do_kv_cache_update(AttentionLayerScales(), key, -key, cache, slots)
    reference.do_kv_cache_update(AttentionLayerScales(), key, -key, codec_cache, slots)
    assert torch.equal(cache, codec_cache)
