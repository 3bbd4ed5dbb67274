"""Whole-page reference writer and reader of a packed NVFP4 KV-cache side.

A side is a uint8 tensor with logical shape ``(B, N, H, F)``, ``F = D/2 + D/16``, NHD or HND
strides, page stride ``P`` bytes (docs/design.md §5). Each page of the side is ``[data | scales]``;
:func:`nvfp4_split_data_scale` gives the data view ``(B, N, H, D/2)`` and
the scale view ``(B, N, H, S)``, ``S = D/16``. For head ``h`` of page ``b`` the scale plane is
``scale_view[b, :, h, :]`` (``[N, S]``), holding element ``(t, s)`` at the position that the
cache's :class:`~vllm.kv_quant.scale_layout.ScaleLayout` gives.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import nvfp4_packed_dim
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.kv_quant.nvfp4 import NVFP4_GROUP_SIZE, dequantize_nvfp4, quantize_nvfp4
from vllm.kv_quant.scale_layout import ScaleLayout, from_layout, layout_index

_FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def nvfp4_data_dim(full_dim: int) -> int:
    """Data bytes of a packed last dim ``F = 9 * D / 16``; raises for an F no head size gives."""
    if full_dim <= 0 or full_dim % 9 != 0:
        raise ValueError(
            f"kv_cache: last dim {full_dim} is not a packed NVFP4 head dim F(D) = D/2 + D/16 "
            "for a head size D that is a multiple of 16 (expected a positive multiple of 9)"
        )
    return full_dim * 8 // 9


def nvfp4_split_data_scale(side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one side ``(B, d1, d2, F)`` of a packed NVFP4 cache into data and scale views
    (upstream v0.33's ``nvfp4_split_data_scale``).

    Each page of the side holds ``d1*d2*data_dim`` data bytes followed by ``d1*d2*scale_dim``
    scale bytes, in the order the side's strides give (NHD or HND). Both views share storage
    with ``side``; the scale view is ``float8_e4m3fn``.
    """
    if side.dim() != 4:
        raise ValueError(
            f"kv_cache: expected a 4-D side (B, d1, d2, F), got shape {tuple(side.shape)}"
        )
    if side.dtype != torch.uint8:
        raise ValueError(f"kv_cache: expected dtype torch.uint8 for NVFP4, got {side.dtype}")
    num_blocks, d1, d2, full_dim = side.shape
    page_stride, s1, s2, s3 = side.stride()
    data_dim = nvfp4_data_dim(full_dim)
    scale_dim = full_dim - data_dim
    is_nhd = (d1 == 1 or s1 == d2 * full_dim) and (d2 == 1 or s2 == full_dim)
    is_hnd = (d1 == 1 or s1 == full_dim) and (d2 == 1 or s2 == d1 * full_dim)
    if s3 != 1 or not (is_nhd or is_hnd):
        raise ValueError(
            "kv_cache: each page of an NVFP4 cache side must be one dense region; expected "
            f"strides (*, {d2 * full_dim}, {full_dim}, 1) (NHD) or (*, {full_dim}, "
            f"{d1 * full_dim}, 1) (HND), got {side.stride()}"
        )
    offset = side.storage_offset()
    data = side.as_strided(
        (num_blocks, d1, d2, data_dim),
        (page_stride, s1 * data_dim // full_dim, s2 * data_dim // full_dim, 1),
        offset,
    )
    scale = side.as_strided(
        (num_blocks, d1, d2, scale_dim),
        (page_stride, s1 * scale_dim // full_dim, s2 * scale_dim // full_dim, 1),
        offset + d1 * d2 * data_dim,
    ).view(torch.float8_e4m3fn)
    return data, scale


def check_slot_mapping(
    slot_mapping: torch.Tensor, num_tokens_padded: int, num_slots: int, device: torch.device
) -> None:
    """Validate ``slot_mapping`` (int64 ``[T]``, ``T <= num_tokens_padded``, every slot
    ``< num_slots``; negative slots mean "skip") on ``device``."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64:
        got = slot_mapping.dtype if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping)
        raise ValueError(f"slot_mapping: expected an int64 tensor, got {got}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected shape [T], got {list(slot_mapping.shape)}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping: expected device {device}, got {slot_mapping.device}")
    if slot_mapping.shape[0] > num_tokens_padded:
        raise ValueError(
            f"slot_mapping: expected at most {num_tokens_padded} entries (tokens in the "
            f"input), got {slot_mapping.shape[0]}"
        )
    if slot_mapping.numel() > 0:
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(
                f"slot_mapping: slot {top} is out of range for a cache of {num_slots} slots "
                "(num_blocks * block_size)"
            )


def _check_input(x: torch.Tensor, cache_side: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [T_pad, H, D], got {list(x.shape)}")
    if cache_side.dim() != 4 or cache_side.dtype != torch.uint8:
        raise ValueError(
            f"cache_side: expected a uint8 (B, N, H, F) tensor, got {cache_side.dtype} "
            f"of shape {list(cache_side.shape)}"
        )
    if x.device != cache_side.device:
        raise ValueError(f"x: expected device {cache_side.device} (the cache's), got {x.device}")
    if x.shape[1] != cache_side.shape[2]:
        raise ValueError(
            f"x: expected {cache_side.shape[2]} heads (cache_side.shape[2]), got {x.shape[1]}"
        )


def _split(cache_side: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data view (uint8) and scale view (uint8) of a side, after checking ``F == F(head_size)``."""
    full_dim = nvfp4_packed_dim(head_size)
    if cache_side.shape[-1] != full_dim:
        raise ValueError(
            f"cache_side: expected last dim F({head_size}) = {full_dim}, got {cache_side.shape[-1]}"
        )
    data, scale = nvfp4_split_data_scale(cache_side)
    return data, scale.view(torch.uint8)


def nvfp4_write_cache(
    x: torch.Tensor,
    cache_side: torch.Tensor,
    slot_mapping: torch.Tensor,
    global_scale: torch.Tensor,
    scale_layout: ScaleLayout | str | None = None,
    *,
    scale_search: bool | str = False,
) -> None:
    """Quantize the first ``T`` tokens of ``x [T_pad, H, D]`` and write them into a packed
    NVFP4 cache side ``(B, N, H, F)`` in place.

    Token ``i`` goes to page ``slot_mapping[i] // N``, row ``slot_mapping[i] % N``; negative
    slots are skipped; a slot ``>= B*N`` raises ``ValueError`` before anything is written.
    ``global_scale`` is fp32, one value (any shape) or ``[H]``. Only the data bytes and
    (layout-placed) scale bytes of the written ``(page, token, head)`` entries change. If a slot
    appears twice, which token ends up in it is unspecified. ``scale_layout=None`` is the op's
    default, :meth:`ScaleLayout.default_for` ``(N, D)`` (upstream's interleave4 where it fits).
    ``scale_search=True`` writes ``nvfp4_mse`` (:func:`quantize_nvfp4`'s block-scale search); the
    page is read like any NVFP4 page; ``scale_search="4over6"`` writes ``nvfp4_4over6``.
    """
    _check_input(x, cache_side)
    num_blocks, block_size, num_heads, _ = cache_side.shape
    head_size = x.shape[2]
    if head_size % NVFP4_GROUP_SIZE != 0:
        raise ValueError(
            f"x: NVFP4 needs a head size that is a multiple of {NVFP4_GROUP_SIZE}, got {head_size}"
        )
    data, scale = _split(cache_side, head_size)
    global_scale = kv_scale_as_1d(global_scale, "global_scale", num_heads)
    num_scales = head_size // NVFP4_GROUP_SIZE
    layout = ScaleLayout.resolve(scale_layout, block_size, head_size)
    device = cache_side.device
    rows, cols = layout_index(layout, block_size, num_scales, device)  # checks interleave4 dims
    check_slot_mapping(slot_mapping, x.shape[0], num_blocks * block_size, device)

    tokens = x[: slot_mapping.shape[0]]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    packed, block_scales = quantize_nvfp4(
        tokens[keep], global_scale, scale_search=scale_search
    )  # [T', H, D/2], [T', H, S]
    page = slots // block_size
    row = slots % block_size

    data[page, row] = packed
    # Scale (t, s) of head h on page b goes to scale[b, rows[t, s], h, cols[t, s]].
    heads = torch.arange(num_heads, device=device)
    scale[
        page[:, None, None],
        rows[row][:, None, :],
        heads[None, :, None],
        cols[row][:, None, :],
    ] = block_scales


def nvfp4_read_cache_raw(
    cache_side: torch.Tensor,
    head_size: int,
    scale_layout: ScaleLayout | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw bytes of a packed NVFP4 cache side ``(B, N, H, F)``.

    Returns ``(packed codes uint8 (B, N, H, D/2), block scales uint8 (B, N, H, D/16))``, both
    new contiguous tensors; the scales are in linear ``[t][s]`` order whatever ``scale_layout``
    the cache uses (``None``: :meth:`ScaleLayout.default_for` ``(N, head_size)``, as written by
    default).
    """
    if cache_side.dim() != 4 or cache_side.dtype != torch.uint8:
        raise ValueError(
            f"cache_side: expected a uint8 (B, N, H, F) tensor, got {cache_side.dtype} "
            f"of shape {list(cache_side.shape)}"
        )
    data, scale = _split(cache_side, head_size)
    layout = ScaleLayout.resolve(scale_layout, cache_side.shape[1], head_size)
    planes = scale.permute(0, 2, 1, 3)  # (B, H, N, S): one [N, S] plane per (page, head)
    linear = from_layout(planes, layout).permute(0, 2, 1, 3)
    return data.contiguous(), linear.contiguous()


def nvfp4_read_cache(
    cache_side: torch.Tensor,
    global_scale: torch.Tensor,
    head_size: int,
    scale_layout: ScaleLayout | str | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a whole packed NVFP4 cache side ``(B, N, H, F)`` to ``(B, N, H, D)``
    (``E2M1[q] * float(sf) * global_scale`` in fp32, then cast to ``out_dtype``).
    ``global_scale`` is fp32, one value (any shape) or ``[H]``; ``scale_layout=None`` reads the
    default layout for the geometry (:meth:`ScaleLayout.default_for`)."""
    packed, block_scales = nvfp4_read_cache_raw(cache_side, head_size, scale_layout)
    global_scale = kv_scale_as_1d(global_scale, "global_scale", cache_side.shape[2])
    return dequantize_nvfp4(packed, block_scales, global_scale, out_dtype)
