"""Upstream v0.33's attention-wiring names on the worker: graph modes, CUDA-graph support
checks, fast-prefill staging, kernel block sizes, attention groups and the model's layer
specs. Upstream's tests/v1/worker/test_attn_utils.py pins the main paths; these pin the rest
and the error paths."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.config.compilation import (
    AttentionCGSupport,
    CompilationConfig,
    CUDAGraphMode,
    get_layers_from_vllm_config,
)
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends import FlashInferBackend, ReferenceAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu.attn_groups import (
    AttentionGroup,
    customize_attention_spec,
    get_block_table_width,
    map_kv_caches_to_kernel_blocks,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from vllm.v1.worker.gpu.attn_utils import (
    AttentionCGSupportInfo,
    FastPrefillHelper,
    get_attn_cg_support,
)
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor


def _spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
    )


def test_cudagraph_mode_pairs_split_decode_and_mixed():
    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert mode.decode_mode() == CUDAGraphMode.FULL
    assert mode.mixed_mode() == CUDAGraphMode.PIECEWISE
    assert mode.has_full_cudagraphs() and mode.requires_piecewise_compilation()
    assert mode.without_piecewise() == CUDAGraphMode.FULL_DECODE_ONLY
    assert CUDAGraphMode.FULL_DECODE_ONLY.mixed_mode() == CUDAGraphMode.NONE
    assert not CUDAGraphMode.NONE and bool(CUDAGraphMode.PIECEWISE)
    assert not mode.is_valid_runtime_mode() and CUDAGraphMode.FULL.is_valid_runtime_mode()
    assert str(mode) == "FULL_AND_PIECEWISE"
    with pytest.raises(ValueError, match="mode: expected NONE, PIECEWISE or FULL"):
        mode.has_mode(CUDAGraphMode.FULL_DECODE_ONLY)


def test_compilation_config_checks_mode_and_lists_layers():
    with pytest.raises(TypeError, match="cudagraph_mode: expected a CUDAGraphMode"):
        CompilationConfig(cudagraph_mode="FULL")  # type: ignore[arg-type]
    layers = {"a": 1, "b": "x", "c": 2}
    config = SimpleNamespace(compilation_config=CompilationConfig(static_forward_context=layers))
    assert get_layers_from_vllm_config(config, int) == {"a": 1, "c": 2}
    assert list(get_layers_from_vllm_config(config, object, ["c", "z", "b"])) == ["c", "b"]
    with pytest.raises(ValueError, match="vllm_config: expected a config with a compilation"):
        get_layers_from_vllm_config(SimpleNamespace(), object)


def test_cg_support_info_narrows_only_to_weaker():
    info = AttentionCGSupportInfo()
    assert info.min_cg_support == AttentionCGSupport.ALWAYS
    weaker = info.narrow(AttentionCGSupport.UNIFORM_BATCH, "B")
    assert weaker == AttentionCGSupportInfo(AttentionCGSupport.UNIFORM_BATCH, "B")
    assert weaker.narrow(AttentionCGSupport.ALWAYS, "C") is weaker
    assert get_attn_cg_support([], None) == AttentionCGSupportInfo()


class _Manager:
    device = "cpu"

    def dispatch(self, **kwargs):
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=64, num_reqs=kwargs["num_reqs"]
        )


def _desc(mode: CUDAGraphMode = CUDAGraphMode.NONE, ubatches: int = 1):
    return BatchExecutionDescriptor(cg_mode=mode, num_tokens=4, num_reqs=1, num_ubatches=ubatches)


def test_fast_prefill_runs_only_for_eager_or_piecewise_prefills():
    helper = FastPrefillHelper(_Manager(), max_num_tokens=16)
    indices = torch.tensor([3, 7], dtype=torch.int32)
    cu = np.array([0, 1, 2], dtype=np.int32)
    assert helper.prepare(indices, 2, cu, False, _desc()) is None
    assert helper.prepare(indices, 2, cu, True, _desc(CUDAGraphMode.FULL)) is None
    assert helper.prepare(indices, 2, cu, True, _desc(ubatches=2)) is None
    metadata = helper.prepare(indices, 2, cu, True, _desc())
    assert metadata is not None
    # Padded to the buffer (the dispatch asked for more), the tail repeats the last index.
    assert metadata.logits_indices_padded.tolist() == [3, 7] + [7] * 14
    assert metadata.num_logits_indices == 2 and metadata.max_logits_per_req == 1


def test_fast_prefill_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_num_tokens: expected a positive int, got 0"):
        FastPrefillHelper(_Manager(), max_num_tokens=0)
    with pytest.raises(TypeError, match="max_num_tokens: expected an int, got float"):
        FastPrefillHelper(_Manager(), max_num_tokens=4.0)  # type: ignore[arg-type]
    helper = FastPrefillHelper(_Manager(), max_num_tokens=2)
    cu = np.array([0, 3], dtype=np.int32)
    with pytest.raises(ValueError, match="logits_indices: expected 1 to 2 indices, got 3"):
        helper.prepare(torch.arange(3), 1, cu, True, _desc())
    with pytest.raises(ValueError, match="logits_indices: expected 1 to 2 indices, got 0"):
        helper.prepare(torch.arange(0), 1, cu, True, _desc())


def test_select_common_block_size_keeps_manager_size_or_largest_shared_divisor():
    assert select_common_block_size(64, [FlashInferBackend]) == 64
    assert select_common_block_size(96, [FlashInferBackend]) == 32
    # Unhashable stand-ins, and a backend answering per spec.
    wide = SimpleNamespace(get_supported_kernel_block_sizes=lambda: [MultipleOf(16)])
    per_spec = SimpleNamespace(
        get_name=lambda: "PER_SPEC",
        get_supported_kernel_block_sizes=lambda spec=None: [spec.block_size // 2],
    )
    assert select_common_block_size(64, [wide, per_spec], [None, _spec(64)]) == 32
    with pytest.raises(ValueError, match="PER_SPEC: 8"):
        select_common_block_size(12, [per_spec], [_spec(16)])


def test_customize_attention_spec_aligns_fixed_kernel_sizes_only():
    fixed = SimpleNamespace(
        customize_spec=lambda spec: spec,
        get_supported_kernel_block_sizes=lambda _=None: [32, 64],
    )
    assert customize_attention_spec(fixed, _spec()).block_stride_alignment == MultipleOf(64)
    flexible = SimpleNamespace(
        customize_spec=lambda spec: spec,
        get_supported_kernel_block_sizes=lambda _=None: [32, MultipleOf(16)],
    )
    assert customize_attention_spec(flexible, _spec()).block_stride_alignment is None


def test_block_table_width_pads_to_token_alignment():
    assert get_block_table_width(5, 16) == 8  # 128 tokens = 8 blocks of 16
    assert get_block_table_width(5, 256) == 5
    assert get_block_table_width(5, 16, token_alignment=None) == 5
    with pytest.raises(ValueError, match="token_alignment: expected a positive int"):
        get_block_table_width(5, 16, token_alignment=0)


class _Builder:
    requires_block_table_width = True

    def __init__(self, spec, layer_names, vllm_config, device, block_table_width=None):
        self.spec, self.width = spec, block_table_width

    def build(self, common_prefix_len, metadata, fast_build=False):
        return metadata.block_table_tensor


@dataclass
class _Meta:
    block_table_tensor: torch.Tensor


_CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(max_model_len=256),
    scheduler_config=SimpleNamespace(max_num_seqs=2),
    parallel_config=SimpleNamespace(decode_context_parallel_size=1),
)


def _group(sizes, block_size=64) -> AttentionGroup:
    backend = SimpleNamespace(
        get_builder_cls=lambda: _Builder,
        get_supported_kernel_block_sizes=lambda _=None: sizes,
        get_name=lambda: "FAKE",
    )
    return AttentionGroup(backend, ["l0"], _spec(block_size), 0)  # type: ignore[arg-type]


def test_split_group_maps_block_tables_to_kernel_blocks():
    group = _group([16])
    group.create_metadata_builders(_CONFIG, "cpu", kernel_block_size=64, num_metadata_builders=2)
    assert group.kernel_block_size == 16
    builder = group.get_metadata_builder(1)
    assert builder.spec.block_size == 16 and builder.width == 16  # 4 blocks x 4 per block
    metadata = _Meta(torch.tensor([[2, 0]], dtype=torch.int32))
    table = group.build_metadata(metadata, ubatch_idx=1)
    assert table.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="ubatch_id: expected one of the group's 2"):
        group.get_metadata_builder(2)


def test_unsplit_group_keeps_manager_blocks_and_token_caches_cannot_split():
    whole = _group([64])
    whole.create_metadata_builders(_CONFIG, "cpu", kernel_block_size=64)
    assert whole.kernel_block_size is None
    cache = torch.zeros(3, 1, 64, 16)
    assert map_kv_caches_to_kernel_blocks({"l0": cache}, [whole])["l0"] is cache
    split = _group([16])
    split.create_metadata_builders(_CONFIG, "cpu", kernel_block_size=64)
    with pytest.raises(ValueError, match="cannot be split"):
        map_kv_caches_to_kernel_blocks({"l0": cache}, [split])


def test_prepare_kernel_block_sizes_skips_packed_tensors():
    spec = _spec(64)
    page = spec.page_size_bytes
    groups = [KVCacheGroupSpec(["l0"], spec)]

    def config(block_stride: int) -> KVCacheConfig:
        tensor = KVCacheTensor(
            size=4 * block_stride, layers=["l0"], layer_stride=page, block_stride=block_stride
        )
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[tensor], kv_cache_groups=groups)

    attn_groups = [[_group([16])]]
    assert prepare_kernel_block_sizes(config(page), attn_groups) == [16]
    # Another layer's page sits between this layer's blocks: not split.
    assert prepare_kernel_block_sizes(config(2 * page), attn_groups) == [64]


def test_get_kv_cache_spec_leaves_out_sharing_and_cacheless_layers(monkeypatch):
    spec = _spec()
    layer = SimpleNamespace(
        get_kv_cache_spec=lambda _: spec,
        get_attn_backend=lambda: ReferenceAttentionBackend,
        is_draft_layer=False,
        kv_sharing_target_layer_name=None,
    )
    layers = {
        "owner": layer,
        "reader": SimpleNamespace(kv_sharing_target_layer_name="owner"),
        "encoder": SimpleNamespace(
            get_kv_cache_spec=lambda _: None, kv_sharing_target_layer_name=None
        ),
    }
    monkeypatch.setattr(attn_utils, "get_layers_from_vllm_config", lambda *_: layers)
    config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None))
    assert list(attn_utils.get_kv_cache_spec(config)) == ["owner"]
    assert attn_utils.get_shared_kv_cache_layers(config) == {"reader": "owner"}
