"""Readers of layers that store keys before RoPE and keep FP8 key sinks (key_rebuild): the
reference reader and CPU_ATTN agree, the attention is the model's (RoPE undone and redone), the
sink rows are the FP8 copies of the first stored keys, and TRITON_ATTN reads like the
reference."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import (
    KeyRope,
    KVScaleObserver,
    dequantize_fp8,
    hadamard_rotate,
    key_sink_scale,
    quantize_fp8,
)
from vllm.v1.attention.backends.key_rebuild import KeyRebuild
from vllm.v1.worker.attention_kv_cache import AttentionKVCache

H, HQ, D, BLOCK = 2, 4, 64, 16
ROPE = KeyRope.from_base(D, 256, base=10000.0)


def _inputs(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-RoPE keys with a large per-channel mean before RoPE (what the offset takes out),
    values and queries."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(H, D, generator=gen) * 4
    pre = mean + torch.randn(tokens, H, D, generator=gen)
    k = ROPE.rotate(pre, torch.arange(tokens))
    v = torch.randn(tokens, H, D, generator=gen)
    q = torch.randn(tokens, HQ, D, generator=gen)
    return k, v, q


def _cache(fmt: str, backend: str, tokens: int, k: torch.Tensor, v: torch.Tensor, **options):
    """A calibrated cache (offset: the pre-RoPE key mean; scales on the stored keys)."""
    cache = AttentionKVCache.create(
        fmt, 8, BLOCK, H, D, num_heads=HQ, backend=backend, model_dtype=torch.float32, **options
    )
    positions = torch.arange(tokens)
    if "key_rope" in options:
        cache.set_key_offset(ROPE.unrotate(k, positions).mean(0))
    observer = KVScaleObserver()
    observer.observe(cache.stored_key(k, positions if "key_rope" in options else None), v)
    cache.set_kv_scales(*observer.scales(fmt))
    return cache


def _compare_readers(
    backend: str,
    fmt: str,
    rotation: str | None,
    seed: int,
    table: torch.Tensor,
    chunks: tuple[tuple[int, int], ...],
    tolerance: float,
) -> None:
    """``backend`` and REFERENCE over the same chunks through forward() (key_rope, one key
    sink, ``rotation``): the same pages, the same sink rows, the same attention."""
    tokens = chunks[-1][1]
    k, v, q = _inputs(seed, tokens)
    options = dict(key_rope=ROPE, key_sink_tokens=1, key_rotation=rotation)
    outs, caches = [], []
    for name in (backend, "REFERENCE"):
        cache = _cache(fmt, name, tokens, k, v, **options)
        parts = []
        for start, stop in chunks:
            meta = cache.metadata([stop], [stop - start], table)
            parts.append(cache.forward(q[start:stop], k[start:stop], v[start:stop], meta))
        outs.append(torch.cat(parts))
        caches.append(cache)
    assert torch.equal(caches[0].kv_cache, caches[1].kv_cache)
    sinks = [c.key_sinks for c in caches]
    assert sinks[0] is not None and sinks[1] is not None and torch.equal(sinks[0], sinks[1])
    torch.testing.assert_close(outs[0], outs[1], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4", "nvfp4_mse"])
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_cpu_attn_reads_like_the_reference(fmt: str, rotation: str | None) -> None:
    """Prefill in two chunks then a decode step, through forward(): same pages, same sink
    rows, the same attention from both readers."""
    table = torch.tensor([[5, 1, 7]], dtype=torch.int32)
    chunks = ((0, 30), (30, 40), (40, 41))
    _compare_readers("CPU_ATTN", fmt, rotation, 0, table, chunks, tolerance=2e-4)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "REFERENCE"])
def test_the_attention_is_the_models(backend: str) -> None:
    """Keys stored before RoPE come back as the model's post-RoPE keys: FP8 pages read with the
    rebuild attend like exact keys; read without it (RoPE not redone) they do not."""
    tokens = 40
    k, v, q = _inputs(1, tokens)
    table = torch.tensor([[2, 0, 6]], dtype=torch.int32)
    cache = _cache("fp8_e4m3", backend, tokens, k, v, key_rope=ROPE, key_sink_tokens=2)
    meta = cache.metadata([tokens], [tokens], table)
    got = cache.forward(q, k, v, meta)
    exact = AttentionKVCache.create("auto", 8, BLOCK, H, D, num_heads=HQ, backend=backend,
                                    model_dtype=torch.float32)  # fmt: skip
    ideal = exact.forward(q, k, v, exact.metadata([tokens], [tokens], table))
    assert (got - ideal).norm() / ideal.norm() < 0.06  # FP8 keys, large scores
    plain = AttentionKVCache.create("fp8_e4m3", 8, BLOCK, H, D, num_heads=HQ, backend=backend)
    plain.set_kv_scales(cache.k_scale, cache.v_scale)
    plain.write(cache.stored_key(k, torch.arange(tokens)), v, meta.slot_mapping)
    unrebuilt = plain.attend(q, meta)
    assert (unrebuilt - ideal).norm() / ideal.norm() > 0.2


def test_sink_rows_are_the_fp8_first_keys_of_each_page() -> None:
    tokens = 40
    k, v, _ = _inputs(2, tokens)
    cache = _cache("nvfp4", "REFERENCE", tokens, k, v, key_rope=ROPE, key_sink_tokens=2,
                   key_rotation="hadamard")  # fmt: skip
    table = torch.tensor([[3, 4, 1]], dtype=torch.int32)
    meta = cache.metadata([tokens], [tokens], table)
    positions = torch.arange(tokens)
    cache.write(k, v, meta.slot_mapping, positions)
    stored = cache.stored_key(k, positions)
    scale = key_sink_scale(cache.k_scale, cache.encoding.sink_scale_multiplier)
    assert cache.encoding.sink_scale_multiplier == 6.0  # NVFP4: amax / (448 * 6)
    sinks = cache.key_sinks
    assert sinks is not None
    for page, first in ((3, 0), (4, 16), (1, 32)):  # every page keeps its first two keys
        assert torch.equal(sinks[page], quantize_fp8(stored[first : first + 2], scale))
    rebuild = KeyRebuild.of(cache.key_transform, sinks, table, 1, scale)
    assert rebuild is not None and rebuild.sinks is not None
    assert torch.equal(rebuild.sinks[0], dequantize_fp8(sinks[3], scale))
    # the rebuilt first key: its FP8 copy rotated back, offset added, RoPE at position 0
    page_rows = torch.zeros(2, H, D)
    got = rebuild.keys(page_rows, 0, torch.arange(2))
    offset = cache.key_offset
    assert offset is not None
    expected = ROPE.rotate(hadamard_rotate(rebuild.sinks[0]) + offset, torch.arange(2))
    assert torch.equal(got, expected)


def test_triton_attn_reads_like_the_reference() -> None:
    """TRITON_ATTN rebuilds keys too (created with key_rope, key sinks and the rotation): a
    prefill then a decode step give the same pages, sink rows and attention as REFERENCE."""
    table = torch.tensor([[6, 2]], dtype=torch.int32)
    chunks = ((0, 20), (20, 21))
    _compare_readers("TRITON_ATTN", "fp8_e4m3", "hadamard", 3, table, chunks, tolerance=2e-5)
