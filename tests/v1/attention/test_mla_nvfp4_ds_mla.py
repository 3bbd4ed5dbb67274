"""``nvfp4_ds_mla`` on the MLA paths: upstream's cache ops (``vllm._custom_ops``), the MLA
backend's cache shape and the latent spec's page size.

The op is the codec (:mod:`vllm.kv_quant.ds_mla_nvfp4`) byte for byte; the upstream checks of
``test_concat_and_cache_nvfp4_ds_mla`` (CUDA-only upstream) run here on the CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant.ds_mla_nvfp4 import (
    NVFP4_DS_MLA,
    concat_and_cache_nvfp4_ds_mla,
    nvfp4_ds_mla_decode,
)
from vllm.kv_quant.modes import KVQuantMode
from vllm.v1.attention.backends.mla.common import MLACommonBackend
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.kv_cache_interface import MLAAttentionSpec

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DTYPE = "nvfp4_ds_mla"
ENTRY = 352
RANK, ROPE = 512, 64
NUM_BLOCKS, BLOCK_SIZE, NUM_TOKENS = 8, 16, 42
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _inputs(seed: int = 0, tokens: int = NUM_TOKENS) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(tokens, RANK, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(tokens, ROPE, generator=gen).to(torch.bfloat16)
    slots = random.Random(seed).sample(range(NUM_BLOCKS * BLOCK_SIZE), tokens)
    return kv_c, k_pe, torch.tensor(slots, dtype=torch.int64)


def _cache(fill: int = 0) -> torch.Tensor:
    return torch.full((NUM_BLOCKS, BLOCK_SIZE, ENTRY), fill, dtype=torch.uint8)


def _scale() -> torch.Tensor:
    return torch.tensor(1.0, dtype=torch.float32)


def test_op_writes_the_codec_bytes_and_keeps_other_slots() -> None:
    kv_c, k_pe, slots = _inputs()
    slots[5] = -1  # padding: skipped
    cache, ref = _cache(0xA5), _cache(0xA5)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, DTYPE, _scale())
    concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, ref, slots)
    assert torch.equal(cache, ref)
    rows = cache.view(-1, ENTRY)
    written = torch.zeros(rows.shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (rows[~written] == 0xA5).all()
    assert not (rows[written] == 0xA5).all(dim=-1).any()


def test_padded_inputs_write_only_the_mapped_tokens() -> None:
    kv_c, k_pe, slots = _inputs(1)
    cache, ref = _cache(), _cache()
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots[:10], DTYPE, _scale())
    ops.concat_and_cache_mla(kv_c[:10], k_pe[:10], ref, slots[:10], DTYPE, _scale())
    assert torch.equal(cache, ref)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1).long()
    magnitude = torch.tensor(E2M1_VALUES)[codes & 0x7]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def test_upstream_concat_and_cache_nvfp4_ds_mla_checks_on_cpu() -> None:
    """Upstream's per-entry checks: scale bytes within one e4m3 code of
    ``e4m3(max(amax_16 / 6, 2^-9))``, NoPE within ``1.5 * sf``, RoPE plain e4m3."""
    kv_c, k_pe, slots = _inputs(2)
    cache = _cache()
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, DTYPE, _scale())
    nope_bytes, sf_off = RANK // 2, RANK // 2 + ROPE
    for i, slot in enumerate(slots.tolist()):
        entry = cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]
        x, pe = kv_c[i].float(), k_pe[i].float()
        stored = entry[sf_off:].unflatten(-1, (4, 8)).transpose(-1, -2).flatten()
        sf = torch.clamp(x.reshape(-1, 16).abs().amax(dim=1) / 6.0, min=2.0**-9)
        ref_sf = sf.to(torch.float8_e4m3fn).view(torch.uint8)
        assert (stored.to(torch.int16) - ref_sf.to(torch.int16)).abs().max() <= 1
        per_elem = stored.view(torch.float8_e4m3fn).float().repeat_interleave(16)
        nope = _unpack_e2m1(entry[:nope_bytes]) * per_elem
        assert ((nope - x).abs() <= 1.5 * per_elem).all()
        rope = entry[nope_bytes:sf_off].view(torch.float8_e4m3fn).float()
        assert ((rope - pe).abs() <= pe.abs() * 2.0**-3 + 2.0**-9).all()


def test_write_then_gather_round_trip() -> None:
    """Two requests written through the op, read back through upstream's gather op into a bf16
    workspace: each row is the decoded record of its token."""
    gen = torch.Generator().manual_seed(3)
    lens = [21, 9]
    tables = [[5, 2], [7, 0]]  # request r's token t lives in block tables[r][t // 16]
    block_table = torch.tensor(tables, dtype=torch.int32)
    cache = _cache()
    originals = []
    for r, n in enumerate(lens):
        kv_c = torch.randn(n, RANK, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn(n, ROPE, generator=gen).to(torch.bfloat16)
        slots = torch.tensor(
            [tables[r][t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(n)]
        )
        ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, DTYPE, _scale())
        originals.append(torch.cat([kv_c, k_pe], dim=-1))
    dst = torch.full((sum(lens), RANK + ROPE), float("nan"), dtype=torch.bfloat16)
    starts = torch.tensor([0, lens[0]], dtype=torch.int32)
    ops.cp_gather_and_upconvert_nvfp4_kv_cache(cache, dst, block_table, starts, 2)
    rows = [
        cache[tables[r][t // BLOCK_SIZE], t % BLOCK_SIZE]
        for r, n in enumerate(lens)
        for t in range(n)
    ]
    assert torch.equal(dst, nvfp4_ds_mla_decode(torch.stack(rows)))
    err = dst[:, :RANK].float() - torch.cat(originals)[:, :RANK].float()
    assert err.abs().max() < 1.0  # randn values: a block scale is at most ~0.75


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_c": torch.zeros(4, 256, dtype=torch.bfloat16)}, r"kv_c: expected shape \[T, 512\]"),
        ({"k_pe": torch.zeros(4, 32, dtype=torch.bfloat16)}, r"k_pe: expected shape \[T, 64\]"),
        (
            {"kv_c": torch.zeros(4, RANK), "k_pe": torch.zeros(4, ROPE)},
            "kv_c: expected a torch.bfloat16 tensor, got",
        ),
        ({"kv_c": torch.zeros(4, RANK)}, r"k_pe: expected dtype float32 \(kv_c's\)"),
        ({"cache": torch.zeros(2, 16, 656, dtype=torch.uint8)}, "last dim of 352 bytes"),
        ({"cache": torch.zeros(2, 16, ENTRY, dtype=torch.bfloat16)}, "kv_cache: expected a "),
        ({"cache": torch.zeros(32, ENTRY, dtype=torch.uint8)}, r"kv_cache: expected shape"),
        ({"dtype": "nvfp4"}, "kv_cache_dtype: expected one of auto, .*nvfp4_ds_mla.*'nvfp4'"),
        ({"dtype": "no_such_dtype"}, "kv_cache_dtype: expected one of .*'no_such_dtype'"),
        ({"slots": torch.tensor([0, 1, 2, 32])}, "slot_mapping: slot 32 is out of range"),
        ({"slots": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping: expected an int64"),
    ],
)
def test_bad_arguments_raise_before_writing(kwargs: dict, match: str) -> None:
    args = {
        "kv_c": torch.ones(4, RANK, dtype=torch.bfloat16),
        "k_pe": torch.ones(4, ROPE, dtype=torch.bfloat16),
        "cache": torch.full((2, 16, ENTRY), 7, dtype=torch.uint8),
        "slots": torch.arange(4),
        "dtype": DTYPE,
        **kwargs,
    }
    before = args["cache"].clone()
    with pytest.raises(ValueError, match=match):
        ops.concat_and_cache_mla(
            args["kv_c"], args["k_pe"], args["cache"], args["slots"], args["dtype"], _scale()
        )
    assert torch.equal(args["cache"], before)


def test_mla_backend_shape_and_dtype_list() -> None:
    assert DTYPE in MLACommonBackend.supported_kv_cache_dtypes
    assert MLACommonBackend.get_kv_cache_shape(9, 64, 1, 576, cache_dtype_str=DTYPE) == (
        9,
        64,
        ENTRY,
    )
    with pytest.raises(ValueError, match="head_size: the nvfp4_ds_mla record is defined for"):
        MLACommonBackend.get_kv_cache_shape(9, 64, 1, 512, cache_dtype_str=DTYPE)
    # What upstream's MLA layer passes: the uint8 storage dtype, with or without the record size.
    common = dict(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8)
    named = MLAAttentionSpec(**common, cache_dtype_str=DTYPE)
    packed = MLAAttentionSpec(
        **common, cache_dtype_str=DTYPE, kv_quant_mode=KVQuantMode.NVFP4_DS_MLA,
        state_content_bytes=ENTRY,
    )  # fmt: skip
    assert named.page_size_bytes == packed.page_size_bytes == 64 * ENTRY
    # The record's bytes whatever the model dtype the spec names (as fp8_ds_mla's).
    model_dtype = MLAAttentionSpec(**{**common, "dtype": torch.bfloat16}, cache_dtype_str=DTYPE)
    assert model_dtype.page_size_bytes == 64 * ENTRY
    assert named.kv_cache_format is NVFP4_DS_MLA is packed.kv_cache_format
    # A flat row view of the cache (sparse MLA) needs whole 352-byte rows per block stride.
    assert align_blocks_to_rows(packed).block_stride_alignment == ENTRY


def test_gather_op_passes_opcheck_and_refuses_meta_arguments() -> None:
    kv_c, k_pe, _ = _inputs(6, tokens=20)
    cache = _cache()
    ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(20) + 16, DTYPE, _scale())
    dst = torch.zeros(20, RANK + ROPE, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    starts = torch.zeros(1, dtype=torch.int32)
    op = torch.ops._C_cache_ops.cp_gather_and_upconvert_nvfp4_kv_cache
    torch.library.opcheck(op, (cache, dst, table, starts, 1))
    with pytest.raises(ValueError, match="src_cache: expected device cpu .dst's., got meta"):
        ops.cp_gather_and_upconvert_nvfp4_kv_cache(cache.to("meta"), dst, table, starts, 1)
