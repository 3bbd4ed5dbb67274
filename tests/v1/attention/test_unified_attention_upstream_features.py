"""What upstream vLLM v0.33's ``unified_attention`` surface adds over the Triton paged attention
(:mod:`vllm.v1.attention.ops.triton_unified_attention`), pinned beyond upstream's own tests:
FP8 e4m3 queries (2D and split-K) against attention over the dequantized values, FP8 outputs
against torch's e4m3 rounding of the reference (saturating), tensor-descriptor tile loads equal
to the pointer loads bit for bit, :func:`reduce_segments` over a non-power-of-two segment
count, the tile-range helper, the split-K admission rule and the new argument errors."""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest
import torch

from vllm.kv_quant.formats import KVQuantMode
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops import triton_unified_attention as attention
from vllm.v1.attention.ops.triton_attention_helpers import compute_tile_loop_bounds
from vllm.v1.attention.ops.triton_unified_attention import reduce_segments, unified_attention

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
H, HQ, D, N, NUM_BLOCKS = 2, 8, 64, 16, 16


def _problem(query_lens: list[int], kv_lens: list[int], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pages = max((k + N - 1) // N for k in kv_lens)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: len(kv_lens) * pages]
    cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(sum(query_lens), HQ, D, generator=gen),
        k=torch.randn(NUM_BLOCKS, N, H, D, generator=gen),
        v=torch.randn(NUM_BLOCKS, N, H, D, generator=gen),
        cu_seqlens_q=cu.to(DEVICE),
        max_seqlen_q=max(query_lens),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        max_seqlen_k=max(kv_lens),
        softmax_scale=D**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=table.reshape(len(kv_lens), pages).to(torch.int32).to(DEVICE),
        softcap=0,
    )


def _reference(
    p: dict,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: list[bool] | None = None,
    window: int | None = None,
    chunk: tuple[int, int] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Attention in fp64 over fp32 inputs, sequence by sequence: causal (or per sequence as
    ``causal``), within ``window`` keys of the query (both sides where not causal) or, for
    ``chunk`` (size, lookback), the query's chunk and ``lookback`` earlier ones; sequence i's
    ``ranges[i]`` (inclusive) seen in full by their queries."""
    out = []
    cu, kv_lens, table = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist(), p["block_table"]
    for i, kv_len in enumerate(kv_lens):
        rows = q[cu[i] : cu[i + 1]].double()
        keys = k[table[i].long().cpu()].reshape(-1, H, D)[:kv_len].double()
        vals = v[table[i].long().cpu()].reshape(-1, H, D)[:kv_len].double()
        keys, vals = (x.repeat_interleave(HQ // H, dim=1) for x in (keys, vals))
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * p["softmax_scale"]
        dist = torch.arange(kv_len - rows.shape[0], kv_len)[:, None] - torch.arange(kv_len)
        hidden = dist < 0 if causal is None or causal[i] else torch.zeros_like(dist, dtype=bool)
        q_pos = torch.arange(kv_len - rows.shape[0], kv_len)[:, None]
        if chunk is not None:
            hidden |= q_pos // chunk[0] - torch.arange(kv_len) // chunk[0] > chunk[1]
        elif window is not None:
            hidden |= (dist >= window) | (dist <= -window)
        if ranges is not None:
            start, end = ranges[i]
            key = torch.arange(kv_len)
            inside = (q_pos >= start) & (q_pos <= end) & (key >= start) & (key <= end)
            hidden &= ~inside
        scores.masked_fill_(hidden, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
    return torch.cat(out).float()


def _run(p: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, **kw):
    args = {n: x for n, x in p.items() if n not in ("q", "k", "v")}
    kw.setdefault("q_descale", None)
    kw.setdefault("k_descale", None)
    kw.setdefault("v_descale", None)
    to = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    unified_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), out, **args, **to)
    return out.cpu()


def _split_k(tokens: int) -> dict:
    shapes = ((tokens, HQ, 4, D), (tokens, HQ, 4), (tokens, HQ, 4))
    bufs = [torch.empty(s, device=DEVICE) for s in shapes]
    return dict(
        seq_threshold_3D=8,
        num_par_softmax_segments=4,
        softmax_segm_output=bufs[0],
        softmax_segm_max=bufs[1],
        softmax_segm_expsum=bufs[2],
    )


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("cache", ["fp8", "fp16"])
def test_fp8_query_is_attention_over_dequantized_values(split: bool, cache: str) -> None:
    """An e4m3 query with ``q_descale``, over an FP8 cache (``k_descale`` / ``v_descale``) or an
    fp16 one, equals fp64 attention over the dequantized values; decodes of 2 sequences split
    into 4 segments when scratch is given."""
    p = _problem([1, 1] if split else [5, 1], [40, 23])
    q_scale, k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.01]), torch.tensor([0.03])
    q8 = (p["q"] / q_scale).to(FP8)
    if cache == "fp8":
        k, v = (p["k"] / k_scale).to(FP8), (p["v"] / v_scale).to(FP8)
        kq, vq = k.float() * k_scale, v.float() * v_scale
        scales = dict(
            k_descale=k_scale, v_descale=v_scale, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR
        )
    else:
        k, v = p["k"].half(), p["v"].half()
        kq, vq, scales = k.float(), v.float(), {}
    out = torch.full(p["q"].shape, float("nan"), dtype=torch.float16, device=DEVICE)
    extra = _split_k(2) if split else {}
    got = _run(p, q8, k, v, out, q_descale=q_scale, **scales, **extra)
    expected = _reference(p, q8.float() * q_scale, kq, vq)
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("split", [False, True])
def test_fp8_output_is_the_scaled_output_rounded_to_e4m3(split: bool) -> None:
    """``out`` float8_e4m3fn with ``output_scale``: the fp32 output (itself the reference's)
    times the scale's fp32 inverse, saturated to +-448 and rounded to nearest even as torch
    rounds it, byte for byte, for a moderate and a tiny (saturating) scale."""
    p = _problem([1, 1] if split else [6, 2], [33, 17], seed=1)
    q, k, v = p["q"].half(), p["k"].half(), p["v"].half()
    extra = _split_k(2) if split else {}
    out32 = _run(p, q, k, v, torch.empty(q.shape, device=DEVICE), **extra)
    expected = _reference(p, q.float(), k.float(), v.float())
    torch.testing.assert_close(out32, expected, atol=2e-3, rtol=2e-3)
    for scale in (0.05, 1e-6):
        out = torch.empty(q.shape, dtype=FP8, device=DEVICE)
        scale_t = torch.tensor([scale])
        got = _run(p, q, k, v, out, output_scale=scale_t, **_split_k(2) if split else {})
        want = (out32 * (1.0 / scale_t)).clamp(-448, 448).to(FP8)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max() == 448


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("cache", ["fp16", "fp8"])
def test_tensor_descriptor_loads_equal_pointer_loads(split: bool, cache: str) -> None:
    """``use_td``: the keys through tensor descriptors (16-key tiles in the 16-token pages,
    where the pointer path takes 32) give the pointer path's result up to the order of the
    fp32 sums; pages past a sequence hold NaN, which neither path lets into the output."""
    p = _problem([1, 1] if split else [7, 1], [37, 20], seed=2)
    q = p["q"].half()
    for i, kv_len in enumerate(p["seqused_k"].tolist()):  # the last pages' unwritten tails
        last = int(p["block_table"][i, (kv_len - 1) // N])
        p["k"][last, kv_len % N :] = p["v"][last, kv_len % N :] = float("nan")
    if cache == "fp8":
        k, v, mode = p["k"].to(FP8), p["v"].to(FP8), KVQuantMode.FP8_PER_TENSOR
    else:
        k, v, mode = p["k"].half(), p["v"].half(), KVQuantMode.NONE
    results = []
    for use_td in (False, True):
        out = torch.empty(q.shape, dtype=torch.float16, device=DEVICE)
        extra = _split_k(2) if split else {}
        results.append(_run(p, q, k, v, out, use_td=use_td, kv_quant_mode=mode, **extra))
    assert not results[0].isnan().any()
    torch.testing.assert_close(results[1], results[0], atol=1e-3, rtol=1e-3)


def test_tensor_descriptor_errors() -> None:
    p = _problem([1], [20])
    out = torch.zeros(p["q"].shape, dtype=torch.float16, device=DEVICE)
    k = p["k"].to(torch.int8)
    scale_cache = torch.ones(NUM_BLOCKS, N, H)
    with pytest.raises(ValueError, match="use_td: expected an unquantized or FP8 cache"):
        _run(
            p, p["q"].half(), k, k, out, use_td=True, k_scale_cache=scale_cache,
            v_scale_cache=scale_cache, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
        )  # fmt: skip
    small = p["k"].half().reshape(NUM_BLOCKS * 2, N // 2, H, D)
    with pytest.raises(ValueError, match="use_td: expected a block size that is a multiple of 16"):
        _run(p, p["q"].half(), small, small, out, use_td=True)
    assert not out.any()


def test_reduce_segments_combines_any_segment_count() -> None:
    """Five segments (not a power of two) of random partial states: the softmax-weighted sum of
    those a sequence of 150 keys in 32-key tiles uses (``ceil(150 / (5 * 32))`` = 1 tile each:
    the first 5), with a segment that saw no key (``max = -inf``) left out."""
    gen = torch.Generator().manual_seed(4)
    heads, segments, dim = 2, 5, 32
    partial = torch.randn(1, heads, segments, dim, generator=gen)
    maxima = torch.randn(1, heads, segments, generator=gen)
    sums = torch.rand(1, heads, segments, generator=gen) + 0.5
    maxima[0, 1, 3] = float("-inf")
    partial[0, 1, 3] = float("nan")  # never read
    out = torch.empty(1, heads, dim)
    reduce_segments[(1, heads)](
        out, partial, maxima, sums, torch.tensor([150], dtype=torch.int32), 1, heads, 1.0,
        out.stride(0), out.stride(1), 1, 32, dim, dim,
        torch.tensor([0, 1], dtype=torch.int32), 1, segments, False,
    )  # fmt: skip
    weights = torch.exp(maxima - maxima.nan_to_num(neginf=-1e30).amax(-1, keepdim=True))
    partial = partial.nan_to_num()
    expected = (partial * weights[..., None]).sum(2) / (sums * weights).sum(2)[..., None]
    torch.testing.assert_close(out, expected)


@triton.jit
def _bounds_probe(
    out_ptr,
    context_len,
    seq_len,
    query_len,
    q_block,
    segment,
    per_segment,
    SLIDING_WINDOW: tl.constexpr,
    IS_3D: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    lo, hi, prefix = compute_tile_loop_bounds(
        context_len, seq_len, query_len, q_block, segment, per_segment, 16, 16, 4, 4,
        SLIDING_WINDOW, False, IS_3D, CAUSAL,
    )  # fmt: skip
    tl.store(out_ptr, lo)
    tl.store(out_ptr + 1, hi)
    tl.store(out_ptr + 2, prefix)


@pytest.mark.parametrize(
    ("args", "window", "is_3d", "causal", "expected"),
    [
        # 4-token query blocks: block 2 of a 20-token query after 100 keys sees keys < 112
        ((100, 120, 20, 2, 0, 0), 0, False, True, [0, 7, 112]),
        # a 16-key window: keys 93 .. 111, tiles 5 .. 6
        ((100, 120, 20, 2, 0, 0), 16, False, True, [5, 7, 112]),
        # non-causal: the whole sequence, the window right of the last query too (tiles .. 7)
        ((100, 120, 20, 2, 0, 0), 16, False, False, [5, 8, 120]),
        # split-K: segment 1 of 3-tile segments over the 7 causal tiles
        ((100, 120, 20, 2, 1, 3), 0, True, True, [3, 6, 112]),
    ],
)
def test_compute_tile_loop_bounds(args, window, is_3d, causal, expected) -> None:
    out = torch.empty(3, dtype=torch.int32, device=DEVICE)
    _bounds_probe[(1,)](out, *args, SLIDING_WINDOW=window, IS_3D=is_3d, CAUSAL=causal)
    assert out.tolist() == expected


@pytest.mark.parametrize(
    ("case", "expected"), [("plain", True), ("batch_invariant", False), ("few_rows", False)]
)
def test_split_k_admission(monkeypatch, case: str, expected: bool) -> None:
    """Decodes with scratch split; batch-invariant mode or scratch with fewer rows than query
    tokens does not (upstream's rule)."""
    monkeypatch.setattr(attention, "is_batch_invariant", case == "batch_invariant")
    kernel = MagicMock()
    monkeypatch.setattr(attention, "kernel_unified_attention", kernel)
    monkeypatch.setattr(attention, "reduce_segments", MagicMock())
    p = _problem([1, 1], [40, 23])
    extra = _split_k(1 if case == "few_rows" else 2)
    out = torch.empty(p["q"].shape, dtype=torch.float16, device=DEVICE)
    _run(p, p["q"].half(), p["k"].half(), p["v"].half(), out, **extra)
    assert kernel.__getitem__.return_value.call_args.kwargs["IS_3D"] is expected
    assert attention.reduce_segments.__getitem__.called is expected


@pytest.mark.parametrize("window", [None, 6])
def test_per_sequence_causal_flags(window: int | None) -> None:
    """``causal`` as a ``[num_seqs]`` tensor: a causal prefill chunk beside a bidirectional
    one (within the window both ways when there is one); such a batch never splits."""
    p = _problem([5, 7], [30, 19], seed=5)
    q, k, v = p["q"].float(), p["k"].float(), p["v"].float()
    flags = torch.tensor([True, False])
    window_size = (window - 1, 0) if window else (-1, -1)
    out = torch.empty(q.shape, device=DEVICE)
    p.update(window_size=window_size, causal=flags)
    got = _run(p, q, k, v, out, **_split_k(12))
    expected = _reference(p, q, k, v, causal=[True, False], window=window)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ranges", [False, True])
def test_chunked_attention_and_prefix_ranges(ranges: bool) -> None:
    """``chunk_lookback`` 1 over a 16-key window: chunks of 8 keys, a query seeing its own and
    the previous chunk; ``mm_prefix_range`` (one range per sequence, inclusive) overrides that
    mask inside the range (unclamped)."""
    p = _problem([20, 3], [40, 30], seed=6)
    q, k, v = p["q"].float(), p["k"].float(), p["v"].float()
    spans = [(21, 33), (2, 28)]
    p["window_size"] = (15, 0)
    extra = {"mm_prefix_range": torch.tensor(spans, dtype=torch.int32)[:, None]} if ranges else {}
    got = _run(p, q, k, v, torch.empty(q.shape, device=DEVICE), chunk_lookback=1, **extra)
    expected = _reference(p, q, k, v, chunk=(8, 1), ranges=spans if ranges else None)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
