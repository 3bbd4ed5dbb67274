"""CPU_ATTN over pages larger than one step: in decode (items over every KV head) a page whose
size is a multiple of 16 keys is attended 16 keys at a time (each step over all the heads, the
next step's rows requested meanwhile), a page of any other size, and any page of a prefill of
per-head items, whole. Against the reference backend (and, for
keys stored before RoPE, dense attention over the rebuilt keys): every cache format, NHD and HND,
pages of 24 (one step), 64 and 128 keys; decode, a chunked prefill of per-head items and a long
decode split into partials, with windows that start inside a step, soft cap and logit sinks."""

from __future__ import annotations

import pytest
import test_cpu_attn_key_rope as key_rope
import torch
from test_cpu_attn_backend import FORMATS, PER_TOKEN_HEAD, Case, check

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


@pytest.mark.parametrize("block_size", [24, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS + PER_TOKEN_HEAD)
def test_decode_and_prefill_over_pages_of_several_steps(
    cache_dtype: str, scale_layout: str, layout: str, block_size: int
) -> None:
    """Decode rows of sequences ending in the first step of a page, inside a later step and on
    a step's last key (items over every KV head), and a chunked prefill of 40 queries (items per
    KV head); the model's head size and group."""
    check(
        Case(
            cache_dtype,
            scale_layout,
            layout,
            num_kv_heads=2,
            group=4,
            head_size=128,
            head_size_v=128,
            block_size=block_size,
            seq_lens=[1, 23, 150, 320, 300],
            query_lens=[1, 1, 1, 1, 40],
            model_dtype=torch.float16 if cache_dtype == "float16" else torch.bfloat16,
        )
    )


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize(
    ("cache_dtype", "scale_layout"),
    [
        ("auto", "linear"),
        ("fp8_e4m3", "linear"),
        ("nvfp4", "interleave4"),
        ("fp8_per_token_head", "linear"),
        ("int8_per_token_head", "linear"),
    ],
)
def test_split_decode_with_window_soft_cap_and_sinks(
    cache_dtype: str, scale_layout: str, block_size: int
) -> None:
    """A decode over 3001 keys split into partials at page boundaries, a window of 1000 keys
    (its first key inside a step), a soft cap and logit sinks; fp32 queries too (the per-row
    softmax step)."""
    base = Case(
        cache_dtype,
        scale_layout,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        block_size=block_size,
        seq_lens=[3001, 200],
        query_lens=[1, 1],
        sliding_window=1000,
        logits_soft_cap=8.0,
        sinks=torch.linspace(-1.0, 1.0, 8),
        per_head_scale=True,
    )
    check(base)
    check(Case(**{**base.__dict__, "model_dtype": torch.float32}), seed=1)


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize(
    ("cache_dtype", "scale_layout", "per_head_scale"),
    [
        ("auto", "linear", False),
        ("fp8_e4m3", "linear", True),
        ("nvfp4", "interleave4", True),
        ("nvfp4", "linear", False),
        ("fp8_per_token_head", "linear", False),
    ],
)
def test_keys_stored_before_rope_over_pages_of_several_steps(
    cache_dtype: str, scale_layout: str, per_head_scale: bool, block_size: int
) -> None:
    """RoPE, a key offset and 20 sink keys rebuilt per step (NVFP4 decode rows on the chunk
    lanes, whose RoPE rows are the step's), a window inside a step, decode and a prefill chunk."""
    key_rope.check(
        key_rope.Case(
            cache_dtype,
            scale_layout,
            per_head_scale,
            group=4,
            head_size=128,
            block_size=block_size,
            rotary_dim=64,
            sink_tokens=20,
            sliding_window=90,
            seq_lens=[150, 33, 260],
            query_lens=[1, 1, 7],
        )
    )
