"""TurboQuant decode attention (vllm.v1.attention.ops.triton_turboquant_decode) against attention
in fp32 torch over the reference codec's decoded keys and values: every preset, Hadamard and
random orthogonal rotations, GQA, several sequences with partial pages over a shuffled block
table, stale bytes in unwritten slots, split counts, fp16 / bf16 / fp32 queries, upstream's
call of its round-trip test, the output buffer contract and the errors. Without a GPU the
kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    solve_lloyd_max,
    turboquant_decode_slots,
)
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.triton_turboquant_decode import (
    triton_compile_cases,
    triton_turboquant_decode_attention,
)
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here"),
    pytest.mark.usefixtures("single_intra_op_thread"),
    # Stale bytes decode to NaN / Inf in slots no sequence reads; the interpreter warns.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _batch(preset: str, d: int, seq_lens: list[int], num_kv_heads: int = 2, seed: int = 0):
    """A cache of random (stale) bytes with ``seq_lens`` tokens stored per sequence by the
    Triton store over a shuffled block table; the rotation, centroids and config."""
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    gen = torch.Generator().manual_seed(seed)
    pi = _hadamard(d) if d & (d - 1) == 0 else torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    pi = pi.float().contiguous()
    centroids, midpoints = solve_lloyd_max(d, cfg.centroid_bits)
    pages = max(1, max((n + BLOCK - 1) // BLOCK for n in seq_lens))
    num_blocks = pages * len(seq_lens) + 1
    cache = torch.randint(0, 256, (num_blocks, BLOCK, num_kv_heads, cfg.slot_size_aligned),
                          generator=gen, dtype=torch.uint8).to(DEVICE)  # fmt: skip
    table = torch.randperm(num_blocks, generator=gen)[: pages * len(seq_lens)]
    table = table.reshape(len(seq_lens), pages).to(torch.int32)
    for b, n in enumerate(seq_lens):
        if n == 0:
            continue
        key = torch.randn(n, num_kv_heads, d, generator=gen) * 2
        value = torch.randn(n, num_kv_heads, d, generator=gen)
        slots = torch.tensor([int(table[b, t // BLOCK]) * BLOCK + t % BLOCK for t in range(n)])
        triton_turboquant_store(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE),
                                pi.T.contiguous().to(DEVICE), midpoints.to(DEVICE),
                                mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                                value_quant_bits=cfg.effective_value_quant_bits,
                                key_fp8=cfg.key_fp8)  # fmt: skip
    return cfg, cache, table.to(DEVICE), pi.to(DEVICE), centroids.float().to(DEVICE)


def _reference(cfg, cache, table, seq_lens, query, pi, centroids, scale) -> torch.Tensor:
    """Attention in fp32 torch over the codec's decoded (rotated-back) keys and values."""
    keys, values = turboquant_decode_slots(cache, cfg, centroids, None if cfg.key_fp8 else pi)
    group = query.shape[1] // cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b, n in enumerate(seq_lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=query.device)
        page = table[b].long()[pos // BLOCK]
        k = keys[page, pos % BLOCK].repeat_interleave(group, 1)
        v = values[page, pos % BLOCK].repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[b].float(), k) * scale, -1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def _decode(cfg, cache, table, seq_lens, query, pi, centroids, scale, **kwargs) -> torch.Tensor:
    return triton_turboquant_decode_attention(
        query, cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), pi,
        centroids, scale, cfg.key_mse_bits, cfg.key_packed_size,
        cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "d"),
    [*((p, 64) for p in TQ_PRESETS), ("turboquant_k8v4", 40), ("turboquant_3bit_nc", 40)],
)
def test_decode_is_attention_over_the_codec_values(preset: str, d: int) -> None:
    """Three sequences (one over two pages, one a partial page, one empty) and GQA 2; fp32
    queries: only the summation order differs from the codec + torch attention. Head dim 40:
    a random orthogonal rotation, rows shorter than their block."""
    seq_lens = [23, 5, 0]
    cfg, cache, table, pi, centroids = _batch(preset, d, seq_lens, seed=d)
    query = torch.randn(3, 4, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = d**-0.5
    got = _decode(cfg, cache, table, seq_lens, query, pi, centroids, scale, max_num_kv_splits=4)
    expected = _reference(cfg, cache, table, seq_lens, query, pi, centroids, scale)
    assert got.dtype == torch.float32 and got.shape == (3, 4, d)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no keys: zeros


@pytest.mark.parametrize("splits", [1, 40])
def test_split_counts_and_pi_t(splits: int) -> None:
    """Any split count (more than 32 clamps) is the same function; an explicit ``PiT`` is the
    one the query is rotated by (``Pi`` is then not read)."""
    seq_lens = [40, 17]
    cfg, cache, table, pi, centroids = _batch("turboquant_k3v4_nc", 64, seq_lens, seed=3)
    query = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = _reference(cfg, cache, table, seq_lens, query, pi, centroids, 0.2)
    got = _decode(cfg, cache, table, seq_lens, query, torch.full_like(pi, float("nan")),
                  centroids, 0.2, PiT=pi.T.contiguous(), max_num_kv_splits=splits)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries_and_output_buffer(dtype: torch.dtype) -> None:
    """A half-precision query is widened (exact) and the output rounded once to its dtype; a
    large enough ``output_buf`` of that dtype receives it, else (fp16) ``buf_holder`` keeps the
    new tensor."""
    seq_lens = [9, 30]
    cfg, cache, table, pi, centroids = _batch("turboquant_4bit_nc", 64, seq_lens, seed=5)
    query = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    expected = _reference(cfg, cache, table, seq_lens, query, pi, centroids, 0.125)
    buffer = torch.full((3, 4, 64), 7.0, dtype=dtype, device=DEVICE)
    got = _decode(cfg, cache, table, seq_lens, query, pi, centroids, 0.125, output_buf=buffer)
    assert got.data_ptr() == buffer.data_ptr() and got.shape == (2, 4, 64)
    tol = 2.0**-10 if dtype == torch.float16 else 2.0**-7  # one rounding to the dtype
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=tol)
    assert (buffer[2] == 7).all()
    if dtype == torch.bfloat16:
        return
    holder = SimpleNamespace()
    wrong = torch.empty(3, 4, 64, dtype=torch.float32, device=DEVICE)
    got = _decode(cfg, cache, table, seq_lens, query, pi, centroids, 0.125, output_buf=wrong,
                  buf_holder=holder)  # fmt: skip
    assert holder._tq_output_buf is got and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=tol)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_upstream_round_trip_call(preset: str) -> None:
    """Upstream's GPU round-trip test's call (head dim 128, one token, query = key, Hadamard
    rotation): the output is the decoded value (one key: softmax weight 1)."""
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim=128)
    h = _hadamard(128).to(DEVICE)
    centroids, _ = solve_lloyd_max(128, cfg.centroid_bits)
    centroids = centroids.float().to(DEVICE)
    c_sorted, _ = centroids.sort()
    midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2
    torch.manual_seed(123)
    key = torch.randn(1, 4, 128, device=DEVICE, dtype=torch.float16)
    value = torch.randn(1, 4, 128, device=DEVICE, dtype=torch.float16)
    cache = torch.zeros(1, 16, 4, cfg.slot_size_aligned, device=DEVICE, dtype=torch.uint8)
    slots = torch.tensor([0], device=DEVICE, dtype=torch.int32)
    triton_turboquant_store(key, value, cache, slots, h, midpoints, mse_bits=cfg.key_mse_bits,
                            key_packed_size=cfg.key_packed_size,
                            value_quant_bits=cfg.effective_value_quant_bits,
                            key_fp8=cfg.key_fp8)  # fmt: skip
    output = triton_turboquant_decode_attention(
        query=key.contiguous(), kv_cache=cache,
        block_table=torch.tensor([[0]], device=DEVICE, dtype=torch.int32),
        seq_lens=torch.tensor([1], device=DEVICE, dtype=torch.int32), Pi=h,
        centroids=centroids, scale=1.0 / math.sqrt(128), mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=h, max_num_kv_splits=4,
    )  # fmt: skip
    _, decoded = turboquant_decode_slots(cache[0, 0], cfg, centroids, h)
    assert output.dtype == torch.float16
    torch.testing.assert_close(output[0], decoded.to(torch.float16), atol=0, rtol=0)
    cos = torch.nn.functional.cosine_similarity(output[0].float(), value[0].float(), dim=-1)
    assert (cos > 0.95).all()


def test_bad_arguments() -> None:
    seq_lens = [20]
    cfg, cache, table, pi, centroids = _batch("turboquant_3bit_nc", 64, seq_lens, seed=7)
    query = torch.randn(1, 2, 64, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    base = dict(query=query, kv_cache=cache, block_table=table, seq_lens=lens, Pi=pi,
                centroids=centroids, scale=0.125, mse_bits=3,
                key_packed_size=cfg.key_packed_size, value_quant_bits=3,
                norm_correction=True)  # fmt: skip
    bad = {
        "key_packed_size: expected 26": dict(key_packed_size=25),
        "mse_bits/value_quant_bits": dict(value_quant_bits=5),
        r"centroids: expected float32 \[8\]": dict(centroids=centroids[:4]),
        r"PiT: expected float32 \[64, 64\]": dict(Pi=pi[:32]),
        "query: expected a multiple of the cache's 2 KV heads": dict(query=query[:, :1]),
        r"seq_lens: expected \[1\] lengths in 0..32": dict(seq_lens=lens + 13),
        "block_table: expected the pages": dict(block_table=table + 100),
        "kv_cache: expected uint8": dict(kv_cache=cache[..., :40]),
        "max_num_kv_splits: expected a positive int": dict(max_num_kv_splits=0),
        "scale: expected a finite float": dict(scale=float("inf")),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            triton_turboquant_decode_attention(**(base | change))  # type: ignore[arg-type]


def test_compile_cases_cover_every_preset() -> None:
    cases = triton_compile_cases()
    assert [c.name for c in cases] == [f"decode/{p}/d{d}" for p in TQ_PRESETS for d in (128, 96)]
    assert all(not case.enable_fp_fusion for case in cases)
