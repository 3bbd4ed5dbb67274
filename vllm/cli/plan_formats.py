"""``vllm-kv plan``: what a cache dtype needs from the model before its pages can be sized, and
the check that every layer it caches can hold it.

Most formats size a page from the layer's shape alone. Octave's block-K slot also depends on the
model's rotary dims, which the dtype string does not name: as upstream's attention layer does,
they are derived from the model config (``partial_rotary_factor``,
:func:`~vllm.v1.attention.ops.rocm_octave.rope_dim_from_hf_config`) and registered per head size
before sizing. A format that cannot cache a layer (``nvfp4_ds_mla`` outside DeepSeek-V3.2's
576-wide latent, Octave with a head size that is not a multiple of 64) is reported as one
``--kv-cache-dtype`` error naming the layer, before anything is printed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from vllm.cli.args import UsageError
from vllm.cli.plan_model import PLANNER_FLAGS
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import AUTO
from vllm.kv_quant.octave import register_rope_dim
from vllm.v1.attention.ops.rocm_octave import rope_dim_from_hf_config
from vllm.v1.core.model_layout import LayerDesc, ModelLayout
from vllm.v1.core.model_specs import build_kv_cache_specs

__all__ = ["check_formats", "register_model_rope_dims"]

_OCTAVE_MLA = "Octave packs each head's K and V; an MLA latent has neither"


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of ``config`` (``text_config`` of a multimodal wrapper)."""
    text = config.get("text_config")
    if "num_attention_heads" not in config and isinstance(text, Mapping):
        return text
    return config


def register_model_rope_dims(
    config: Mapping[str, Any], layout: ModelLayout, dtypes: Sequence[str]
) -> None:
    """Register the rotary dims of each attention head size of ``layout`` when one of ``dtypes``
    is an Octave format (whose block-K slot depends on them); :class:`UsageError` naming
    ``--model`` when the config's factor is unusable or the process already holds other
    rotary dims for a head size."""
    if not any(KVCacheEncoding.parse(d).format.quant_mode.is_octave for d in dtypes):
        return
    text = SimpleNamespace(**_text_config(config))
    factor = getattr(text, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1
    ):
        raise UsageError(
            "--model", f"expected partial_rotary_factor in (0, 1] in the config, got {factor!r}"
        )
    heads = {lay.head_size for lay in layout.layers if lay.head_size and "mla" not in lay.tags}
    for head_size in sorted(heads):
        try:
            register_rope_dim(head_size, rope_dim_from_hf_config(text, head_size))
        except ValueError as exc:
            raise UsageError("--model", str(exc)) from None


def _refused(dtype: str, model: str, layer: LayerDesc, problem: str) -> UsageError:
    return UsageError(
        "--kv-cache-dtype",
        f"{dtype} cannot cache layer {layer.name} of {model} ({layer.kind}, "
        f"{layer.num_kv_heads} KV heads of {layer.head_size}): {problem}",
    )


def check_formats(
    model: str,
    layout: ModelLayout,
    dtypes: Sequence[str],
    block_size: int | None,
    skip_layers: Sequence[str],
) -> None:
    """Build and size every layer's page for each of ``dtypes`` now, so that a format that
    cannot cache a layer is one :class:`UsageError` naming ``--kv-cache-dtype`` and the layer,
    not a failure while the report is printed. Errors of the other flags (a ``block_size:`` or
    ``kv_cache_dtype_skip_layers:`` ``ValueError``) propagate for the caller to name."""
    for dtype in dtypes:
        octave = KVCacheEncoding.parse(dtype).format.quant_mode.is_octave
        try:
            specs = build_kv_cache_specs(layout, dtype, block_size, skip_layers)
        except ValueError as exc:
            if str(exc).partition(": ")[0] in PLANNER_FLAGS:
                raise
            mla = next((lay for lay in layout.layers if "mla" in lay.tags), None)
            if octave and mla is not None:
                raise _refused(dtype, model, mla, _OCTAVE_MLA) from None
            raise UsageError("--kv-cache-dtype", f"{dtype} cannot cache {model}: {exc}") from None
        for layer in layout.layers:
            if octave and specs.cache_dtypes[layer.name] != AUTO.name and "mla" in layer.tags:
                raise _refused(dtype, model, layer, _OCTAVE_MLA)
            try:
                specs.specs[layer.name].page_size_bytes  # noqa: B018  (sizing is the check)
            except ValueError as exc:
                raise _refused(dtype, model, layer, str(exc)) from None
