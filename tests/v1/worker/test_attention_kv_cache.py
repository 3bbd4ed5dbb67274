"""``AttentionKVCache``: one object allocates a layer's cache, writes it and reads it with the
same scales and scale layouts, for every format; errors name the argument."""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant import (
    KeyRope,
    KVScaleObserver,
    ScaleLayout,
    hadamard_rotate,
    nvfp4_read_cache,
)
from vllm.v1.attention.backends import (
    CPUAttentionBackend,
    CPUAttentionImpl,
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec
from vllm.v1.worker.attention_kv_cache import AttentionKVCache

FORMATS = ["auto", "bfloat16", "fp8", "fp8_e5m2", "nvfp4", "int8_per_token_head"]
H, HQ, D = 3, 9, 64
TABLE = torch.tensor([[2, 5, 7]])


def _kvq(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(40, h, D, generator=gen).to(torch.bfloat16) for h in (H, H, HQ))


def _calibrated(kv_cache_dtype: str, **options: object) -> AttentionKVCache:
    cache = AttentionKVCache.create(kv_cache_dtype, 8, 16, H, D, num_heads=HQ, **options)
    k, v, _ = _kvq(0)
    observer = KVScaleObserver()
    observer.observe(k, v)
    cache.set_kv_scales(*observer.scales(kv_cache_dtype))
    return cache


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_prefill_then_decode_reads_what_it_wrote(kv_cache_dtype: str) -> None:
    cache = _calibrated(kv_cache_dtype)
    assert cache.backend is CPUAttentionBackend and isinstance(cache.impl, CPUAttentionImpl)
    assert (cache.num_blocks, cache.block_size) == (8, 16)
    k, v, q = _kvq(0)
    prefill = cache.metadata([32], [32], TABLE)
    cache.write(k[:32], v[:32], prefill.slot_mapping)
    outs = [cache.attend(q[:32], prefill)]
    for t in range(32, 40):
        outs.append(
            cache.forward(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], cache.metadata([t + 1], [1], TABLE)
            )
        )
    got = torch.cat(outs)
    # The reference impl, given the same layouts, reads the same bytes to the same attention.
    reference = ReferenceAttentionImpl(
        HQ,
        D,
        num_kv_heads=H,
        kv_cache_dtype=cache.kv_cache_dtype,
        k_scale_layout=cache.scale_layouts.k_scale_layout,
        v_scale_layout=cache.scale_layouts.v_scale_layout,
    )
    full = cache.metadata([40], [40], TABLE)
    want = reference.forward(cache.layer, q, None, None, cache.kv_cache, full)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    exact = ReferenceAttentionImpl(HQ, D, num_kv_heads=H)
    bf16 = AttentionKVCache.create("auto", 8, 16, H, D, num_heads=HQ, backend="REFERENCE")
    bf16.write(k, v, full.slot_mapping)
    ideal = exact.forward(bf16.layer, q, None, None, bf16.kv_cache, full)
    cos = torch.nn.functional.cosine_similarity(got.float().flatten(1), ideal.float().flatten(1))
    assert cos.min() > 0.95


def test_write_is_the_op_with_the_cache_sides_scales_and_layouts() -> None:
    cache = _calibrated("nvfp4", layout="HND", scale_layouts=("interleave4", "linear"))
    assert cache.impl.k_scale_layout is ScaleLayout.INTERLEAVE4
    assert cache.impl.v_scale_layout is ScaleLayout.LINEAR
    assert cache.key_cache.stride(2) > cache.key_cache.stride(1)  # HND: tokens inner to heads
    k, v, _ = _kvq(1)
    slots = cache.metadata([40], [40], TABLE).slot_mapping
    cache.write(k, v, slots)
    by_hand = torch.zeros_like(cache.kv_cache)
    ops.reshape_and_cache_flash(
        k,
        v,
        by_hand[:, 0],
        by_hand[:, 1],
        slots,
        "nvfp4",
        cache.k_scale,
        cache.v_scale,
        k_scale_layout="interleave4",
        v_scale_layout="linear",
    )
    assert torch.equal(cache.kv_cache, by_hand)
    keys = nvfp4_read_cache(cache.key_cache, cache.k_scale, D, cache.scale_layouts.k_scale_layout)
    err = (keys[2].float() - k[:16].float()).abs().max()
    assert err < 0.5 * k.float().abs().max()


def test_head_size_v_and_named_backend() -> None:
    cache = AttentionKVCache.create(
        "fp8", 4, 16, H, D, head_size_v=32, num_heads=HQ, backend=ReferenceAttentionBackend
    )
    assert isinstance(cache.kv_cache, tuple) and cache.value_cache.shape == (4, 16, H, 32)
    assert type(cache.impl) is ReferenceAttentionImpl
    k, v, q = _kvq(2)
    meta = cache.metadata([20], [20], torch.tensor([[1, 3]]))
    out = cache.forward(q[:20], k[:20], v[:20, :, :32].contiguous(), meta)
    assert out.shape == (20, HQ, 32) and torch.isfinite(out).all()


def test_scales_are_public_and_checked() -> None:
    cache = AttentionKVCache.create("fp8", 4, 16, H, D)
    assert cache.k_scale.shape == torch.Size([]) and cache.k_scale == 1.0
    cache.set_kv_scales(torch.full((H,), 0.5), torch.tensor(2.0))
    assert cache.k_scale.tolist() == [0.5] * H and cache.v_scale == 2.0
    with pytest.raises(
        ValueError, match=r"k_scale: expected one value .*\[H\] = \[3\], got shape \[2\]"
    ):
        cache.set_kv_scales(torch.ones(2), torch.ones(()))
    with pytest.raises(ValueError, match="v_scale: expected finite scales > 0"):
        cache.set_kv_scales(torch.ones(()), torch.zeros(()))
    assert cache.v_scale == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype: unknown KV-cache dtype 'fp4'"),
        ({"num_blocks": 0}, "num_blocks: expected a positive int, got 0"),
        ({"num_heads": 4}, "num_heads: expected a multiple of num_kv_heads=3"),
        ({"backend": "FLASHINFER"}, "FLASHINFER: FlashInfer needs an NVIDIA GPU"),
        ({"layout": "NDH"}, "layout: unknown KV-cache layout 'NDH'"),
        ({"scale_layouts": ("swizzle", "linear")}, "scale_layout: expected one of"),
        (
            {"block_size": 6, "scale_layouts": ("interleave4", "linear")},
            r"scale_layouts: k_scale_layout: expected a layout that fits pages of 6 tokens and "
            r"heads of 64 \(interleave4 needs multiples of 4 tokens and of 64 elements\), got "
            r"interleave4",
        ),
        (
            {"block_size": 8, "scale_layouts": ("linear", "interleave4"), "head_size_v": 32},
            "scale_layouts: v_scale_layout: expected a layout that fits pages of 8 tokens and "
            "heads of 32",
        ),
        ({"sliding_window": 0}, "sliding_window: expected None or a positive int"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, object], message: str) -> None:
    args = {"kv_cache_dtype": "nvfp4", "num_blocks": 4, "block_size": 16} | kwargs
    with pytest.raises(ValueError, match=message):
        AttentionKVCache.create(
            args.pop("kv_cache_dtype"),
            args.pop("num_blocks"),
            args.pop("block_size"),
            H,
            D,
            **args,
        )


def test_spec_errors() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="spec: expected a non-MLA attention spec, got MLAAttentionSpec"
    ):
        AttentionKVCache.from_spec(mla, 4)
    fp8 = AttentionKVCache.create("fp8_e5m2", 4, 16, H, D)
    assert fp8.kv_cache_dtype == "fp8_e5m2"
    assert fp8.impl.kv_cache_format.fp8_variant == "e5m2"  # the variant reaches the impl
    nvfp4 = FullAttentionSpec(
        block_size=16,
        num_kv_heads=H,
        head_size=D,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.NVFP4,
    )
    with pytest.raises(
        ValueError,
        match="kv_cache_dtype: expected a name of the spec's encoding 'nvfp4', got 'fp8'",
    ):
        AttentionKVCache.from_spec(nvfp4, 4, kv_cache_dtype="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "nvfp4"])
def test_on_a_gpu(kv_cache_dtype: str) -> None:
    cache = _calibrated(kv_cache_dtype, device="cuda", layout="HND")
    assert cache.device.type == "cuda" and type(cache.impl) is ReferenceAttentionImpl
    k, v, q = (t.cuda() for t in _kvq(3))
    meta = cache.metadata([40], [40], TABLE)
    out = cache.forward(q, k, v, meta)
    assert out.shape == (40, HQ, D) and torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cpu_rope_table_moves_to_the_cache_once() -> None:
    """A model's RoPE table built on the CPU is moved to the cache's device when the cache is
    built, not copied on every write and read."""
    cache = AttentionKVCache.create(
        "nvfp4_mse+offset+prerope+sink", 8, 16, H, D, num_heads=HQ, key_rope=ROPE, device="cuda"
    )
    assert cache.key_transform.rope is not None
    assert cache.key_transform.rope.cos_sin.device.type == "cuda"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "nvfp4", "fp8_per_token_head"])
def test_hadamard_key_rotation_keeps_the_attention(kv_cache_dtype: str) -> None:
    k, v, q = _kvq(1)
    k[:, :, 5] *= 30  # an outlier key channel
    rotated = AttentionKVCache.create(
        kv_cache_dtype, 8, 16, H, D, num_heads=HQ, key_rotation="hadamard"
    )
    plain = AttentionKVCache.create(kv_cache_dtype, 8, 16, H, D, num_heads=HQ)
    for cache in (rotated, plain):
        observer = KVScaleObserver()
        observer.observe(cache.stored_key(k), v)
        cache.set_kv_scales(*observer.scales(kv_cache_dtype))
    meta = rotated.metadata([40], [40], TABLE)
    # The cache holds the quantized rotated keys: the op on hadamard_rotate(k) gives its bytes.
    rotated.write(k, v, meta.slot_mapping)
    by_hand = AttentionKVCache.create(kv_cache_dtype, 8, 16, H, D, num_heads=HQ)
    by_hand.set_kv_scales(rotated.k_scale, rotated.v_scale)
    by_hand.write(hadamard_rotate(k).to(k.dtype), v, meta.slot_mapping)
    assert torch.equal(rotated.key_cache, by_hand.key_cache)
    got = rotated.attend(q, meta)
    exact = AttentionKVCache.create("auto", 8, 16, H, D, num_heads=HQ)
    exact.write(k, v, meta.slot_mapping)
    ideal = exact.attend(q, meta).float()
    plain.write(k, v, meta.slot_mapping)
    err_rotated = (got.float() - ideal).norm() / ideal.norm()
    err_plain = (plain.attend(q, meta).float() - ideal).norm() / ideal.norm()
    # The scores are kept: the error is the format's own, of the order of the unrotated one
    # (which channel layout favours which depends on the data; docs/accuracy.md measures it).
    assert err_rotated < (0.3 if kv_cache_dtype == "nvfp4" else 0.1)
    assert err_rotated < 3 * err_plain


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key_rotation": "random"}, "key_rotation: expected None or 'hadamard', got 'random'"),
        ({"kv_cache_dtype": "auto", "key_rotation": "hadamard"}, "expected a quantized cache"),
        ({"head_size": 80, "key_rotation": "hadamard"}, "head_size: expected a power of two"),
    ],
)
def test_bad_key_rotation(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kv_cache_dtype": "fp8", "head_size": D, **kwargs}
    with pytest.raises(ValueError, match=message):
        AttentionKVCache.create(
            args.pop("kv_cache_dtype"),
            8,
            16,
            H,
            args.pop("head_size"),
            **args,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_key_offset_keeps_the_attention_and_frees_the_range(rotation: str | None) -> None:
    k, v, q = _kvq(2)
    k[:, :, 3] += 40.0  # a large part common to every key: softmax ignores it
    meta = AttentionKVCache.create("auto", 8, 16, H, D, num_heads=HQ).metadata([40], [40], TABLE)
    exact = AttentionKVCache.create("auto", 8, 16, H, D, num_heads=HQ)
    exact.write(k, v, meta.slot_mapping)
    ideal = exact.attend(q, meta).float()
    errors = []
    for offset in (False, True):
        cache = AttentionKVCache.create("fp8", 8, 16, H, D, num_heads=HQ, key_rotation=rotation)
        raw = KVScaleObserver()
        raw.observe(k, v)
        if offset:
            cache.set_key_offset(raw.key_mean())
        stored = KVScaleObserver()
        stored.observe(cache.stored_key(k), v)
        cache.set_kv_scales(*stored.scales("fp8"))
        cache.write(k, v, meta.slot_mapping)
        got = cache.attend(q, meta).float()
        errors.append(float((got - ideal).norm() / ideal.norm()))
        if offset:  # what the writer got: fp32 key - offset, rotated, rounded to bf16
            want = k.float() - raw.key_mean()
            want = want if rotation is None else hadamard_rotate(want)
            assert torch.equal(cache.stored_key(k), want.to(k.dtype))
    assert errors[1] < 0.5 * errors[0], errors


def test_key_offset_checks() -> None:
    cache = AttentionKVCache.create("fp8", 8, 16, H, D, num_heads=HQ)
    with pytest.raises(ValueError, match=r"offset: expected a tensor of shape \[3, 64\]"):
        cache.set_key_offset(torch.zeros(H, D + 1))
    with pytest.raises(ValueError, match="offset: expected finite values"):
        cache.set_key_offset(torch.full((H, D), float("nan")))
    capped = AttentionKVCache.create("fp8", 8, 16, H, D, num_heads=HQ, logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="offset: expected an attention without sinks"):
        capped.set_key_offset(torch.zeros(H, D))
    cache.set_key_offset(torch.ones(H, D))
    cache.set_key_offset(None)
    k = torch.randn(2, H, D)
    assert cache.stored_key(k) is k


ROPE = KeyRope.from_base(D, 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_dtype": "auto", "key_rope": ROPE}, "key_rope: expected a quantized cache"),
        ({"kv_cache_dtype": "auto", "key_sink_tokens": 1}, "key_sink_tokens: expected a quant"),
        ({"key_rope": KeyRope.from_base(2 * D, 8)}, "key_rope: expected rotary_dim <= head_size"),
        ({"key_rope": "rope"}, "key_rope: expected None or a KeyRope, got str"),
        ({"key_sink_tokens": -1}, "key_sink_tokens: expected an int >= 0, got -1"),
        ({"key_sink_tokens": 17}, "key_sink_tokens: expected at most block_size=16, got 17"),
        (
            {"kv_cache_dtype": "int8_per_token_head", "key_sink_tokens": 1},
            "key_sink_tokens: expected an FP8 or NVFP4 cache",
        ),
    ],
)
def test_bad_key_rebuild_options(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kv_cache_dtype": "fp8", **kwargs}
    with pytest.raises(ValueError, match=message):
        AttentionKVCache.create(args.pop("kv_cache_dtype"), 8, 16, H, D, **args)  # type: ignore[arg-type]


def test_pre_rope_keys_need_positions_and_keep_rope_and_sinks_with_an_offset() -> None:
    cache = AttentionKVCache.create(
        "fp8", 8, 16, H, D, num_heads=HQ, key_rope=ROPE, key_sink_tokens=1, logits_soft_cap=30.0
    )
    k, v, _ = _kvq(4)
    meta = cache.metadata([40], [40], TABLE)
    with pytest.raises(ValueError, match="positions: expected each key's position"):
        cache.write(k, v, meta.slot_mapping)
    sinks = cache.key_sinks
    assert sinks is not None and not sinks.any()  # nothing written
    # the reader adds the offset back: allowed with a soft cap, RoPE and sinks kept
    cache.set_key_offset(torch.ones(H, D))
    assert cache.key_transform.rope is ROPE and cache.encoding.key.sink_tokens == 1
    assert cache.key_sinks.data_ptr() == sinks.data_ptr()  # the same rows, in the pages
    positions = meta.token_positions()
    assert torch.equal(positions, torch.arange(40))
    expected = ROPE.unrotate(k.float(), positions) - 1.0
    assert torch.equal(cache.stored_key(k, positions), expected.to(k.dtype))
    cache.write(k, v, meta.slot_mapping, positions)
    assert sinks.any()


def test_forward_with_padded_rows_and_pre_rope_keys() -> None:
    """Rows past num_actual_tokens (CUDA-graph padding) are neither positioned nor written."""
    k, v, q = _kvq(5)
    caches = [
        AttentionKVCache.create("fp8", 8, 16, H, D, num_heads=HQ, key_rope=ROPE) for _ in range(2)
    ]
    for cache in caches:
        cache.set_kv_scales(torch.tensor(0.05), torch.tensor(0.05))
    meta = caches[0].metadata([30], [30], TABLE)
    padded = caches[0].forward(q[:40], k[:40], v[:40], meta)
    exact = caches[1].forward(q[:30], k[:30], v[:30], meta)
    assert torch.equal(caches[0].kv_cache, caches[1].kv_cache)
    assert torch.equal(padded[:30], exact)


def test_a_bad_value_writes_neither_pages_nor_sink_rows() -> None:
    cache = AttentionKVCache.create("fp8", 8, 16, H, D, num_heads=HQ, key_sink_tokens=1)
    cache.set_kv_scales(torch.tensor(0.05), torch.tensor(0.05))
    k, v, _ = _kvq(6)
    meta = cache.metadata([40], [40], TABLE)
    before = cache.kv_cache.clone()
    with pytest.raises((ValueError, RuntimeError), match="value"):
        cache.write(k, v[:, :1], meta.slot_mapping)  # one KV head instead of two
    sinks = cache.key_sinks
    assert sinks is not None and not sinks.any()
    assert torch.equal(cache.kv_cache, before)
