"""The KV-cache formats that ``vllm-kv check`` measures, and their data-derived scales.

A format under test is a KV-cache encoding (:class:`~vllm.kv_quant.encoding.KVCacheEncoding`:
a ``kv_cache_dtype`` plus its scale granularity, NVFP4 block-scale layout and key options),
named by an encoding id, as the CLI's ``--formats`` takes them (the grammar is the encoding's,
docs/design.md §3)::

    bf16                              unquantized bfloat16 (the reference)
    fp8_e4m3 | fp8_e5m2 | nvfp4       per-tensor scale ("fp8" is an alias of fp8_e4m3)
    nvfp4_mse                         nvfp4 whose writer searches each block scale (§5.3)
    <quantized>/head                  per-head scale, e.g. fp8_e4m3/head
    nvfp4[/head]@interleave4          NVFP4 with 4-token-interleaved block scales
    nvfp4[/head]@linear               NVFP4 with linear block scales (plain nvfp4 uses the
                                      op's default: interleave4 where the geometry fits)
    <quantized>...+hadamard+offset    keys rotated and/or offset before writing (§5.5;
                                      ``vllm-kv check --model`` only)
    <quantized>...+prerope+sink       keys stored before RoPE (rebuilt by the reader) and the
                                      first key of each page kept in FP8 (FP8 / NVFP4; §5.6;
                                      ``vllm-kv check --model`` only)
    int8_per_token_head               int8 / FP8 e4m3 rows with their own inline fp32 scale
    fp8_per_token_head                (per token and head; no /head, no /tensor)
    int4_per_token_head               rotated 4-bit rows with an inline scale and zero point
    turboquant_* | ultraquant_4bit    K and V of a (token, head) packed in one slot with their
    | octave_*                        scales (:mod:`vllm.kv_quant.slot_codecs`; no /head, @, +)

Scales come from the data: ``scale = amax(|x|) / MAX`` with ``MAX`` the codec's scale maximum
(448 for FP8 e4m3, 57344 for e5m2, ``448 * 6 = 2688`` for the NVFP4 global scale,
docs/design.md §5.3); ``amax`` over the whole tensor, or over each head for a per-head scale.
Per-token-head rows: ``amax(|row|) / 127`` (int8) or ``/ 448`` (e4m3) per token and head,
computed by the writer (:mod:`vllm.kv_quant.per_token_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vllm.kv_quant.calibration import scale_from_amax
from vllm.kv_quant.codecs import has_codec
from vllm.kv_quant.encoding import KeySpec, KVCacheEncoding, ScaleGranularity
from vllm.kv_quant.formats import BFLOAT16, KVCacheFormat, formats, lookup
from vllm.kv_quant.fp8 import FP8_E4M3_MAX
from vllm.kv_quant.nvfp4 import E2M1_MAX
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, SlotCodec, is_packed, slot_codec

MEASURED_FORMATS: tuple[KVCacheFormat, ...] = (
    BFLOAT16,
    *(f for f in formats() if f.is_quantized and not f.mla_only and (has_codec(f) or is_packed(f))),
)
"""The registry formats ``vllm-kv check`` can measure: the reference (bf16) and every quantized
format a user can select that a reference codec reads, per side or packed K+V slots (the
registry's, in its order; MLA records such as ``nvfp4_ds_mla`` excluded: no K/V to compare)."""

SLOT = "slot"
"""The scale granularity of the packed-slot formats (scales inside each slot)."""

TOKEN_HEAD = "token+head"
"""The scale granularity of the per-token-head formats (one inline scale per row)."""


def _default_formats() -> tuple[str, ...]:
    """The reference, then every measured format of the registry but the writer-only variants
    (``nvfp4_mse``: measured on request), each with its scale per tensor and, where it has one,
    per head."""
    ids = [BFLOAT16.label]
    for fmt in MEASURED_FORMATS[1:]:
        if fmt.scale_search:
            continue
        encoding = KVCacheEncoding(fmt)
        ids.append(encoding.id)
        if encoding.granularity is ScaleGranularity.TENSOR and not is_packed(fmt):
            ids.append(KVCacheEncoding(fmt, ScaleGranularity.HEAD).id)
    return tuple(ids)


DEFAULT_FORMATS: tuple[str, ...] = _default_formats()
"""The formats ``vllm-kv check`` measures when ``--formats`` is not given (bf16, fp8_e4m3,
fp8_e4m3/head, fp8_e5m2, fp8_e5m2/head, nvfp4, nvfp4/head and the per-token-head formats)."""

MODEL_DEFAULT_FORMATS: tuple[str, ...] = (
    *DEFAULT_FORMATS,
    "nvfp4_4over6",
    "fp8_e4m3/head+hadamard+offset",
    "nvfp4_mse+offset+prerope+sink",
    "nvfp4_4over6+hadamard+offset+prerope+sink",
)
"""What ``vllm-kv check --model`` measures when ``--formats`` is not given: the defaults, upstream's
``nvfp4_4over6`` (so that every upstream format is a row), and the best FP8 and NVFP4 key
options measured on the model (docs/accuracy.md), those its attention backend reads
(:func:`vllm.cli.check_model.model_formats`)."""


@dataclass(frozen=True)
class CacheFormat:
    """One KV-cache format under test: an encoding (:attr:`encoding`) described by the fields
    the harness reads, checked by the encoding's rules when built.

    Attributes:
        kv_cache_dtype: canonical dtype string of a :data:`MEASURED_FORMATS` entry
            (``bfloat16``, ``fp8_e4m3``, ``nvfp4``, ``int8_per_token_head``, ...).
        per_head: one scale per KV head (``[H]``) instead of one per tensor (``[1]``).
        scale_layout: NVFP4 block-scale layout in the page (K and V alike); ``None`` is the
            op's default for the cache geometry (:meth:`scale_layout_for`).
        key_rotation, key_offset, key_prerope, key_sink_tokens: the encoding's key spec
            (docs/design.md §5.5-5.6).
    """

    kv_cache_dtype: str
    per_head: bool = False
    scale_layout: ScaleLayout | None = None
    key_rotation: str | None = None
    key_offset: bool = False
    key_prerope: bool = False
    key_sink_tokens: int = 0

    def __post_init__(self) -> None:
        measured = {f.name for f in MEASURED_FORMATS}
        if self.kv_cache_dtype not in measured:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(measured)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        self.encoding  # the encoding's rules  # noqa: B018
        if self.is_packed and (self.per_head or self.scale_layout or self.has_key_options):
            raise ValueError(
                f"formats: expected {self.kv_cache_dtype} without /head, @layout or key options "
                f"(its scales are inside each slot), got {self.encoding.id!r}"
            )

    @classmethod
    def of(cls, encoding: KVCacheEncoding) -> CacheFormat:
        """The format under test of ``encoding`` (its RoPE identity aside; the harness writes
        one NVFP4 block-scale layout for K and V, the encoding's K layout)."""
        key = encoding.key
        return cls(
            encoding.format.name,
            encoding.per_head_scales,
            encoding.k_scale_layout,
            key.rotation,
            key.offset,
            key.prerope,
            key.sink_tokens,
        )

    @cached_property
    def encoding(self) -> KVCacheEncoding:
        """The encoding under test (``ValueError`` where the fields do not go together); built
        once."""
        granularity = ScaleGranularity.HEAD if self.per_head else None
        return KVCacheEncoding(
            lookup(self.kv_cache_dtype),
            granularity,
            self.scale_layout,
            self.scale_layout,
            KeySpec(self.key_rotation, self.key_offset, self.key_prerope, self.key_sink_tokens),
        )

    @property
    def name(self) -> str:
        """The format id: the encoding's (e.g. ``nvfp4/head``), ``bf16`` for the unquantized
        reference."""
        return self.encoding.id if self.is_quantized else self.format.label

    @property
    def has_key_options(self) -> bool:
        """A key rotation, offset, pre-RoPE storage or key sinks are set (measured by the
        model report only)."""
        return not self.encoding.key.is_identity

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
    def is_packed(self) -> bool:
        """K and V of a (token, head) in one slot with their scales (their codecs:
        :mod:`vllm.kv_quant.slot_codecs`)."""
        return is_packed(self.format)

    def slot_codec(self, head_size: int) -> SlotCodec:
        """The packed-slot codec of this format for heads of ``head_size``."""
        return slot_codec(self.format, head_size, OCTAVE_CHECK_ROPE_DIM)

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
        """``MAX`` in ``scale = amax / MAX``: the codec's (448 for e4m3, 57344 for e5m2, 448 × 6
        for NVFP4, 127 or 448 for the per-token-head rows, int8 or e4m3)."""
        scale_max = None if self.is_packed else self.encoding.codec.scale_max
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
        if self.is_packed:
            return SLOT
        granularity = self.encoding.granularity
        if granularity is ScaleGranularity.NONE:
            return "-"
        if granularity is ScaleGranularity.TOKEN_HEAD:
            return TOKEN_HEAD
        return granularity.value  # type: ignore[union-attr]

    @property
    def scale_method(self) -> str:
        """Human-readable rule that chose the scales, e.g. ``amax(|x|)/448 per head`` or
        ``amax(|x|)/127 per token and head, inline``."""
        if not self.is_quantized:
            return "none (unquantized)"
        if self.is_packed:
            return "its own, inside each slot (packed K+V)"
        if self.is_per_token_head:
            return f"amax(|x|)/{self.scale_max_text} per token and head, inline"
        per = "per head" if self.per_head else "per tensor"
        return f"amax(|x|)/{self.scale_max_text} {per}"

    def head_size_problem(self, head_size: int) -> str | None:
        """Why this format cannot cache heads of ``head_size`` elements (its layout's error,
        e.g. Octave's 64-dim blocks), or ``None`` when it can."""
        try:
            if self.is_packed:
                self.slot_codec(head_size)
            else:
                self.cache_last_dim(head_size)
        except ValueError as exc:
            return str(exc)
        return None

    def cache_last_dim(self, head_size: int) -> int:
        """Last dim ``D'`` of the cache tensor: ``D``, or ``F(D) = D/2 + D/16`` for NVFP4."""
        return self.format.last_dim(head_size)

    def page_bytes(
        self, num_kv_heads: int, head_size: int, head_size_v: int, block_size: int = 16
    ) -> int:
        """Every byte of one page of ``block_size`` tokens of one layer (K and V, block and
        inline scales, key sink rows): the encoding's page, what a plan allocates per page."""
        if self.is_packed:  # Octave's slot follows the rotary dims the check's codec uses
            return block_size * num_kv_heads * self.slot_codec(head_size).slot_bytes
        return self.encoding.page_bytes(block_size, num_kv_heads, head_size, head_size_v)

    def bytes_per_token(self, num_kv_heads: int, head_size: int, head_size_v: int) -> int:
        """K plus V cache bytes of one token of one layer (all KV heads) at 16-token pages:
        the page (global scales, a few bytes per layer, are not counted; key sink rows are)
        shared by its tokens (rounded up)."""
        block_size = 16
        return -(-self.page_bytes(num_kv_heads, head_size, head_size_v, block_size) // block_size)


def parse_format(text: str) -> CacheFormat:
    """The :class:`CacheFormat` named by a format id such as ``fp8_e5m2/head`` or
    ``nvfp4@interleave4`` (the encoding grammar); ``ValueError`` naming ``formats``
    otherwise."""
    encoding = KVCacheEncoding.parse(text, "formats", include_mla_only=False)
    try:
        return CacheFormat.of(encoding)
    except ValueError as e:
        raise ValueError(f"formats: invalid format {text.strip()!r}: {e}") from None


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
    """``(k_scale, v_scale)`` for ``fmt`` from the data (see :func:`amax_scale`); for bf16, the
    per-token-head and the packed-slot formats both are ``[1.0]`` (unread: those writers compute
    their own)."""
    if not fmt.is_quantized or fmt.is_per_token_head or fmt.is_packed:
        one = torch.ones(1, dtype=torch.float32, device=key.device)
        return one, one.clone()
    return (
        amax_scale(key, fmt.per_head, fmt.scale_max),
        amax_scale(value, fmt.per_head, fmt.scale_max),
    )
