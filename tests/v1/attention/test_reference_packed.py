"""The REFERENCE backend over the packed-slot formats (TurboQuant, UltraQuant, Octave: K and V
of a token and KV head in one slot) and ``int4_per_token_head``: its output equals attention
over the codecs' decoded values, its pages are TURBOQUANT's byte for byte and the spec's size,
negative slots are skipped, and bad input is refused before anything is written."""

from __future__ import annotations

import math

import pytest
import torch
from kv_cache_test_utils import one_group

from vllm._extension import compiled_kernel
from vllm.kv_quant import octave
from vllm.kv_quant.formats import find_format, formats
from vllm.kv_quant.int4_per_token_head import dequantize_int4_rows, quantize_int4_rows
from vllm.kv_quant.slot_codecs import (
    OCTAVE_CHECK_ROPE_DIM,
    compiled_store_op,
    is_packed,
    slot_codec,
)
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backends.abstract import AttentionLayerScales
from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl
from vllm.v1.attention.backends.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.reference_packed import PACKED_STRIDE_ORDER, PackedSlots
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.attention.backends.ultraquant_attn import UltraQuantAttentionBackend
from vllm.v1.attention.ops.triton_packed_store import triton_packed_store
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

PACKED = tuple(f.name for f in formats() if is_packed(f))
"""TurboQuant's four presets, ``ultraquant_4bit``, Octave's three."""
FORMATS = (*PACKED, "int4_per_token_head")
HQ, H, D, N = 4, 2, 64, 16
NUM_BLOCKS = 10


def _cache(dtype: str, seed: int = 0) -> torch.Tensor:
    """Seeded garbage in the backend's shape; a packed cache stored block, token, head, slot."""
    shape = ReferenceAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, N, H, D, dtype)
    gen = torch.Generator().manual_seed(seed)
    if dtype not in PACKED:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    physical = [shape[i] for i in PACKED_STRIDE_ORDER]
    return torch.randint(0, 256, physical, dtype=torch.uint8, generator=gen).transpose(1, 2)


def _decoded(dtype: str, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 K and V ``[T, H, D]`` as the format's codec stores and reads them back."""
    if dtype in PACKED:
        codec = slot_codec(find_format(dtype), D, OCTAVE_CHECK_ROPE_DIM)
        return codec.decode(codec.encode(key, value))
    return tuple(dequantize_int4_rows(*quantize_int4_rows(x)) for x in (key, value))


def _expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal fp32 attention, written out: ``k`` / ``v`` hold every sequence's tokens in order,
    ``q`` the last ``query_lens`` of each."""
    outs = []
    keys, values = torch.split(k, seq_lens), torch.split(v, seq_lens)
    for qi, ki, vi, s in zip(torch.split(q, query_lens), keys, values, seq_lens, strict=True):
        qpos = torch.arange(s - qi.shape[0], s)[:, None]
        kpos = torch.arange(s)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= qpos - kpos < window
        kk = ki.repeat_interleave(HQ // H, dim=1)
        vv = vi.repeat_interleave(HQ // H, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, kk) / math.sqrt(D)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            extra = sinks[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
    return torch.cat(outs)


def _packed_spec(dtype: str, head_size: int = D) -> FullAttentionSpec:
    """The spec of a layer of ``H`` KV heads in packed format ``dtype``, ``N``-token pages."""
    fmt = find_format(dtype)
    assert fmt is not None and fmt.storage_dtype is not None
    return FullAttentionSpec(
        block_size=N,
        num_kv_heads=H,
        head_size=head_size,
        dtype=fmt.storage_dtype,
        kv_quant_mode=fmt.quant_mode,
    )


def _slots(table: torch.Tensor, seq: int, positions: torch.Tensor) -> torch.Tensor:
    return table[seq, positions // N] * N + positions % N


@pytest.mark.parametrize(
    "impl_cls", [ReferenceAttentionImpl, CPUAttentionImpl, TritonAttentionImpl]
)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", FORMATS)
def test_output_is_attention_over_decoded_values(
    dtype: str, window: int | None, impl_cls: type[ReferenceAttentionImpl]
) -> None:
    """A batch of a chunked prefill over a cached prefix, a decode and a first prefill (sinks
    with the window): the impl (REFERENCE, CPU_ATTN's compiled kernel, TRITON_ATTN's packed
    kernel under the interpreter) writes the new tokens and attends over every cached one."""
    gen = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [37, 21, 18], [5, 1, 18]
    total = sum(seq_lens)
    key = torch.randn(total, H, D, generator=gen)
    value = torch.randn(total, H, D, generator=gen)
    query = torch.randn(sum(query_lens), HQ, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) if window else None
    table = torch.tensor([[7, 2, 9], [4, 0, 0], [1, 5, 0]])
    impl = impl_cls(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype, sliding_window=window, sinks=sinks)
    layer, cache = AttentionLayerScales(), _cache(dtype)
    starts = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    # The cached prefixes first (one write), then the new tokens through forward.
    prefix = [torch.arange(starts[i], starts[i + 1] - q) for i, q in enumerate(query_lens)]
    new = [torch.arange(starts[i + 1] - q, starts[i + 1]) for i, q in enumerate(query_lens)]
    slots = torch.cat([_slots(table, i, p - starts[i]) for i, p in enumerate(prefix)])
    rows = torch.cat(prefix)
    impl.do_kv_cache_update(layer, key[rows], value[rows], cache, slots)
    meta = ReferenceAttentionMetadata.build(seq_lens, query_lens, table, N)
    rows = torch.cat(new)
    out = impl.forward(layer, query, key[rows], value[rows], cache, meta)
    k, v = _decoded(dtype, key, value)
    expected = _expected(query, k, v, seq_lens, query_lens, window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", PACKED)
def test_write_is_the_codec_bytes_and_skips_negative_slots(dtype: str) -> None:
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, H, D, generator=gen), torch.randn(5, H, D, generator=gen)
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype)
    cache = _cache(dtype)
    before = cache.clone()
    slots = torch.tensor([3, -1, 40, -1, 17])
    impl.do_kv_cache_update(AttentionLayerScales(), key, value, cache, slots)
    codec = slot_codec(find_format(dtype), D, OCTAVE_CHECK_ROPE_DIM)
    encoded = codec.encode(key, value)
    pages = cache.transpose(1, 2)  # (B, N, H, slot)
    written = torch.zeros(NUM_BLOCKS * N, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written[slot] = True
            assert torch.equal(pages[slot // N, slot % N], encoded[i])
    untouched = ~written.view(NUM_BLOCKS, N)
    assert torch.equal(pages[untouched], before.transpose(1, 2)[untouched])
    # The bytes above came from the format's compiled store (the extension is built here).
    assert impl._packed is not None
    assert impl._packed._store(cache.device) is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here")
@pytest.mark.parametrize("dtype", PACKED)
def test_triton_store_is_the_gpu_fallback_and_writes_the_codec_bytes(dtype: str) -> None:
    """On a GPU the extension has no kernel for, the layer writes with the format's Triton
    store (picked for a CUDA device here, whose extension has CPU kernels only); its bytes, run
    here under the interpreter on CPU tensors, are the codec's, negative slots skipped."""
    fmt = find_format(dtype)
    packed = PackedSlots(fmt, H, D)
    cuda = torch.device("cuda")
    if compiled_kernel(compiled_store_op(fmt) or "", cuda) is None:
        assert packed._store(cuda) is not None
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(4, H, D, generator=gen), torch.randn(4, H, D, generator=gen)
    cache = _cache(dtype)
    before = cache.clone()
    view = packed.cache_view(cache)
    slots = torch.tensor([9, -1, 0, 30])
    triton_packed_store(fmt, D, packed.codec.reader.rope_dim)(key, value, view, slots)
    encoded = packed.codec.encode(key, value)
    want = before.transpose(1, 2).clone()
    keep = slots >= 0
    want[slots[keep] // N, slots[keep] % N, :, : encoded.shape[-1]] = encoded[keep]
    assert torch.equal(view, want)


def test_int4_per_token_head_write_skips_negative_slots() -> None:
    key = torch.randn(3, H, D)
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype="int4_per_token_head")
    cache = _cache("int4_per_token_head")
    before = cache.clone()
    impl.do_kv_cache_update(AttentionLayerScales(), key, key, cache, torch.tensor([-1, 5, -1]))
    changed = (cache != before).any(-1).any(-1).any(1)  # (B, 2, N, H, row) -> [B, N]
    assert changed.nonzero().tolist() == [[0, 5]]


@pytest.mark.parametrize(
    ("dtype", "other"),
    [
        *((name, TurboQuantAttentionBackend) for name in PACKED if name.startswith("turbo")),
        ("ultraquant_4bit", UltraQuantAttentionBackend),
    ],
)
def test_pages_are_the_packed_backends_pages(dtype: str, other: type) -> None:
    """Same logical shape and physical order as TURBOQUANT's (and ULTRAQUANT's) cache, and the
    same bytes as its reference codec: a page moves between the backends as it is."""
    for head_size in (64, 128):
        ours = ReferenceAttentionBackend.get_kv_cache_shape(3, 16, 2, head_size, dtype)
        assert ours == other.get_kv_cache_shape(3, 16, 2, head_size, dtype)
    assert TurboQuantAttentionBackend.get_kv_cache_stride_order() == PACKED_STRIDE_ORDER


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("head_size", [64, 128])
def test_spec_page_is_the_backend_page(dtype: str, head_size: int, monkeypatch) -> None:
    monkeypatch.setattr(octave, "_rope_dims", {})
    octave.register_rope_dim(head_size, OCTAVE_CHECK_ROPE_DIM)
    spec = _packed_spec(dtype, head_size)
    shape = ReferenceAttentionBackend.get_kv_cache_shape(1, N, H, head_size, dtype)
    assert spec.page_size_bytes == math.prod(shape)


def test_every_packed_format_is_listed() -> None:
    listed = set(ReferenceAttentionBackend.supported_kv_cache_dtypes)
    assert set(FORMATS) <= listed


# ------------------------------------------------------------------------------ errors


def _refused(dtype: str, **kwargs: object) -> str:
    with pytest.raises(ValueError) as exc:
        ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype, **kwargs)
    return str(exc.value)


@pytest.mark.parametrize("dtype", PACKED)
def test_key_options_and_per_head_scales_are_refused(dtype: str) -> None:
    for option in ("+offset", "+prerope", "+hadamard", "+sink"):
        assert _refused(dtype + option).startswith("kv_cache_dtype: invalid KV-cache encoding")
    assert _refused(f"{dtype}/head").startswith(f"kv_cache_dtype: expected {dtype} without /head")
    assert _refused(dtype, head_size_v=32).startswith("head_size_v: expected head_size=64")
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype)
    with pytest.raises(ValueError, match="^key_offset: expected a format whose writers"):
        impl.set_key_offset(torch.zeros(H, D))


def test_key_rope_and_kernel_impls_are_refused() -> None:
    from vllm.kv_quant import KeyRope

    rope = KeyRope(torch.zeros(64, D))
    assert _refused("turboquant_k8v4", key_rope=rope) == (
        "key_rope: expected None for turboquant_k8v4 (a packed-slot format stores keys as "
        "given), got a KeyRope"
    )
    with pytest.raises(ValueError, match="^kv_cache_dtype: expected a format _OwnKernels reads"):
        _OwnKernels(HQ, D, num_kv_heads=H, kv_cache_dtype="octave_k3v3")


class _OwnKernels(CPUAttentionImpl):
    """An impl whose forward replaces CPU_ATTN's without saying it reads packed slots."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("never reached: the constructor refuses packed formats")


@pytest.mark.parametrize("dtype", PACKED)
def test_wrong_cache_is_refused_before_writing(dtype: str) -> None:
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype)
    key = torch.randn(2, H, D)
    slots = torch.tensor([0, 1])
    layer = AttentionLayerScales()
    good = _cache(dtype)
    b, h, n, c = good.shape
    wrong = [
        torch.zeros(b, h, n, c + 1, dtype=torch.uint8),  # slot bytes
        torch.zeros(b, h + 1, n, c, dtype=torch.uint8),  # heads
        torch.zeros(b, h, n, c, dtype=torch.int8),  # dtype
        torch.zeros(b, 2, n, h, c, dtype=torch.uint8),  # a per-side cache
    ]
    for cache in wrong:
        with pytest.raises(ValueError, match="^kv_cache: expected a uint8"):
            impl.do_kv_cache_update(layer, key, key, cache, slots)
        assert not cache.any()
    meta = ReferenceAttentionMetadata.build([2], [2], torch.tensor([[0]]), N)
    with pytest.raises(ValueError, match="^kv_cache: expected a uint8"):
        impl.forward(layer, torch.randn(2, HQ, D), key, key, wrong[0], meta)


@pytest.mark.parametrize("dtype", ["turboquant_3bit_nc", "octave_k3v3_compact"])
def test_bad_slots_and_inputs_are_refused_before_writing(dtype: str) -> None:
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype)
    layer, cache = AttentionLayerScales(), _cache(dtype)
    before = cache.clone()
    key = torch.randn(2, H, D)
    cases = [
        (key, key, torch.tensor([0, 1], dtype=torch.int32), "^slot_mapping: expected an int64"),
        (key, key, torch.tensor([0.0, 1.0]), "^slot_mapping: expected an int64"),
        (key, key, torch.tensor([0, NUM_BLOCKS * N]), "^slot_mapping: slot 160 is out of range"),
        (key, key, torch.tensor([0, 1, 2]), "^slot_mapping: expected at most 2 entries"),
        (key, torch.randn(2, H, 32), torch.tensor([0, 1]), "^value: expected shape"),
        (key.to(torch.int32), key, torch.tensor([0, 1]), "^key: expected dtype"),
    ]
    for k, v, slots, match in cases:
        with pytest.raises(ValueError, match=match):
            impl.do_kv_cache_update(layer, k, v, cache, slots)
        assert torch.equal(cache, before)


def test_unholdable_head_size_is_refused() -> None:
    expected = "^head_size: expected a head size ultraquant_4bit can hold, got 80"
    with pytest.raises(ValueError, match=expected):
        ReferenceAttentionBackend.get_kv_cache_shape(2, N, H, 80, "ultraquant_4bit")
    with pytest.raises(ValueError, match=expected):
        ReferenceAttentionImpl(HQ, 80, num_kv_heads=H, kv_cache_dtype="ultraquant_4bit")
    with pytest.raises(ValueError, match="^num_blocks: ReferenceAttentionBackend"):
        ReferenceAttentionBackend.get_kv_cache_shape(-1, N, H, D, "turboquant_k8v4")


# ------------------------------------------------------------------------ engine allocation


@pytest.mark.parametrize("kernel_block_size", [N, N // 2])
@pytest.mark.parametrize("dtype", PACKED)
def test_engine_allocates_packed_caches(dtype: str, kernel_block_size: int, monkeypatch) -> None:
    """``init_layer_kv_caches`` gives a packed layer the backend's ``(B, H, N, slot)`` view over
    its buffer, stored block, token, head, slot (kernel blocks split a page's tokens), and the
    impl writes the codec's bytes through it."""
    monkeypatch.setattr(octave, "_rope_dims", {})
    octave.register_rope_dim(D, OCTAVE_CHECK_ROPE_DIM)
    spec = _packed_spec(dtype)
    fmt = spec.kv_cache_format
    config = one_group(spec, spec.page_size_bytes * NUM_BLOCKS)
    cache = init_layer_kv_caches(
        config, [ReferenceAttentionBackend], "cpu", kernel_block_sizes=[kernel_block_size]
    )["l0"]
    assert isinstance(cache, torch.Tensor)
    split = N // kernel_block_size
    shape = ReferenceAttentionBackend.get_kv_cache_shape(
        NUM_BLOCKS * split, kernel_block_size, H, D, dtype
    )
    assert tuple(cache.shape) == shape
    slot_bytes = shape[-1]
    assert cache.stride() == (kernel_block_size * H * slot_bytes, slot_bytes, H * slot_bytes, 1)
    assert cache.untyped_storage().nbytes() == spec.page_size_bytes * NUM_BLOCKS

    key, value = torch.randn(3, H, D), torch.randn(3, H, D)
    slots = torch.tensor([0, N + 1, NUM_BLOCKS * N - 1])
    impl = ReferenceAttentionImpl(HQ, D, num_kv_heads=H, kv_cache_dtype=dtype)
    impl.do_kv_cache_update(AttentionLayerScales(), key, value, cache, slots)
    encoded = slot_codec(fmt, D, OCTAVE_CHECK_ROPE_DIM).encode(key, value)
    flat = cache.transpose(1, 2).reshape(-1, H, slot_bytes)  # every (token, head) in slot order
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[slot], encoded[i])


def test_engine_refuses_a_packed_cache_in_another_layout() -> None:
    spec = _packed_spec("turboquant_4bit_nc")
    config = one_group(spec, spec.page_size_bytes * NUM_BLOCKS)

    class HeadMajor(ReferenceAttentionBackend):
        @staticmethod
        def get_kv_cache_stride_order(
            include_num_layers_dimension: bool = False,
        ) -> tuple[int, ...]:
            return (0, 1, 2, 3)

    class FiveDims(ReferenceAttentionBackend):
        @staticmethod
        def get_kv_cache_shape(*args: object, **kwargs: object) -> tuple[int, ...]:
            return (NUM_BLOCKS, 1, H, N, spec.page_size_bytes // (H * N))

    with pytest.raises(
        ValueError, match=r"layer 'l0'.*order \(0, 1, 2, 3\); expected \(0, 2, 1, 3\)"
    ):
        init_layer_kv_caches(config, [HeadMajor], "cpu")
    with pytest.raises(ValueError, match=r"layer 'l0'.*needs a \(B, H, N, slot\) cache"):
        init_layer_kv_caches(config, [FiveDims], "cpu")
