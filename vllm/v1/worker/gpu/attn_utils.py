"""Upstream v0.33's ``vllm.v1.worker.gpu.attn_utils``: the runner's KV-cache entry point
(:func:`init_kv_cache`: allocate, share, bind to the model's layers) and the model-layer lookups
(:func:`get_kv_cache_spec`, the KV-sharing layers).

It re-exports the names upstream keeps here that live in modules split out by job:
:mod:`~vllm.v1.worker.gpu.attn_cg_support` (CUDA-graph support, fast prefill),
:mod:`~vllm.v1.worker.gpu.attn_groups` (kernel block sizes),
:mod:`~vllm.v1.worker.gpu.kv_binding` (binding caches to layers, per-layer slot mappings),
:mod:`~vllm.v1.worker.gpu.paged_views` (typed page views) and the library's own validated
view builder, :mod:`~vllm.v1.worker.gpu.init_layer_kv_caches`
(:func:`~vllm.v1.worker.gpu.init_layer_kv_caches.init_layer_kv_caches`, the scale layouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from vllm.config.compilation import get_layers_from_vllm_config
from vllm.v1.hisparse.binding import init_hisparse_kv_cache, resolve_hisparse_specs
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.worker.gpu.attn_cg_support import (
    AttentionCGSupportInfo as AttentionCGSupportInfo,
)
from vllm.v1.worker.gpu.attn_cg_support import (
    FastPrefillBatchMetadata as FastPrefillBatchMetadata,
)
from vllm.v1.worker.gpu.attn_cg_support import FastPrefillHelper as FastPrefillHelper
from vllm.v1.worker.gpu.attn_cg_support import get_attn_cg_support as get_attn_cg_support
from vllm.v1.worker.gpu.attn_cg_support import (
    get_query_lens_mismatch_unsupported_backend as get_query_lens_mismatch_unsupported_backend,
)
from vllm.v1.worker.gpu.attn_cg_support import (
    get_varlen_cudagraph_unsupported_backend as get_varlen_cudagraph_unsupported_backend,
)
from vllm.v1.worker.gpu.attn_groups import (
    AttentionGroup,
    customize_attention_spec,
    map_kv_caches_to_kernel_blocks,
)
from vllm.v1.worker.gpu.attn_groups import select_kernel_block_size as select_kernel_block_size
from vllm.v1.worker.gpu.init_layer_kv_caches import AttnBackends as AttnBackends
from vllm.v1.worker.gpu.init_layer_kv_caches import LayerKVCache as LayerKVCache
from vllm.v1.worker.gpu.init_layer_kv_caches import _reshape_kv_cache as _reshape_kv_cache
from vllm.v1.worker.gpu.init_layer_kv_caches import (
    get_kv_cache_scale_layouts as get_kv_cache_scale_layouts,
)
from vllm.v1.worker.gpu.init_layer_kv_caches import init_layer_kv_caches as init_layer_kv_caches
from vllm.v1.worker.gpu.init_layer_kv_caches import (
    validate_kv_cache_backends as validate_kv_cache_backends,
)
from vllm.v1.worker.gpu.kv_binding import bind_kv_cache_to_layers
from vllm.v1.worker.gpu.kv_binding import (
    build_slot_mappings_by_layer as build_slot_mappings_by_layer,
)
from vllm.v1.worker.gpu.kv_cache_buffers import _allocate_kv_cache as _allocate_kv_cache
from vllm.v1.worker.gpu.paged_views import _paged_view as _paged_view
from vllm.v1.worker.gpu.paged_views import spec_cache_dtype_str as spec_cache_dtype_str
from vllm.v1.worker.utils import allocate_kv_cache

# -------------------------------------------------------------------------------- init


def init_kv_cache(
    forward_context: dict[str, Any],
    kv_cache_config: KVCacheConfig,
    device: torch.device,
    kernel_block_sizes: list[int],
    vllm_config: Any,
    kv_cache_allocation_context: AbstractContextManager | None = None,
    *,
    block_tables: Any = None,
    attn_groups: Iterable[AttentionGroup] = (),
) -> dict[str, Any]:
    """Allocate the KV cache, give each KV-sharing layer its target's cache and bind every
    cache of a ``forward_context`` layer to it; return the caches by layer name (the manager's
    views, addressed by the scheduler's block ids, which KV connectors register).

    Only the allocation runs inside ``kv_cache_allocation_context`` (e.g. a memory pool
    scope). It is :func:`vllm.v1.worker.utils.allocate_kv_cache` under the config's resolved
    layout, with ``kernel_block_sizes`` (tokens, one per group); with HiSparse on it is
    :func:`vllm.v1.hisparse.binding.init_hisparse_kv_cache`, which also binds the HiSparse
    handles to ``block_tables`` (the runner's, required then). Layers bind the views of their
    ``attn_groups`` group in kernel blocks where it splits blocks
    (:func:`~vllm.v1.worker.gpu.attn_groups.map_kv_caches_to_kernel_blocks`).

    Every KV-sharing layer's target (its ``kv_sharing_target_layer_name``) must have a cache:
    checked before anything is bound (``ValueError`` naming the layers whose target has none).
    """
    hisparse = vllm_config.attention_config.hisparse_config is not None
    if hisparse and block_tables is None:
        raise ValueError(
            "block_tables: expected the runner's block tables (HiSparse binds its caches to "
            "them), got None"
        )
    with kv_cache_allocation_context or nullcontext():
        if hisparse:
            kv_caches = init_hisparse_kv_cache(
                kv_cache_config,
                device,
                kernel_block_sizes,
                vllm_config,
                forward_context,
                block_tables,
            )
        else:
            kv_caches = allocate_kv_cache(
                kv_cache_config,
                device,
                vllm_config.cache_config.get_resolved_kv_cache_layout(),
                kernel_block_sizes,
            )
    shared = get_shared_kv_cache_layers(vllm_config)
    orphans = {layer: target for layer, target in shared.items() if target not in kv_caches}
    if orphans:
        raise ValueError(
            f"kv_sharing_target_layer_name: expected target layers with a cache, got {orphans}"
        )
    kv_caches.update((layer, kv_caches[target]) for layer, target in shared.items())
    # LongCat-Flash puts two attention modules in each decoder layer. The library's
    # VllmConfig may have no model_config: then it is no such model.
    hf_config = getattr(vllm_config.model_config, "hf_config", None)
    num_attn_module = 2 if getattr(hf_config, "model_type", None) == "longcat_flash" else 1
    layer_caches = map_kv_caches_to_kernel_blocks(
        {name: cache for name, cache in kv_caches.items() if name in forward_context},
        attn_groups,
    )
    bind_kv_cache_to_layers(
        layer_caches,
        forward_context,
        num_attn_module,
        kv_cache_groups=kv_cache_config.kv_cache_groups,
    )
    return kv_caches


# ------------------------------------------------------------------------ model layers
# They look the layer lookups up in this module's namespace, where callers (and tests)
# substitute the model's layers.


def get_kv_cache_spec(vllm_config: Any) -> dict[str, KVCacheSpec]:
    """Each cache-owning layer's spec as its backend stores it (:func:`customize_attention_spec`),
    draft-model layers tagged ``is_draft``; layers reading another layer's cache and layers
    without one are left out. With HiSparse on, its MLA specs are resolved to one block size
    and its resident and hot specs added (:func:`resolve_hisparse_specs`)."""
    layers = get_layers_from_vllm_config(vllm_config, object)
    specs: dict[str, KVCacheSpec] = {}
    for name, layer in layers.items():
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if layer.is_draft_layer:
            spec = dataclasses.replace(spec, is_draft=True)
        specs[name] = spec
    if vllm_config.attention_config.hisparse_config is not None:
        specs = resolve_hisparse_specs(vllm_config, specs, layers)
    return specs


def get_shared_kv_cache_layers(vllm_config: Any) -> dict[str, str]:
    """Each layer that reads another layer's cache, by the layer it reads."""
    return {
        name: target
        for name, layer in get_layers_from_vllm_config(vllm_config, object).items()
        if (target := getattr(layer, "kv_sharing_target_layer_name", None))
    }


def get_kv_sharing_fast_prefill_eligible_layers(
    vllm_config: Any, draft_layer_names: set[str] | None = None
) -> set[str]:
    """The layers prefill may skip (``cache_config.kv_sharing_fast_prefill``): the trailing run
    of cache-sharing layers in registration (execution) order, as in You Only Cache Once.
    Draft-model layers (``draft_layer_names``) register after the target's and are passed
    over: they neither join nor end the run."""
    if not vllm_config.cache_config.kv_sharing_fast_prefill:
        return set()
    shared = get_shared_kv_cache_layers(vllm_config)
    if not shared:
        return set()
    eligible: set[str] = set()
    for name in reversed(list(get_layers_from_vllm_config(vllm_config, object))):
        if draft_layer_names is not None and name in draft_layer_names:
            continue
        if name not in shared:
            break
        eligible.add(name)
    return eligible
