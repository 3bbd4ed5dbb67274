"""``vllm._custom_ops.concat_and_cache_mla`` for the unquantized, FP8 and ``fp8_ds_mla`` caches
(``nvfp4_ds_mla``: tests/v1/attention/test_mla_nvfp4_ds_mla.py).

Upstream's ``test_concat_and_cache_mla`` / ``test_concat_and_cache_ds_mla`` /
``test_concat_and_cache_ds_mla_nope`` are CUDA-only; their checks run here on the CPU, plus the
error paths upstream's C++ checks cover (here: ``ValueError`` before anything is written).
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant.fp8 import dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

NUM_TOKENS, NUM_BLOCKS, BLOCK_SIZE, ROPE = 42, 8, 16, 64


def _inputs(
    rank: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(NUM_TOKENS, rank, generator=gen).to(dtype)
    k_pe = torch.randn(NUM_TOKENS, ROPE, generator=gen).to(dtype)
    slots = random.Random(seed).sample(range(NUM_BLOCKS * BLOCK_SIZE), NUM_TOKENS)
    return kv_c, k_pe, torch.tensor(slots, dtype=torch.int64)


def _reference_rows(kv_c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    ref = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_c.shape[1] + ROPE, dtype=kv_c.dtype)
    for i, slot in enumerate(slots.tolist()):
        ref[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = torch.cat([kv_c[i], k_pe[i]])
    return ref


@pytest.mark.parametrize("rank", [256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_upstream_concat_and_cache_mla_on_cpu(
    rank: int, dtype: torch.dtype, kv_cache_dtype: str
) -> None:
    kv_c, k_pe, slots = _inputs(rank, dtype)
    scale = torch.tensor(0.1, dtype=torch.float32)
    ref = _reference_rows(kv_c, k_pe, slots)
    cache_dtype = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, rank + ROPE, dtype=cache_dtype)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)
    if kv_cache_dtype == "auto":
        torch.testing.assert_close(cache, ref, rtol=0, atol=0)
        return
    ref_bytes = torch.empty_like(ref, dtype=torch.uint8)
    ops.convert_fp8(ref_bytes, ref, scale.item(), kv_dtype=kv_cache_dtype)
    assert torch.equal(cache, ref_bytes)  # upstream compares dequantized values; bytes are equal
    got, want = torch.empty_like(ref), torch.empty_like(ref)
    ops.convert_fp8(got, cache, scale.item(), kv_dtype=kv_cache_dtype)
    ops.convert_fp8(want, ref_bytes, scale.item(), kv_dtype=kv_cache_dtype)
    torch.testing.assert_close(got, want, atol=0.001, rtol=0.1)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_variants_skip_scale_and_float8_caches(kv_cache_dtype: str) -> None:
    kv_c, k_pe, slots = _inputs(512, torch.float16, seed=1)
    ref = _reference_rows(kv_c, k_pe, slots)
    one = torch.ones(1, dtype=torch.float32)
    want = quantize_fp8(ref, one, kv_cache_dtype)
    cache = torch.zeros_like(ref, dtype=torch.uint8)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, torch.tensor(9.0), True)
    assert torch.equal(cache, want)  # skip_scale: the scale (even a bad one) is not used
    f8 = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    typed = torch.zeros_like(ref, dtype=f8)
    ops.concat_and_cache_mla(kv_c, k_pe, typed, slots, kv_cache_dtype, one)
    assert torch.equal(typed.view(torch.uint8), want)


def test_auto_rounds_to_the_cache_dtype_and_named_dtypes_need_theirs() -> None:
    kv_c, k_pe, slots = _inputs(256, torch.float32, seed=2)
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 256 + ROPE, dtype=torch.bfloat16)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", torch.tensor(1.0))
    assert torch.equal(cache, _reference_rows(kv_c, k_pe, slots).to(torch.bfloat16))
    with pytest.raises(ValueError, match="kv_cache: expected dtype float16 for kv_cache_dtype"):
        ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "float16", torch.tensor(1.0))


def _ds_mla_reference(
    kv_c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Upstream's test reference: per 128-value tile, the scale ``2^ceil(log2(max(amax / 448,
    1e-4)))`` (amax by a Python loop), e4m3 of ``x / scale`` by ``convert_fp8``, the fp32 scales
    at float index 128.., the RoPE as 16-bit words after them."""
    ref = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 656, dtype=torch.uint8)
    for i, slot in enumerate(slots.tolist()):
        entry = ref[slot // BLOCK_SIZE, slot % BLOCK_SIZE]
        for tile in range(4):
            data = kv_c[i, tile * 128 : (tile + 1) * 128]
            values = data.float().tolist()
            amax = abs(values[0])
            for v in values[1:]:
                amax = max(amax, abs(v))
            raw = torch.clamp(torch.tensor(amax, dtype=torch.float32) / 448.0, min=1e-4)
            tile_scale = torch.exp2(torch.ceil(torch.log2(raw)))
            entry.view(torch.float32)[128 + tile] = tile_scale
            ops.convert_fp8(entry[tile * 128 : (tile + 1) * 128], data, tile_scale.item(), "fp8")
        entry.view(dtype)[264:] = k_pe[i]
    return ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upstream_concat_and_cache_ds_mla_on_cpu(dtype: torch.dtype) -> None:
    kv_c, k_pe, slots = _inputs(512, dtype, seed=3)
    kv_c[0, :128] *= 1e-6  # a tile whose scale is the 1e-4 floor
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 656, dtype=torch.uint8)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.tensor(1.0))
    assert torch.equal(cache, _ds_mla_reference(kv_c, k_pe, slots, dtype))


@pytest.mark.parametrize("block_size", [64, 256])
def test_upstream_concat_and_cache_ds_mla_nope_on_cpu(block_size: int) -> None:
    """No RoPE columns: as zero RoPE, the RoPE tail of written rows cleared, other slots kept."""
    slots = torch.tensor([block_size - 1, block_size, -1])
    kv_c = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    one = torch.tensor(1.0)
    cache = torch.full((2, block_size, 656), 0xFF, dtype=torch.uint8)
    ref = cache.clone()
    ops.concat_and_cache_mla(kv_c, kv_c[:, :0], cache, slots, "fp8_ds_mla", one)
    ops.concat_and_cache_mla(kv_c, torch.zeros(3, 64, dtype=torch.bfloat16), ref, slots,
                             "fp8_ds_mla", one)  # fmt: skip
    assert torch.equal(cache, ref)
    rows = cache.view(-1, 656)
    assert (rows[slots[:2], 528:] == 0).all()
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[slots[:2]] = False
    assert (rows[untouched] == 0xFF).all()


def _args(**changes: object) -> dict:
    args: dict = {
        "kv_c": torch.ones(4, 512, dtype=torch.bfloat16),
        "k_pe": torch.ones(4, ROPE, dtype=torch.bfloat16),
        "kv_cache": torch.full((2, 16, 576), 3, dtype=torch.uint8),
        "slot_mapping": torch.arange(4),
        "kv_cache_dtype": "fp8",
        "scale": torch.tensor(1.0),
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype: expected one of .* got 'nvfp4'"),
        ({"kv_cache_dtype": "float32"}, "kv_cache_dtype: expected one of .* got 'float32'"),
        ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype: expected one of"),
        ({"k_pe": torch.ones(4, ROPE, dtype=torch.float16)}, "k_pe: expected dtype bfloat16"),
        ({"kv_c": torch.ones(4, 512, dtype=torch.int32)}, "kv_c: expected dtype float32"),
        ({"kv_c": torch.ones(4, 8, 64, dtype=torch.bfloat16)}, r"kv_c: expected shape \[T, dim\]"),
        ({"kv_cache": torch.zeros(2, 16, 577, dtype=torch.uint8)}, "entry .* of 576"),
        ({"kv_cache": torch.zeros(2, 16, 576, dtype=torch.bfloat16)}, "kv_cache: expected dtype"),
        ({"kv_cache": torch.zeros(2, 16, 576, dtype=torch.uint8)[..., ::2]}, "contiguous entr"),
        ({"scale": torch.tensor([1.0, 2.0])}, r"scale: expected one value"),
        ({"scale": torch.tensor(1.0, dtype=torch.float64)}, "scale: expected a torch.float32"),
        ({"slot_mapping": torch.arange(5)}, "slot_mapping: expected at most 4 entries"),
        ({"slot_mapping": torch.tensor([0, 32])}, "slot_mapping: slot 32 is out of range"),
        ({"kv_cache_dtype": "fp8_ds_mla"}, "entry .* of 656 for kv_cache_dtype 'fp8_ds_mla'"),
        (
            {"kv_cache_dtype": "fp8_ds_mla", "kv_c": torch.ones(4, 512), "k_pe": torch.ones(4, 64)},
            "kv_c: expected dtype float16 or bfloat16 for fp8_ds_mla",
        ),
        (
            {"kv_cache_dtype": "fp8_ds_mla", "k_pe": torch.ones(4, 32, dtype=torch.bfloat16)},
            "k_pe: expected 64 or 0 columns for fp8_ds_mla, got 32",
        ),
        (
            {"kv_cache_dtype": "fp8_ds_mla", "kv_c": torch.ones(4, 448, dtype=torch.bfloat16)},
            r"kv_c: expected shape \[T, 512\] for fp8_ds_mla",
        ),
    ],
)
def test_bad_arguments_raise_before_writing(changes: dict, match: str) -> None:
    args = _args(**changes)
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=match):
        ops.concat_and_cache_mla(**args)
    assert torch.equal(args["kv_cache"], before)


def test_inputs_must_be_on_the_cache_device() -> None:
    args = _args(k_pe=torch.ones(4, ROPE, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="k_pe: expected device cpu .kv_cache's., got meta"):
        ops.concat_and_cache_mla(**args)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_torch_op_passes_opcheck(kv_cache_dtype: str) -> None:
    """Upstream's tests ``opcheck`` the op by its dispatcher name (schema, fake kernel, AOT)."""
    kv_c, k_pe, slots = _inputs(512, torch.bfloat16, seed=5)
    entry = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_cache_dtype, 512 + ROPE)
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, entry, dtype=dtype)
    args = (kv_c, k_pe, cache, slots, kv_cache_dtype, torch.tensor(0.5))
    torch.library.opcheck(torch.ops._C_cache_ops.concat_and_cache_mla, args)


def _gather_setup(seq_starts: list[int] | None) -> tuple[torch.Tensor, ...]:
    """Requests of 20, 0 and 37 tokens in a 576-entry cache of 16 blocks of 16 slots, each
    through its own random block table; the expected rows, found one token at a time."""
    gen = torch.Generator().manual_seed(7)
    lens = [20, 0, 37]
    cu = torch.tensor([0, 20, 20, 57], dtype=torch.int32)
    table = torch.stack([torch.randperm(16, generator=gen) for _ in lens]).to(torch.int32)
    starts = None if seq_starts is None else torch.tensor(seq_starts, dtype=torch.int32)
    expected = [
        (int(table[r, t // 16]), t % 16)
        for r, n in enumerate(lens)
        for t in range(
            0 if starts is None else int(starts[r]), n + (0 if starts is None else int(starts[r]))
        )
    ]
    return cu, table, starts, torch.tensor(expected)


@pytest.mark.parametrize("seq_starts", [None, [3, 9, 17]])
def test_cp_gather_cache_copies_each_requests_entries(seq_starts: list[int] | None) -> None:
    cu, table, starts, where = _gather_setup(seq_starts)
    src = torch.randn(16, 16, 576, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    dst = torch.zeros(int(cu[-1]) + 2, 576, dtype=torch.bfloat16)  # two rows past the last
    ops.cp_gather_cache(src, dst, table, cu, 3, starts)
    assert torch.equal(dst[:-2], src[where[:, 0], where[:, 1]])
    assert not dst[-2:].any()
    torch.library.opcheck(torch.ops._C_cache_ops.cp_gather_cache, (src, dst, table, cu, 3, starts))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_gather_and_maybe_dequant_cache_reads_what_concat_wrote(kv_cache_dtype: str) -> None:
    """Write every slot through ``concat_and_cache_mla``, gather with ``seq_starts``: each row
    is its slot's entry, dequantized as ``fp8 * scale``."""
    cu, table, starts, where = _gather_setup([3, 9, 17])
    gen = torch.Generator().manual_seed(9)
    kv_c = torch.randn(256, 512, generator=gen)
    k_pe = torch.randn(256, ROPE, generator=gen)
    scale = torch.tensor(0.25)
    quantized = kv_cache_dtype != "auto"
    cache = torch.zeros(16, 16, 576, dtype=torch.uint8 if quantized else torch.float32)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(256), kv_cache_dtype, scale)
    dst = torch.zeros(int(cu[-1]), 576)
    token_to_seq = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), cu.diff())
    ops.gather_and_maybe_dequant_cache(
        cache, dst, table, cu, token_to_seq, dst.shape[0], kv_cache_dtype, scale, starts
    )
    rows = torch.cat([kv_c, k_pe], dim=-1)[where[:, 0] * 16 + where[:, 1]]
    if quantized:
        rows = dequantize_fp8(quantize_fp8(rows, scale, kv_cache_dtype), scale, kv_cache_dtype)
    assert torch.equal(dst, rows)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"kv_cache_dtype": "fp8_ds_mla"}, "kv_cache_dtype: expected one of auto, .* 'fp8_ds_mla'"),
        ({"src_cache": torch.zeros(4, 16, 576)}, "src_cache: expected dtype uint8 for kv_cache"),
        ({"dst": torch.zeros(8, 512)}, r"dst: expected shape \[total_tokens, \*entry\]"),
        ({"dst": torch.zeros(8, 576, dtype=torch.int32)}, "dst: expected dtype float32, float16"),
        (
            {"block_table": torch.zeros(1, 4, dtype=torch.int64)},
            "block_table: expected dtype int32",
        ),
        ({"cu_seq_lens": torch.tensor([0, 8.0])}, "cu_seq_lens: expected dtype int32"),
        (
            {"seq_starts": torch.zeros(1, device="meta", dtype=torch.int32)},
            "seq_starts: expected device cpu",
        ),
        ({"scale": torch.tensor([1.0, 2.0])}, "scale: expected one value"),
    ],
)
def test_gather_bad_arguments_raise_before_writing(changes: dict, match: str) -> None:
    args: dict = {
        "src_cache": torch.zeros(4, 16, 576, dtype=torch.uint8),
        "dst": torch.full((8, 576), 5.0),
        "block_table": torch.zeros(1, 4, dtype=torch.int32),
        "cu_seq_lens": torch.tensor([0, 8], dtype=torch.int32),
        "token_to_seq": torch.zeros(8, dtype=torch.int32),
        "num_tokens": 8,
        "kv_cache_dtype": "fp8",
        "scale": torch.tensor(1.0),
        "seq_starts": None,
        **changes,
    }
    before = args["dst"].clone()
    with pytest.raises(ValueError, match=match):
        ops.gather_and_maybe_dequant_cache(**args)
    assert torch.equal(args["dst"], before)


def test_cp_gather_cache_keeps_the_cache_dtype() -> None:
    src = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    dst = torch.full((8, 576), 5.0)
    table, cu = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="dst: expected dtype bfloat16 .src_cache's., got float32"):
        ops.cp_gather_cache(src, dst, table, cu, 1)
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[0, 1\]"):
        ops.cp_gather_cache(src, dst.bfloat16(), table, cu, 2)
    assert (dst == 5.0).all()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_empty_batches_and_a_layer_view_of_a_shared_tensor(kv_cache_dtype: str) -> None:
    """No tokens writes nothing; a cache that is one layer's strided view of a bigger tensor
    gets only its own slots written."""
    entry = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_cache_dtype, 512 + ROPE)
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    layers = torch.zeros(2, 3, 16, entry, dtype=dtype)
    cache = layers[:, 1]
    one = torch.tensor(1.0)
    empty = torch.zeros(0, 512, dtype=torch.bfloat16), torch.zeros(0, ROPE, dtype=torch.bfloat16)
    ops.concat_and_cache_mla(*empty, cache, torch.zeros(0, dtype=torch.int64), kv_cache_dtype, one)
    assert not layers.any()
    kv_c, k_pe, _ = _inputs(512, torch.bfloat16, seed=6)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 17, -1]), kv_cache_dtype, one)
    assert not layers[:, 0].any() and not layers[:, 2].any()
    written = (cache.reshape(-1, entry) != 0).any(dim=-1)
    assert written.nonzero().flatten().tolist() == [0, 17]
