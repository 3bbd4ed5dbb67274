"""A model's cache-holding layers, independent of cache dtype and block size.

A :class:`ModelLayout` holds one :class:`LayerDesc` per cache-holding layer, heads already
divided for tensor parallelism; the parsers of :mod:`vllm.v1.core.model_families` build it
from a config, and :func:`vllm.v1.core.model_specs.build_kv_cache_specs` turns it into specs.

Layer kinds (``LayerDesc.kind``) and the names they get:

- ``full_attention`` / ``sliding_window``: ``model.layers.{i}.self_attn``, a
  ``FullAttentionSpec`` / ``SlidingWindowSpec`` with ``num_kv_heads`` K and V heads.
- ``mla`` (DeepSeek-V3): ``model.layers.{i}.self_attn``, ``MLAAttentionSpec`` with one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token, shared by all heads (never split by TP).
- DeepSeek-V4, per main layer i with ``compress_ratios[i]`` r (the rtp-llm / aiconfigurator
  accounting recorded in the presets' ``derived`` block): every layer keeps a sliding-window
  cache of one ``head_dim`` latent per token (``sliding_window_mla``, a ``SlidingWindowMLASpec``);
  r=4 layers add the compressed KV (``compressed_mla``, ``MLAAttentionSpec(compress_ratio=4)``)
  and the indexer keys (``mla_indexer``, ``index_head_dim`` per stored slot, also ratio 4);
  r=128 layers add the compressed KV only. Names: the main cache is
  ``model.layers.{i}.self_attn``, the extra caches ``.self_attn.indexer`` and ``.self_attn.swa``.
  The per-sequence fp32 compressor decode states are not paged KV cache and are not modelled
  (``deepseek_v4_compressor_state_bytes`` in :mod:`vllm.v1.core.model_families.deepseek_v4`
  gives aiconfigurator's estimate). The MTP layers (``num_nextn_predict_layers``) of V3/V4 are
  not modelled.
- ``mamba`` (Nemotron-H ``M``): ``model.layers.{i}.mixer``, ``MambaSpec`` with conv state
  ``(conv_kernel-1, heads*head_dim + 2*n_groups*ssm_state_size)`` and SSM state
  ``(heads, head_dim, ssm_state_size)``.
- ``linear_attention`` (Qwen3-Next Gated DeltaNet): ``model.layers.{i}.linear_attn``,
  ``MambaSpec`` with conv state ``(kernel-1, 2*k_heads*k_dim + v_heads*v_dim)`` and recurrent
  state ``(v_heads, k_dim, v_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "LAYER_KINDS",
    "SKIP_TAGS",
    "STATE_KINDS",
    "LayerDesc",
    "ModelLayout",
    "ParsedLayers",
    "attention_layer",
]

DEFAULT_BLOCK_SIZE = 16
"""Tokens per page when none is given (models without compressed layers)."""

LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "full_attention": ("full_attention",),
    "sliding_window": ("sliding_window",),
    "mla": ("mla",),
    "compressed_mla": ("compressed_mla", "mla"),
    "mla_indexer": ("mla_indexer", "compressed_mla", "mla"),
    "sliding_window_mla": ("sliding_window_mla", "sliding_window", "mla"),
    "mamba": ("mamba",),
    "linear_attention": ("linear_attention", "mamba"),
}
"""Each layer kind and the tags ``kv_cache_dtype_skip_layers`` entries match it by."""

SKIP_TAGS = frozenset(tag for tags in LAYER_KINDS.values() for tag in tags)
"""Every tag a ``kv_cache_dtype_skip_layers`` entry may name."""

STATE_KINDS = frozenset({"mamba", "linear_attention"})
"""Kinds that hold a fixed recurrent state rather than per-token K/V."""


@dataclass(frozen=True, kw_only=True)
class LayerDesc:
    """One cache-holding layer, heads already per tensor-parallel rank.

    ``head_size`` is in elements; ``sliding_window`` in tokens; ``compress_ratio`` is tokens per
    stored slot (1 = uncompressed); ``state_shapes`` are the Mamba state tensor shapes.
    """

    name: str
    kind: str
    num_kv_heads: int = 1
    head_size: int = 0
    sliding_window: int | None = None
    compress_ratio: int = 1
    state_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_type: str | None = None

    @property
    def tags(self) -> tuple[str, ...]:
        """Kind tags matched by ``kv_cache_dtype_skip_layers``."""
        return LAYER_KINDS[self.kind]


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """The cache-holding layers of a model, in model order, for one tensor-parallel rank."""

    model_type: str
    model_dtype: str
    """Model dtype string (``torch_dtype``; ``bfloat16`` when the config has none)."""
    num_hidden_layers: int
    max_position_embeddings: int | None
    tensor_parallel_size: int
    default_block_size: int
    """Tokens per page used when the caller gives none."""
    layers: tuple[LayerDesc, ...]
    notes: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct layer kinds, in order of first appearance."""
        return tuple(dict.fromkeys(layer.kind for layer in self.layers))

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Distinct compress ratios > 1 of the layers."""
        return tuple(sorted({lyr.compress_ratio for lyr in self.layers if lyr.compress_ratio > 1}))


ParsedLayers = tuple[list[LayerDesc], list[str], int]
"""What a model-family parser returns: (layers, notes, default block size in tokens)."""


def attention_layer(name: str, kind: str, heads: int, head: int, window: int | None) -> LayerDesc:
    """A K/V attention layer of ``heads`` heads of ``head`` elements (``window`` tokens or
    None)."""
    return LayerDesc(
        name=name, kind=kind, num_kv_heads=heads, head_size=head, sliding_window=window
    )
