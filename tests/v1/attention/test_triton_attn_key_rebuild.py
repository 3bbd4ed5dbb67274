"""TRITON_ATTN rebuilds keys stored before RoPE and reads FP8 key sinks
(:mod:`vllm.v1.attention.ops.triton_key_rebuild`): the rebuilt key tile is the kv_quant
definition bit for bit (every format, each transform alone and all together); the attention
equals a dense torch attention over the rebuilt keys (each input alone, NHD / HND, split-K,
prefill and decode in one batch) and the REFERENCE reader through ``AttentionKVCache``
(FP8, NVFP4 in both scale layouts, per-token-head, neox / GPT-J / partial RoPE, sinks S = 1 and
3, chunked prefill then decode, fp32 / fp16 / bf16 queries); bad arguments are refused before
anything is launched or written. Under Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import KeyRope, ScaleLayout, hadamard_rotate, kv_scale_as_1d
from vllm.kv_quant.formats import lookup
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_key_rebuild import key_rebuild_args, rebuilt_key_tile
from vllm.v1.attention.ops.triton_unified_attention import (
    _side,
    kernel_format,
    plan_paged_attention,
    unified_attention,
)
from vllm.v1.worker.attention_kv_cache import AttentionKVCache

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, HQ, D, BLOCK, NUM_BLOCKS = 2, 4, 64, 16, 8
ROPES = {
    "neox": KeyRope.from_base(D, 64),
    "gptj": KeyRope.from_base(D, 64, is_neox_style=False),
    "neox_partial": KeyRope.from_base(D // 2, 64),
    "gptj_partial": KeyRope.from_base(D // 4, 64, is_neox_style=False),
}


def _rebuilt(
    rows: torch.Tensor,
    positions: torch.Tensor,
    rope: KeyRope | None = None,
    offset: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    hadamard: bool = False,
) -> torch.Tensor:
    """The kv_quant definition of the rebuilt keys ``[n, H, D]`` of one sequence: sink rows at
    positions < S, Hadamard back, offset added, RoPE at each position."""
    x = rows.to(torch.float32).clone()
    if sinks is not None:
        use = positions < sinks.shape[0]
        x[use] = sinks[positions[use]]
    if hadamard:
        x = hadamard_rotate(x)
    if offset is not None:
        x = x + offset
    if rope is not None:
        x = rope.rotate(x, positions)
    return x


def _keys(gen: torch.Generator, tokens: int) -> torch.Tensor:
    """Random keys with edge rows: zeros, far beyond FP8's range (within fp16's), tiny
    (subnormal per-token-head scales)."""
    k = torch.randn(tokens, H, D, generator=gen) * 3
    k[1] = 0.0
    k[2, 0] *= 1e3
    k[5, 1] = torch.randn(D, generator=gen) * 1e-30
    return k


@triton.jit
def _rebuild_tile_kernel(
    out_ptr,
    k_ptr,
    k_aux_ptr,
    rope_ptr,
    key_offset_ptr,
    sink_keys_ptr,
    hadamard_scale,
    rotary_dim,
    num_sink_keys,
    table_ptr,
    k_scale_ptr,
    k_scale_stride,
    num_keys,
    stride_page,
    stride_tok,
    stride_head,
    stride_aux_page,
    stride_aux_tok,
    stride_aux_head,
    HEAD_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FORMAT: tl.constexpr,
    BF16_PAGES: tl.constexpr,
    K_INTERLEAVE4: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    USE_ROPE: tl.constexpr,
    ROPE_NEOX: tl.constexpr,
    KEY_HADAMARD: tl.constexpr,
    USE_KEY_OFFSET: tl.constexpr,
    USE_SINK_KEYS: tl.constexpr,
):
    """Grid ``(tiles, heads, 1)``: the rebuilt keys of sequence 0 (pages ``table``) into
    ``out [num_keys, H, HEAD_SIZE]`` fp32."""
    keys = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    kv_head = tl.program_id(1)
    key_ok = keys < num_keys
    page = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_SIZE)
    x = rebuilt_key_tile(
        k_ptr,
        k_aux_ptr,
        rope_ptr,
        key_offset_ptr,
        sink_keys_ptr,
        page,
        keys % BLOCK_SIZE,
        keys,
        key_ok,
        tl.program_id(2),
        kv_head.to(tl.int64),
        d,
        tl.load(k_scale_ptr + kv_head * k_scale_stride),
        hadamard_scale,
        rotary_dim,
        num_sink_keys,
        NUM_KV_HEADS,
        stride_page,
        stride_tok,
        stride_head,
        stride_aux_page,
        stride_aux_tok,
        stride_aux_head,
        HEAD_SIZE,
        HEAD_SIZE,
        FORMAT,
        BF16_PAGES,
        K_INTERLEAVE4,
        True,
        ROW_ALIGN,
        USE_ROPE,
        ROPE_NEOX,
        KEY_HADAMARD,
        USE_KEY_OFFSET,
        USE_SINK_KEYS,
    )
    out = (keys[:, None] * NUM_KV_HEADS + kv_head) * HEAD_SIZE + d[None, :]
    tl.store(out_ptr + out, x, mask=key_ok[:, None])


FORMATS = [
    ("auto", torch.float32, None),
    ("auto", torch.bfloat16, None),
    ("auto", torch.float16, None),
    ("fp8_e4m3", torch.float32, None),
    ("fp8_e5m2", torch.float32, None),
    ("int8_per_token_head", torch.float32, None),
    ("fp8_per_token_head", torch.float32, None),
    ("nvfp4", torch.float32, "linear"),
    ("nvfp4", torch.float32, "interleave4"),
]
TRANSFORMS = {
    "rope_neox": dict(rope="neox"),
    "rope_gptj": dict(rope="gptj"),
    "rope_neox_partial": dict(rope="neox_partial"),
    "rope_gptj_partial": dict(rope="gptj_partial"),
    "hadamard": dict(hadamard=True),
    "offset": dict(offset=True),
    "sinks1": dict(sinks=1),
    "sinks3": dict(sinks=3),
    "all_neox": dict(rope="neox", hadamard=True, offset=True, sinks=3),
    "all_gptj_partial": dict(rope="gptj_partial", hadamard=True, offset=True, sinks=1),
}


def _transform_inputs(gen: torch.Generator, num_seqs: int, options: dict) -> dict:
    """Keyword arguments of both :func:`_rebuilt` (per sequence: ``sinks`` indexed) and the
    kernels (``rope_cos_sin`` ...), from ``options``."""
    rope = ROPES[options["rope"]] if "rope" in options else None
    offset = torch.randn(H, D, generator=gen) * 2 if options.get("offset") else None
    sinks = None
    if options.get("sinks"):
        sinks = torch.randn(num_seqs, options["sinks"], H, D, generator=gen) * 2
    return dict(rope=rope, offset=offset, sinks=sinks, hadamard=options.get("hadamard", False))


def _kernel_kwargs(inputs: dict) -> dict:
    rope = inputs["rope"]
    return dict(
        rope_cos_sin=None if rope is None else rope.cos_sin.to(DEVICE),
        rope_is_neox=True if rope is None else rope.is_neox_style,
        key_offset=None if inputs["offset"] is None else inputs["offset"].to(DEVICE),
        sink_keys=None if inputs["sinks"] is None else inputs["sinks"].to(DEVICE),
        key_hadamard=inputs["hadamard"],
    )


def _run_tile_check(fmt: str, model_dtype: torch.dtype, layout: str | None, options: dict):
    tokens, table = 37, torch.tensor([5, 1, 7], dtype=torch.int32)
    gen = torch.Generator().manual_seed(len(fmt) + 7 * len(options))
    layouts = None if layout is None else (layout, layout)
    cache = AttentionKVCache.create(fmt, NUM_BLOCKS, BLOCK, H, D, backend="REFERENCE",
                                    model_dtype=model_dtype, scale_layouts=layouts,
                                    device=DEVICE)  # fmt: skip
    if lookup(fmt, include_mla_only=False).is_quantized:
        cache.set_kv_scales(torch.tensor([0.02, 0.05]), torch.tensor(0.1))
    k = _keys(gen, tokens)
    k[3, 1, 7], k[4, 0, 2] = float("nan"), float("inf")  # the definition's NaN / Inf, too
    k = k.to(DEVICE, model_dtype)
    table = table.to(DEVICE)
    meta = cache.metadata([tokens], [tokens], table[None])
    cache.write(k, torch.zeros_like(k), meta.slot_mapping)
    k_scale = kv_scale_as_1d(cache.k_scale, "k_scale", H).to(DEVICE, torch.float32)
    k_layout = ScaleLayout.resolve(cache.impl.k_scale_layout, BLOCK, D)
    pages = cache.key_cache[table.long()]
    rows = cache.encoding.codec.read(pages, k_scale, D, k_layout, torch.float32)
    rows = rows.reshape(-1, H, D)[:tokens].cpu()

    inputs = _transform_inputs(gen, 1, options)
    positions = torch.arange(tokens)
    sinks = inputs["sinks"]
    expected = _rebuilt(rows, positions, inputs["rope"], inputs["offset"],
                        None if sinks is None else sinks[0], inputs["hadamard"])  # fmt: skip
    code = kernel_format(cache.impl.kv_cache_format)
    side = _side(cache.key_cache, code, D, k_layout, None)
    rebuild = key_rebuild_args(
        **_kernel_kwargs(inputs), num_seqs=1, num_kv_heads=H, head_size=D,
        max_seq_len=tokens, device=cache.device,
    )  # fmt: skip
    constexprs = dict(rebuild.constexprs)
    assert constexprs.pop("REBUILD_KEYS")
    got = torch.full((tokens, H, D), float("nan"), device=DEVICE)
    _rebuild_tile_kernel[(triton.cdiv(tokens, 16), H, 1)](
        got, side.data, side.aux, *rebuild.kernel_args(k_scale), table, k_scale,
        int(k_scale.numel() > 1), tokens, *side.strides, *side.aux_strides, HEAD_SIZE=D,
        NUM_KV_HEADS=H, BLOCK_SIZE=BLOCK, TILE_N=16, FORMAT=code.value,
        BF16_PAGES=cache.key_cache.dtype == torch.bfloat16,
        K_INTERLEAVE4=side.interleave4, ROW_ALIGN=side.row_align, **constexprs,
        enable_fp_fusion=False,  # as the attention kernel is launched: products rounded alone
    )  # fmt: skip
    got = got.cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert got.isfinite().float().mean() > 0.9  # NaN / Inf stay in their keys' rows


# NaN / Inf keys: numpy's warnings of the interpreted kernel
NAN_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@NAN_WARNINGS
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_each_transform_of_the_key_tile_is_the_definition_bit_for_bit(name: str) -> None:
    _run_tile_check("fp8_e4m3", torch.float32, None, TRANSFORMS[name])


@NAN_WARNINGS
@pytest.mark.parametrize(("fmt", "model_dtype", "layout"), FORMATS)
def test_every_formats_rebuilt_key_tile_is_the_definition_bit_for_bit(
    fmt: str, model_dtype: torch.dtype, layout: str | None
) -> None:
    _run_tile_check(fmt, model_dtype, layout, TRANSFORMS["all_neox"])
    _run_tile_check(fmt, model_dtype, layout, TRANSFORMS["all_gptj_partial"])


def _dense_attention(q, rows_per_seq, v_per_seq, inputs, query_lens, scale):
    """fp32 causal attention of each sequence's last queries over its rebuilt keys."""
    outs, start = [], 0
    for i, (rows, v) in enumerate(zip(rows_per_seq, v_per_seq, strict=True)):
        n, q_len = rows.shape[0], query_lens[i]
        positions = torch.arange(n)
        sinks = None if inputs["sinks"] is None else inputs["sinks"][i]
        k = _rebuilt(rows, positions, inputs["rope"], inputs["offset"], sinks, inputs["hadamard"])
        qs = q[start : start + q_len].float()
        k = k.repeat_interleave(HQ // H, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        causal = positions[None, :] <= torch.arange(n - q_len, n)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(HQ // H, 1)))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(
    ("cache_dtype", "query_dtype", "layout", "splits"),
    [
        (torch.bfloat16, torch.float32, "NHD", 1),
        (torch.float16, torch.float16, "HND", 3),
    ],
)
def test_attention_over_rebuilt_keys_is_dense_attention(
    name: str, cache_dtype: torch.dtype, query_dtype: torch.dtype, layout: str, splits: int
) -> None:
    """Three sequences in one batch: a 6-token prefill chunk, a decode step and a 2-token
    prefill (shorter than S = 3 sinks), over an unquantized cache (NHD, or HND strides) with
    the rebuild's arguments given directly."""
    gen = torch.Generator().manual_seed(3)
    seq_lens, query_lens = [37, 9, 2], [6, 1, 2]
    table = torch.tensor([[5, 1, 7], [2, 0, 0], [4, 0, 0]], dtype=torch.int32)
    if layout == "NHD":
        k_cache = torch.randn(NUM_BLOCKS, BLOCK, H, D, generator=gen).to(cache_dtype)
    else:
        k_cache = torch.randn(NUM_BLOCKS, H, BLOCK, D, generator=gen).to(cache_dtype)
        k_cache = k_cache.transpose(1, 2)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, H, D, generator=gen).to(cache_dtype)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(query_dtype)
    inputs = _transform_inputs(gen, 3, TRANSFORMS[name])
    out = torch.full_like(q, float("nan"))
    launch = plan_paged_attention(
        out.to(DEVICE), q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 6, 7, 9], dtype=torch.int32, device=DEVICE), "auto",
        torch.ones(1), torch.ones(1), D**-0.5, 6, 37, num_splits=splits,
        **_kernel_kwargs(inputs),
    )  # fmt: skip
    assert launch.num_splits == splits and launch.constexprs["REBUILD_KEYS"]
    launch()
    got = launch.args[0].cpu()
    rows = [k_cache[table[i].long()].reshape(-1, H, D)[:n] for i, n in enumerate(seq_lens)]
    vals = [v_cache[table[i].long()].reshape(-1, H, D)[:n] for i, n in enumerate(seq_lens)]
    expected = _dense_attention(q, rows, vals, inputs, query_lens, D**-0.5)
    tol = 1e-5 if query_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_unified_attention_takes_the_rebuild_arguments() -> None:
    """Upstream's signature passes them on (fp16 cache and queries, a decode batch)."""
    gen = torch.Generator().manual_seed(4)
    seq_lens = [37, 9]
    table = torch.tensor([[5, 1, 7], [2, 0, 0]], dtype=torch.int32)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, H, D, generator=gen).half()
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, H, D, generator=gen).half()
    q = torch.randn(2, HQ, D, generator=gen).half()
    inputs = _transform_inputs(gen, 2, TRANSFORMS["all_gptj_partial"])
    out = torch.full_like(q, float("nan")).to(DEVICE)
    unified_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), out,
        torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE), 1,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 37, D**-0.5, True, (-1, -1),
        table.to(DEVICE), 0, None, None, None, **_kernel_kwargs(inputs),
    )  # fmt: skip
    rows = [k_cache[table[i].long()].reshape(-1, H, D)[:n] for i, n in enumerate(seq_lens)]
    vals = [v_cache[table[i].long()].reshape(-1, H, D)[:n] for i, n in enumerate(seq_lens)]
    expected = _dense_attention(q, rows, vals, inputs, [1, 1], D**-0.5)
    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-3, rtol=2e-3)


# (first, last + 1) token of each of the two sequences per forward: prefill, prefill, decode
CHUNKS = (((0, 0), (20, 11)), ((20, 11), (35, 19)), ((35, 19), (36, 20)))
ATTENTION_CASES = [
    # format, scale layout, RoPE, sinks, hadamard, model dtype, layout, splits
    ("fp8_e4m3", None, "neox", 1, True, torch.float32, "NHD", None),
    ("fp8_e4m3", None, "gptj_partial", 3, False, torch.float16, "HND", 3),
    ("fp8_e5m2", None, "neox_partial", 3, True, torch.bfloat16, "NHD", None),
    ("nvfp4", "linear", "neox", 1, True, torch.float32, "HND", 2),
    ("nvfp4", "interleave4", "gptj", 3, True, torch.float16, "NHD", None),
    ("nvfp4", "interleave4", "neox_partial", 1, False, torch.float32, "NHD", 4),
    ("fp8_per_token_head", None, "gptj", 0, True, torch.float32, "NHD", 2),
    ("int8_per_token_head", None, "neox", 0, False, torch.float16, "HND", None),
]


@pytest.mark.parametrize(
    ("fmt", "scale_layout", "rope", "sinks", "hadamard", "model_dtype", "layout", "splits"),
    ATTENTION_CASES,
)
def test_triton_attn_reads_like_the_reference(
    fmt: str,
    scale_layout: str | None,
    rope: str,
    sinks: int,
    hadamard: bool,
    model_dtype: torch.dtype,
    layout: str,
    splits: int | None,
) -> None:
    """Through ``AttentionKVCache.create(..., key_rope=, key_sink_tokens=, key_rotation=)``:
    two sequences, a prefill in two chunks then a decode step (:data:`CHUNKS`), the same pages
    and sink rows and the same attention from TRITON_ATTN and REFERENCE."""
    gen = torch.Generator().manual_seed(11)
    seq_lens = (36, 20)
    k = [_keys(gen, n) for n in seq_lens]
    v = [torch.randn(n, H, D, generator=gen) for n in seq_lens]
    q = [torch.randn(n, HQ, D, generator=gen) for n in seq_lens]
    offset = torch.randn(H, D, generator=gen)
    table = torch.tensor([[5, 1, 7], [2, 6, 0]], dtype=torch.int32)
    options = dict(
        key_rope=ROPES[rope],
        key_sink_tokens=sinks,
        key_rotation="hadamard" if hadamard else None,
        scale_layouts=None if scale_layout is None else (scale_layout, scale_layout),
        layout=layout,
    )
    outs, caches = [], []
    for backend in ("TRITON_ATTN", "REFERENCE"):
        cache = AttentionKVCache.create(
            fmt, NUM_BLOCKS, BLOCK, H, D, num_heads=HQ, backend=backend, model_dtype=model_dtype,
            device=DEVICE, **options,
        )  # fmt: skip
        if backend == "TRITON_ATTN":
            cache.impl.num_splits = splits
        cache.set_key_offset(offset)
        cache.set_kv_scales(torch.tensor([0.03, 0.05]), torch.tensor(0.02))
        parts = []
        for starts, stops in CHUNKS:
            spans = list(zip(starts, stops, strict=True))
            meta = cache.metadata(list(stops), [b - a for a, b in spans], table)
            q_b, k_b, v_b = (
                torch.cat([x[i][a:b] for i, (a, b) in enumerate(spans)]).to(DEVICE, model_dtype)
                for x in (q, k, v)
            )
            parts.append(cache.forward(q_b, k_b, v_b, meta).float().cpu())
        outs.append(torch.cat(parts))
        caches.append(cache)
    assert torch.equal(caches[0].key_cache, caches[1].key_cache)
    if sinks:
        assert torch.equal(caches[0].key_sinks, caches[1].key_sinks)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[model_dtype]
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def _plan(**rebuild):
    """plan_paged_attention over a small fp8 cache with the given rebuild arguments; returns the
    output tensor (NaN until written)."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, H, D, dtype=torch.uint8, device=DEVICE)
    q = torch.randn(3, HQ, D, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    plan_paged_attention(
        out, q, cache, cache, torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE),
        torch.tensor([20], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), "fp8_e4m3",
        torch.ones(1), torch.ones(1), 0.1, 3, 20, **rebuild,
    )()  # fmt: skip
    return out


TABLE = ROPES["neox"].cos_sin
BAD_ARGUMENTS = [
    (dict(rope_cos_sin=TABLE.double()), "rope_cos_sin: expected a float32"),
    (dict(rope_cos_sin=TABLE[0]), "rope_cos_sin: expected a float32"),
    (dict(rope_cos_sin=TABLE[:19]), "rope_cos_sin: expected at least max_seq_len=20 rows"),
    (dict(rope_cos_sin=TABLE[:, :3].contiguous()), "rope_cos_sin: expected an even rotary_dim"),
    (dict(rope_cos_sin=torch.zeros(64, 2 * D)), "rope_cos_sin: expected an even rotary_dim"),
    (dict(rope_cos_sin=TABLE.t().contiguous().t()), "rope_cos_sin: expected a contiguous"),
    (dict(rope_cos_sin=TABLE, rope_is_neox=1), "rope_is_neox: expected a bool"),
    (dict(key_offset=torch.zeros(H, D + 1)), r"key_offset: expected shape \[2, 64\]"),
    (dict(key_offset=torch.zeros(H, D, dtype=torch.float16)), "key_offset: expected a float32"),
    (dict(sink_keys=torch.zeros(2, 1, H, D)), r"sink_keys: expected shape \[1, S >= 1"),
    (dict(sink_keys=torch.zeros(1, 0, H, D)), r"sink_keys: expected shape \[1, S >= 1"),
    (dict(sink_keys=torch.zeros(1, 1, H, D, device="meta")), "sink_keys: expected a contiguous"),
    (dict(key_hadamard="yes"), "key_hadamard: expected a bool"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_ARGUMENTS)
def test_bad_rebuild_arguments_are_refused_before_launching(kwargs: dict, match: str) -> None:
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
              for k, v in kwargs.items()}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        _plan(**kwargs)
    assert not _plan().isnan().any()  # the same call without them writes everything


def test_hadamard_needs_a_power_of_two_head_size() -> None:
    cache = torch.zeros(NUM_BLOCKS, BLOCK, H, 48, dtype=torch.uint8, device=DEVICE)
    q = torch.randn(1, HQ, 48).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="head_size: expected a power of two"):
        plan_paged_attention(
            out, q, cache, cache, torch.tensor([[1]], dtype=torch.int32, device=DEVICE),
            torch.tensor([3], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), "fp8_e4m3",
            torch.ones(1), torch.ones(1), 0.1, 1, 3, key_hadamard=True,
        )  # fmt: skip
    assert out.isnan().all()


def test_sequences_past_the_rope_table_are_refused_before_writing() -> None:
    rope = KeyRope.from_base(D, 16)
    cache = AttentionKVCache.create("fp8_e4m3", NUM_BLOCKS, BLOCK, H, D, num_heads=HQ,
                                    backend="TRITON_ATTN", model_dtype=torch.float32,
                                    key_rope=rope, key_sink_tokens=1, device=DEVICE)  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    k, v, q = (
        x.to(DEVICE) for x in (_keys(gen, 17), torch.randn(17, H, D), torch.randn(17, HQ, D))
    )
    meta = cache.metadata([17], [17], torch.tensor([[3, 4]], dtype=torch.int32))
    before, sinks = cache.kv_cache.clone(), cache.key_sinks.clone()
    with pytest.raises(ValueError, match="seq_lens: expected at most 16 tokens"):
        cache.impl.forward(cache.layer, q, k, v, cache.kv_cache, meta)
    assert torch.equal(cache.kv_cache, before) and torch.equal(cache.key_sinks, sinks)
