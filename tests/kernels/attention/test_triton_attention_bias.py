"""Upstream v0.33's score biases and R-SWA mask in the Triton ``unified_attention``
(:mod:`vllm.v1.attention.ops.triton_unified_attention`) against the fp32 oracle
(:func:`~vllm.v1.attention.backends.reference_attend.attend_fp32`): ALiBi (linear and square
root), the q/q bias and R-SWA, alone and together, with a sliding window, sinks, a soft cap
and an FP8 cache, in the 2D (prefill) and split-K (decode) launches; GQA groups of 3 query
heads, partial last pages; and the argument errors, raised before anything is written."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant.formats import KVQuantMode
from vllm.v1.attention.backends.reference_attend import attend_fp32
from vllm.v1.attention.ops.triton_unified_attention import plan_paged_attention, unified_attention

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # interpreter: no bf16
TOL = 4e-3 if DTYPE is torch.float16 else 2e-2
H, HQ, D, N, BLOCKS = 2, 6, 32, 16, 12  # GQA group of 3 (not a power of 2)
PREFILL = ([5, 3], [37, 21])  # query lens, key lens: partial last pages
DECODE = ([1, 1], [45, 19])
FP8 = torch.float8_e4m3fn


def _problem(shape: tuple[list[int], list[int]], seed: int = 0) -> dict:
    query_lens, kv_lens = shape
    gen = torch.Generator().manual_seed(seed)
    pages = max(-(-k // N) for k in kv_lens)
    table = torch.randperm(BLOCKS, generator=gen)[: len(kv_lens) * pages]
    return dict(
        q=torch.randn(sum(query_lens), HQ, D, generator=gen),
        k=torch.randn(BLOCKS, N, H, D, generator=gen),
        v=torch.randn(BLOCKS, N, H, D, generator=gen),
        cu_seqlens_q=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(DEVICE),
        max_seqlen_q=max(query_lens),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        max_seqlen_k=max(kv_lens),
        softmax_scale=D**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=table.reshape(len(kv_lens), pages).to(torch.int32).to(DEVICE),
        softcap=0,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    )


def _split_k(tokens: int) -> dict:
    shapes = ((tokens, HQ, 4, D), (tokens, HQ, 4), (tokens, HQ, 4))
    bufs = [torch.empty(s, device=DEVICE) for s in shapes]
    names = ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum")
    scratch = dict(zip(names, bufs, strict=True))
    return dict(seq_threshold_3D=8, num_par_softmax_segments=4, **scratch)


def _features(name: str, p: dict, gen: torch.Generator) -> dict:
    """``unified_attention``'s keyword arguments for ``name``'s features (``+``-joined)."""
    kw: dict = {}
    parts = name.split("+")
    if "alibi" in parts or "alibi_sqrt" in parts:
        kw["alibi_slopes"] = (torch.rand(HQ, generator=gen) * 0.5 + 0.05).to(DEVICE)
        kw["use_alibi_sqrt"] = "alibi_sqrt" in parts
    if "qq_bias" in parts:  # wider than the longest query: columns past it are other keys'
        kw["qq_bias"] = torch.randn(p["max_seqlen_q"] + 1, 7, generator=gen).to(DEVICE)
    if "rswa" in parts:
        kw["rswa_prefix_lens"] = torch.tensor([9, 4], dtype=torch.int32, device=DEVICE)
        kw["rswa_window"] = 6
    if "window" in parts:
        kw["window_size"] = (10, 0)  # 11 keys
    if "sinks" in parts:
        kw["sinks"] = torch.randn(HQ, generator=gen).to(DEVICE)
    if "softcap" in parts:
        kw["softcap"] = 3.0
    return kw


def _oracle(p: dict, k: torch.Tensor, v: torch.Tensor, kw: dict) -> torch.Tensor:
    """Sequence by sequence, attend_fp32 over the gathered (dequantized) pages."""
    out = []
    cu, kv_lens = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist()
    window = kw.get("window_size", p["window_size"])[0]
    prefix = kw.get("rswa_prefix_lens")
    for i, kv_len in enumerate(kv_lens):
        pages = p["block_table"][i].long().cpu()
        keys = k[pages].reshape(-1, H, D)[:kv_len]
        vals = v[pages].reshape(-1, H, D)[:kv_len]
        q = p["q"][cu[i] : cu[i + 1]]
        q_pos = torch.arange(kv_len - q.shape[0], kv_len)
        softcap = kw.get("softcap", 0)
        out.append(
            attend_fp32(
                q.to(DTYPE).float(),
                keys,
                vals,
                q_pos,
                torch.arange(kv_len),
                scale=p["softmax_scale"],
                causal=True,
                sliding_window=window + 1 if window >= 0 else None,
                logits_soft_cap=softcap or None,
                sinks=kw.get("sinks"),
                alibi_slopes=kw.get("alibi_slopes"),
                alibi_sqrt=kw.get("use_alibi_sqrt", False),
                qq_bias=kw.get("qq_bias"),
                rswa=None if prefix is None else (int(prefix[i]), kw["rswa_window"]),
            )
        )
    return torch.cat(out)


def _run(p: dict, kw: dict, split: bool, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the oracle's, over an fp16 (or e4m3, scale 0.05) cache."""
    args = {n: x for n, x in p.items() if n not in ("q", "k", "v")}
    args.update(kw)
    if split:
        args.update(_split_k(p["q"].shape[0]))
    k, v = p["k"].to(DTYPE), p["v"].to(DTYPE)
    if fp8:
        scale = torch.tensor([0.05])
        k, v = (p["k"] / scale).to(FP8), (p["v"] / scale).to(FP8)
        args.update(k_descale=scale, v_descale=scale, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        deq = (k.float() * scale, v.float() * scale)
    else:
        deq = (k.float(), v.float())
    q = p["q"].to(DEVICE, DTYPE)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, k.to(DEVICE), v.to(DEVICE), out, **args)
    return out.float().cpu(), _oracle(p, *deq, {n: x.cpu() if isinstance(x, torch.Tensor) else x
                                                for n, x in kw.items()})  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["prefill_2d", "decode_split_k"])
@pytest.mark.parametrize("feature", ["alibi", "alibi_sqrt", "qq_bias", "rswa"])
def test_each_feature_matches_the_oracle(feature: str, split: bool) -> None:
    p = _problem(DECODE if split else PREFILL)
    gen = torch.Generator().manual_seed(1)
    got, expected = _run(p, _features(feature, p, gen), split, fp8=False)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("features", "split", "fp8"),
    [
        ("alibi+qq_bias+rswa+sinks", False, False),
        ("alibi+window+sinks+softcap", False, False),
        ("alibi_sqrt+qq_bias+window", True, False),
        ("rswa+window+sinks", True, False),  # R-SWA replaces the window
        ("alibi+qq_bias+rswa", True, True),
        ("alibi_sqrt+window", False, True),
    ],
)
def test_features_combined_with_window_sinks_fp8(features: str, split: bool, fp8: bool) -> None:
    p = _problem(DECODE if split else PREFILL, seed=2)
    gen = torch.Generator().manual_seed(3)
    got, expected = _run(p, _features(features, p, gen), split, fp8)
    torch.testing.assert_close(got, expected, atol=2e-2 if fp8 else TOL, rtol=TOL)


def test_rswa_needs_both_arguments_as_upstream() -> None:
    """Upstream applies R-SWA only with both ``rswa_prefix_lens`` and ``rswa_window``: a window
    alone changes nothing; the oracle without R-SWA is the result."""
    p = _problem(PREFILL, seed=4)
    got, expected = _run(p, {"rswa_window": 2}, False, fp8=False)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


def test_features_off_compile_nothing_and_on_set_their_constexprs() -> None:
    """The policies are constexprs: all off without the arguments (the kernel compiled without
    their code), each on with its argument."""
    p = _problem(PREFILL)
    q = p["q"].to(DEVICE, DTYPE)
    cache = p["k"].to(DEVICE, DTYPE)
    base = (torch.empty_like(q), q, cache, cache, p["block_table"], p["seqused_k"],
            p["cu_seqlens_q"], "auto", torch.ones(1), torch.ones(1), 1.0, 5, 37)  # fmt: skip
    flags = ("USE_ALIBI", "ALIBI_SQRT", "USE_QQ_BIAS", "USE_RSWA")
    off = plan_paged_attention(*base).constexprs
    assert [off[f] for f in flags] == [False] * 4
    on = plan_paged_attention(
        *base,
        alibi_slopes=torch.ones(HQ, device=DEVICE),
        alibi_sqrt=True,
        qq_bias=torch.zeros(5, 5, device=DEVICE),
        rswa_prefix_lens=torch.zeros(2, dtype=torch.int32, device=DEVICE),
        rswa_window=4,
    ).constexprs
    assert [on[f] for f in flags] == [True] * 4


def test_compile_cases_cover_the_bias_policies() -> None:
    """The ahead-of-time cases (sm_80/90/100) compile each policy on, 2D and split-K (the
    square-root ALiBi split-K: it differs from the linear one in the bias arithmetic only)."""
    from vllm.v1.attention.ops.triton_attention_cases import triton_compile_cases
    from vllm.v1.attention.ops.triton_paged_attention import paged_attention_kernel

    cases = [c for c in triton_compile_cases() if c.kernel is paged_attention_kernel]
    for flag in ("USE_ALIBI", "ALIBI_SQRT", "USE_QQ_BIAS", "USE_RSWA"):
        assert {c.constexprs[flag] for c in cases} == {True, False}, flag
        launches = {c.constexprs["IS_3D"] for c in cases if c.constexprs[flag]}
        assert launches == ({True} if flag == "ALIBI_SQRT" else {True, False}), flag


META = torch.device("meta")


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"alibi_slopes": torch.ones(HQ + 1)}, ValueError, r"alibi_slopes: expected a float32 / "
         r"float16 / bfloat16 \[6\] \(Hq\) tensor on \w+, got torch.float32 of shape \[7\]"),
        ({"alibi_slopes": torch.ones(HQ, dtype=torch.int32)}, ValueError,
         r"alibi_slopes: expected .* got torch.int32 of shape \[6\]"),
        ({"alibi_slopes": torch.ones(HQ, device=META)}, ValueError,
         r"alibi_slopes: expected .* got torch.float32 of shape \[6\] on meta"),
        ({"alibi_slopes": [1.0] * HQ}, ValueError, r"alibi_slopes: expected .* got list"),
        ({"use_alibi_sqrt": 1}, TypeError, r"use_alibi_sqrt: expected a bool, got int"),
        ({"qq_bias": torch.zeros(4, 5)}, ValueError,
         r"qq_bias: expected a float32 / float16 / bfloat16 \[>= 5, C\] tensor .* got "
         r"torch.float32 of shape \[4, 5\]"),
        ({"qq_bias": torch.zeros(5)}, ValueError, r"qq_bias: expected .* shape \[5\]"),
        ({"qq_bias": torch.zeros(5, 5, dtype=torch.int64)}, ValueError,
         r"qq_bias: expected .* got torch.int64"),
        ({"qq_bias": torch.zeros(5, 5).t()[:, :4].t()}, ValueError,
         r"qq_bias: expected .*unit last stride"),
        ({"qq_bias": torch.zeros(5, 5, device=META)}, ValueError, r"qq_bias: expected .* on meta"),
        ({"rswa_prefix_lens": torch.zeros(3, dtype=torch.int32), "rswa_window": 4}, ValueError,
         r"rswa_prefix_lens: expected an integer \[2\] \(num_seqs\) tensor on \w+, got "
         r"torch.int32 of shape \[3\]"),
        ({"rswa_prefix_lens": torch.zeros(2), "rswa_window": 4}, ValueError,
         r"rswa_prefix_lens: expected an integer tensor, got torch.float32"),
        ({"rswa_prefix_lens": torch.zeros(2, dtype=torch.int32, device=META)}, ValueError,
         r"rswa_prefix_lens: expected .* on meta"),
        ({"rswa_window": 0}, ValueError, r"rswa_window: expected None or a positive int, got 0"),
        ({"rswa_window": True}, ValueError, r"rswa_window: expected .* got True"),
        ({"rswa_window": 4.0}, ValueError, r"rswa_window: expected .* got 4.0"),
    ],
)  # fmt: skip
def test_argument_errors_before_anything_runs(
    change: dict, error: type[Exception], message: str
) -> None:
    p = _problem(PREFILL)
    args = {n: x for n, x in p.items() if n not in ("q", "k", "v")}
    q, k = p["q"].to(DEVICE, DTYPE), p["k"].to(DEVICE, DTYPE)
    out = torch.zeros_like(q)
    with pytest.raises(error, match=message):
        unified_attention(q, k, k, out, **args, **change)
    assert not out.any()
