"""The KV-cache formats that ``vllm-kv check`` measures, and their data-derived scales.

A format is a ``kv_cache_dtype`` string (docs/design.md §3) plus how its dequantization scale is
chosen: one fp32 scale per tensor (``[1]``) or one per KV head (``[H]``), and for NVFP4 where
the block scales live in a page (:class:`~vllm.kv_quant.scale_layout.ScaleLayout`). The
per-token-head formats (docs/design.md §5.4) choose no scale here: their writer computes one per
token and head and stores it inline, so the check hands it unit ``k_scale`` / ``v_scale``.

Format ids, as the CLI's ``--formats`` takes them::

    bf16                              unquantized bfloat16 (the reference)
    fp8_e4m3 | fp8_e5m2 | nvfp4       per-tensor scale ("fp8" is an alias of fp8_e4m3)
    nvfp4_mse                         nvfp4 whose writer searches each block scale (§5.3);
                                      takes every nvfp4 option below
    <quantized>/head                  per-head scale, e.g. fp8_e4m3/head
    nvfp4[/head]@interleave4          NVFP4 with 4-token-interleaved block scales
    <quantized>...+hadamard+offset    keys rotated and/or offset before writing (docs/design.md
                                      §5.5; ``vllm-kv check --model`` only)
    <quantized>...+prerope+sink       keys stored before RoPE (rebuilt by the reader) and the
                                      first key of each page kept in FP8 (FP8 / NVFP4;
                                      §5.5; ``vllm-kv check --model`` only)
    nvfp4[/head]@linear               NVFP4 with linear block scales (plain nvfp4 uses the
                                      op's default: interleave4 where the geometry fits)
    int8_per_token_head               int8 / FP8 e4m3 rows with their own inline fp32 scale
    fp8_per_token_head                (per token and head; no /head, no /tensor)

Scales come from the data: ``scale = amax(|x|) / MAX`` with ``MAX = 448`` for FP8 e4m3,
``57344`` for FP8 e5m2 and ``448 * 6 = 2688`` for the NVFP4 global scale
(:data:`~vllm.kv_quant.nvfp4.NVFP4_SCALE_MAX`, docs/design.md §5.3); ``amax`` over the whole
tensor, or over each head for a per-head scale. Per-token-head rows: ``amax(|row|) / 127``
(int8) or ``/ 448`` (e4m3) per token and head, computed by the writer
(:mod:`vllm.kv_quant.per_token_head`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kv_quant.calibration import kv_scale_max, scale_from_amax
from vllm.kv_quant.formats import BFLOAT16, KVCacheFormat, formats, lookup
from vllm.kv_quant.fp8 import FP8_E4M3_MAX
from vllm.kv_quant.hadamard import HADAMARD
from vllm.kv_quant.key_transform import KeyTransform
from vllm.kv_quant.nvfp4 import E2M1_MAX
from vllm.kv_quant.per_token_head import per_token_head_qmax
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.v1.kv_cache_interface import FullAttentionSpec

MEASURED_FORMATS: tuple[KVCacheFormat, ...] = (
    BFLOAT16,
    *(f for f in formats() if f.is_quantized and not f.mla_only),
)
"""The registry formats ``vllm-kv check`` can measure: the reference (bf16) and every quantized
format a user can select (the registry's, in its order; MLA-only record layouts excluded)."""

TOKEN_HEAD = "token+head"
"""The scale granularity of the per-token-head formats (one inline scale per row)."""

_SHORT_NAMES: dict[str, str] = {
    f.name: f.name if f.is_quantized else f.label for f in MEASURED_FORMATS
}
"""Canonical dtype → format id (``bf16`` for the unquantized reference)."""

_DTYPE_ALIASES: dict[str, str] = {
    **{short: name for name, short in _SHORT_NAMES.items()},
    **{name: f.name for f in MEASURED_FORMATS for name in f.accepted_names},
}
"""Every name a format id may start with (its id, e.g. ``bf16``, and the registry's names and
aliases) → its canonical dtype."""

DEFAULT_FORMATS: tuple[str, ...] = (
    "bf16",
    "fp8_e4m3",
    "fp8_e4m3/head",
    "fp8_e5m2",
    "fp8_e5m2/head",
    "nvfp4",
    "nvfp4/head",
    "int8_per_token_head",
    "fp8_per_token_head",
)
"""The formats ``vllm-kv check`` measures when ``--formats`` is not given."""

MODEL_DEFAULT_FORMATS: tuple[str, ...] = (
    *DEFAULT_FORMATS,
    "fp8_e4m3/head+hadamard+offset",
    "nvfp4_mse+offset+prerope+sink",
)
"""What ``vllm-kv check --model`` measures when ``--formats`` is not given: the defaults and the
best FP8 and NVFP4 key options measured on the model (docs/accuracy.md)."""


@dataclass(frozen=True)
class CacheFormat:
    """One KV-cache format under test.

    Attributes:
        kv_cache_dtype: canonical dtype string of a :data:`MEASURED_FORMATS` entry
            (``bfloat16``, ``fp8_e4m3``, ``nvfp4``, ``int8_per_token_head``, ...).
        per_head: one scale per KV head (``[H]``) instead of one per tensor (``[1]``).
            Always False for ``bfloat16`` and the per-token-head formats.
        scale_layout: NVFP4 block-scale layout in the page (K and V alike); ``None`` (the
            only value for other dtypes) is the op's default for the cache geometry
            (:meth:`scale_layout_for`).
    """

    kv_cache_dtype: str
    per_head: bool = False
    scale_layout: ScaleLayout | None = None
    key_rotation: str | None = None
    """``"hadamard"``: keys stored rotated, queries rotated alike (docs/design.md §5.5)."""
    key_offset: bool = False
    """Keys stored minus their calibrated mean per head and channel (docs/design.md §5.5)."""
    key_prerope: bool = False
    """Keys stored before RoPE, the reader applying it (docs/design.md §5.5)."""
    key_sink_tokens: int = 0
    """The first keys of each page kept again in FP8 beside the pages (docs/design.md §5.5)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _SHORT_NAMES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(_SHORT_NAMES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not self.is_quantized and self.per_head:
            raise ValueError(
                f"per_head: {_SHORT_NAMES[self.kv_cache_dtype]} has no scale, so no per-head scale"
            )
        if self.is_per_token_head and self.per_head:
            raise ValueError(
                f"per_head: expected False for {self.kv_cache_dtype} (one inline scale per "
                "token and head), got True"
            )
        KeyTransform(self.key_rotation)  # checks the rotation's name
        if self.has_key_options and not self.is_quantized:
            raise ValueError(
                f"kv_cache_dtype: expected a quantized format with +{HADAMARD} / +offset / "
                f"+prerope / +sink (they only reduce quantization error), got "
                f"{self.kv_cache_dtype}"
            )
        if self.key_sink_tokens and self.is_per_token_head:
            raise ValueError(
                "kv_cache_dtype: expected an FP8 or NVFP4 format with +sink (the sink rows use "
                f"its K scale), got {self.kv_cache_dtype}"
            )
        if (
            self.scale_layout is not None
            and self.scale_layout.value not in self.format.scale_layouts
        ):
            raise ValueError(
                f"scale_layout: only NVFP4 has block scales, got {self.scale_layout.value!r} "
                f"for {self.kv_cache_dtype}"
            )

    @property
    def name(self) -> str:
        """The format id (see the module docstring), e.g. ``nvfp4/head``."""
        out = _SHORT_NAMES[self.kv_cache_dtype]
        if self.per_head:
            out += "/head"
        if self.scale_layout is not None:
            out += f"@{self.scale_layout.value}"
        if self.key_rotation is not None:
            out += f"+{self.key_rotation}"
        if self.key_offset:
            out += "+offset"
        if self.key_prerope:
            out += "+prerope"
        if self.key_sink_tokens:
            out += "+sink"
        return out

    @property
    def has_key_options(self) -> bool:
        """A key rotation, offset, pre-RoPE storage or key sinks are set (measured by the
        model report only)."""
        return (
            self.key_rotation is not None
            or self.key_offset
            or self.key_prerope
            or self.key_sink_tokens > 0
        )

    def scale_layout_for(self, block_size: int, head_size: int) -> ScaleLayout:
        """The NVFP4 block-scale layout of a cache of this format with pages of ``block_size``
        tokens and heads of ``head_size``: the named one, else the op's default."""
        return ScaleLayout.resolve(self.scale_layout, block_size, head_size)

    @property
    def format(self) -> KVCacheFormat:
        """The registry's entry for :attr:`kv_cache_dtype`."""
        return lookup(self.kv_cache_dtype)

    @property
    def is_quantized(self) -> bool:
        return self.format.is_quantized

    @property
    def is_nvfp4(self) -> bool:
        return self.format.is_nvfp4

    @property
    def is_fp8(self) -> bool:
        return self.format.is_fp8

    @property
    def is_per_token_head(self) -> bool:
        """Rows with their own inline scale: ``k_scale`` / ``v_scale`` are not read."""
        return self.format.is_per_token_head

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element dtype of the cache tensor (uint8, or int8 for ``int8_per_token_head``)."""
        assert self.format.storage_dtype is not None
        return self.format.storage_dtype

    @property
    def scale_max(self) -> float:
        """``MAX`` in ``scale = amax / MAX``: the FP8 variant's largest value (448 for e4m3,
        57344 for e5m2), 448 × 6 for NVFP4 (the largest block scale times the largest E2M1
        value), 127 or 448 for the per-token-head rows (int8, e4m3)."""
        if self.is_per_token_head:
            return per_token_head_qmax(self.format)
        scale_max = kv_scale_max(self.kv_cache_dtype)
        if scale_max is None:
            raise ValueError(f"format: expected a quantized format, got {self.name!r}")
        return scale_max

    @property
    def scale_max_text(self) -> str:
        """:attr:`scale_max` as printed in scale rules: ``448``, ``57344`` or ``(448*6)``."""
        if self.is_nvfp4:
            return f"({FP8_E4M3_MAX:g}*{E2M1_MAX:g})"
        return f"{self.scale_max:g}"

    @property
    def granularity(self) -> str:
        """``-`` (no scale), ``tensor``, ``head`` or ``token+head`` (inline per-row scales)."""
        if not self.is_quantized:
            return "-"
        if self.is_per_token_head:
            return TOKEN_HEAD
        return "head" if self.per_head else "tensor"

    @property
    def scale_method(self) -> str:
        """Human-readable rule that chose the scales, e.g. ``amax(|x|)/448 per head`` or
        ``amax(|x|)/127 per token and head, inline``."""
        if not self.is_quantized:
            return "none (unquantized)"
        if self.is_per_token_head:
            return f"amax(|x|)/{self.scale_max_text} per token and head, inline"
        per = "per head" if self.per_head else "per tensor"
        return f"amax(|x|)/{self.scale_max_text} {per}"

    def cache_last_dim(self, head_size: int) -> int:
        """Last dim ``D'`` of the cache tensor: ``D``, or ``F(D) = D/2 + D/16`` for NVFP4."""
        return self.format.last_dim(head_size)

    def page_bytes(
        self, num_kv_heads: int, head_size: int, head_size_v: int, block_size: int = 16
    ) -> int:
        """Bytes of one page of ``block_size`` tokens of one layer (K and V, block and inline
        scales): the spec's page size, what a plan allocates per page. The key sink rows are
        not in it (:meth:`sink_bytes_per_page`)."""
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size_v,
            dtype=self.storage_dtype,
            kv_quant_mode=self.format.quant_mode,
        )
        return spec.real_page_size_bytes

    def sink_bytes_per_page(self, num_kv_heads: int, head_size: int) -> int:
        """Bytes of the FP8 key sink rows kept beside each page of one layer (0 without
        ``+sink``)."""
        return self.key_sink_tokens * num_kv_heads * head_size

    def bytes_per_token(self, num_kv_heads: int, head_size: int, head_size_v: int) -> int:
        """K plus V cache bytes of one token of one layer (all KV heads) at 16-token pages:
        the page (global scales, a few bytes per layer, are not counted) plus its key sink
        rows, shared by its tokens (rounded up)."""
        block_size = 16
        page = self.page_bytes(num_kv_heads, head_size, head_size_v, block_size)
        sinks = self.sink_bytes_per_page(num_kv_heads, head_size)
        return -(-(page + sinks) // block_size)


def parse_format(text: str) -> CacheFormat:
    """The :class:`CacheFormat` named by a format id such as ``fp8_e5m2/head`` or
    ``nvfp4@interleave4``; ``ValueError`` naming the accepted ids otherwise."""
    raw = text.strip()
    body, *options = raw.split("+")
    body, _, layout = body.partition("@")
    dtype, _, granularity = body.partition("/")
    per_token_head = ", ".join(f.name for f in MEASURED_FORMATS if f.is_per_token_head)
    accepted = (
        "bf16, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2, nvfp4, nvfp4_mse, optionally followed by "
        "/tensor or /head, and for nvfp4 / nvfp4_mse by @linear or @interleave4; or "
        f"{per_token_head}; then "
        f"optionally +{HADAMARD}, +offset, +prerope and/or +sink"
    )
    known_options = {HADAMARD, "offset", "prerope", "sink"}
    if (
        dtype not in _DTYPE_ALIASES
        or granularity not in ("", "tensor", "head")
        or not set(options) <= known_options
        or len(set(options)) != len(options)
    ):
        raise ValueError(f"formats: unknown format {raw!r}; expected {accepted}")
    kv_cache_dtype = _DTYPE_ALIASES[dtype]
    try:
        scale_layout = ScaleLayout.parse(layout) if layout else None
        return CacheFormat(
            kv_cache_dtype,
            granularity == "head",
            scale_layout,
            key_rotation=HADAMARD if HADAMARD in options else None,
            key_offset="offset" in options,
            key_prerope="prerope" in options,
            key_sink_tokens=1 if "sink" in options else 0,
        )
    except ValueError as e:
        raise ValueError(f"formats: invalid format {raw!r}: {e}") from None


def parse_formats(text: str | None) -> list[CacheFormat]:
    """Formats of a comma-separated list of ids (``None``, ``""`` or ``"all"``: the defaults).
    Duplicates are dropped, order is kept."""
    items = DEFAULT_FORMATS if not text or text.strip() == "all" else text.split(",")
    out: list[CacheFormat] = []
    for item in items:
        if not item.strip():
            continue
        fmt = parse_format(item)
        if fmt not in out:
            out.append(fmt)
    if not out:
        raise ValueError(f"formats: no format in {text!r}")
    return out


def amax_scale(x: torch.Tensor, per_head: bool, scale_max: float) -> torch.Tensor:
    """Dequantization scale of ``x [T, H, D]``: ``amax(|x|) / scale_max`` in fp32, shape
    ``[1]`` or ``[H]`` (per head). An all-zero tensor or head gets scale 1.0 (any positive
    scale represents zeros exactly; the ops reject scale 0)."""
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [T, H, D], got {list(x.shape)}")
    xf = x.detach().to(torch.float32).abs()
    amax = xf.amax(dim=(0, 2)) if per_head else xf.amax().reshape(1)
    return scale_from_amax(amax, scale_max)


def compute_scales(
    key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` for ``fmt`` from the data (see :func:`amax_scale`); for bf16 and
    the per-token-head formats both are ``[1.0]`` (unread: those writers compute their own)."""
    if not fmt.is_quantized or fmt.is_per_token_head:
        one = torch.ones(1, dtype=torch.float32, device=key.device)
        return one, one.clone()
    return (
        amax_scale(key, fmt.per_head, fmt.scale_max),
        amax_scale(value, fmt.per_head, fmt.scale_max),
    )
