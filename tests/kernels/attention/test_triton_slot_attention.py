"""TRITON_ATTN's reader of the packed-slot caches
(:func:`vllm.v1.attention.ops.triton_slot_attention.triton_packed_slot_attention`: the fused packed
kernel with the ``ultraquant_4bit`` and Octave tiles beside TurboQuant's): for every packed format
its output is attention over the reference codecs' decoded values up to fp32 summation order
(decode, chunked prefill, GQA, windows, sinks, soft cap, split-K, Octave's every RoPE split), and a
lone key reads back as the codec's value bit for bit. Without a GPU the kernel runs under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1); its GPU builds are the module's compile
cases (tools/compile_triton_kernels.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kv_quant.formats import find_format, formats
from vllm.kv_quant.slot_codecs import is_packed, slot_codec
from vllm.v1.attention.ops.triton_slot_attention import (
    triton_compile_cases,
    triton_packed_slot_attention,
)

PACKED = tuple(f.name for f in formats() if is_packed(f))
H, N = 2, 16


def _run(
    dtype: str,
    head_size: int,
    seq_lens: list[int],
    query_lens: list[int],
    group: int = 2,
    window: int | None = None,
    sinks: bool = False,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    rope_dim: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, fp32 attention over the codec's decoded K / V)."""
    gen = torch.Generator().manual_seed(3)
    fmt = find_format(dtype)
    assert fmt is not None
    codec = slot_codec(fmt, head_size, rope_dim)
    pages = [-(-s // N) for s in seq_lens]
    num_blocks = sum(pages) + 2
    cache = torch.randint(0, 256, (num_blocks, N, H, codec.slot_bytes), dtype=torch.uint8,
                          generator=gen).transpose(1, 2)  # fmt: skip
    order = torch.randperm(num_blocks, generator=gen)[: sum(pages)].int()
    table = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int32)
    q = torch.randn(sum(query_lens), H * group, head_size, generator=gen)
    sink_logits = torch.randn(H * group, generator=gen) if sinks else None
    scale = 1 / math.sqrt(head_size)
    expected, first, at = [], 0, 0
    for i, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table[i, : pages[i]] = order[at : at + pages[i]]
        at += pages[i]
        k, v = (
            torch.randn(s, H, head_size, generator=gen),
            torch.randn(s, H, head_size, generator=gen),
        )
        slots = codec.encode(k, v)
        pos = torch.arange(s)
        cache[table[i, pos // N].long(), :, pos % N] = slots
        kd, vd = codec.decode(slots)
        qpos = torch.arange(s - n, s)[:, None]
        seen = pos[None, :] <= qpos
        if window is not None:
            seen &= qpos - pos[None, :] < window
        scores = torch.einsum("qhd,khd->hqk", q[first : first + n], kd.repeat_interleave(group, 1))
        scores = scores * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sink_logits is not None:
            extra = sink_logits[:, None, None].expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, extra], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        expected.append(torch.einsum("hqk,khd->qhd", probs, vd.repeat_interleave(group, 1)))
        first += n
    out = torch.full_like(q, float("nan"))
    triton_packed_slot_attention(
        out, q, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        dtype, scale, max(query_lens), max(seq_lens), sliding_window=window,
        logits_soft_cap=soft_cap, sinks=sink_logits, num_splits=num_splits,
        default_rope_dim=rope_dim,
    )  # fmt: skip
    return out, torch.cat(expected)


@pytest.mark.parametrize("dtype", PACKED)
def test_matches_attention_over_decoded_values(dtype: str) -> None:
    out, expected = _run(dtype, 64, [37, 18], [4, 1])
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["turboquant_k3v4_nc", "ultraquant_4bit", "octave_k3v3"])
def test_window_sinks_soft_cap_split_k(dtype: str) -> None:
    out, expected = _run(dtype, 64, [45, 20], [1, 1], group=4, window=11, sinks=True,
                         soft_cap=3.0, num_splits=3)  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rope_dim", [0, 128])
def test_octave_block_k_rope_splits(rope_dim: int) -> None:
    out, expected = _run("octave_k3v4", 128, [20], [2], rope_dim=rope_dim)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", PACKED)
def test_a_lone_key_reads_back_as_the_codec_value(dtype: str) -> None:
    out, expected = _run(dtype, 64, [1, 1], [1, 1], group=1)
    assert torch.equal(out, expected)


def test_bad_cache_and_format_are_named() -> None:
    q = torch.zeros(1, 2, 64)
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
    cache = torch.zeros(2, H, N, 70, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^kv_cache_dtype: expected a packed-slot format"):
        triton_packed_slot_attention(q.clone(), q, cache, *meta, "nvfp4", 0.1, 1, 1)
    with pytest.raises(ValueError, match=r"^kv_cache: expected a uint8 .* 68\) tensor"):
        triton_packed_slot_attention(q.clone(), q, cache, *meta, "ultraquant_4bit", 0.1, 1, 1)


def test_compile_cases_cover_the_new_tiles() -> None:
    names = [case.name for case in triton_compile_cases()]
    assert names == [
        "ultraquant_4bit/d128/splits1",
        "octave_k3v4/d128/splits4",
        "octave_k3v3_compact/d128/splits1",
    ]
