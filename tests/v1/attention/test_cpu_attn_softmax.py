"""CPU_ATTN's online softmax in decode against the reference backend: scores that climb page by
page, slowly (a running maximum that stays within the slack it may lag by) and fast (one that
must move every page), a late key far above every other, and a sequence whose keys are all
outside the window but the last. Every SIMD level and the formats of the bf16 dot, the NVFP4
chunk path and the fp32 tile."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attn_backend import SIMD_LEVELS, Case, setup

from vllm.v1.attention.backends import ReferenceAttentionMetadata

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("climb", [0.02, 1.0])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3", "nvfp4", "fp8_per_token_head"])
def test_decode_scores_that_climb(
    cache_dtype: str, climb: float, block_size: int, model_dtype: torch.dtype, simd: str
) -> None:
    """Keys along their KV head's mean query direction, growing by `climb` per position (about
    0.2 or 8 in score per 16 keys) plus noise, and one key at position 280 of the long sequence
    40 units further: the output is the reference's. A running maximum never moved would
    overflow the weights (scores grow by ~150 over the sequence at the fast climb); pages of 48
    keys take three 16-key steps whose later ones move the maximum after the earlier ones'
    weights are taken (one maximum per page, or those weights rescaled, is what keeps them
    right)."""
    case = Case(
        cache_dtype,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        block_size=block_size,
        seq_lens=[300, 45],
        query_lens=[1, 1],
        model_dtype=model_dtype,
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    cpu.simd = simd
    gen = torch.Generator().manual_seed(5)
    keys = []
    for seq, seq_len in enumerate(case.seq_lens):
        rows = query[seq].float().reshape(case.num_kv_heads, case.group, case.head_size)
        direction = torch.nn.functional.normalize(rows.mean(dim=1), dim=-1)
        reach = climb * torch.arange(seq_len, dtype=torch.float32)
        if seq == 0:
            reach[280] += 40.0
        noise = torch.randn(seq_len, case.num_kv_heads, case.head_size, generator=gen) * 0.3
        keys.append(reach[:, None, None] * direction[None] + noise)
    key = torch.cat(keys)
    value = torch.randn(key.shape[0], case.num_kv_heads, case.head_size_v, generator=gen)
    if not case.quantized:
        key, value = key.to(case.cache_torch_dtype), value.to(case.cache_torch_dtype)
    slots = ReferenceAttentionMetadata.build(
        case.seq_lens, case.seq_lens, metadata.block_table, case.block_size
    ).slot_mapping
    reference.do_kv_cache_update(layer, key, value, kv_cache, slots)
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    assert torch.isfinite(expected).all()
    tol = 2e-2 if model_dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3", "nvfp4"])
def test_decode_window_of_one_key(cache_dtype: str, simd: str) -> None:
    """A window of one position: each row sees one key, inside its last page (positions 69 and
    32: one valid lane of a 16-key step, away from its first), so its output is that value."""
    case = Case(
        cache_dtype,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        seq_lens=[70, 33],
        query_lens=[1, 1],
        sliding_window=1,
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    cpu.simd = simd
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
