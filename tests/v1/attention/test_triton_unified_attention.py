"""Upstream vLLM's ``unified_attention(...)`` signature over the Triton paged attention
(:mod:`vllm.v1.attention.ops.triton_unified_attention`): per-token-head caches with separate
scale caches (upstream's layout) against the same values dequantized, float8-typed FP8 caches
with expanded descales, upstream's window / soft cap / 3D (split) arguments, the split rule and
the argument errors. fp16 queries under the interpreter (its bf16 is wrong), bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant.formats import KVQuantMode
from vllm.v1.attention.backends import (
    AttentionLayerScales,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.ops.triton_unified_attention import (
    MAX_SPLITS,
    choose_num_splits,
    plan_paged_attention,
    unified_attention,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUERY_DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
TOL = 4e-3 if QUERY_DTYPE is torch.float16 else 2e-2  # operands rounded to the query dtype
H, HQ, D, N = 2, 4, 64, 16


def _problem(seed: int, query_lens: list[int], kv_lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 24
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(DEVICE, QUERY_DTYPE)
    max_pages = max((k + N - 1) // N for k in kv_lens)
    table = torch.randperm(num_blocks, generator=gen)[: len(kv_lens) * max_pages]
    table = table.reshape(len(kv_lens), max_pages).to(torch.int32).to(DEVICE)
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    args = dict(
        cu_seqlens_q=cu.to(DEVICE),
        max_seqlen_q=max(query_lens),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        max_seqlen_k=max(kv_lens),
        softmax_scale=D**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=table,
        softcap=0,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    )
    return gen, num_blocks, q, args


@pytest.mark.parametrize(
    ("mode", "dtype", "qmax"),
    [
        (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8, 127.0),
        (KVQuantMode.FP8_PER_TOKEN_HEAD, torch.float8_e4m3fn, 448.0),
    ],
)
def test_per_token_head_scale_caches(mode: KVQuantMode, dtype: torch.dtype, qmax: float) -> None:
    """Upstream's layout: one-byte caches ``[B, N, H, D]`` and fp32 scale caches
    ``[B, N, H]``; the result equals attention over the dequantized values (an fp32 cache)."""
    gen, num_blocks, q, args = _problem(0, [1, 1, 5], [40, 17, 23])
    values = [torch.randn(num_blocks, N, H, D, generator=gen) for _ in range(2)]
    caches, scales, dequantized = [], [], []
    for x in values:
        scale = (x.abs().amax(-1) / qmax).clamp(min=1e-6)
        y = (x / scale[..., None]).clamp(-qmax, qmax)
        quant = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)
        caches.append(quant.to(DEVICE))
        scales.append(scale.to(DEVICE))
        dequantized.append((quant.float() * scale[..., None]).to(DEVICE))
    out = torch.empty_like(q)
    unified_attention(
        q, caches[0], caches[1], out, **args, kv_quant_mode=mode,
        k_scale_cache=scales[0], v_scale_cache=scales[1],
    )  # fmt: skip
    expected = torch.empty_like(q)
    unified_attention(q, dequantized[0], dequantized[1], expected, **args)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL, rtol=TOL)


def _fp8_cache_and_reference(sliding_window: int | None, soft_cap: float | None):
    """An FP8 e4m3 cache written by the reference writer, its per-head scales, and the
    reference impl's output."""
    query_lens, kv_lens = [7, 1, 1], [30, 33, 64]
    gen, num_blocks, q, args = _problem(1, query_lens, kv_lens)
    ref = ReferenceAttentionImpl(
        HQ, D, num_kv_heads=H, kv_cache_dtype="fp8_e4m3", sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
    )  # fmt: skip
    cache = torch.zeros(num_blocks, 2, N, H, D, dtype=torch.uint8, device=DEVICE)
    layer = AttentionLayerScales(
        torch.tensor([0.01, 0.02], device=DEVICE), torch.tensor([0.015, 0.005], device=DEVICE)
    )
    table = args["block_table"]
    full = ReferenceAttentionMetadata.build(kv_lens, kv_lens, table, N)
    k = torch.randn(sum(kv_lens), H, D, generator=gen).to(DEVICE)
    v = torch.randn(sum(kv_lens), H, D, generator=gen).to(DEVICE)
    ref.do_kv_cache_update(layer, k, v, cache, full.slot_mapping)
    meta = ReferenceAttentionMetadata.build(kv_lens, query_lens, table, N)
    expected = ref.forward(layer, q, None, None, cache, meta)
    return q, cache, layer, args, expected


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (9, 5.0)])
@pytest.mark.parametrize("threshold", [None, 0, 8])
def test_fp8_cache_with_upstream_arguments(
    window: int | None, soft_cap: float | None, threshold: int | None
) -> None:
    """float8-typed cache sides, descales expanded to ``[num_seqs, H]``, ``window_size =
    (W - 1, 0)``, ``softcap``, and upstream's 3D rule (``seq_threshold_3D`` 0: never split;
    8 with ``max_seqlen_q == 1`` and scratch buffers: 4 segments) give the reference impl's
    result."""
    q, cache, layer, args, expected = _fp8_cache_and_reference(window, soft_cap)
    if threshold is not None:  # a decode-only batch: the split path applies at threshold 8
        args = {**args, "cu_seqlens_q": torch.arange(4, dtype=torch.int32, device=DEVICE)}
        args["max_seqlen_q"] = 1
        q, expected = q[[6, 7, 8]], expected[[6, 7, 8]]
    args.update(
        window_size=(window - 1, 0) if window else (-1, -1),
        softcap=soft_cap or 0,
        k_descale=layer._k_scale.expand(3, H),
        v_descale=layer._v_scale.expand(3, H),
    )
    out = torch.empty_like(q)
    fp8 = cache.view(torch.float8_e4m3fn)
    scratch = [torch.empty(q.shape[0], HQ, 4, *d, device=DEVICE) for d in ((D,), (), ())]
    unified_attention(
        q, fp8[:, 0], fp8[:, 1], out, **args, seq_threshold_3D=threshold,
        num_par_softmax_segments=4, softmax_segm_output=scratch[0],
        softmax_segm_max=scratch[1], softmax_segm_expsum=scratch[2],
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL, rtol=TOL)


def test_choose_num_splits() -> None:
    """Few programs over long keys split up to the target, at least 4 tiles each, at most
    MAX_SPLITS; prefill-sized batches and full grids never split."""
    assert choose_num_splits(8, 8192, 8, 264) == MAX_SPLITS
    assert choose_num_splits(8, 8192, 1, 264) == 32  # batch 1, 8 KV heads: 256 programs
    assert choose_num_splits(8, 2048, 1, 264) == 16  # 64 tiles of 32 keys: 4 per split
    assert choose_num_splits(64, 8192, 8, 264) == 5
    assert choose_num_splits(8, 256, 8, 264) == 2  # 8 tiles of 32 keys: 2 splits of 4
    assert choose_num_splits(8, 64, 8, 264) == 1
    assert choose_num_splits(8, 8192, 4096, 264) == 1
    assert choose_num_splits(512, 8192, 8, 264) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alibi_slopes": torch.ones(HQ + 1)}, r"alibi_slopes: expected a float32 / float16 / "),
        ({"q_descale": torch.ones(2)}, r"q_descale: expected None or a one-element"),
        ({"output_scale": torch.ones(2)}, r"output_scale: expected None or a one-element"),
        ({"causal": "per_sequence"}, r"causal: expected a bool or a bool / integer tensor of"),
        ({"mm_prefix_range": "ranges"}, r"mm_prefix_range: expected an integer \[3, R, 2\]"),
        ({"chunk_lookback": 8, "window_size": (7, 0)}, r"chunk_lookback: expected -1 or less"),
        ({"out": "e5m2"}, "out: expected"),
        ({"softmax_segm_output": "small"}, r"softmax_segm_output: expected a contiguous float32"),
        ({"window_size": (3, 2)}, r"window_size: expected \(-1, -1\) or \(W - 1, 0\)"),
        ({"block_table": "int64"}, "block_table: expected an int32"),
        ({"cu_seqlens_q": "short"}, r"cu_seqlens_q: expected shape \[4\]"),
        ({"cu_seqlens_q": "float"}, "cu_seqlens_q: expected an integer tensor, got torch.float32"),
        ({"seqused_k": "float"}, "seqused_k: expected an integer tensor, got torch.float32"),
        ({"k": "int16"}, "k: expected a float16 / bfloat16 / float32 / float8 / uint8 cache"),
    ],
)
def test_argument_errors(change: dict, message: str) -> None:
    _, num_blocks, q, args = _problem(2, [1, 1, 1], [3, 4, 5])
    k = torch.zeros(num_blocks, N, H, D, dtype=QUERY_DTYPE, device=DEVICE)
    out = torch.zeros_like(q)
    tensors = {"q": q, "k": k, "v": k, "out": out}
    for name, value in change.items():
        if value == "int64":
            args[name] = args[name].long()
        elif value == "short":
            args[name] = args[name][:2]
        elif value == "float":
            args[name] = args[name] + 0.5
        elif value == "int16":
            tensors[name] = k.view(torch.int16)
        elif value == "e5m2":
            tensors[name] = out.to(torch.float8_e5m2)
        elif value == "per_sequence":
            args[name] = torch.ones(3)  # floats
        elif value == "ranges":
            args[name] = torch.zeros(2, 1, 2, dtype=torch.int32)  # 2 sequences, not 3
        elif value == "small":  # a split-K launch whose scratch has 2, not 4, segments
            args.update(seq_threshold_3D=8, num_par_softmax_segments=4)
            args["softmax_segm_max"] = torch.empty(3, HQ, 4)
            args["softmax_segm_expsum"] = torch.empty(3, HQ, 4)
            args[name] = torch.empty(3, HQ, 2, D)
        elif name in tensors:
            tensors[name] = value
        else:
            args[name] = value
    with pytest.raises(ValueError, match=message):
        unified_attention(tensors["q"], tensors["k"], tensors["v"], tensors["out"], **args)
    assert not out.any()


def test_compile_cases_cover_every_reader_and_feature() -> None:
    """triton_compile_cases() (compiled for sm_80/90/100 by tools/compile_triton_kernels.py)
    holds every row encoding of the registry (bf16 pages too), both NVFP4 scale layouts,
    both per-token-head scale sources,
    split and unsplit, each feature flag on (FP8 queries / output, tensor descriptors), every
    query dtype, and the segment reduction per output dtype."""
    from vllm.kv_quant.formats import CacheKind
    from vllm.v1.attention.ops.triton_attention_cases import triton_compile_cases
    from vllm.v1.attention.ops.triton_attention_reduce import reduce_segments
    from vllm.v1.attention.ops.triton_paged_attention import paged_attention_kernel

    cases = triton_compile_cases()
    attention = [c for c in cases if c.kernel is paged_attention_kernel]
    kinds = {(c.constexprs["FORMAT"], c.constexprs["BF16_PAGES"]) for c in attention}
    # INT4 rows are read by the packed kernel (its cases: triton_packed_attention).
    paged = {k for k in CacheKind if k is not CacheKind.INT4_PER_TOKEN_HEAD}
    assert kinds == {(k.value, False) for k in paged} | {(CacheKind.UNQUANTIZED.value, True)}
    nvfp4 = [c for c in attention if c.constexprs["FORMAT"] == CacheKind.NVFP4]
    assert {c.constexprs["K_INTERLEAVE4"] for c in nvfp4} == {True, False}
    per_token_head = (CacheKind.INT8_PER_TOKEN_HEAD, CacheKind.FP8_PER_TOKEN_HEAD)
    for kind in per_token_head:
        inline = {c.constexprs["SCALE_INLINE"] for c in attention if c.constexprs["FORMAT"] == kind}
        assert inline == {True, False}, kind
    row_aligns = {
        c.constexprs["ROW_ALIGN"] for c in attention if c.constexprs["FORMAT"] in per_token_head
    }
    assert row_aligns == {1, 4}  # per-token-head rows: 4-byte loads and the byte-load fallback
    flags = ("CAUSAL", "USE_WINDOW", "USE_SOFT_CAP", "USE_SINKS", "FP32_DOT", "IS_3D")
    for flag in (*flags, "Q_FP8", "OUT_SCALE", "USE_TD", "PER_SEQ_CAUSAL"):
        assert {c.constexprs[flag] for c in attention} == {True, False}, flag
    assert {c.constexprs["NUM_SPLITS"] > 1 for c in attention} == {True, False}
    assert {c.signature["q_ptr"] for c in attention} == {"*fp16", "*bf16", "*fp32", "*u8"}
    assert {c.signature["out_ptr"] for c in attention} == {"*fp16", "*bf16", "*fp32", "*u8"}
    td_formats = {c.constexprs["FORMAT"] for c in attention if c.constexprs["USE_TD"]}
    assert td_formats == {CacheKind.UNQUANTIZED, CacheKind.FP8_E4M3, CacheKind.FP8_E5M2}
    # What is compiled is what is launched: the same constexpr names, the same pipelining.
    _, num_blocks, q, args = _problem(4, [1], [40])
    cache = torch.zeros(num_blocks, N, H, D, dtype=QUERY_DTYPE, device=DEVICE)
    launch = plan_paged_attention(
        torch.empty_like(q), q, cache, cache, args["block_table"], args["seqused_k"],
        args["cu_seqlens_q"], "auto", torch.ones(1), torch.ones(1), 1.0, 1, 40,
    )  # fmt: skip
    assert {tuple(sorted(c.constexprs)) for c in attention} == {tuple(sorted(launch.constexprs))}
    assert {c.constexprs["NUM_STAGES"] for c in attention} == {launch.constexprs["NUM_STAGES"]}
    reduces = [c for c in cases if c.kernel is reduce_segments]
    assert {c.signature["output_ptr"] for c in reduces} == {"*fp16", "*bf16", "*fp32", "*u8"}
    assert len({c.name for c in cases}) == len(cases)
    # ... and the same tiling: the exact paths at 16 x 16 with 8 warps, the others 4 warps
    # (tensor-descriptor tiles inside the 16-token pages).
    for c in attention:
        exact = c.constexprs["FP32_DOT"] or c.constexprs["REBUILD_KEYS"]
        shape = (c.constexprs["BLOCK_M"], c.constexprs["TILE_N"], c.num_warps)
        td_tile = 16 if c.constexprs["USE_TD"] else 32  # tensor descriptors: in one page
        assert shape == ((16, 16, 8) if exact else (shape[0], td_tile, 4)), c.name


def test_tiling_exact_paths_small_tiles_more_warps() -> None:
    """choose_tiling: tensor-core dots take 16 (decode) / 64 (prefill) rows, 32-key tiles and 4
    warps; the exact paths 16 rows, 16-key tiles and 8 warps (their FMA dots spill at larger
    tiles); a GQA group wider than the rows widens them. Launches follow it: fp32 queries on
    the exact tiling, fp16 on the fast one, the split count counted in the launch's tiles."""
    from vllm.v1.attention.ops.triton_paged_attention import Tiling, choose_tiling

    assert choose_tiling(4, 1, exact=False) == Tiling(16, 32, 4)
    assert choose_tiling(4, 7, exact=False) == Tiling(64, 32, 4)
    assert choose_tiling(128, 7, exact=False) == Tiling(128, 32, 4)
    assert choose_tiling(4, 7, exact=True) == Tiling(16, 16, 8)
    assert choose_tiling(32, 1, exact=True) == Tiling(32, 16, 8)
    assert choose_num_splits(8, 2048, 1, 264, tile_n=16) == 32  # 128 tiles of 16 keys
    _, num_blocks, q, args = _problem(4, [1], [300])
    for dtype, tiling in ((torch.float32, (16, 16, 8)), (torch.float16, (16, 32, 4))):
        query = q.to(dtype)
        cache = torch.zeros(num_blocks, N, H, D, dtype=dtype, device=DEVICE)
        launch = plan_paged_attention(
            torch.empty_like(query), query, cache, cache, args["block_table"],
            args["seqused_k"], args["cu_seqlens_q"], "auto", torch.ones(1), torch.ones(1), 1.0,
            1, 300, num_splits=1,
        )  # fmt: skip
        constexprs = launch.constexprs
        assert (constexprs["BLOCK_M"], constexprs["TILE_N"], launch.num_warps) == tiling
