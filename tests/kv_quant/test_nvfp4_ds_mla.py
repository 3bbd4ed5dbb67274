"""The ``nvfp4_ds_mla`` record (352 bytes per token): registry entry, page math, and the codec's
bytes against an independent scalar oracle transcribed from upstream's CUDA writer (IEEE fp32
steps in numpy, e4m3 and e2m1 rounding by nearest-value search), on random and edge inputs;
plus upstream test_cache.py's own checks of the record, run on CPU through our writer."""

import random

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops
from vllm.config.cache import CacheConfig
from vllm.kv_quant.ds_mla_nvfp4 import (
    NVFP4_DS_MLA_RECORD_BYTES,
    concat_and_cache_nvfp4_ds_mla,
    cp_gather_and_upconvert_nvfp4_kv_cache,
    nvfp4_ds_mla_decode,
    nvfp4_ds_mla_encode,
    scale_byte_of_block,
)
from vllm.kv_quant.formats import KVQuantMode, kernel_cache_kind, lookup
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_FINITE = [_e4m3_value(b) for b in range(0x7F)]  # 0x7F is NaN


def _nearest_even(a: float, grid: list[float] | tuple[float, ...]) -> int:
    """Index of the grid value nearest ``a``; a tie goes to the even index (even mantissa)."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - a), i % 2))
    return best


def _e4m3_byte(v: np.float32) -> int:
    if np.isnan(v):
        return 0x7F
    sign = 0x80 if np.signbit(v) else 0
    a = float(abs(v))
    return sign | (0x7E if a >= 448.0 else _nearest_even(a, E4M3_FINITE))


def _e2m1_code(v: np.float32) -> int:
    sign = 8 if np.signbit(v) else 0
    a = float(abs(v))
    return sign | (7 if a >= 6.0 else _nearest_even(a, E2M1))


def _oracle_record(kv_c: torch.Tensor, k_pe: torch.Tensor) -> list[int]:
    """One token's 352 bytes, step by step as upstream's kernel computes them."""
    x = kv_c.float().numpy().astype(np.float32)
    record = [0] * NVFP4_DS_MLA_RECORD_BYTES
    for s in range(32):
        block = x[16 * s : 16 * s + 16]
        amax = np.float32(0.0)
        for v in block:
            if not np.isnan(v):
                amax = max(amax, np.float32(abs(v)))
        sf_f = max(np.float32(amax / np.float32(6.0)), np.float32(2.0**-9))
        sf_byte = _e4m3_byte(np.float32(sf_f))
        inv = np.float32(1.0) / np.float32(_e4m3_value(sf_byte))
        codes = [_e2m1_code(np.float32(v * inv)) for v in block]
        for j in range(8):
            record[8 * s + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
        record[320 + 8 * (s % 4) + s // 4] = sf_byte
    for i, v in enumerate(k_pe.float().numpy().astype(np.float32)):
        record[256 + i] = _e4m3_byte(v)
    return record


def _edge_latents() -> torch.Tensor:
    """Blocks on every e2m1 tie (block amax 6 gives scale 1), zeros of both signs, values below
    the scale floor, bf16's largest value, infinities, and a block whose amax / 6 is an e4m3 tie."""
    rows = torch.zeros(3, 512)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[0, :16] = torch.cat([ties, -ties])
    rows[0, 16:32] = -0.0
    rows[0, 32:48] = torch.linspace(-1e-4, 1e-4, 16)
    rows[0, 48:64] = 3.3895e38
    rows[0, 64:80] = torch.randn(16)
    rows[0, 64] = float("inf")
    rows[0, 80:96] = torch.randn(16)
    rows[0, 80] = -float("inf")
    rows[0, 96:112] = 6.0 * 1.0625  # amax / 6 halfway between e4m3 1.0 and 1.125
    rows[1] = torch.randn(512) * 1e3
    rows[2] = torch.randn(512) * 1e-3
    return rows.bfloat16()


@pytest.mark.parametrize("source", ["random", "edge"])
def test_encode_matches_the_oracle_byte_for_byte(source: str) -> None:
    torch.manual_seed(0)
    if source == "random":
        kv_c = (torch.randn(6, 512) * torch.logspace(-3, 2, 6)[:, None]).bfloat16()
        k_pe = (torch.randn(6, 64) * 4).bfloat16()
    else:
        kv_c = _edge_latents()
        k_pe = torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-4, 2.0**-10, 0.1, -3.0] * 8)
        k_pe = k_pe.repeat(3, 1).bfloat16()
    got = nvfp4_ds_mla_encode(kv_c, k_pe)
    assert got.shape == (kv_c.shape[0], 352) and got.dtype == torch.uint8
    for t in range(kv_c.shape[0]):
        assert got[t].tolist() == _oracle_record(kv_c[t], k_pe[t]), f"token {t}"


def test_ties_round_to_even_and_saturate() -> None:
    kv_c = _edge_latents()[:1]
    record = nvfp4_ds_mla_encode(kv_c, torch.zeros(1, 64, dtype=torch.bfloat16))[0]
    assert record[320 + scale_byte_of_block(0)] == 0x38  # e4m3 1.0
    codes = [(b >> k) & 0xF for b in record[:8].tolist() for k in (0, 4)]
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, 6; then the negatives
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    assert record[:8].tolist() == [0x20, 0x42, 0x64, 0x76, 0xA8, 0xCA, 0xEC, 0xFE]  # docs' example
    assert record[320 + scale_byte_of_block(1)] == 0x01  # all -0.0: the 2^-9 floor
    assert record[8:16].tolist() == [0x88] * 8  # -0.0 keeps its sign
    assert record[320 + scale_byte_of_block(3)] == 0x7E  # huge block: scale saturates at 448
    assert record[320 + scale_byte_of_block(6)] == 0x38  # 1.0625 ties to the even 1.0


def test_amax_skips_nan() -> None:
    kv_c = torch.ones(1, 512)
    kv_c[0, 3] = float("nan")
    record = nvfp4_ds_mla_encode(kv_c.bfloat16(), torch.zeros(1, 64, dtype=torch.bfloat16))[0]
    assert record[320] == _e4m3_byte(np.float32(1.0 / 6.0))  # the NaN does not reach amax
    # every other value is the block's amax: code 6, so 6 * scale back
    assert record[2:8].eq(0x77).all()


def test_decode_is_exact_and_scale_bytes_are_permuted() -> None:
    torch.manual_seed(1)
    kv_c = torch.randn(5, 512).bfloat16()
    k_pe = torch.randn(5, 64).bfloat16()
    records = nvfp4_ds_mla_encode(kv_c, k_pe)
    out = nvfp4_ds_mla_decode(records)
    assert out.shape == (5, 576) and out.dtype == torch.bfloat16
    # Independent decode: e2m1 value times the scale found at the permuted byte.
    for t in range(2):
        for i in range(0, 512, 37):
            code = (records[t, i // 2].item() >> (4 * (i % 2))) & 0xF
            value = (-1.0 if code & 8 else 1.0) * E2M1[code & 7]
            sf = _e4m3_value(records[t, 320 + 8 * ((i // 16) % 4) + (i // 16) // 4].item())
            assert out[t, i].item() == value * sf
    assert torch.equal(out[:, 512:], k_pe.float().to(torch.float8_e4m3fn).float().bfloat16())
    assert sorted(scale_byte_of_block(s) for s in range(32)) == list(range(32))
    assert [scale_byte_of_block(s) for s in (0, 1, 4, 31)] == [0, 8, 1, 31]


def _ref_sf_bytes(vals: torch.Tensor) -> torch.Tensor:
    """upstream test_cache.py's reference: e4m3(max(amax_per_16 / 6, 2^-9)), block order."""
    sf = torch.clamp(vals.float().reshape(-1, 16).abs().amax(dim=1) / 6.0, min=2.0**-9)
    return sf.to(torch.float8_e4m3fn).view(torch.uint8)


def test_upstream_cache_checks_on_cpu() -> None:
    """upstream's test_concat_and_cache_nvfp4_ds_mla (CUDA SM100 only there), on our writer."""
    random.seed(0)
    torch.manual_seed(0)
    num_tokens, block_size, num_blocks = 42, 16, 8
    slots = random.sample(range(num_blocks * block_size), num_tokens)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    kv_c = torch.randn(num_tokens, 512, dtype=torch.bfloat16)
    k_pe = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    kv_cache = torch.zeros(num_blocks, block_size, 352, dtype=torch.uint8)
    concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, kv_cache, slot_mapping)
    for i, slot in enumerate(slots):
        entry = kv_cache[slot // block_size, slot % block_size]
        wire = entry[320:352]
        sf_bytes = wire.unflatten(-1, (4, 8)).transpose(-1, -2).flatten(-2)
        ref = _ref_sf_bytes(kv_c[i])
        assert ((sf_bytes.to(torch.int16) - ref.to(torch.int16)).abs() <= 1).all()
        sf = sf_bytes.view(torch.float8_e4m3fn).float().repeat_interleave(16)
        low, high = entry[:256] & 0xF, entry[:256] >> 4
        codes = torch.stack([low, high], -1).reshape(-1).long()
        mags = torch.tensor(E2M1)[codes & 7] * torch.where(codes & 8 != 0, -1.0, 1.0)
        assert ((mags * sf - kv_c[i].float()).abs() <= 1.5 * sf).all()
        rope = entry[256:320].view(torch.float8_e4m3fn).float()
        tol = k_pe[i].float().abs() * 2.0**-3 + 2.0**-9
        assert ((rope - k_pe[i].float()).abs() <= tol).all()


def test_write_skips_padding_and_gather_reads_back() -> None:
    torch.manual_seed(2)
    kv_c = torch.randn(6, 512).bfloat16()
    k_pe = torch.randn(6, 64).bfloat16()
    cache = torch.randint(0, 256, (4, 4, 352), dtype=torch.uint8)
    before = cache.clone()
    slot_mapping = torch.tensor([5, -1, 0, 15, 6], dtype=torch.long)  # shorter: padded input
    concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, cache, slot_mapping)
    written = torch.zeros(16, dtype=torch.bool)
    written[[5, 0, 15, 6]] = True
    flat, flat_before = cache.view(16, 352), before.view(16, 352)
    assert torch.equal(flat[~written], flat_before[~written])
    records = nvfp4_ds_mla_encode(kv_c, k_pe)
    assert torch.equal(flat[[5, 0, 15, 6]], records[[0, 2, 3, 4]])
    # Two requests: tokens 0..1 in blocks (1, 0) and tokens 0..2 in block 3.
    block_table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32)
    dst = torch.empty(6, 576, dtype=torch.bfloat16)
    cp_gather_and_upconvert_nvfp4_kv_cache(
        cache, dst, block_table, torch.tensor([0, 2], dtype=torch.int32), 2
    )
    expect = nvfp4_ds_mla_decode(cache[[1, 1, 3, 3, 3, 3], [0, 1, 0, 1, 2, 3]])
    assert torch.equal(dst.view(torch.int16), expect.view(torch.int16))  # random bytes: NaNs
    assert torch.equal(
        dst[2:6].view(torch.int16), nvfp4_ds_mla_decode(flat[12:16]).view(torch.int16)
    )


def test_bad_input_is_refused_before_writing() -> None:
    cache = torch.zeros(2, 4, 352, dtype=torch.uint8)
    kv_c, k_pe = torch.zeros(2, 512).bfloat16(), torch.zeros(2, 64).bfloat16()
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="kv_c: expected a torch.bfloat16 tensor, got torch.f"):
        concat_and_cache_nvfp4_ds_mla(kv_c.float(), k_pe, cache, slots)
    with pytest.raises(ValueError, match=r"k_pe: expected shape \[T, 64\], got \[2, 32\]"):
        nvfp4_ds_mla_encode(kv_c, k_pe[:, :32])
    with pytest.raises(ValueError, match="kv_cache: expected a last dim of 352 bytes"):
        concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, torch.zeros(2, 4, 584, dtype=torch.uint8), slots)
    with pytest.raises(ValueError, match="slot_mapping: slot 8 is out of range"):
        concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, cache, torch.tensor([0, 8]))
    assert not cache.any()
    with pytest.raises(ValueError, match="records: expected a torch.uint8 tensor"):
        nvfp4_ds_mla_decode(torch.zeros(352))
    dst = torch.empty(1, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace_starts: expected dtype torch.int32"):
        cp_gather_and_upconvert_nvfp4_kv_cache(cache, dst, table, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[1, 1\], got 2"):
        cp_gather_and_upconvert_nvfp4_kv_cache(cache, dst, table, table[0], 2)


def test_registry_entry_and_page_math() -> None:
    fmt = lookup("nvfp4_ds_mla")
    assert fmt.quant_mode is KVQuantMode.NVFP4_DS_MLA and get_kv_quant_mode("nvfp4_ds_mla") is (
        KVQuantMode.NVFP4_DS_MLA
    )
    assert not fmt.quant_mode.is_nvfp4 and fmt.is_quantized
    assert fmt.storage_dtype == STR_DTYPE_TO_TORCH_DTYPE["nvfp4_ds_mla"] == torch.uint8
    assert fmt.last_dim(576) == 352 and fmt.cache_kind is None
    assert CacheConfig(cache_dtype="nvfp4_ds_mla").cache_dtype == "nvfp4_ds_mla"
    with pytest.raises(ValueError, match="head_size: the nvfp4_ds_mla record is defined for"):
        fmt.last_dim(512)
    with pytest.raises(ValueError, match="format 'nvfp4_ds_mla' has no kernel support"):
        kernel_cache_kind("nvfp4_ds_mla")
    common = dict(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8)
    mode = KVQuantMode.NVFP4_DS_MLA
    named = MLAAttentionSpec(**common, kv_quant_mode=mode, cache_dtype_str="nvfp4_ds_mla")
    # upstream's MLA layer passes the record size as state_content_bytes; both give 64 * 352
    packed = MLAAttentionSpec(**common, kv_quant_mode=mode, state_content_bytes=352)
    assert named.page_size_bytes == packed.page_size_bytes == 64 * 352
    assert named.kv_cache_format is fmt is packed.kv_cache_format
    with pytest.raises(ValueError, match="head_size: the nvfp4_ds_mla record"):
        MLAAttentionSpec(**{**common, "head_size": 512}, kv_quant_mode=mode)
    with pytest.raises(ValueError, match=r"NVFP4 is not a format for MLA .*, nvfp4_ds_mla\)"):
        MLAAttentionSpec(**common, kv_quant_mode=KVQuantMode.NVFP4)


def test_compiled_op_refuses_it() -> None:
    key = torch.zeros(1, 1, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 352, dtype=torch.uint8)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="format 'nvfp4_ds_mla' has no kernel support"):
        ops.reshape_and_cache_flash(
            key, key, cache, cache, torch.zeros(1, dtype=torch.long), "nvfp4_ds_mla", scale, scale
        )
