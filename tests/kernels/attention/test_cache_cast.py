"""K/V of any float dtype into an unquantized cache of any float dtype (docs/design.md §6).

``reshape_and_cache_flash`` casts each element inside the kernel; the bytes are those of the
reference writer, ``x.to(cache_dtype)`` (round to nearest even, overflow to ±Inf), for every
(key dtype, cache dtype) pair, NHD and HND, rows further apart than a token (slices of a fused
tensor), padding slots (-1) skipped. A NaN stays a NaN; its bits are not compared (torch's own
fp32 -> bf16 cast gives 0xFFFF or 0x7FC0 depending on its code path). The fake (meta) impl
accepts the same dtypes and rejects the same ones with the same messages; ``CPU_ATTN``'s
``paged_attention`` reads an unquantized cache with a query of any float dtype.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops

from .cache_utils import (
    SOURCE_DTYPES,
    _id,
    check_against_reference,
    expected_buffers,
    make_case,
)

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
PAIRS = list(itertools.product(SOURCE_DTYPES, SOURCE_DTYPES))
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _edge_values() -> torch.Tensor:
    """fp32 values at every rounding and range edge of fp32 -> fp16 / bf16 and fp16 <-> bf16."""
    two = 2.0
    values = [
        0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -1.0,
        # bf16 ties (8 kept bits): to even down, to even up, just above a tie
        1 + two**-8, 1 + 3 * two**-8, 1 + two**-8 + two**-20, -(1 + 3 * two**-8),
        # fp16 ties (11 kept bits)
        1 + two**-11, 1 + 3 * two**-11, 1 + two**-11 + two**-20, -(1 + 3 * two**-11),
        # fp16 range: max, just below the tie to Inf, the tie (-> Inf), above, fp32 and bf16 max
        65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e5, -1e5, 3.4028234663852886e38,
        -3.4028234663852886e38, 3.3e38,
        # fp16 subnormals and their ties: 2^-24 is the smallest, 2^-25 ties to 0, 3 * 2^-25 to 2^-23
        two**-24, two**-25, 3 * two**-25, -(two**-25), two**-26, two**-14, two**-14 - two**-24,
        6.1e-5, 1e-7, -1e-7,
        # fp32 / bf16 subnormals and the smallest normals
        two**-126, two**-127, 1e-40, -1e-40, two**-149, 1e-45, 1.1754942e-38,
        # wide-mantissa values (all three differ)
        3.14159265, -2.718281828, 0.1, 1 / 3, 1234.5678, 1e-3, 7e4, 255.875,
    ]  # fmt: skip
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def _edge_source(t_pad: int, heads: int, head_size: int, dtype: torch.dtype, offset: int):
    """[T_pad, H, D] of the edge values (cycled, shifted by `offset`) in `dtype`, rows 3
    elements further apart than a token (a non-contiguous view)."""
    edges = _edge_values().to(dtype)
    width = heads * head_size
    n = t_pad * width
    flat = edges.repeat(n // edges.numel() + 2)[offset : offset + n]
    base = torch.zeros(t_pad, width + 3, dtype=dtype)
    base[:, :width] = flat.view(t_pad, width)
    view = base[:, :width].view(t_pad, heads, head_size)
    assert not view.is_contiguous()
    return view


def _assert_equal_nan_aware(got: list[torch.Tensor], expected: list[torch.Tensor], dtype):
    """Raw buffers equal as `dtype` elements: the same bits, or NaN in both."""
    for g, e in zip(got, expected, strict=True):
        gv, ev = g.view(dtype), e.view(dtype)
        same = (gv.view(BITS[dtype]) == ev.view(BITS[dtype])) | (gv.isnan() & ev.isnan())
        bad = (~same).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{bad.numel()} of {gv.numel()} elements differ, first at {bad[:8].tolist()}: "
            f"got {gv[bad[:4]].tolist()}, expected {ev[bad[:4]].tolist()}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src,cache", PAIRS, ids=_id)
@pytest.mark.parametrize("named", [False, True], ids=["auto", "named"])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_random_values_match_reference(
    device: str, src: torch.dtype, cache: torch.dtype, named: bool, hnd: bool
) -> None:
    kind = NAMES[cache] if named else "auto"
    case = make_case(
        device, kind, src, cache_dtype=cache, hnd=hnd, row_padding=5, skip_every=5, head_size=40
    )
    assert case.key_cache.dtype == cache and case.key.stride(0) == 4 * 40 + 5
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src,cache", PAIRS, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_edge_values_match_reference(
    device: str, src: torch.dtype, cache: torch.dtype, hnd: bool
) -> None:
    """Ties, fp16 overflow, subnormals, NaN, ±Inf and -0.0, every (key, cache) dtype pair."""
    heads, head_size, tokens, padding = 3, 24, 20, 2
    case = make_case(
        device, "auto", src, cache_dtype=cache, hnd=hnd, num_heads=heads, head_size=head_size,
        num_tokens=tokens, padding=padding, skip_every=4, num_blocks=4, block_size=8,
    )  # fmt: skip
    case.key = _edge_source(tokens + padding, heads, head_size, src, 0).to(device)
    case.value = _edge_source(tokens + padding, heads, head_size, src, 17).to(device)
    assert (case.slot_mapping == -1).any()
    expected = expected_buffers(case)
    assert any(not torch.equal(b, e) for b, e in zip(case.buffers, expected, strict=True))
    case.run()
    _assert_equal_nan_aware(case.buffers, expected, cache)


def test_cast_rounding_pinned() -> None:
    """The contract in numbers, independent of torch: round to nearest even, fp16 overflow to
    ±Inf from 65520 on, subnormals kept, -0.0 kept, NaN stays NaN."""
    two = 2.0
    cases = {
        (torch.float32, torch.float16): [
            (65504.0, 65504.0), (65519.99, 65504.0), (65520.0, float("inf")),
            (-1e5, float("-inf")), (1 + two**-11, 1.0), (1 + 3 * two**-11, 1 + two**-9),
            (two**-25, 0.0), (3 * two**-25, two**-23), (two**-24, two**-24), (-0.0, -0.0),
        ],
        (torch.float32, torch.bfloat16): [
            (1 + two**-8, 1.0), (1 + 3 * two**-8, 1 + two**-6),
            (1 + two**-8 + two**-20, 1 + two**-7),
            (3.4028234663852886e38, float("inf")), (two**-130 + two**-140, two**-130),
            (two**-133 * 1.5, two**-132), (-0.0, -0.0),
        ],
        (torch.bfloat16, torch.float16): [
            (65536.0, float("inf")), (65280.0, 65280.0), (two**-25, 0.0), (3 * two**-26, two**-24),
        ],
        (torch.float16, torch.bfloat16): [
            (1 + two**-8, 1.0), (1 + 3 * two**-8, 1 + two**-6), (65504.0, 65536.0),
        ],
    }  # fmt: skip
    for (src, cache), pairs in cases.items():
        x = torch.tensor([p[0] for p in pairs] + [float("nan")], dtype=torch.float64)
        want = torch.tensor([p[1] for p in pairs] + [float("nan")], dtype=torch.float64)
        d = x.numel()
        key = x.to(torch.float32).to(src).view(1, 1, d)
        key_cache = torch.zeros(1, 1, 1, d, dtype=cache)
        value_cache = torch.zeros_like(key_cache)
        one = torch.ones(1)
        slots = torch.zeros(1, dtype=torch.int64)
        ops.reshape_and_cache_flash(key, key, key_cache, value_cache, slots, "auto", one, one)
        got = key_cache.flatten().double()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got.signbit()[:-1], want.signbit()[:-1])  # -0.0 kept


@pytest.mark.parametrize("src,cache", PAIRS, ids=_id)
def test_fake_impl_accepts_every_pair(src: torch.dtype, cache: torch.dtype) -> None:
    case = make_case("cpu", NAMES[cache], src, cache_dtype=cache, num_tokens=8)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args()]
    torch.ops._C_cache_ops.reshape_and_cache_flash(*meta)
    meta[5] = "auto"
    torch.ops._C_cache_ops.reshape_and_cache_flash(*meta)


@pytest.mark.parametrize(
    "src,cache", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)], ids=_id
)
def test_opcheck_cast(src: torch.dtype, cache: torch.dtype) -> None:
    case = make_case("cpu", "auto", src, cache_dtype=cache, num_tokens=8, row_padding=3)
    torch.library.opcheck(torch.ops._C_cache_ops.reshape_and_cache_flash.default, case.args())


def _mutations():
    f64 = torch.float64
    return [
        ("value_dtype", "auto", lambda c: setattr(c, "value", c.value.half()),
         r"value: expected dtype float32 \(key's dtype\), got float16"),
        ("key_float64", "fp8", lambda c: (setattr(c, "key", c.key.to(f64)),
                                          setattr(c, "value", c.value.to(f64))),
         r"key: expected dtype float32, float16 or bfloat16, got float64"),
        ("auto_cache_float64", "auto",
         lambda c: (setattr(c, "key_cache", c.key_cache.to(f64)),
                    setattr(c, "value_cache", c.value_cache.to(f64))),
         r"key_cache: expected dtype float32, float16 or bfloat16 for kv_cache_dtype 'auto', "
         r"got float64"),
        ("auto_sides_differ", "auto", lambda c: setattr(c, "value_cache", c.value_cache.half()),
         r"value_cache: expected dtype bfloat16 \(key_cache's dtype\), got float16"),
        ("named_cache_dtype", "float16", lambda c: None,
         r"key_cache: expected dtype float16 for kv_cache_dtype 'float16', got bfloat16"),
        ("fp8_cache_dtype", "fp8", lambda c: setattr(c, "key_cache", c.key_cache.view(torch.int8)),
         r"key_cache: expected dtype uint8 for kv_cache_dtype 'fp8', got int8"),
        ("slot_mapping_float", "auto",
         lambda c: setattr(c, "slot_mapping", c.slot_mapping.float() + 0.7),
         r"slot_mapping: expected dtype int64, got float32"),
        ("slot_mapping_int32", "nvfp4",
         lambda c: setattr(c, "slot_mapping", c.slot_mapping.int()),
         r"slot_mapping: expected dtype int64, got int32"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kind,mutate,message", [m[1:] for m in _mutations()], ids=[m[0] for m in _mutations()]
)
def test_fake_and_op_reject_the_same_dtypes(kind, mutate, message) -> None:
    """One dtype rule: the compiled op and the fake impl (all-meta call) give the same error."""
    case = make_case("cpu", "auto" if kind == "float16" else kind, torch.float32,
                     cache_dtype=torch.bfloat16, num_tokens=8)  # fmt: skip
    case.kv_cache_dtype = kind
    mutate(case)
    before = case.snapshot()
    with pytest.raises(RuntimeError, match=message):
        case.run()
    assert all(torch.equal(b, a) for b, a in zip(case.buffers, before, strict=True))
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args()]
    with pytest.raises(RuntimeError, match=message):
        torch.ops._C_cache_ops.reshape_and_cache_flash(*meta)


def _attention_reference(query, key_cache, value_cache, table, seq_len, scale):
    """fp64 causal attention of the last `query` tokens over one sequence's pages."""
    n = key_cache.shape[1]
    pages = table[: (seq_len + n - 1) // n].long()
    k = key_cache[pages].flatten(0, 1)[:seq_len].double()  # [S, Hkv, D]
    v = value_cache[pages].flatten(0, 1)[:seq_len].double()
    q = query.double()
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, k) * scale
    pos = torch.arange(seq_len - t, seq_len).view(-1, 1)
    logits = logits.masked_fill(torch.arange(seq_len).view(1, -1) > pos, float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), v)


@pytest.mark.parametrize("query_dtype,cache", PAIRS, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_cpu_attention_query_of_any_float_dtype(
    query_dtype: torch.dtype, cache: torch.dtype, hnd: bool
) -> None:
    """CPU_ATTN reads an unquantized cache with a query of any float dtype (widened in the
    kernel) and writes the output in the query's dtype."""
    gen = torch.Generator().manual_seed(3)
    seq_len, q_len, hkv, hq, d, n = 45, 5, 2, 4, 64, 16
    blocks = 5
    shape = (blocks, hkv, n, d) if hnd else (blocks, n, hkv, d)
    sides = [torch.randn(shape, generator=gen).to(cache) for _ in range(2)]
    if hnd:
        sides = [s.transpose(1, 2) for s in sides]
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    query = torch.randn(q_len, hq, d, generator=gen).to(query_dtype)
    out = torch.empty(q_len, hq, d, dtype=query_dtype)
    one = torch.ones(1)
    scale = d**-0.5
    ops.paged_attention(
        out, query, sides[0], sides[1], table, torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, q_len], dtype=torch.int32), "auto", one, one, scale,
    )  # fmt: skip
    expected = _attention_reference(query, sides[0], sides[1], table[0], seq_len, scale)
    tol = 1e-4 if query_dtype == torch.float32 else 2e-2
    assert out.dtype == query_dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
