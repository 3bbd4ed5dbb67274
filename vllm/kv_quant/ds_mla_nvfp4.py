"""Registry entry and pure-torch codec of the ``nvfp4_ds_mla`` KV cache (upstream v0.33's
``KVQuantMode.NVFP4_DS_MLA``): DeepSeek-V3.2's MLA latent (576 = 512 NoPE + 64 RoPE values) as
one opaque 352-byte record per token, shared by all heads.

Record layout (bytes):

- ``[0, 256)``: the 512 NoPE values as E2M1 codes, two per byte, element ``2j`` in byte ``j``'s
  low nibble;
- ``[256, 320)``: the 64 RoPE values as plain FP8-e4m3 (no scale);
- ``[320, 352)``: the 32 FP8-e4m3 block scales of the NoPE, one per 16 values, permuted: the
  scale of values ``[16s, 16s + 16)`` sits at byte ``320 + 8 * (s % 4) + s // 4`` (so that the
  eight scales one decode thread needs are adjacent).

The writer follows upstream's CUDA kernel operation by operation, in fp32: ``amax`` of a block's
16 values (NaN ignored, as ``fmaxf``), ``sf = e4m3(max(amax / 6, 2^-9))`` rounded to nearest
and saturated, ``q = e2m1(x * (1 / float(sf)))`` rounded to nearest even and saturated at 6.
Dequantization ``float(q) * float(sf)`` is exact in bf16 (at most 6 significant bits).

The page is ``block_size * 352`` bytes, whatever the model dtype (upstream keys it on the
dtype string). ``reshape_and_cache_flash`` does not take the format (``cache_kind=None``:
:func:`~vllm.kv_quant.formats.kernel_cache_kind` refuses it); the extension's own writer,
``concat_and_cache_nvfp4_ds_mla`` (``csrc/ds_mla_nvfp4.h``), writes these bytes.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import KVCacheFormat, register_format
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.nvfp4 import (
    E2M1_MAX,
    NVFP4_GROUP_SIZE,
    e2m1_decode,
    e2m1_encode,
    fp32_to_e4m3_satfinite,
    pack_e2m1,
    unpack_e2m1,
)
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

__all__ = [
    "NVFP4_DS_MLA",
    "NVFP4_DS_MLA_HEAD_SIZE",
    "NVFP4_DS_MLA_NOPE_DIM",
    "NVFP4_DS_MLA_RECORD_BYTES",
    "NVFP4_DS_MLA_ROPE_DIM",
    "NVFP4_DS_MLA_SCALE_FLOOR",
    "check_nvfp4_ds_mla_write",
    "concat_and_cache_nvfp4_ds_mla",
    "cp_gather_and_upconvert_nvfp4_kv_cache",
    "nvfp4_ds_mla_decode",
    "nvfp4_ds_mla_encode",
    "nvfp4_ds_mla_record_dim",
    "scale_byte_of_block",
]

NVFP4_DS_MLA_NOPE_DIM = 512
"""NoPE (latent) values per token."""

NVFP4_DS_MLA_ROPE_DIM = 64
"""RoPE values per token."""

NVFP4_DS_MLA_HEAD_SIZE = NVFP4_DS_MLA_NOPE_DIM + NVFP4_DS_MLA_ROPE_DIM
"""The MLA head size the record stores (DeepSeek-V3.2 geometry): 576."""

_NUM_BLOCKS = NVFP4_DS_MLA_NOPE_DIM // NVFP4_GROUP_SIZE  # 32 block scales
_ROPE_OFFSET = NVFP4_DS_MLA_NOPE_DIM // 2  # 256
_SCALE_OFFSET = _ROPE_OFFSET + NVFP4_DS_MLA_ROPE_DIM  # 320

NVFP4_DS_MLA_RECORD_BYTES = _SCALE_OFFSET + _NUM_BLOCKS
"""Bytes per token: 256 E2M1 bytes + 64 e4m3 RoPE bytes + 32 e4m3 scale bytes = 352."""

NVFP4_DS_MLA_SCALE_FLOOR = 2.0**-9
"""Smallest block scale the writer picks (the smallest e4m3 subnormal), so an all-zero block
still has a positive scale."""


def scale_byte_of_block(block: int) -> int:
    """Byte (within the 32 scale bytes) holding the scale of NoPE values
    ``[16 * block, 16 * block + 16)``: an 8x4 to 4x8 transpose."""
    if not 0 <= block < _NUM_BLOCKS:
        raise ValueError(f"block: expected an int in [0, {_NUM_BLOCKS}), got {block}")
    return 8 * (block % 4) + block // 4


_SCALE_BYTE_OF_BLOCK = [scale_byte_of_block(s) for s in range(_NUM_BLOCKS)]


def nvfp4_ds_mla_record_dim(head_size: int) -> int:
    """Bytes of one record (the cache's last dim) for head size ``head_size``: 352 for 576."""
    if head_size != NVFP4_DS_MLA_HEAD_SIZE:
        raise ValueError(
            f"head_size: the nvfp4_ds_mla record is defined for head size "
            f"{NVFP4_DS_MLA_HEAD_SIZE} ({NVFP4_DS_MLA_NOPE_DIM} NoPE + {NVFP4_DS_MLA_ROPE_DIM} "
            f"RoPE, DeepSeek-V3.2), got {head_size}"
        )
    return NVFP4_DS_MLA_RECORD_BYTES


def _check_bf16(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a torch.bfloat16 tensor, got {got}")
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"{name}: expected shape [T, {dim}], got {list(t.shape)}")


def nvfp4_ds_mla_encode(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Records ``[T, 352]`` (uint8) of latents ``kv_c [T, 512]`` and RoPE keys ``k_pe [T, 64]``
    (both bf16, as upstream's kernel requires)."""
    _check_bf16("kv_c", kv_c, NVFP4_DS_MLA_NOPE_DIM)
    _check_bf16("k_pe", k_pe, NVFP4_DS_MLA_ROPE_DIM)
    if k_pe.shape[0] != kv_c.shape[0] or k_pe.device != kv_c.device:
        raise ValueError(
            f"k_pe: expected {kv_c.shape[0]} tokens on {kv_c.device} (kv_c's), "
            f"got {k_pe.shape[0]} on {k_pe.device}"
        )
    x = kv_c.float().reshape(-1, _NUM_BLOCKS, NVFP4_GROUP_SIZE)
    amax = x.abs().nan_to_num(nan=0.0).amax(dim=-1, keepdim=True)  # fmaxf skips NaN
    sf_bytes = fp32_to_e4m3_satfinite(torch.clamp(amax / E2M1_MAX, min=NVFP4_DS_MLA_SCALE_FLOOR))
    inv_sf = 1.0 / sf_bytes.view(torch.float8_e4m3fn).float()
    codes = pack_e2m1(e2m1_encode(x * inv_sf)).reshape(-1, _ROPE_OFFSET)
    rope = fp32_to_e4m3_satfinite(k_pe.float())
    out = torch.empty(kv_c.shape[0], NVFP4_DS_MLA_RECORD_BYTES, dtype=torch.uint8,
                      device=kv_c.device)  # fmt: skip
    out[:, :_ROPE_OFFSET] = codes
    out[:, _ROPE_OFFSET:_SCALE_OFFSET] = rope
    order = torch.tensor(_SCALE_BYTE_OF_BLOCK, device=kv_c.device) + _SCALE_OFFSET
    out[:, order] = sf_bytes.squeeze(-1)
    return out


def _check_records(name: str, records: torch.Tensor) -> None:
    if not isinstance(records, torch.Tensor) or records.dtype != torch.uint8:
        got = records.dtype if isinstance(records, torch.Tensor) else type(records).__name__
        raise ValueError(f"{name}: expected a torch.uint8 tensor, got {got}")
    if records.dim() < 1 or records.shape[-1] != NVFP4_DS_MLA_RECORD_BYTES:
        raise ValueError(
            f"{name}: expected a last dim of {NVFP4_DS_MLA_RECORD_BYTES} bytes, "
            f"got shape {list(records.shape)}"
        )


def nvfp4_ds_mla_decode(records: torch.Tensor) -> torch.Tensor:
    """The bf16 latents ``[..., 576]`` (NoPE then RoPE) of records ``[..., 352]``; exact."""
    _check_records("records", records)
    lead = records.shape[:-1]
    flat = records.reshape(-1, NVFP4_DS_MLA_RECORD_BYTES)
    order = torch.tensor(_SCALE_BYTE_OF_BLOCK, device=records.device) + _SCALE_OFFSET
    sf = flat[:, order].view(torch.float8_e4m3fn).float()
    values = e2m1_decode(unpack_e2m1(flat[:, :_ROPE_OFFSET])).view(-1, _NUM_BLOCKS, 16)
    nope = (values * sf.unsqueeze(-1)).reshape(-1, NVFP4_DS_MLA_NOPE_DIM)
    rope = flat[:, _ROPE_OFFSET:_SCALE_OFFSET].view(torch.float8_e4m3fn).float()
    return torch.cat([nope, rope], dim=-1).to(torch.bfloat16).reshape(*lead, -1)


def check_nvfp4_ds_mla_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The checks of :func:`concat_and_cache_nvfp4_ds_mla` (every writer of the format runs
    them before writing): ``ValueError`` naming the argument."""
    _check_records("kv_cache", kv_cache)
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected shape (B, N, 352), got {list(kv_cache.shape)}")
    _check_bf16("kv_c", kv_c, NVFP4_DS_MLA_NOPE_DIM)
    _check_bf16("k_pe", k_pe, NVFP4_DS_MLA_ROPE_DIM)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.device != kv_cache.device:
            raise ValueError(
                f"{name}: expected device {kv_cache.device} (the cache's), got {t.device}"
            )
    num_blocks, block_size, _ = kv_cache.shape
    rows = min(kv_c.shape[0], k_pe.shape[0])
    check_slot_mapping(slot_mapping, rows, num_blocks * block_size, kv_cache.device)


def concat_and_cache_nvfp4_ds_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token ``t``'s record into slot ``slot_mapping[t]`` of ``kv_cache (B, N, 352)``
    (uint8); negative slots (padding) are skipped. Upstream's ``concat_and_cache_mla`` for this
    dtype: ``slot_mapping`` may be shorter than ``kv_c`` (padded inputs)."""
    check_nvfp4_ds_mla_write(kv_c, k_pe, kv_cache, slot_mapping)
    block_size = kv_cache.shape[1]
    num_tokens = slot_mapping.shape[0]
    records = nvfp4_ds_mla_encode(kv_c[:num_tokens], k_pe[:num_tokens])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[slots // block_size, slots % block_size] = records[keep]


def cp_gather_and_upconvert_nvfp4_kv_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    batch_size: int,
) -> None:
    """Gather requests' records into the bf16 workspace ``dst [total_tokens, 576]`` (upstream's
    op of this name). Row ``i`` belongs to the last request ``r`` with
    ``workspace_starts[r] <= i``; it is that request's token ``i - workspace_starts[r]``, found
    through ``block_table [batch, max_blocks]`` (int32) in ``src_cache (B, N, 352)``."""
    _check_records("src_cache", src_cache)
    if src_cache.dim() != 3:
        raise ValueError(f"src_cache: expected shape (B, N, 352), got {list(src_cache.shape)}")
    if dst.dtype != torch.bfloat16 or dst.dim() != 2 or dst.shape[1] != NVFP4_DS_MLA_HEAD_SIZE:
        raise ValueError(
            f"dst: expected a bf16 [total_tokens, {NVFP4_DS_MLA_HEAD_SIZE}] tensor, "
            f"got {dst.dtype} of shape {list(dst.shape)}"
        )
    for name, t in (("block_table", block_table), ("workspace_starts", workspace_starts)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if isinstance(batch_size, bool) or not 0 < batch_size <= workspace_starts.shape[0]:
        raise ValueError(
            f"batch_size: expected an int in [1, {workspace_starts.shape[0]}], got {batch_size}"
        )
    device = src_cache.device
    rows = torch.arange(dst.shape[0], device=device)
    starts = workspace_starts[:batch_size].to(device=device, dtype=torch.int64)
    req = torch.searchsorted(starts, rows, right=True) - 1
    if bool((req < 0).any()):
        raise ValueError("workspace_starts: expected the first request to start at row 0")
    offset = rows - starts[req]
    block_size = src_cache.shape[1]
    blocks = block_table.to(device=device, dtype=torch.int64)[req, offset // block_size]
    dst.copy_(nvfp4_ds_mla_decode(src_cache[blocks, offset % block_size]))


NVFP4_DS_MLA = register_format(
    KVCacheFormat(
        name="nvfp4_ds_mla",
        accepted_names=("nvfp4_ds_mla",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.NVFP4_DS_MLA,
        label="nvfp4_ds_mla",
        row_dim=nvfp4_ds_mla_record_dim,
        # Selectable, as upstream's CacheDType lists it; its record fits only the 576 latent.
        cache_kind=None,
        has_kernel=False,
    )
)
