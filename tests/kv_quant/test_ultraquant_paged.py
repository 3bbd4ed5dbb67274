"""``ultraquant_store`` / ``ultraquant_full_dequant_kv`` (upstream's paths) on CPU: slot bytes
equal the reference codec's, skipped slots stay untouched, bad input fails before any write."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.ops.ultraquant.format import slot_size
from vllm.v1.attention.ops.ultraquant.reference import (
    reference_ultraquant_attention,
    ultraquant_dequant,
    ultraquant_encode,
)
from vllm.v1.attention.ops.ultraquant.triton_dequant import ultraquant_full_dequant_kv
from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store
from vllm.v1.attention.ops.ultraquant.triton_unified_attention import (
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
