"""CPU paged attention over keys stored before RoPE: ``rope_cos_sin``, ``rope_is_neox``,
``key_offset``, ``sink_keys`` and ``key_hadamard`` of :func:`vllm._custom_ops.paged_attention`
against dense fp32 torch attention over keys rebuilt from the reference codecs' dequantization
of the same cache (sink key or cache key, rotated back by the Hadamard rotation, plus the
offset, then :meth:`vllm.kv_quant.key_rope.KeyRope.rotate`).
Every cache format x every compiled SIMD level, NHD / HND, neox and GPT-J pairs, partial rotary
dims, each argument alone and together, sinks longer than the sequences, GQA, prefill + decode
in one batch, split-K, sliding window, soft cap, logit sinks, fp32 / bf16 / fp16 queries, and
the argument errors (nothing written)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant.formats import lookup
from vllm.kv_quant.fp8_cache import fp8_read_cache
from vllm.kv_quant.hadamard import hadamard_rotate
from vllm.kv_quant.key_rope import KeyRope
from vllm.kv_quant.nvfp4_cache import nvfp4_read_cache
from vllm.kv_quant.per_token_head import per_token_head_read_cache

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

SIMD_LEVELS = ops.paged_attention_simd_levels()

# (kv_cache_dtype, NVFP4 scale layout, per-head K / V scales)
FORMATS = [
    ("auto", "linear", False),
    ("float16", "linear", False),
    ("fp8_e4m3", "linear", False),
    ("fp8_e4m3", "linear", True),
    ("fp8_e5m2", "linear", True),
    ("nvfp4", "linear", False),
    ("nvfp4", "interleave4", True),
    ("int8_per_token_head", "linear", False),
    ("fp8_per_token_head", "linear", False),
]


@dataclass
class Case:
    """One batch: sequences of ``seq_lens`` tokens whose last ``query_lens`` are queries.
    ``rotary_dim`` None: no ``rope_cos_sin``; ``sink_tokens`` 0: no ``sink_keys``."""

    cache_dtype: str = "fp8_e4m3"
    scale_layout: str = "linear"
    per_head_scale: bool = False
    layout: str = "NHD"
    num_kv_heads: int = 2
    group: int = 2
    head_size: int = 64
    block_size: int = 16
    seq_lens: list[int] = field(default_factory=lambda: [37, 21, 50])
    query_lens: list[int] = field(default_factory=lambda: [37, 6, 1])
    query_dtype: torch.dtype = torch.bfloat16
    rotary_dim: int | None = 64
    neox: bool = True
    offset: bool = True
    sink_tokens: int = 3
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    logit_sinks: bool = False
    hadamard: bool = False


def dequantize(case: Case, side: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, N, H, D]`` of a cache side, by the format's reference codec."""
    fmt = lookup(case.cache_dtype)
    if fmt.is_nvfp4:
        return nvfp4_read_cache(side, scale, case.head_size, case.scale_layout)
    if fmt.is_fp8:
        return fp8_read_cache(side, scale, fmt.fp8_variant)
    if fmt.is_per_token_head:
        return per_token_head_read_cache(side, case.cache_dtype)
    return side.float()


@dataclass
class Batch:
    args: dict
    key: torch.Tensor  # fp32 [B, N, Hkv, D], dequantized
    value: torch.Tensor
    table: torch.Tensor


def build(case: Case, seed: int = 0) -> Batch:
    """Cache written by reshape_and_cache_flash over a shuffled block table, a query and the
    optional key-transform tensors: the op's keyword arguments and the dequantized sides."""
    gen = torch.Generator().manual_seed(seed)
    fmt = lookup(case.cache_dtype)
    heads, dim = case.num_kv_heads, case.head_size
    num_seqs = len(case.seq_lens)
    max_pages = max((s + case.block_size - 1) // case.block_size for s in case.seq_lens)
    num_blocks = max_pages * num_seqs + 2
    table = torch.randperm(num_blocks, generator=gen)[: max_pages * num_seqs]
    table = table.reshape(num_seqs, max_pages).to(torch.int32)
    storage = fmt.resolve_storage_dtype(case.query_dtype)
    shape = (num_blocks, case.block_size, heads, fmt.last_dim(dim))
    if case.layout == "NHD":
        key_cache, value_cache = (torch.zeros(shape, dtype=storage) for _ in range(2))
    else:
        b, n, h, d = shape
        key_cache, value_cache = (
            torch.zeros(b, h, n, d, dtype=storage).transpose(1, 2) for _ in range(2)
        )
    k_scale = (
        torch.rand(heads, generator=gen) + 0.25 if case.per_head_scale else torch.tensor([0.6])
    )
    v_scale = k_scale.flip(0) * 1.7
    total = sum(case.seq_lens)
    source = torch.float32 if fmt.is_quantized else storage
    key = (torch.randn(total, heads, dim, generator=gen) * 2).to(source)
    value = torch.randn(total, heads, dim, generator=gen).to(source)
    slots = torch.cat(
        [
            table[s, torch.arange(n) // case.block_size].long() * case.block_size
            + torch.arange(n) % case.block_size
            for s, n in enumerate(case.seq_lens)
        ]
    )
    layout = case.scale_layout if fmt.is_nvfp4 else None
    ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots, case.cache_dtype, k_scale, v_scale, layout
    )
    query_start_loc = torch.tensor([0, *itertools.accumulate(case.query_lens)], dtype=torch.int32)
    tokens = int(query_start_loc[-1])
    num_heads = heads * case.group
    query = torch.randn(tokens, num_heads, dim, generator=gen).to(case.query_dtype)
    args = dict(
        out=torch.full((tokens, num_heads, dim), float("nan"), dtype=case.query_dtype),
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        kv_cache_dtype=case.cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        scale=dim**-0.5,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
        sinks=torch.randn(num_heads, generator=gen) if case.logit_sinks else None,
        k_scale_layout=layout,
        rope_cos_sin=None
        if case.rotary_dim is None
        else KeyRope.from_base(case.rotary_dim, max(case.seq_lens) + 3).cos_sin,
        rope_is_neox=case.neox,
        key_offset=torch.randn(heads, dim, generator=gen) * 3 if case.offset else None,
        sink_keys=torch.randn(num_seqs, case.sink_tokens, heads, dim, generator=gen) * 2
        if case.sink_tokens
        else None,
        key_hadamard=case.hadamard,
    )
    return Batch(
        args, dequantize(case, key_cache, k_scale), dequantize(case, value_cache, v_scale), table
    )


def expected_output(case: Case, batch: Batch) -> torch.Tensor:
    """Dense fp32 attention of every sequence's queries over its rebuilt keys."""
    args = batch.args
    outs = []
    for s, seq_len in enumerate(case.seq_lens):
        q_len = case.query_lens[s]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        pages = batch.table[s, pos // case.block_size].long()
        k = batch.key[pages, pos % case.block_size].clone()
        v = batch.value[pages, pos % case.block_size]
        if args["sink_keys"] is not None:
            n = min(case.sink_tokens, seq_len)
            k[:n] = args["sink_keys"][s, :n]
        if args["key_hadamard"]:
            k = hadamard_rotate(k)
        if args["key_offset"] is not None:
            k = k + args["key_offset"]
        if args["rope_cos_sin"] is not None:
            k = KeyRope(args["rope_cos_sin"], case.neox).rotate(k, pos)
        start = int(args["query_start_loc"][s])
        q = args["query"][start : start + q_len].float()
        k = k.repeat_interleave(case.group, dim=1)
        v = v.repeat_interleave(case.group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * args["scale"]
        if case.logits_soft_cap is not None:
            scores = case.logits_soft_cap * torch.tanh(scores / case.logits_soft_cap)
        delta = torch.arange(seq_len - q_len, seq_len)[:, None] - pos[None, :]
        allowed = delta >= 0
        if case.sliding_window is not None:
            allowed &= delta < case.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if args["sinks"] is not None:
            sink = args["sinks"][:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def check(case: Case, simd: str = "auto", seed: int = 0) -> None:
    batch = build(case, seed)
    ops.paged_attention(**batch.args, simd=simd)
    got = batch.args["out"]
    tol = 1e-4 if case.query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected_output(case, batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("cache_dtype", "scale_layout", "per_head_scale"), FORMATS)
def test_every_format_layout_and_simd_level(
    cache_dtype: str, scale_layout: str, per_head_scale: bool, layout: str, simd: str
) -> None:
    """All three arguments at once over a prefill, a chunked prefill and a decode; GQA."""
    query_dtype = torch.float16 if cache_dtype == "float16" else torch.bfloat16
    check(Case(cache_dtype, scale_layout, per_head_scale, layout, query_dtype=query_dtype), simd)


TRANSFORMS = [
    dict(rotary_dim=rotary, offset=offset, sink_tokens=sink)
    for rotary, offset, sink in itertools.product([None, 64], [False, True], [0, 3])
    if (rotary, offset, sink) != (None, False, 0)
]


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "nvfp4"])
def test_each_argument_alone_and_together(cache_dtype: str, transform: dict, neox: bool) -> None:
    check(Case(cache_dtype, neox=neox, query_dtype=torch.float32, **transform))


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [2, 24, 32])
def test_partial_rotary_dim(rotary_dim: int, neox: bool, simd: str) -> None:
    """Channels past rotary_dim pass unchanged; fp32 queries keep the tolerance tight."""
    check(Case("auto", rotary_dim=rotary_dim, neox=neox, query_dtype=torch.float32), simd)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head_size", "rotary_dim"), [(32, 32), (96, 96), (96, 64), (256, 128)])
@pytest.mark.parametrize("cache_dtype", ["auto", "nvfp4"])
def test_head_sizes_in_and_out_of_registers(
    cache_dtype: str, head_size: int, rotary_dim: int, neox: bool, simd: str
) -> None:
    """Rows rebuilt in registers (2 to 16 whole vectors, rotary pairs of whole vectors) and
    through the scalar loops (a rotary half or a head that is not whole vectors at the level);
    decode, chunked prefill and prefill rows; fp32 queries keep the tolerance tight."""
    case = Case(
        cache_dtype,
        head_size=head_size,
        rotary_dim=rotary_dim,
        neox=neox,
        query_dtype=torch.float32,
        seq_lens=[40, 19],
        query_lens=[1, 19],
    )
    check(case, simd)


@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(
    ("scale_layout", "per_head_scale"), [("linear", False), ("interleave4", True)]
)
def test_nvfp4_values_on_the_bf16_dot_under_rebuilt_keys(
    scale_layout: str, per_head_scale: bool, neox: bool, extras: bool
) -> None:
    """Head size 128 (the NVFP4 chunk geometry), a bf16 query, decode and chunked rows (4 and 8
    per KV head): keys rebuilt and scored in fp32 from the tile, values on the bf16 dot (AVX-512
    BF16 builds); with a sliding window, a soft cap and logit sinks too."""
    case = Case(
        "nvfp4",
        scale_layout,
        per_head_scale,
        group=4,
        head_size=128,
        rotary_dim=128,
        neox=neox,
        seq_lens=[70, 33, 16],
        query_lens=[1, 2, 1],
    )
    if extras:
        case = replace(case, sliding_window=40, logits_soft_cap=15.0, logit_sinks=True)
    check(case)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("sink_tokens", [0, 20])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 16, 64, 128, 24, 40])
def test_nvfp4_keys_rebuilt_on_the_chunk_lanes(
    rotary_dim: int | None, neox: bool, offset: bool, sink_tokens: int, window: int | None
) -> None:
    """NVFP4 decode rows of head size 128 and a bf16 query (AVX-512 BF16 builds: keys rebuilt on
    the chunk path's lanes, pages past the sink positions): full, partial (16, 64) and no RoPE,
    each pair order, with and without the offset, sinks over a page and a bit, windows that start
    inside a page, a last page partly filled; rotary dims of no whole 16-position transpose (24,
    40) take the key tile, as every build without the chunks does."""
    case = Case(
        "nvfp4",
        "interleave4",
        True,
        group=4,
        head_size=128,
        rotary_dim=rotary_dim,
        neox=neox,
        offset=offset,
        sink_tokens=sink_tokens,
        sliding_window=window,
        seq_lens=[75, 33, 16, 50],
        query_lens=[1, 2, 1, 1],
    )
    check(case)


@pytest.mark.parametrize("sink_tokens", [1, 3])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8_per_token_head", "nvfp4"])
def test_sequences_shorter_than_the_sinks(cache_dtype: str, sink_tokens: int) -> None:
    """Sequences of 1 and 2 tokens (all sink keys), one that starts with sinks, an empty query."""
    case = Case(
        cache_dtype,
        sink_tokens=sink_tokens,
        seq_lens=[2, 1, 9, 5],
        query_lens=[2, 1, 4, 0],
        query_dtype=torch.float32,
    )
    check(case)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", ["auto", "nvfp4", "fp8_per_token_head"])
def test_query_dtypes(cache_dtype: str, query_dtype: torch.dtype) -> None:
    check(Case(cache_dtype, query_dtype=query_dtype, num_kv_heads=1, group=4))


@pytest.mark.parametrize(
    ("cache_dtype", "scale_layout"),
    [("auto", "linear"), ("fp8_e5m2", "linear"), ("nvfp4", "interleave4")],
)
def test_split_k_window_soft_cap_and_logit_sinks(cache_dtype: str, scale_layout: str) -> None:
    """A decode over 1100 tokens (split-K, partials merged) and a chunked prefill; then with a
    sliding window that starts past the sink keys, a soft cap and logit sinks."""
    case = Case(
        cache_dtype,
        scale_layout,
        num_kv_heads=1,
        group=4,
        seq_lens=[1100, 300],
        query_lens=[1, 3],
        query_dtype=torch.float32,
    )
    check(case)
    check(replace(case, sliding_window=700, logits_soft_cap=20.0, logit_sinks=True), seed=1)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("others", [False, True])
@pytest.mark.parametrize(("cache_dtype", "scale_layout", "per_head_scale"), FORMATS)
def test_keys_rotated_back_by_the_hadamard_rotation(
    cache_dtype: str, scale_layout: str, per_head_scale: bool, others: bool, simd: str
) -> None:
    """``key_hadamard`` alone and with the three others; head sizes 64 and 128."""
    transform = dict(rotary_dim=64, offset=True, sink_tokens=3)
    if not others:
        transform = dict(rotary_dim=None, offset=False, sink_tokens=0)
    query_dtype = torch.float16 if cache_dtype == "float16" else torch.float32
    for head_size in (64, 128):
        case = Case(
            cache_dtype,
            scale_layout,
            per_head_scale,
            head_size=head_size,
            query_dtype=query_dtype,
            hadamard=True,
            **transform,
        )
        check(case, simd)


def test_hadamard_needs_a_power_of_two_head_size() -> None:
    case = Case("auto", head_size=48, rotary_dim=None, offset=False, sink_tokens=0, hadamard=True)
    args = build(case).args
    with pytest.raises(
        RuntimeError, match="key_hadamard: expected a power-of-two head size, got 48"
    ):
        ops.paged_attention(**args)
    assert args["out"].isnan().all()  # nothing written


def test_transform_changes_the_output() -> None:
    """The arguments are read: without them the same cache gives another result."""
    batch = build(Case(query_dtype=torch.float32))
    ops.paged_attention(**batch.args)
    with_transform = batch.args["out"].clone()
    plain = {
        **batch.args,
        "rope_cos_sin": None,
        "key_offset": None,
        "sink_keys": None,
        "key_hadamard": False,
    }
    ops.paged_attention(**plain)
    assert (with_transform - plain["out"]).abs().max() > 0.1


def test_errors_name_the_argument() -> None:
    case = Case(seq_lens=[37, 21], query_lens=[4, 1])
    args = build(case).args
    cos_sin, offset, sinks = args["rope_cos_sin"], args["key_offset"], args["sink_keys"]
    for change, pattern in [
        (dict(rope_cos_sin=cos_sin.double()), r"rope_cos_sin: expected dtype float32, got float64"),
        (dict(rope_cos_sin=cos_sin[0]), r"rope_cos_sin: expected a 2-D tensor \[max_positions, "),
        (dict(rope_cos_sin=cos_sin.t()), r"rope_cos_sin: expected a contiguous tensor"),
        (
            dict(rope_cos_sin=cos_sin[:, :3].contiguous()),
            r"rope_cos_sin: expected an even rotary_dim in \[2, head_size = 64\] at dim 1, got "
            r"shape \[40, 3\]",
        ),
        (
            dict(rope_cos_sin=KeyRope.from_base(66, 40).cos_sin),
            r"rope_cos_sin: expected an even rotary_dim in \[2, head_size = 64\]",
        ),
        (
            dict(rope_cos_sin=cos_sin[:30]),
            r"rope_cos_sin: expected at least 37 rows \(sequence 0's seq_len\), got 30",
        ),
        (dict(rope_cos_sin=cos_sin.to("meta")), r"rope_cos_sin: expected device cpu"),
        (dict(key_offset=offset.half()), r"key_offset: expected dtype float32, got float16"),
        (
            dict(key_offset=offset[:1]),
            r"key_offset: expected shape \[num_kv_heads, head_size\] = \[2, 64\], got \[1, 64\]",
        ),
        (dict(key_offset=offset.reshape(-1)), r"key_offset: expected a 2-D tensor"),
        (dict(key_offset=offset[:, :32].contiguous()), r"key_offset: expected shape .*\[2, 32\]"),
        (
            dict(key_offset=torch.zeros(64, 2).t()),
            r"key_offset: expected a contiguous tensor, got strides",
        ),
        (dict(sink_keys=sinks.bfloat16()), r"sink_keys: expected dtype float32, got bfloat16"),
        (dict(sink_keys=sinks[0]), r"sink_keys: expected a 4-D tensor \[num_seqs, S, "),
        (
            dict(sink_keys=sinks[:, :0]),
            r"sink_keys: expected shape \[num_seqs, S >= 1, num_kv_heads, head_size\] = "
            r"\[2, S, 2, 64\], got \[2, 0, 2, 64\]",
        ),
        (dict(sink_keys=sinks[:1]), r"sink_keys: expected shape .*, got \[1, 3, 2, 64\]"),
        (dict(sink_keys=sinks[:, :, :, :32]), r"sink_keys: expected a contiguous tensor"),
        (dict(sink_keys=sinks.to("meta")), r"sink_keys: expected device cpu"),
    ]:
        out = args["out"].clone()
        with pytest.raises(RuntimeError, match=pattern):
            ops.paged_attention(**{**args, "out": out, **change})
        assert out.isnan().all()  # nothing written


def test_meta_tensors_take_the_fake_kernel() -> None:
    """Shape propagation with the new arguments on meta writes nothing and raises nothing."""
    args = build(Case(seq_lens=[5], query_lens=[2])).args
    ops.paged_attention(
        **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    )
