"""Keys rebuilt inside the Triton paged attention (``REBUILD_KEYS``): layers that store keys
before RoPE or keep FP8 key sinks (:mod:`vllm.v1.attention.backends.key_rebuild`).

:func:`rebuilt_key_tile` gives the fp32 keys ``[TILE_N, D_PAD]`` of one tile in real units, as
the CPU kernel's ``KeyRebuild`` and :meth:`~vllm.kv_quant.KeyTransform.rebuild_key` define
them: the sequence's sink row at positions ``p < S`` (else the page row times its scale), then
the Hadamard rotation back (:func:`hadamard_tile`: the butterflies of
:func:`vllm.kv_quant.hadamard_rotate` in their order, then the one multiply), plus the per-head
offset, then RoPE at ``p`` (:func:`rope_tile`). Each channel's partner comes from ``tl.gather``
along the row, so the fp32 operations are the reference's, one rounding each (the kernel is
launched without FMA contraction). The kernel then dots the query with these keys in IEEE fp32.

:func:`key_rebuild_args` checks the host-side inputs (:class:`KeyRebuildArgs`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from vllm.kv_quant.hadamard import check_hadamard_head_size
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_kv_decode import (
    KIND_FP8_E4M3,
    KIND_FP8_PER_TOKEN_HEAD,
    KIND_INT8_PER_TOKEN_HEAD,
    KIND_NVFP4,
    KIND_UNQUANTIZED,
    NVFP4_UNIT,
    load_kv_tile,
    load_row_scale,
    nvfp4_tile,
)

HADAMARD_MAX_BITS = tl.constexpr(12)
"""log2 of the largest head size the Hadamard butterflies unroll for (4096 channels)."""


@triton.jit
def hadamard_tile(x, d, scale, HEAD_SIZE: tl.constexpr):
    """``c H x`` along the rows of fp32 ``x [N, D_PAD]`` (channels ``d``, power-of-two
    ``HEAD_SIZE``; padding channels stay 0): for ``h = 1, 2, .., HEAD_SIZE / 2`` the pair
    ``(i, i + h)`` becomes ``(x_i + x_{i+h}, x_i - x_{i+h})``, then every element times
    ``scale`` (``fp32(1 / sqrt(HEAD_SIZE))``)."""
    for bit in tl.static_range(HADAMARD_MAX_BITS):
        if (1 << bit) < HEAD_SIZE:
            partner = tl.gather(x, tl.broadcast_to((d ^ (1 << bit))[None, :], x.shape), axis=1)
            x = tl.where((d & (1 << bit))[None, :] == 0, x + partner, partner - x)
    return x * scale


@triton.jit
def rope_tile(x, table_ptr, keys, key_ok, d, rotary_dim, NEOX: tl.constexpr):
    """fp32 ``x [N, D_PAD]`` (keys at positions ``keys [N]``, channels ``d``) turned by RoPE:
    pair ``(a, b)`` -> ``(a cos - b sin, b cos + a sin)`` with row ``p`` of the table
    (``[max_positions, rotary_dim]``: cos, then sin); neox pairs ``(i, i + rotary_dim / 2)``,
    GPT-J ``(2i, 2i + 1)``; channels from ``rotary_dim`` on unchanged."""
    half = rotary_dim // 2
    rotated = d < rotary_dim
    if NEOX:
        first = d < half
        partner_d = tl.where(first, d + half, d - half)
        freq = tl.where(first, d, d - half)
    else:
        first = (d & 1) == 0
        partner_d = d ^ 1
        freq = d // 2
    partner_d = tl.where(rotated, partner_d, d)
    mask = key_ok[:, None] & rotated[None, :]
    row = table_ptr + keys.to(tl.int64)[:, None] * rotary_dim
    cos = tl.load(row + freq[None, :], mask=mask, other=1.0)
    sin = tl.load(row + half + freq[None, :], mask=mask, other=0.0)
    partner = tl.gather(x, tl.broadcast_to(partner_d[None, :], x.shape), axis=1)
    straight = x * cos
    turned = partner * sin
    out = tl.where(first[None, :], straight - turned, straight + turned)
    return tl.where(rotated[None, :], out, x)


@triton.jit
def rebuilt_key_tile(
    k_ptr,
    k_aux_ptr,
    rope_ptr,
    key_offset_ptr,
    sink_keys_ptr,
    page,
    tok,
    keys,
    key_ok,
    seq,
    kv_head64,
    d,
    k_scale,
    hadamard_scale,
    rotary_dim,
    num_sink_keys,
    num_kv_heads,
    stride_k_page,
    stride_k_tok,
    stride_k_head,
    stride_ka_page,
    stride_ka_tok,
    stride_ka_head,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    FORMAT: tl.constexpr,
    BF16_PAGES: tl.constexpr,
    K_INTERLEAVE4: tl.constexpr,
    SCALE_INLINE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    USE_ROPE: tl.constexpr,
    ROPE_NEOX: tl.constexpr,
    KEY_HADAMARD: tl.constexpr,
    USE_KEY_OFFSET: tl.constexpr,
    USE_SINK_KEYS: tl.constexpr,
):
    """fp32 keys ``[N, D_PAD]`` at positions ``keys [N]`` (pages ``page``, slots ``tok``) of
    sequence ``seq``, KV head ``kv_head64``, in real units (module docstring); masked keys and
    padding channels are 0. ``k_scale``: the head's FP8 / NVFP4 global scale."""
    d_ok = d < HEAD_SIZE
    if FORMAT == KIND_NVFP4:  # (E2M1 * sf) * gs, rounded once (dequantize_nvfp4)
        x = nvfp4_tile(
            k_ptr,
            k_aux_ptr,
            page,
            tok,
            kv_head64,
            key_ok,
            stride_k_page,
            stride_k_tok,
            stride_k_head,
            stride_ka_page,
            stride_ka_tok,
            stride_ka_head,
            K_INTERLEAVE4,
            HEAD_SIZE,
            D_PAD,
        )
        x = x.to(tl.float32) * (k_scale * NVFP4_UNIT)
    else:
        x = load_kv_tile(
            k_ptr,
            page[:, None],
            tok[:, None],
            kv_head64,
            d[None, :],
            key_ok[:, None],
            d_ok[None, :],
            stride_k_page,
            stride_k_tok,
            stride_k_head,
            FORMAT,
            BF16_PAGES,
            tl.float32,
            ROW_ALIGN,
        ).to(tl.float32)
        # e4m3 units are value * 2^-8: units * (scale * 2^8) is value * scale, rounded once
        e4m3 = FORMAT == KIND_FP8_E4M3 or FORMAT == KIND_FP8_PER_TOKEN_HEAD  # noqa: SIM109 (Triton compiles no `in`)
        unit = 256.0 if e4m3 else 1.0
        if FORMAT == KIND_INT8_PER_TOKEN_HEAD or FORMAT == KIND_FP8_PER_TOKEN_HEAD:  # noqa: SIM109 (Triton compiles no `in`)
            # value * the row's scale, rounded once
            k_aux = page * stride_ka_page + tok * stride_ka_tok + kv_head64 * stride_ka_head
            k_row = load_row_scale(k_aux_ptr, k_aux, key_ok, SCALE_INLINE, ROW_ALIGN)
            x = x * (k_row * unit)[:, None]
        elif FORMAT != KIND_UNQUANTIZED:  # FP8: the tensor or head scale
            x = x * (k_scale * unit)
    if USE_SINK_KEYS:
        is_sink = key_ok & (keys < num_sink_keys)
        row = ((seq.to(tl.int64) * num_sink_keys + keys) * num_kv_heads + kv_head64) * HEAD_SIZE
        sink = tl.load(
            sink_keys_ptr + row[:, None] + d[None, :],
            mask=is_sink[:, None] & d_ok[None, :],
            other=0.0,
        )
        x = tl.where(is_sink[:, None], sink, x)
    if KEY_HADAMARD:
        x = hadamard_tile(x, d, hadamard_scale, HEAD_SIZE)
    if USE_KEY_OFFSET:
        offset = tl.load(key_offset_ptr + kv_head64 * HEAD_SIZE + d, mask=d_ok, other=0.0)
        x = x + offset[None, :]
    if USE_ROPE:
        x = rope_tile(x, rope_ptr, keys, key_ok, d, rotary_dim, ROPE_NEOX)
    return x


def _check_fp32(name: str, x: object, shape: str, dims: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != dims or x.dtype != torch.float32:
        got = f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"{name}: expected a float32 {shape} tensor, got {got}")
    if x.device != device or not x.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor on {device}, got one on {x.device} with "
            f"strides {x.stride()}"
        )
    return x


class KeyRebuildArgs(NamedTuple):
    """The checked rebuild inputs of one launch (:func:`key_rebuild_args`): ``tensors`` the
    RoPE table, offset and sink rows (None: not given), ``scalars`` the Hadamard scale
    ``fp32(1 / sqrt(D))``, ``rotary_dim`` and S (0: none), and the kernel's constexprs."""

    tensors: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    scalars: tuple[float, int, int]
    constexprs: dict[str, Any]

    def kernel_args(self, unused: torch.Tensor) -> list[Any]:
        """``[rope_ptr, key_offset_ptr, sink_keys_ptr, hadamard_scale, rotary_dim,
        num_sink_keys]``; ``unused`` (an fp32 tensor on the kernel's device) stands in for an
        absent tensor."""
        return [unused if t is None else t for t in self.tensors] + list(self.scalars)


def key_rebuild_args(
    rope_cos_sin: torch.Tensor | None,
    rope_is_neox: bool,
    key_offset: torch.Tensor | None,
    sink_keys: torch.Tensor | None,
    key_hadamard: bool,
    *,
    num_seqs: int,
    num_kv_heads: int,
    head_size: int,
    max_seq_len: int,
    device: torch.device,
) -> KeyRebuildArgs:
    """The kernel's rebuild inputs, after checking them (``ValueError``, ``<arg>: expected X,
    got Y``): ``rope_cos_sin`` fp32 ``[max_positions >= max_seq_len, rotary_dim]`` (even, at
    most ``head_size``), ``key_offset`` fp32 ``[num_kv_heads, head_size]`` (real units),
    ``sink_keys`` fp32 ``[num_seqs, S >= 1, num_kv_heads, head_size]`` (real units), all
    contiguous on ``device``; ``key_hadamard`` needs a power-of-two ``head_size``."""
    for name, flag in (("rope_is_neox", rope_is_neox), ("key_hadamard", key_hadamard)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    rotary_dim = num_sink = 0
    if rope_cos_sin is not None:
        table = _check_fp32("rope_cos_sin", rope_cos_sin, "[max_positions, rotary_dim]", 2, device)
        rotary_dim = table.shape[1]
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(
                f"rope_cos_sin: expected an even rotary_dim in [2, head_size={head_size}], got "
                f"{rotary_dim}"
            )
        if table.shape[0] < max_seq_len:
            raise ValueError(
                f"rope_cos_sin: expected at least max_seq_len={max_seq_len} rows (one per key "
                f"position), got {table.shape[0]}"
            )
    if key_offset is not None:
        _check_fp32("key_offset", key_offset, "[num_kv_heads, head_size]", 2, device)
        if tuple(key_offset.shape) != (num_kv_heads, head_size):
            raise ValueError(
                f"key_offset: expected shape [{num_kv_heads}, {head_size}], got "
                f"{list(key_offset.shape)}"
            )
    if sink_keys is not None:
        shape = "[num_seqs, S, num_kv_heads, head_size]"
        _check_fp32("sink_keys", sink_keys, shape, 4, device)
        num_sink = sink_keys.shape[1]
        if num_sink < 1 or tuple(sink_keys.shape) != (num_seqs, num_sink, num_kv_heads, head_size):
            raise ValueError(
                f"sink_keys: expected shape [{num_seqs}, S >= 1, {num_kv_heads}, {head_size}], "
                f"got {list(sink_keys.shape)}"
            )
    if key_hadamard:
        check_hadamard_head_size(head_size)
    hadamard_scale = float(torch.tensor(1.0 / math.sqrt(head_size), dtype=torch.float32))
    constexprs = dict(
        REBUILD_KEYS=bool(rotary_dim or num_sink or key_hadamard or key_offset is not None),
        USE_ROPE=rope_cos_sin is not None,
        ROPE_NEOX=rope_is_neox or rope_cos_sin is None,  # one variant without RoPE
        KEY_HADAMARD=key_hadamard,
        USE_KEY_OFFSET=key_offset is not None,
        USE_SINK_KEYS=sink_keys is not None,
    )
    return KeyRebuildArgs(
        (rope_cos_sin, key_offset, sink_keys), (hadamard_scale, rotary_dim, num_sink), constexprs
    )
