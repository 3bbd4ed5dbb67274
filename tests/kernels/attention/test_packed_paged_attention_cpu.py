"""The compiled CPU attention over packed-slot caches (``_C_cache_ops::packed_paged_attention``
through :func:`vllm._packed_attention_ops.packed_paged_attention`): for every TurboQuant preset,
``ultraquant_4bit`` and the Octave formats, at every compiled SIMD level, its output is attention
over the reference codecs' decoded values up to fp32 summation order (decode, chunked prefill,
split-K, GQA, windows, sinks, soft cap, pages out of order and spaced apart); a lone key reads
back as the codec's value bit for bit; bad arguments are named before anything runs."""

from __future__ import annotations

import math

import pytest
import torch

from vllm import _custom_ops as ops
from vllm._packed_attention_ops import packed_paged_attention
from vllm.kv_quant.formats import find_format, formats
from vllm.kv_quant.slot_codecs import SlotCodec, is_packed, slot_codec

PACKED = tuple(f.name for f in formats() if is_packed(f))
SIMD_LEVELS = ops.paged_attention_simd_levels()
ROPE_DIM = 64  # Octave block K's rotary dims when the model registered none
H, N = 2, 16


def _codec(dtype: str, head_size: int, rope_dim: int = ROPE_DIM) -> SlotCodec:
    fmt = find_format(dtype)
    assert fmt is not None
    return slot_codec(fmt, head_size, rope_dim)


def _page_tables(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct pages for every sequence, in a shuffled order; unused entries -1."""
    need = [-(-s // N) for s in seq_lens]
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at : at + n].int()
        at += n
    return table


def _reference(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Causal fp32 attention of each sequence's last query rows over its decoded K / V."""
    outs = []
    group = q.shape[1] // H
    for qi, k, v in zip(torch.split(q, query_lens), keys, values, strict=True):
        s = k.shape[0]
        qpos = torch.arange(s - qi.shape[0], s)[:, None]
        kpos = torch.arange(s)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= qpos - kpos < window
        scores = torch.einsum("qhd,khd->hqk", qi, k.repeat_interleave(group, 1)) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            extra = sinks[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, extra], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, 1)))
    return torch.cat(outs)


def _run(
    dtype: str,
    head_size: int,
    seq_lens: list[int],
    query_lens: list[int],
    simd: str = "auto",
    group: int = 2,
    window: int | None = None,
    sinks: bool = False,
    soft_cap: float | None = None,
    page_gap: int = 0,
    rope_dim: int = ROPE_DIM,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference) for random K / V / queries written by the codec."""
    gen = torch.Generator().manual_seed(seed)
    codec = _codec(dtype, head_size, rope_dim)
    num_blocks = sum(-(-s // N) for s in seq_lens) + 3
    # Pages spaced page_gap bytes apart (a view into a larger buffer), slots contiguous.
    page = H * N * codec.slot_bytes
    buffer = torch.randint(0, 256, (num_blocks, page + page_gap), dtype=torch.uint8, generator=gen)
    cache = buffer[:, :page].view(num_blocks, N, H, codec.slot_bytes).transpose(1, 2)
    table = _page_tables(seq_lens, num_blocks, gen)
    keys, values = [], []
    for i, s in enumerate(seq_lens):
        k = torch.randn(s, H, head_size, generator=gen)
        v = torch.randn(s, H, head_size, generator=gen)
        pos = torch.arange(s)
        cache[table[i, pos // N].long(), :, pos % N] = codec.encode(k, v)
        kd, vd = codec.decode(codec.encode(k, v))
        keys.append(kd)
        values.append(vd)
    q = torch.randn(sum(query_lens), H * group, head_size, generator=gen)
    sink_logits = torch.randn(H * group, generator=gen) if sinks else None
    scale = 1 / math.sqrt(head_size)
    out = torch.full_like(q, float("nan"))
    packed_paged_attention(
        out,
        q,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        dtype,
        scale,
        sliding_window=window,
        logits_soft_cap=soft_cap,
        sinks=sink_logits,
        simd=simd,
        default_rope_dim=rope_dim,
    )
    expected = _reference(q, keys, values, query_lens, scale, window, sink_logits, soft_cap)
    return out, expected


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("dtype", PACKED)
def test_matches_attention_over_decoded_values(dtype: str, simd: str) -> None:
    """A decode, a chunked prefill over a cached prefix and a first prefill, head size 128."""
    out, expected = _run(dtype, 128, [37, 21, 18], [1, 6, 18], simd)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", PACKED)
def test_window_sinks_soft_cap_gqa_spaced_pages(dtype: str) -> None:
    out, expected = _run(
        dtype, 64, [45, 3], [4, 3], group=4, window=9, sinks=True, soft_cap=2.5, page_gap=40
    )
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["turboquant_k3v4_nc", "ultraquant_4bit", "octave_k3v4"])
def test_long_decode_splits_keys(dtype: str) -> None:
    """One query over 1500 keys: the planner splits the key range, the partials merge."""
    out, expected = _run(dtype, 64, [1500], [1], group=1)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rope_dim", [0, 64, 192])
@pytest.mark.parametrize("dtype", ["octave_k3v4", "octave_k3v3"])
def test_octave_block_k_at_every_rope_split(dtype: str, rope_dim: int) -> None:
    """Head size 256: 4-bit codes for the first rope_dim dims, 3-bit for the rest."""
    out, expected = _run(dtype, 256, [20], [3], rope_dim=rope_dim)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", PACKED)
def test_a_lone_key_reads_back_as_the_codec_value(dtype: str) -> None:
    """Over one key the softmax weight is exactly 1: the output is the decoded value, bit for
    bit (the value decode is the codec's, its rotation back the codec's own function)."""
    out, expected = _run(dtype, 128, [1, 1, 1], [1, 1, 1], group=1)
    assert torch.equal(out, expected)


def _raw_args(dtype: str = "turboquant_4bit_nc", **overrides: object) -> dict[str, object]:
    codec = _codec("turboquant_4bit_nc", 64)
    args: dict[str, object] = dict(
        out=torch.zeros(2, 4, 64),
        query=torch.zeros(2, 4, 64),
        kv_cache=torch.zeros(3, N, H, codec.slot_bytes, dtype=torch.uint8),
        block_table=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        kv_cache_dtype=dtype,
        key_bits=4,
        value_bits=4,
        norm_correction=True,
        rope_dim=0,
        codebook=codec.reader.codebook,
        scale=0.125,
        sliding_window=0,
        logits_soft_cap=0.0,
        sinks=None,
        causal=True,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(kv_cache_dtype="nvfp4"), "kv_cache_dtype: expected a packed-slot format"),
        (dict(key_bits=5), "key_bits: expected 3 or 4 (Lloyd-Max keys) or 8"),
        (dict(value_bits=2), "value_bits: expected 3 or 4"),
        (dict(codebook=None), "codebook: expected a contiguous float32 tensor [16]"),
        (dict(codebook=torch.zeros(8)), "codebook: expected a contiguous float32 tensor [16]"),
        (
            dict(kv_cache=torch.zeros(3, N, H, 60, dtype=torch.uint8)),
            "kv_cache: expected shape [3, 16, 2, 70]",
        ),
        (dict(query=torch.zeros(2, 4, 60)), "query: 'turboquant_4bit_nc' needs a head size"),
        (
            dict(kv_cache_dtype="ultraquant_4bit", norm_correction=False, codebook=None),
            "kv_cache: expected shape [3, 16, 2, 68]",
        ),
        (
            dict(kv_cache_dtype="octave_k3v4", key_bits=3, norm_correction=True),
            "norm_correction: expected false for 'octave_k3v4'",
        ),
        (
            dict(kv_cache_dtype="octave_k3v3_compact", key_bits=3, value_bits=3, rope_dim=64),
            "rope_dim: compact Octave K takes rope_dim 0",
        ),
        (dict(simd="sse9"), "simd: expected 'auto' or one of"),
    ],
)
def test_bad_arguments_are_named(overrides: dict[str, object], message: str) -> None:
    args = _raw_args(**overrides)
    with pytest.raises(RuntimeError, match=f"^{_escaped(message)}"):
        torch.ops._C_cache_ops.packed_paged_attention(**args)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_wrapper_refuses_other_formats_and_shapes() -> None:
    q = torch.zeros(1, 4, 64)
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    cache = torch.zeros(2, H, N, 70, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^kv_cache_dtype: expected a packed-slot format"):
        packed_paged_attention(q.clone(), q, cache, *meta, qsl, "fp8_e4m3", 0.1)
    expected = r"^kv_cache: expected a uint8 \(num_blocks, num_kv_heads, block_size, 70\) tensor"
    with pytest.raises(ValueError, match=expected):
        packed_paged_attention(q.clone(), q, cache[0], *meta, qsl, "turboquant_4bit_nc", 0.1)


def test_fake_kernel_traces() -> None:
    """The op's fake runs on meta tensors (torch.compile's shape propagation) and refuses what
    the kernel would."""
    args = _raw_args()
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    torch.ops._C_cache_ops.packed_paged_attention(**meta)
    meta["kv_cache"] = meta["kv_cache"].float()
    with pytest.raises(ValueError, match="^kv_cache: expected a uint8"):
        torch.ops._C_cache_ops.packed_paged_attention(**meta)
