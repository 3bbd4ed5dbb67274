"""Where NVFP4 block scales live inside each head's ``[N, S]`` scale plane of a page.

``N`` is tokens per page, ``S = D / 16`` block scales per token and head. ``LINEAR`` stores
element ``(t, s)`` at ``(t, s)``. ``INTERLEAVE4`` (the 4-token interleave read by
TRT-LLM-generation kernels) stores it at row ``(t//4)*4 + s//(S//4)``, column
``(s % (S//4))*4 + t%4``; it needs ``N % 4 == 0`` and ``S % 4 == 0``.

Upstream vLLM's ``reshape_and_cache_flash`` always writes NVFP4 scales in the interleave4 order
(its 4x4 swizzle), so that is the default wherever the geometry allows it
(:meth:`ScaleLayout.default_for`; the C++ twin is ``default_scale_layout`` in
``csrc/cache_kernels.h``).
"""

from __future__ import annotations

from enum import Enum

import torch


class ScaleLayout(str, Enum):
    """Placement of block scales within a head's ``[N, S]`` scale plane."""

    LINEAR = "linear"
    INTERLEAVE4 = "interleave4"

    @classmethod
    def parse(cls, value: ScaleLayout | str) -> ScaleLayout:
        """The layout named by ``value``; ``ValueError`` listing the accepted names otherwise."""
        if isinstance(value, ScaleLayout):
            return value
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"scale_layout: expected one of {accepted}, got {value!r}") from None

    @classmethod
    def default_for(cls, block_size: int, head_size: int) -> ScaleLayout:
        """The layout used when a caller names none, for pages of ``block_size`` tokens and
        heads of ``head_size`` elements: upstream's ``INTERLEAVE4`` whenever it fits
        (``block_size % 4 == 0`` and ``S = head_size / 16`` a multiple of 4, i.e.
        ``head_size % 64 == 0``), ``LINEAR`` for geometries upstream cannot write."""
        return cls.INTERLEAVE4 if cls.INTERLEAVE4.fits(block_size, head_size) else cls.LINEAR

    def fits(self, block_size: int, head_size: int) -> bool:
        """Whether pages of ``block_size`` tokens and heads of ``head_size`` elements can hold
        their block scales in this layout (``LINEAR``: any; ``INTERLEAVE4``: ``block_size``
        and ``head_size / 16`` multiples of 4)."""
        if self is ScaleLayout.LINEAR:
            return True
        return block_size > 0 and block_size % 4 == 0 and head_size > 0 and head_size % 64 == 0

    @classmethod
    def resolve(
        cls, value: ScaleLayout | str | None, block_size: int, head_size: int
    ) -> ScaleLayout:
        """``value`` parsed, or :meth:`default_for` the geometry when it is ``None``."""
        return cls.default_for(block_size, head_size) if value is None else cls.parse(value)


def interleave4_index(
    num_tokens: int, num_scales: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(rows, cols)`` (int64 ``[N, S]`` each) of element ``(t, s)`` of an
    interleave4 plane with ``N = num_tokens`` rows and ``S = num_scales`` columns."""
    if num_tokens <= 0 or num_tokens % 4 != 0:
        raise ValueError(
            f"num_tokens: interleave4 scale layout needs a block size (tokens per page) that is "
            f"a positive multiple of 4, got {num_tokens}"
        )
    if num_scales <= 0 or num_scales % 4 != 0:
        raise ValueError(
            f"num_scales: interleave4 scale layout needs S = head_size/16 scales per token to be "
            f"a positive multiple of 4 (head size a multiple of 64), got {num_scales}"
        )
    quarter = num_scales // 4
    t = torch.arange(num_tokens, dtype=torch.int64, device=device).unsqueeze(1)
    s = torch.arange(num_scales, dtype=torch.int64, device=device).unsqueeze(0)
    rows = (t // 4) * 4 + s // quarter
    cols = (s % quarter) * 4 + t % 4
    return rows, cols


def layout_index(
    layout: ScaleLayout | str,
    num_tokens: int,
    num_scales: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(rows, cols)`` (int64 ``[N, S]``) of element ``(t, s)`` for any layout
    (the identity for ``LINEAR``)."""
    layout = ScaleLayout.parse(layout)
    if layout is ScaleLayout.INTERLEAVE4:
        return interleave4_index(num_tokens, num_scales, device)
    if num_tokens < 0 or num_scales < 0:
        raise ValueError(f"num_tokens, num_scales: expected >= 0, got {num_tokens}, {num_scales}")
    t = torch.arange(num_tokens, dtype=torch.int64, device=device).unsqueeze(1)
    s = torch.arange(num_scales, dtype=torch.int64, device=device).unsqueeze(0)
    return t.expand(num_tokens, num_scales), s.expand(num_tokens, num_scales)


def _check_plane(name: str, t: torch.Tensor) -> None:
    if t.dim() < 2:
        raise ValueError(f"{name}: expected shape [..., N, S], got {list(t.shape)}")


def to_layout(scales: torch.Tensor, layout: ScaleLayout | str) -> torch.Tensor:
    """Rearrange linear planes ``scales [..., N, S]`` into ``layout``: the value at ``(t, s)``
    moves to its stored ``(row, col)``. Returns a new tensor of the same shape and dtype."""
    _check_plane("scales", scales)
    layout = ScaleLayout.parse(layout)
    if layout is ScaleLayout.LINEAR:
        return scales.clone()
    rows, cols = interleave4_index(scales.shape[-2], scales.shape[-1], scales.device)
    out = torch.empty_like(scales, memory_format=torch.contiguous_format)
    out[..., rows, cols] = scales
    return out


def from_layout(stored: torch.Tensor, layout: ScaleLayout | str) -> torch.Tensor:
    """Inverse of :func:`to_layout`: linear planes ``[..., N, S]`` from planes stored in
    ``layout``. Returns a new tensor."""
    _check_plane("stored", stored)
    layout = ScaleLayout.parse(layout)
    if layout is ScaleLayout.LINEAR:
        return stored.clone()
    rows, cols = interleave4_index(stored.shape[-2], stored.shape[-1], stored.device)
    return stored[..., rows, cols]
