"""CPU_ATTN's bf16 dot paths against the reference backend: per-token-head rows in decode (the
row scale on the score and the softmax weight), the blocked prefill (pages packed once per KV
head into vdpbf16ps panels: tiles, head widths, the edges of a row's key range), and NaN / Inf
entries where those paths could drop or invent them. On builds without AVX-512 BF16 the same
cases run the fp32 paths."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attn_backend import PER_TOKEN_HEAD, SIMD_LEVELS, Case, check, setup

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_raw_rows_on_the_bf16_dot(cache_dtype: str, simd: str) -> None:
    """Decode with a bf16 query at head size 128 (the bf16 dot on AVX-512 BF16 builds, the row
    scale applied to the score and the softmax weight): rows of random value bytes (every int8,
    every e4m3 code but NaN) and random positive scales agree with the reference; a key row whose
    scale is NaN (a row that held a NaN) makes its KV head's outputs NaN, as in the reference."""
    case = Case(
        cache_dtype,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        seq_lens=[40, 17],
        query_lens=[1, 1],
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    cpu.simd = simd
    gen = torch.Generator().manual_seed(3)
    for side in kv_cache:
        raw = side.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        if cache_dtype == "fp8_per_token_head":
            raw[(raw & 0x7F) == 0x7F] = 0x3C
        scales = torch.rand(raw.shape[:-1], generator=gen) * 0.02 + 0.005
        raw[..., case.head_size :] = scales.unsqueeze(-1).view(torch.uint8)
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)

    block = int(metadata.block_table[0, 1])  # key 16 of sequence 0, KV head 1
    nan_scale = torch.tensor([float("nan")]).view(torch.uint8)
    kv_cache[0].view(torch.uint8)[block, 0, 1, case.head_size :] = nan_scale
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    assert torch.isnan(expected[0, 4:8]).all() and torch.isfinite(expected[0, :4]).all()
    assert torch.isnan(got[0, 4:8]).all()
    torch.testing.assert_close(got[0, :4], expected[0, :4], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], expected[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "cache_dtype",
    ["auto", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6", *[k for k, _ in PER_TOKEN_HEAD]],
)
def test_prefill_pages_of_two_tiles_and_a_narrow_value_head(cache_dtype: str) -> None:
    """Prefill with a bf16 query (the blocked path where the format is exact in bf16): pages of
    32 keys (two 16-key tiles each), head size 96 (six 16-dimension blocks of values), 3 query
    heads per KV head (blocks of 15 query rows on the 16 lanes of the value sums), a chunked
    prefill (queries after 25 cached tokens)."""
    check(
        Case(
            cache_dtype,
            num_kv_heads=2,
            group=3,
            head_size=96,
            head_size_v=96,
            block_size=32,
            seq_lens=[70, 45],
            query_lens=[70, 20],
        )
    )


def test_prefill_infinite_value_next_to_a_window_edge() -> None:
    """Prefill (many query rows: the blocked bf16 path) over a sliding window of 7 with +Inf in
    element 3 of key 20's V row and element 5 of key 21's: a row reads +Inf where its window holds
    the key and, elsewhere, what it reads without them, also where the key is the other half of
    a key pair at its window's edge (query 27 starts at key 21, query 20 ends at key 20). The
    reference agrees on the Inf; its masked products are 0 x Inf, NaN, so it is not the oracle
    for the rest."""
    case = Case(num_kv_heads=1, group=2, seq_lens=[40], query_lens=[40], sliding_window=7)
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    expected = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    block = int(metadata.block_table[0, 1])  # keys 16..31
    kv_cache[1][block, 4, 0, 3] = float("inf")
    kv_cache[1][block, 5, 0, 5] = float("inf")
    expected[20:27, :, 3] = float("inf")
    expected[21:28, :, 5] = float("inf")
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with_inf = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    assert torch.isinf(with_inf[20:27, :, 3]).all() and torch.isinf(with_inf[21:28, :, 5]).all()


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_other_query_dtypes_weight_values_in_fp32(
    cache_dtype: str, model_dtype: torch.dtype, simd: str
) -> None:
    """Decode rows of caches exact in bf16 with an fp32 or fp16 query: the values are weighted
    in fp32 (only a bf16 query's output tolerates weights rounded to bf16), so an fp32 query
    agrees with the reference to fp32 summation order, an fp16 one to its own rounding."""
    case = Case(
        cache_dtype,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        seq_lens=[300, 45],
        query_lens=[1, 1],
        model_dtype=model_dtype,
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    cpu.simd = simd
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    tol = 1e-5 if model_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("block_size", [16, 48, 512])
@pytest.mark.parametrize("cache_dtype", ["auto", "nvfp4", "int8_per_token_head"])
def test_prefill_spans_of_several_pages(
    cache_dtype: str, block_size: int, window: int | None
) -> None:
    """Prefill with a bf16 query on the blocked path, which packs spans of consecutive pages (256
    keys of 16-key pages, 240 of 48-key ones, one 512-key page) and attends them together:
    contexts across several spans, a chunked prefill whose first query sits inside a span, a
    window that starts inside one, and 4 query tokens x 3 heads per KV head (an item over every
    KV head, its heads taken one by one)."""
    check(
        Case(
            cache_dtype,
            num_kv_heads=2,
            group=3,
            head_size=128,
            head_size_v=128,
            block_size=block_size,
            seq_lens=[600, 530, 300],
            query_lens=[90, 4, 300],
            sliding_window=window,
        )
    )
