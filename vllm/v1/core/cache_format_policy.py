"""Which cache format each layer gets for a requested ``kv_cache_dtype`` (the fallback policy).

The request is a dtype string or an encoding id (:mod:`vllm.kv_quant.encoding`). K/V attention
layers get its encoding: the format's storage dtype and quant mode, and the whole encoding
(key options, key sink rows, layouts) in the spec when it is more than the default of that mode
and dtype. MLA latents take the format only (key options are K/V page options; a note says so).
Mamba / linear-attention states always use the model dtype (the KV-cache dtype does not apply
to them). NVFP4 is not a format for MLA latents: for ``nvfp4`` requests V3 MLA layers fall back
to the model dtype (plain fp8 MLA needs a calibrated per-tensor fp8 scale that an NVFP4
checkpoint does not carry) and DeepSeek-V4 layers fall back to ``fp8_ds_mla`` (its 584-byte
record carries its own scales); the indexer falls back to its fp8 entry (132 bytes). Every
fallback is recorded in the specs' notes (:attr:`~vllm.v1.core.model_specs.ModelKVSpecs.notes`).

:func:`layer_spec` is the one place that applies it: one layer, one requested dtype (already
resolved for ``kv_cache_dtype_skip_layers``) → its spec, the dtype string it got and the note
explaining a fallback.
"""

from __future__ import annotations

from typing import Any

from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import AUTO, FP8_DS_MLA, FP8_E4M3
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.model_layout import STATE_KINDS, LayerDesc
from vllm.v1.kv_cache_interface import (
    FP8_DS_MLA_HEAD_SIZE,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)

__all__ = ["DSV4_INDEXER_FP8_SCALE_GROUP", "FP8_DS_MLA_ALIGNMENT", "layer_spec"]

DSV4_MODEL_VERSION = "deepseek_v4"
"""The latent specs' ``model_version`` selecting DeepSeek-V4's 584-byte ``fp8_ds_mla`` record."""

FP8_DS_MLA_ALIGNMENT = 576
"""Page alignment (bytes) of compressed ``fp8_ds_mla`` pages (docs/design.md §4)."""

DSV4_FP8_NAME = FP8_E4M3.accepted_names[0]
"""``fp8``: the dtype string DeepSeek-V4's self-scaled e4m3 entries are reported under."""

DSV4_INDEXER_FP8_SCALE_GROUP = 128
"""fp8 indexer keys carry one 4-byte fp32 scale per this many values: index_head_dim 128 gives
the 132-byte entry of rtp-llm's ``fp8_indexer_entry``."""


def _attention_kwargs(
    layer: LayerDesc, block_size: int, cache_dtype: str, model_dtype: str
) -> dict[str, Any]:
    """Page, head and dtype fields of an attention spec of ``layer`` cached as ``cache_dtype``
    (a dtype string: the format of an encoding id)."""
    return dict(
        block_size=block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_dtype),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )


def _kv_page_kwargs(
    layer: LayerDesc, block_size: int, encoding: KVCacheEncoding, model_dtype: str
) -> dict[str, Any]:
    """:func:`_attention_kwargs` of the encoding's format, with the encoding itself (a spec
    equals upstream's when the encoding is its quant mode and dtype's default)."""
    kwargs = _attention_kwargs(layer, block_size, encoding.format.name, model_dtype)
    return {**kwargs, "encoding": encoding}


def layer_spec(
    layer: LayerDesc, cache_dtype: str, model_dtype: str, block_size: int
) -> tuple[KVCacheSpec, str, str | None]:
    """Spec of ``layer`` for ``cache_dtype`` (a dtype string or encoding id, already
    skip-resolved): (spec, effective dtype string or encoding id, fallback note or None)."""
    encoding = KVCacheEncoding.parse(cache_dtype, "cache_dtype", include_mla_only=False)
    mode = encoding.format.quant_mode
    kind = layer.kind
    if kind in STATE_KINDS:
        dtype = kv_cache_dtype_str_to_dtype(AUTO.name, model_dtype)
        note = None
        if mode.is_quantized:
            note = (
                f"{kind} layers keep their recurrent state in the model dtype ({model_dtype}); "
                "a quantized kv_cache_dtype applies to attention layers only"
            )
        spec = MambaSpec(
            block_size=block_size,
            shapes=layer.state_shapes,
            dtypes=(dtype,) * len(layer.state_shapes),
            mamba_type=layer.mamba_type or "mamba2",
        )
        return spec, AUTO.name, note
    if kind in ("full_attention", "sliding_window"):
        common = _kv_page_kwargs(layer, block_size, encoding, model_dtype)
        if kind == "full_attention":
            return FullAttentionSpec(**common), cache_dtype, None
        assert layer.sliding_window is not None
        return SlidingWindowSpec(sliding_window=layer.sliding_window, **common), cache_dtype, None
    key_note = None
    if not encoding.key.is_identity:
        key_note = (
            f"{kind} layers: the key options of {encoding.id} apply to K/V pages; the latent "
            f"cache is stored as {encoding.format.name}"
        )
        cache_dtype = encoding.format.name
    if kind == "mla":
        note = key_note
        effective = cache_dtype
        if mode.is_nvfp4:
            effective = AUTO.name
            note = (
                f"mla layers: nvfp4 is not an MLA cache format; kept in the model dtype "
                f"({model_dtype}) since plain fp8 MLA needs a calibrated fp8 scale"
            )
        latent = _attention_kwargs(layer, block_size, effective, model_dtype)
        spec = MLAAttentionSpec(
            cache_dtype_str=effective if latent["kv_quant_mode"].is_quantized else None, **latent
        )
        return spec, effective, note
    # DeepSeek-V4 kinds: quantized requests use the self-scaled fp8 formats.
    note = key_note
    if mode.is_quantized:
        if encoding.format is not FP8_E4M3:
            note = (
                f"deepseek_v4: {cache_dtype} is not a DeepSeek-V4 cache format; latent caches "
                "use fp8_ds_mla (584 B per slot) and indexer keys the fp8 entry (128 values + "
                "fp32 scale), both e4m3 with their own scales"
            )
        if kind == "mla_indexer":
            spec = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=layer.head_size + 4 * -(-layer.head_size // DSV4_INDEXER_FP8_SCALE_GROUP),
                dtype=FP8_E4M3.storage_dtype,
                kv_quant_mode=FP8_E4M3.quant_mode,
                compress_ratio=layer.compress_ratio,
            )
            return spec, DSV4_FP8_NAME, note
        if layer.head_size != FP8_DS_MLA_HEAD_SIZE:
            raise ValueError(
                f"config: key 'head_dim' must be {FP8_DS_MLA_HEAD_SIZE} for the fp8_ds_mla "
                f"cache, got {layer.head_size}"
            )
        quant = dict(
            block_size=block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            dtype=FP8_DS_MLA.storage_dtype,
            kv_quant_mode=FP8_DS_MLA.quant_mode,
            cache_dtype_str=FP8_DS_MLA.name,
            model_version=DSV4_MODEL_VERSION,
        )
        if kind == "sliding_window_mla":
            assert layer.sliding_window is not None
            return (
                SlidingWindowMLASpec(sliding_window=layer.sliding_window, **quant),
                DSV4_FP8_NAME,
                note,
            )
        spec = MLAAttentionSpec(
            compress_ratio=layer.compress_ratio, alignment=FP8_DS_MLA_ALIGNMENT, **quant
        )
        return spec, FP8_DS_MLA.name, note
    plain = _attention_kwargs(layer, block_size, cache_dtype, model_dtype)
    if kind == "sliding_window_mla":
        assert layer.sliding_window is not None
        spec = SlidingWindowMLASpec(sliding_window=layer.sliding_window, **plain)
        return spec, cache_dtype, key_note
    return MLAAttentionSpec(compress_ratio=layer.compress_ratio, **plain), cache_dtype, key_note
