"""``ultraquant_store`` / ``ultraquant_full_dequant_kv`` / ``ultraquant_unified_attention``
(upstream's paths) on CPU: slot bytes equal the reference codec's, skipped slots stay untouched,
the attention kernels (compiled CPU, Triton under the interpreter) equal the torch definition,
bad input fails before any write."""

from __future__ import annotations

import pytest
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.ultraquant.format import slot_size
from vllm.v1.attention.ops.ultraquant.reference import (
    hadamard_matrix,
    reference_ultraquant_attention,
    ultraquant_dequant,
    ultraquant_encode,
)
from vllm.v1.attention.ops.ultraquant.triton_dequant import (
    triton_ultraquant_full_dequant_kv,
    ultraquant_full_dequant_kv,
)
from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store
from vllm.v1.attention.ops.ultraquant.triton_unified_attention import (
    reference_unified_attention,
    ultraquant_unified_attention,
)


def _cache(blocks: int, hk: int, d: int, pad: int = 0) -> torch.Tensor:
    return torch.zeros(blocks, 4, hk, slot_size(d) + pad, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_bytes_and_round_trip(dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    k = torch.randn(6, 2, 64, dtype=dtype)
    v = torch.randn(6, 2, 64, dtype=dtype)
    cache = _cache(3, 2, 64, pad=4)
    slots = torch.tensor([4, -1, 5, 6, 7, 8])  # block 0 unused, token 1 skipped
    ultraquant_store(k, v, cache, slots)
    rk, rv = ultraquant_encode(k), ultraquant_encode(v, rotate=False)
    want = torch.cat([rk.codes_packed, rk.scale_bytes, rv.codes_packed, rv.scale_bytes], -1)
    flat = cache.view(12, 2, -1)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s, :, :68], want[i])
    assert flat[:4].eq(0).all() and flat[9:].eq(0).all() and flat[:, :, 68:].eq(0).all()
    k_out = torch.zeros(1, 2, 6, 64, dtype=dtype)
    v_out = torch.zeros_like(k_out)
    ultraquant_full_dequant_kv(cache, torch.tensor([[1, 2]]), k_out, v_out, alloc_len=5)
    # Position p lives in slot 4 + p; slot 5 holds token 2, so compare per slot.
    src = {4: 0, 5: 2, 6: 3, 7: 4, 8: 5}
    for p in range(5):
        i = src[4 + p]
        assert torch.equal(k_out[0, :, p], ultraquant_dequant(rk, 64)[i].to(dtype))
        assert torch.equal(v_out[0, :, p], ultraquant_dequant(rv, 64)[i].to(dtype))
    assert k_out[0, :, 5].eq(0).all()


@pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 96])
def test_triton_full_dequant_equals_the_torch_path(dtype: torch.dtype, d: int) -> None:
    """The GPU dequant kernel (here under the interpreter on CPU tensors) against the torch
    path on every byte value: all codes, scale bytes 0 (zero), 1 (subnormal products), 254 and
    255 (overflow to Inf); three requests over a shuffled block table (int32), an allocation
    that ends inside a block, a head size whose row is no power of two, outputs with padded
    positions (left untouched past the allocation). Not bf16 outputs: the interpreter's bf16
    rounding is not the GPU's."""
    gen = torch.Generator().manual_seed(d)
    cache = torch.randint(0, 256, (7, 4, 2, slot_size(d)), generator=gen, dtype=torch.uint8)
    scales = cache[..., d // 2 : d // 2 + d // 32]
    scales[0, 0, 0, 0], scales[1, 1, 0, 0], scales[2, 2, 1, 0], scales[3, 0, 1, 0] = 0, 1, 254, 255
    table = torch.tensor([[3, 0, 6], [1, 2, 5], [4, 6, 0]], dtype=torch.int32)
    want_k = torch.full((3, 2, 12, d), 7.0, dtype=dtype)
    want_v = want_k.clone()
    got_k, got_v = want_k.clone(), want_v.clone()
    ultraquant_full_dequant_kv(cache, table, want_k, want_v, alloc_len=10)
    triton_ultraquant_full_dequant_kv(cache, table, got_k, got_v, alloc_len=10)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        nan = want.isnan()  # code 0 under scale byte 255: 0 * Inf
        assert torch.equal(got.isnan(), nan)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])  # -0.0 included
    assert bool(got_k[:, :, 10:].eq(7).all())
    assert bool(torch.isinf(want_k).any()) and bool((want_k == 0).any())


def test_bad_input_writes_nothing() -> None:
    k = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    cache = _cache(1, 1, 64)
    bad = [
        ((k, k, cache.to(torch.int8), torch.tensor([0, 1])), TypeError, "kv_cache: expected"),
        ((k, k, _cache(1, 2, 64), torch.tensor([0, 1])), ValueError, "kv_cache: expected"),
        ((k, k[:1], cache, torch.tensor([0, 1])), ValueError, "key: expected"),
        ((k, k.half(), cache, torch.tensor([0, 1])), TypeError, "key: expected"),
        ((k, k, cache, torch.tensor([0])), ValueError, "slot_mapping: expected"),
        ((k, k, cache, torch.tensor([0, 4])), ValueError, "slot_mapping: expected slots"),
    ]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            ultraquant_store(*args)
    assert cache.eq(0).all()
    out = torch.zeros(1, 1, 8, 64)
    with pytest.raises(ValueError, match="block_table: expected"):
        ultraquant_full_dequant_kv(cache, torch.tensor([[0]]), out, out.clone(), alloc_len=8)
    with pytest.raises(ValueError, match="k_out: expected"):
        ultraquant_full_dequant_kv(cache, torch.tensor([[0]]), out, out[..., :32], alloc_len=1)
    # Ids out of the cache, in the columns the allocation uses (4 tokens a block).
    for table, alloc_len in (([[1]], 4), ([[-1]], 1), ([[0, 5]], 5)):
        with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, 1\)"):
            ultraquant_full_dequant_kv(cache, torch.tensor(table), out, out.clone(), alloc_len)
    assert out.eq(0).all()
    ultraquant_full_dequant_kv(cache, torch.tensor([[0, 5]]), out, out.clone(), alloc_len=4)


def test_unified_attention_decode_and_prefill() -> None:
    torch.manual_seed(13)
    hq, hk, d, n = 4, 2, 64, 7
    key = torch.randn(1, n, hk, d)
    value = torch.randn(1, n, hk, d)
    cache = _cache(2, hk, d)
    ultraquant_store(key[0], value[0], cache, torch.arange(n))
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    q = torch.randn(3, hq, d)
    # Prefill of the last 3 positions: row t sees keys [0, n - 3 + t].
    got = ultraquant_unified_attention(
        q, cache, table, torch.tensor([n]), torch.tensor([0, 3]), scale=0.125
    )
    for t in range(3):
        seen = n - 3 + t + 1
        want = reference_ultraquant_attention(
            q[t : t + 1], key[:, :seen], value[:, :seen], scale=0.125
        )
        torch.testing.assert_close(got[t : t + 1], want, rtol=1e-5, atol=1e-5)
    windowed = ultraquant_unified_attention(
        q[:1], cache, table, torch.tensor([n]), torch.tensor([0, 1]), 0.125, sliding_window=2
    )
    want = reference_ultraquant_attention(q[:1], key[:, -2:], value[:, -2:], scale=0.125)
    torch.testing.assert_close(windowed, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="query_start_loc: expected"):
        ultraquant_unified_attention(q, cache, table, torch.tensor([n]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(ValueError, match="query: expected a head count"):
        ultraquant_unified_attention(
            q[:, :3], cache, table, torch.tensor([n]), torch.tensor([0, 3]), 1.0
        )


def _codec_slots(k: torch.Tensor, v: torch.Tensor, c: float | None = None) -> torch.Tensor:
    rk = ultraquant_encode(k, constant_c=c)
    rv = ultraquant_encode(v, rotate=False, constant_c=c)
    return torch.cat([rk.codes_packed, rk.scale_bytes, rv.codes_packed, rv.scale_bytes], -1)


def _edge_rows(d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K / V ``[6, 2, d]``: random rows over many magnitudes, then groups of zeros, a NaN, an
    Inf, subnormals, values on every rounding boundary (V: ``amax`` 4 gives ``s = 1/2``, so
    ``v = m / 2`` lands on midpoint ``m``) and huge values."""
    gen = torch.Generator().manual_seed(d)
    k = torch.randn(6, 2, d, generator=gen) * 10.0 ** torch.arange(-3, 3).view(6, 1, 1)
    v = torch.randn(6, 2, d, generator=gen) * 10.0 ** torch.arange(2, -4, -1).view(6, 1, 1)
    v[0, 0, :32] = 0.0
    v[0, 1, 3] = float("nan")
    k[1, 0, 7] = float("-inf")
    v[1, 1, :32] = 1e-40
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v[2, 0, :32] = torch.cat([mids, -mids, mids / 2, -mids / 2, torch.tensor([8.0] * 4)]) / 2
    v[3, 1, :32] = 3e38 if dtype == torch.float32 else 6e4
    return k.to(dtype), v.to(dtype)


def _snap_boundary_rows() -> torch.Tensor:
    """V ``[6, 2, 64]`` fp32 whose groups' amax is ``m * 2^e`` with ``m`` the fp32 mantissas
    either side of ``sqrt(2)`` (0x3FB504F3, 0x3FB504F4): with ``constant_c = 1`` that is
    ``s_raw``, and the snap must round the first down and the second up."""
    below, above = torch.tensor([0x3FB504F3, 0x3FB504F4], dtype=torch.int32).view(torch.float32)
    v = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(5)) * 0.1
    for i, e in enumerate((-100, -10, -3, 0, 5, 60)):
        v[i] *= 2.0**e
        v[i, 0, 7], v[i, 1, 40] = below * 2.0**e, -above * 2.0**e
    return v


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_store_is_the_codecs_bytes(d: int, dtype: torch.dtype) -> None:
    """The extension's kernel writes the slots here (the CPU op): byte for byte the codec's,
    padding and unnamed slots untouched, on edge groups as on random ones."""
    from vllm._extension import compiled_kernel

    assert compiled_kernel("ultraquant_store", torch.device("cpu")) is not None
    k, v = _edge_rows(d, dtype)
    storage = torch.full((5, 4, 2, slot_size(d) + 3), 0xA5, dtype=torch.uint8)
    cache = storage[::2]  # blocks not adjacent
    slots = torch.tensor([0, 9, 5, 11, 2, -1])
    ultraquant_store(k, v, cache, slots)
    want = _codec_slots(k, v)
    flat = cache.reshape(12, 2, -1)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s, :, : slot_size(d)], want[i]), (i, s)
    assert flat[:, :, slot_size(d) :].eq(0xA5).all()
    assert flat[[1, 3, 4, 6, 7, 8, 10]].eq(0xA5).all()


def test_compiled_store_takes_constant_c_and_strided_rows() -> None:
    k, v = _edge_rows(64, torch.float32)
    k = k.transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost
    v = v[..., :64].clone()
    wide = torch.zeros(6, 2, 96)
    wide[..., :64] = v
    v = wide[..., :64]
    cache = _cache(3, 2, 64)
    slots = torch.arange(6)
    ultraquant_store(k, v, cache, slots, constant_c=0.3)
    assert torch.equal(cache.reshape(12, 2, -1)[:6], _codec_slots(k, v, 0.3))
    v = _snap_boundary_rows()
    ultraquant_store(k, v, cache, slots, constant_c=1.0)
    assert torch.equal(cache.reshape(12, 2, -1)[:6], _codec_slots(k, v, 1.0))


def test_compiled_op_names_the_bad_argument() -> None:
    op = torch.ops._C_cache_ops.ultraquant_store
    k = torch.zeros(2, 1, 64)
    cache, slots = _cache(1, 1, 64), torch.tensor([0, 1])
    cases = [
        ((k.half(), k, cache, slots, 0.156), "key: expected dtype float32"),
        ((k, k[..., :48], cache, slots, 0.156), "value: expected a head dim that is a positive"),
        ((k, k, cache[..., :60], slots, 0.156), r"kv_cache: expected a \(num_blocks"),
        ((k, k, cache, slots, float("nan")), "constant_c: expected a finite value > 0"),
        ((k, k, cache, torch.tensor([0, 4]), 0.156), "expected slots < num_blocks"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(*args)
    assert cache.eq(0).all()


def _paged_requests(lens: list[int], hk: int, d: int, pad: int) -> tuple[torch.Tensor, ...]:
    """A padded-slot cache of 4-token blocks holding requests of ``lens`` tokens in shuffled
    blocks, and their block table."""
    gen = torch.Generator().manual_seed(sum(lens))
    per_request = -(-max(lens) // 4)
    blocks = torch.randperm(len(lens) * per_request, generator=gen).view(len(lens), per_request)
    cache = _cache(len(lens) * per_request, hk, d, pad=pad)
    for i, n in enumerate(lens):
        key = torch.randn(n, hk, d, generator=gen, dtype=torch.bfloat16)
        value = torch.randn(n, hk, d, generator=gen, dtype=torch.bfloat16)
        pos = torch.arange(n)
        ultraquant_store(key, value, cache, blocks[i][pos // 4] * 4 + pos % 4)
    return cache, blocks.int()


@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, True)])
def test_unified_attention_kernels_equal_the_definition(window: int | None, with_sinks) -> None:
    """The compiled CPU kernel (what ultraquant_unified_attention runs here) and the fused Triton
    packed kernel, both given the rotated FP8-rounded query, against the torch definition: GQA
    4, decode and prefill rows, shuffled blocks, a window and sinks; with padded slots (which
    the readers do not take) the definition itself runs."""
    lens, q_lens, hk, hq, d = [9, 14, 3], [1, 6, 3], 2, 8, 64
    cache, table = _paged_requests(lens, hk, d, pad=0)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    starts = [0, 1, 7, 10]
    seq_lens, qsl = torch.tensor(lens), torch.tensor(starts)
    got = ultraquant_unified_attention(
        query, cache, table, seq_lens, qsl, 0.2, sinks=sinks, sliding_window=window
    )
    q = (query @ hadamard_matrix(d, "cpu")).to(torch.float8_e4m3fn).float()
    want = reference_unified_attention(
        q, cache, table, lens, starts, 0.2, torch.empty_like(query), sinks, window
    )
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    padded, _ = _paged_requests(lens, hk, d, pad=4)
    assert torch.equal(padded[..., : slot_size(d)], cache)
    again = ultraquant_unified_attention(
        query, padded, table, seq_lens, qsl, 0.2, sinks=sinks, sliding_window=window
    )
    torch.testing.assert_close(again, want, rtol=2e-5, atol=2e-5)
    if not HAS_TRITON:
        return
    from vllm.v1.attention.ops.triton_slot_attention import triton_packed_slot_attention

    out = torch.zeros_like(query)
    triton_packed_slot_attention(
        out, q, cache.transpose(1, 2), table, seq_lens.int(), qsl.int(),
        "ultraquant_4bit", 0.2, max(q_lens), max(lens), sliding_window=window, sinks=sinks,
        query_in_key_frame=True,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
