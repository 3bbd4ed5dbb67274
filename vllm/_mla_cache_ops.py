"""Upstream v0.33's MLA cache ops in torch: ``concat_and_cache_mla`` writes a token's latent
``kv_c`` and RoPE key ``k_pe`` into a latent cache ``(num_blocks, block_size, entry)``;
``cp_gather_and_upconvert_nvfp4_kv_cache`` reads ``nvfp4_ds_mla`` records back into a bf16
workspace, ``cp_gather_cache`` / ``gather_and_maybe_dequant_cache`` copy (or dequantize FP8)
requests' entries into one. ``vllm._custom_ops`` re-exports them at upstream's names (this
module is its MLA part, as :mod:`vllm._cpu_attn_args` is its CPU-attention part), and each is
a ``torch.ops._C_cache_ops`` op as upstream's tests expect.

Every format is written byte for byte as upstream's CUDA kernels write it, here in torch except
``nvfp4_ds_mla``, which the extension's ``concat_and_cache_nvfp4_ds_mla`` writes where it has a
kernel for the cache's device (CPU; CUDA builds) and the codec otherwise:

- ``auto`` / ``float16`` / ``bfloat16``: ``[kv_c, k_pe]`` in the cache's float dtype;
- ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: ``[kv_c, k_pe] / scale`` as FP8 bytes
  (:func:`vllm.kv_quant.fp8.quantize_fp8`; ``skip_scale`` divides by 1);
- ``fp8_ds_mla``: DeepSeek-V3.2's 656-byte record (head size 576): 512 e4m3 NoPE bytes in four
  128-value tiles, each with its fp32 power-of-two scale (bytes 512..528), then the 64 RoPE
  values' 16-bit words (zero when ``k_pe`` has no columns); ``scale`` is not used;
- ``nvfp4_ds_mla``: the 352-byte record of :mod:`vllm.kv_quant.ds_mla_nvfp4`.

Every argument is checked before the cache is written (``ValueError``, ``<arg>: expected X,
got Y``).
"""

from __future__ import annotations

import torch

from vllm._extension import compiled_kernel  # loads the extension: its ops before their fakes
from vllm.kv_quant.ds_mla_nvfp4 import (
    NVFP4_DS_MLA,
    check_nvfp4_ds_mla_write,
    concat_and_cache_nvfp4_ds_mla,
)
from vllm.kv_quant.ds_mla_nvfp4 import (
    cp_gather_and_upconvert_nvfp4_kv_cache as _gather_nvfp4_records,
)
from vllm.kv_quant.formats import (
    AUTO,
    BFLOAT16,
    FLOAT16,
    FP8_DS_MLA,
    FP8_DS_MLA_V32_RECORD_BYTES,
    FP8_E4M3,
    FP8_E5M2,
    KVCacheFormat,
    accepted_names_of,
    find_format,
    lookup,
)
from vllm.kv_quant.fp8 import (
    FP8_E4M3_MAX,
    Fp8Format,
    dequantize_fp8,
    fp32_to_fp8_bytes,
    quantize_fp8,
)
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

# What ``vllm._custom_ops`` re-exports (upstream's op names).
__all__ = [
    "concat_and_cache_mla",
    "cp_gather_and_upconvert_nvfp4_kv_cache",
    "cp_gather_cache",
    "gather_and_maybe_dequant_cache",
]

_WRITE_FORMATS: tuple[KVCacheFormat, ...] = (
    AUTO,
    FLOAT16,
    BFLOAT16,
    FP8_E4M3,
    FP8_E5M2,
    FP8_DS_MLA,
    NVFP4_DS_MLA,
)
"""The formats :func:`concat_and_cache_mla` writes (upstream's op takes the same strings)."""

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# fp8_ds_mla (DeepSeek-V3.2) record geometry, in bytes unless named otherwise.
_DS_NOPE_DIM = 512  # NoPE values (one e4m3 byte each)
_DS_TILE = 128  # NoPE values sharing one fp32 scale
_DS_ROPE_DIM = 64  # RoPE values (one 16-bit word each)
_DS_SCALE_OFFSET = _DS_NOPE_DIM
_DS_ROPE_OFFSET = _DS_SCALE_OFFSET + 4 * (_DS_NOPE_DIM // _DS_TILE)  # 528
_DS_SCALE_FLOOR = 1e-4  # smallest tile scale before rounding up to a power of two


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _mla_format(kv_cache_dtype: str) -> KVCacheFormat:
    fmt = find_format(kv_cache_dtype)
    if fmt not in _WRITE_FORMATS:
        names = ", ".join(accepted_names_of(*_WRITE_FORMATS))
        raise ValueError(
            f"kv_cache_dtype: expected one of {names} for an MLA cache, got {kv_cache_dtype!r}"
        )
    assert fmt is not None
    return fmt


def _check_inputs(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[int, int]:
    """The common rules: 2-D float inputs of one dtype, a 3-D cache with contiguous entries,
    all on the cache's device. Returns ``(kv_lora_rank, pe_dim)``."""
    for name, t, dims in (("kv_cache", kv_cache, 3), ("kv_c", kv_c, 2), ("k_pe", k_pe, 2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            shape = "[T, dim]" if dims == 2 else "[num_blocks, block_size, entry]"
            raise ValueError(f"{name}: expected shape {shape}, got {list(t.shape)}")
        if t.device != kv_cache.device:
            raise ValueError(
                f"{name}: expected device {kv_cache.device} (kv_cache's), got {t.device}"
            )
    if kv_c.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"kv_c: expected dtype float32, float16 or bfloat16, got {_dtype_name(kv_c.dtype)}"
        )
    if k_pe.dtype != kv_c.dtype:
        raise ValueError(
            f"k_pe: expected dtype {_dtype_name(kv_c.dtype)} (kv_c's), "
            f"got {_dtype_name(k_pe.dtype)}"
        )
    if kv_cache.shape[2] > 1 and kv_cache.stride(2) != 1:
        raise ValueError(
            f"kv_cache: expected contiguous entries (last stride 1), got strides "
            f"{list(kv_cache.stride())}"
        )
    return kv_c.shape[1], k_pe.shape[1]


def _check_entry(
    kv_cache: torch.Tensor, entry: int, dtypes: tuple[torch.dtype, ...], why: str
) -> None:
    if kv_cache.dtype not in dtypes:
        names = " or ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(
            f"kv_cache: expected dtype {names} {why}, got {_dtype_name(kv_cache.dtype)}"
        )
    if kv_cache.shape[2] != entry:
        raise ValueError(
            f"kv_cache: expected an entry (last dim) of {entry} {why}, got shape "
            f"{list(kv_cache.shape)}"
        )


def _check_ds_mla_inputs(kv_c: torch.Tensor, pe_dim: int) -> None:
    if kv_c.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"kv_c: expected dtype float16 or bfloat16 for fp8_ds_mla, got "
            f"{_dtype_name(kv_c.dtype)}"
        )
    if kv_c.shape[1] != _DS_NOPE_DIM:
        raise ValueError(
            f"kv_c: expected shape [T, {_DS_NOPE_DIM}] for fp8_ds_mla, got {list(kv_c.shape)}"
        )
    if pe_dim not in (_DS_ROPE_DIM, 0):
        raise ValueError(f"k_pe: expected {_DS_ROPE_DIM} or 0 columns for fp8_ds_mla, got {pe_dim}")


def _fp8_ds_mla_records(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """656-byte records ``[T, 656]`` (uint8) of ``kv_c [T, 512]`` and ``k_pe [T, 64 or 0]``, as
    upstream's CUDA writer: tile scale ``2^ceil(log2(max(amax / 448, 1e-4)))`` in fp32 (NaN
    skipped in ``amax``, as ``fmaxf``), NoPE ``e4m3(x / scale)`` saturated."""
    tokens = kv_c.shape[0]
    x = kv_c.float().reshape(tokens, _DS_NOPE_DIM // _DS_TILE, _DS_TILE)
    amax = x.abs().nan_to_num(nan=0.0).amax(dim=-1, keepdim=True)
    scale = torch.exp2(
        torch.ceil(torch.log2(torch.clamp(amax / FP8_E4M3_MAX, min=_DS_SCALE_FLOOR)))
    )
    out = torch.zeros(tokens, FP8_DS_MLA_V32_RECORD_BYTES, dtype=torch.uint8, device=kv_c.device)
    nope = fp32_to_fp8_bytes(x / scale, Fp8Format.E4M3)
    out[:, :_DS_NOPE_DIM] = nope.reshape(tokens, _DS_NOPE_DIM)
    out[:, _DS_SCALE_OFFSET:_DS_ROPE_OFFSET] = scale.reshape(tokens, _DS_NOPE_DIM // _DS_TILE).view(
        torch.uint8
    )
    if k_pe.shape[1]:  # NoPE-only rows keep a zero RoPE tail
        out[:, _DS_ROPE_OFFSET:] = k_pe.contiguous().view(torch.uint8)
    return out


def _check_args(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool,
) -> KVCacheFormat:
    """Every rule that needs no tensor values (the fake kernel runs these too); returns the
    format."""
    fmt = _mla_format(kv_cache_dtype)
    rank, pe_dim = _check_inputs(kv_c, k_pe, kv_cache)
    why = f"for kv_cache_dtype {kv_cache_dtype!r}"
    if fmt is NVFP4_DS_MLA:
        return fmt  # the codec checks its own geometry (bf16, 512 + 64, 352 bytes)
    if fmt is FP8_DS_MLA:
        _check_ds_mla_inputs(kv_c, pe_dim)
        _check_entry(kv_cache, FP8_DS_MLA_V32_RECORD_BYTES, (torch.uint8,), why)
    elif fmt.fp8_variant is not None:
        storage = (torch.uint8, Fp8Format(fmt.fp8_variant).torch_dtype)
        _check_entry(kv_cache, rank + pe_dim, storage, why)
        if not skip_scale:
            kv_scale_as_1d(scale, "scale", None)
    else:
        dtypes = _FLOAT_DTYPES if fmt.storage_dtype is None else (fmt.storage_dtype,)
        _check_entry(kv_cache, rank + pe_dim, dtypes, why)
    return fmt


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
) -> None:
    """Write token ``t`` (``kv_c [T_pad, kv_lora_rank]``, ``k_pe [T_pad, pe_dim]``) into slot
    ``slot_mapping[t]`` (int64 ``[T]``, ``T <= T_pad``; negative: skipped) of ``kv_cache
    (num_blocks, block_size, entry)``, encoded for ``kv_cache_dtype`` (module docstring), through
    ``torch.ops._C_cache_ops.concat_and_cache_mla`` as upstream.

    Entry (last dim, cache elements): ``kv_lora_rank + pe_dim`` for unquantized and FP8 caches
    (float dtype / uint8 or the variant's float8 dtype), 656 for ``fp8_ds_mla`` and 352 for
    ``nvfp4_ds_mla`` (uint8). ``scale`` (fp32, one value) divides FP8 values unless
    ``skip_scale``; the record formats ignore it, as upstream does.
    """
    torch.ops._C_cache_ops.concat_and_cache_mla(
        kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale
    )


@torch.library.register_fake("_C_cache_ops::concat_and_cache_nvfp4_ds_mla")
def _nvfp4_ds_mla_writer_fake(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # Tracing rejects what the writer would (dtypes, shapes, devices); slot values are its own.
    check_nvfp4_ds_mla_write(kv_c, k_pe, kv_cache, slot_mapping[:0])


# The extension has no general MLA writer, so the op upstream's tests call (and ``opcheck``) by its
# dispatcher name is defined here, in a fragment of the extension's namespace. A compiled
# kernel of this name must replace this definition, not add to it.
@torch.library.custom_op("_C_cache_ops::concat_and_cache_mla", mutates_args=("kv_cache",))
def _concat_and_cache_mla_op(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
) -> None:
    fmt = _check_args(kv_c, k_pe, kv_cache, kv_cache_dtype, scale, skip_scale)
    compiled = (
        compiled_kernel("concat_and_cache_nvfp4_ds_mla", kv_cache.device)
        if fmt is NVFP4_DS_MLA
        else None
    )
    if fmt is NVFP4_DS_MLA and compiled is None:
        concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, kv_cache, slot_mapping)
        return
    if compiled is not None:
        check_nvfp4_ds_mla_write(kv_c, k_pe, kv_cache, slot_mapping)
        tokens = slot_mapping.shape[0]
        compiled(kv_c[:tokens], k_pe[:tokens], kv_cache, slot_mapping)
        return
    rows = min(kv_c.shape[0], k_pe.shape[0])
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    check_slot_mapping(slot_mapping, rows, num_slots, kv_cache.device)

    tokens = slot_mapping.shape[0]
    kv_c, k_pe = kv_c[:tokens], k_pe[:tokens]
    if fmt is FP8_DS_MLA:
        entries = _fp8_ds_mla_records(kv_c, k_pe)
    elif fmt.fp8_variant is not None:
        if skip_scale:
            scale = torch.ones(1, dtype=torch.float32, device=kv_cache.device)
        fp8 = Fp8Format(fmt.fp8_variant)
        entries = quantize_fp8(torch.cat([kv_c, k_pe], dim=-1), scale, fp8)
        entries = entries.view(kv_cache.dtype)
    else:
        entries = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = entries[keep]


@_concat_and_cache_mla_op.register_fake
def _concat_and_cache_mla_fake(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
) -> None:
    # Tracing rejects what the op would; a real cache with a meta argument (the dispatcher
    # picks this kernel then) fails the same-device rule instead of writing nothing.
    _check_args(kv_c, k_pe, kv_cache, kv_cache_dtype, scale, skip_scale)


def cp_gather_and_upconvert_nvfp4_kv_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    batch_size: int,
) -> None:
    """Upstream's op of this name: ``nvfp4_ds_mla`` records of ``src_cache (B, N, 352)``
    (uint8) gathered per request through ``block_table [batch, max_blocks]`` (int32) into the
    bf16 workspace ``dst [total_tokens, 576]``, request ``r`` from row ``workspace_starts[r]``
    (:func:`vllm.kv_quant.ds_mla_nvfp4.cp_gather_and_upconvert_nvfp4_kv_cache`)."""
    torch.ops._C_cache_ops.cp_gather_and_upconvert_nvfp4_kv_cache(
        src_cache, dst, block_table, workspace_starts, batch_size
    )


@torch.library.custom_op(
    "_C_cache_ops::cp_gather_and_upconvert_nvfp4_kv_cache", mutates_args=("dst",)
)
def _cp_gather_and_upconvert_nvfp4_op(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    batch_size: int,
) -> None:
    _gather_nvfp4_records(src_cache, dst, block_table, workspace_starts, batch_size)


@_cp_gather_and_upconvert_nvfp4_op.register_fake
def _cp_gather_and_upconvert_nvfp4_fake(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    batch_size: int,
) -> None:
    # A real workspace with a meta argument lands here: refuse it rather than write nothing.
    for name, t in (("src_cache", src_cache), ("block_table", block_table)):
        if t.device != dst.device:
            raise ValueError(f"{name}: expected device {dst.device} (dst's), got {t.device}")


_GATHER_FORMATS = (AUTO, FLOAT16, BFLOAT16, FP8_E4M3, FP8_E5M2)
"""The formats :func:`gather_and_maybe_dequant_cache` reads (upstream's op takes these)."""


def _check_gather_args(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    seq_starts: torch.Tensor | None,
) -> None:
    """The rules of upstream's two gather ops that need no tensor values: int32 index tensors,
    every tensor on ``src_cache``'s device, ``dst``'s entry shape that of the cache."""
    index = {"block_table": block_table, "cu_seq_lens": cu_seq_lens, "seq_starts": seq_starts}
    for name, t in {"dst": dst, **index}.items():
        if t is not None and t.device != src_cache.device:
            raise ValueError(
                f"{name}: expected device {src_cache.device} (src_cache's), got {t.device}"
            )
    for name, t in index.items():
        if t is not None and t.dtype != torch.int32:
            raise ValueError(f"{name}: expected dtype int32, got {_dtype_name(t.dtype)}")
    if src_cache.dim() < 3 or dst.dim() < 2 or dst.shape[1:] != src_cache.shape[2:]:
        raise ValueError(
            f"dst: expected shape [total_tokens, *entry] with entry {list(src_cache.shape[2:])} "
            f"(src_cache [num_blocks, block_size, *entry]), got {list(dst.shape)}"
        )


def _gather_rows(
    src_cache: torch.Tensor,
    rows: int,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None,
) -> torch.Tensor:
    """The cache entries of workspace rows ``[0, rows)``: row ``i`` of request ``r``
    (``cu_seq_lens[r] <= i < cu_seq_lens[r + 1]``) is its token ``i - cu_seq_lens[r]``, plus
    ``seq_starts[r]`` when given, found through ``block_table[r]``."""
    if not 0 <= batch_size < cu_seq_lens.shape[0]:
        raise ValueError(
            f"batch_size: expected an int in [0, {cu_seq_lens.shape[0] - 1}] "
            f"(cu_seq_lens has {cu_seq_lens.shape[0]} entries), got {batch_size}"
        )
    bounds = cu_seq_lens[: batch_size + 1].long()
    rows = min(rows, int(bounds[-1]))
    row = torch.arange(rows, device=src_cache.device)
    req = torch.searchsorted(bounds, row, right=True) - 1  # an empty request owns no row
    token = row - bounds[req]
    if seq_starts is not None:
        token += seq_starts.long()[req]
    block_size = src_cache.shape[1]
    return src_cache[block_table.long()[req, token // block_size], token % block_size]


def cp_gather_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Upstream's op: copy (no conversion) each request's cache entries into ``dst
    [total_tokens, *entry]`` (``src_cache``'s dtype), request ``r`` in rows ``cu_seq_lens[r]``
    to ``cu_seq_lens[r + 1]`` (int32 ``[batch_size + 1]``), from its token ``seq_starts[r]``
    (int32 ``[batch_size]``, default 0) through ``block_table [batch, max_blocks]`` (int32)."""
    torch.ops._C_cache_ops.cp_gather_cache(
        src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts
    )


def _check_cp_gather_args(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None = None,
) -> None:
    _check_gather_args(src_cache, dst, block_table, cu_seq_lens, seq_starts)
    if dst.dtype != src_cache.dtype:
        raise ValueError(
            f"dst: expected dtype {_dtype_name(src_cache.dtype)} (src_cache's), "
            f"got {_dtype_name(dst.dtype)}"
        )


@torch.library.custom_op("_C_cache_ops::cp_gather_cache", mutates_args=("dst",))
def _cp_gather_cache_op(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None = None,
) -> None:
    _check_cp_gather_args(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    rows = _gather_rows(src_cache, dst.shape[0], block_table, cu_seq_lens, batch_size, seq_starts)
    dst[: rows.shape[0]] = rows


_cp_gather_cache_op.register_fake(_check_cp_gather_args)


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Upstream's op: as :func:`cp_gather_cache` (all requests of ``cu_seq_lens``) for the
    first ``num_tokens`` rows of ``dst`` (float ``[total_tokens, entry]``), dequantized: an FP8
    cache (uint8) gives ``fp8 * scale`` (``scale`` fp32, one value), an unquantized one
    (``dst``'s dtype) is copied. ``token_to_seq`` is accepted and unused, as upstream."""
    args = (token_to_seq, num_tokens, kv_cache_dtype, scale, seq_starts)
    torch.ops._C_cache_ops.gather_and_maybe_dequant_cache(
        src_cache, dst, block_table, cu_seq_lens, *args
    )


def _check_dequant_args(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    fmt = find_format(kv_cache_dtype)
    if fmt not in _GATHER_FORMATS:
        names = ", ".join(accepted_names_of(*_GATHER_FORMATS))
        raise ValueError(f"kv_cache_dtype: expected one of {names}, got {kv_cache_dtype!r}")
    _check_gather_args(src_cache, dst, block_table, cu_seq_lens, seq_starts)
    if dst.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"dst: expected dtype float32, float16 or bfloat16, got {_dtype_name(dst.dtype)}"
        )
    expected = dst.dtype if fmt.fp8_variant is None else torch.uint8
    if src_cache.dtype != expected:
        raise ValueError(
            f"src_cache: expected dtype {_dtype_name(expected)} for kv_cache_dtype "
            f"{kv_cache_dtype!r} into a {_dtype_name(dst.dtype)} dst, "
            f"got {_dtype_name(src_cache.dtype)}"
        )
    if fmt.fp8_variant is not None:
        kv_scale_as_1d(scale, "scale", None)


@torch.library.custom_op("_C_cache_ops::gather_and_maybe_dequant_cache", mutates_args=("dst",))
def _gather_and_maybe_dequant_op(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    _check_dequant_args(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                        kv_cache_dtype, scale, seq_starts)  # fmt: skip
    batch_size = cu_seq_lens.shape[0] - 1
    rows = min(num_tokens, dst.shape[0])
    entries = _gather_rows(src_cache, rows, block_table, cu_seq_lens, batch_size, seq_starts)
    variant = lookup(kv_cache_dtype).fp8_variant
    if variant is not None:
        entries = dequantize_fp8(entries, scale, variant, dst.dtype)
    dst[: entries.shape[0]] = entries


_gather_and_maybe_dequant_op.register_fake(_check_dequant_args)
