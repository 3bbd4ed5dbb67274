"""``OffloadingConnectorWorker.register_kv_caches`` and byte-exact GPU→CPU→GPU round trips.

On a CPU-only machine the "GPU" KV cache is a CPU tensor and the same handlers run (thread
path). Each test runs with the compiled ops (``swap_blocks``, ``reshape_and_cache_flash``) when the
extension is built, and with the pure-torch reference implementations, which write the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from kv_offload_test_utils import (
    DEVICE,
    allocate_worker_kv_cache,
    make_connector,
    round_trip,
    write_kv,
)

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.worker.page_views import (
    build_kv_cache_page_views,
    canonicalize_kv_caches,
)

NUM_BLOCKS = 10
BLOCK_SIZE = 16

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def attn_spec(kv_cache_dtype: str, num_kv_heads: int, head_size: int) -> FullAttentionSpec:
    if kv_cache_dtype == "nvfp4":
        dtype, mode = torch.uint8, KVQuantMode.NVFP4
    elif kv_cache_dtype.startswith("fp8"):
        dtype, mode = torch.uint8, KVQuantMode.FP8_PER_TENSOR
    else:
        dtype, mode = torch.bfloat16, KVQuantMode.NONE
    return FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        kv_quant_mode=mode,
    )


def uniform_type_config(
    kv_cache_dtype: str, equal_sized_tensors: bool
) -> tuple[KVCacheConfig, dict[str, KVCacheSpec], dict[str, str]]:
    """One UniformTypeKVCacheSpecs group whose layers differ in page size: head sizes 64 and 128
    in ``kv_cache_dtype``, plus a bf16 layer (as ``kv_cache_dtype_skip_layers`` leaves one).

    With ``equal_sized_tensors`` every buffer gets the largest layer's size, so the worker's
    views (``raw.numel() // page_size_bytes`` blocks) disagree on their block count.
    """
    specs: dict[str, KVCacheSpec] = {
        "layers.0.attn": attn_spec(kv_cache_dtype, 2, 64),
        "layers.1.attn": attn_spec(kv_cache_dtype, 2, 128),
        "layers.2.attn": attn_spec("bfloat16", 1, 128),
    }
    dtypes = {"layers.0.attn": kv_cache_dtype, "layers.1.attn": kv_cache_dtype}
    dtypes["layers.2.attn"] = "bfloat16"
    group = UniformTypeKVCacheSpecs(block_size=BLOCK_SIZE, kv_cache_specs=dict(specs))
    largest = max(s.page_size_bytes for s in specs.values())
    tensors = [
        KVCacheTensor(
            size=NUM_BLOCKS * (largest if equal_sized_tensors else spec.page_size_bytes),
            shared_by=[name],
        )
        for name, spec in specs.items()
    ]
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(specs), group)],
    )
    return config, specs, dtypes


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "nvfp4"])
@pytest.mark.parametrize("registered", ["views", "raw"])
@pytest.mark.parametrize("block_size_factor", [1, 2])
def test_uniform_type_specs_round_trip(
    impl: str, kv_cache_dtype: str, registered: str, block_size_factor: int
) -> None:
    config, specs, dtypes = uniform_type_config(kv_cache_dtype, equal_sized_tensors=True)
    page_sizes = [specs[t.shared_by[0]].page_size_bytes for t in config.kv_cache_tensors]
    assert len(set(page_sizes)) > 1
    kv = allocate_worker_kv_cache(config, specs, DEVICE)
    kv_caches = kv.views if registered == "views" else kv.layer_to_raw
    # The case that breaks "num_blocks from a tensor's shape": the views disagree on their
    # leading dim (a raw buffer's counts bytes), and they need not be num_blocks.
    leading = {name: t.shape[0] for name, t in kv_caches.items()}
    assert set(leading.values()) != {NUM_BLOCKS}, leading
    if registered == "views":
        assert len(set(leading.values())) > 1, leading

    connector = make_connector(config, impl, block_size_factor)
    connector.register_kv_caches(kv_caches, config)
    handlers = connector.spec.handlers
    assert handlers is not None
    assert handlers.num_gpu_blocks == NUM_BLOCKS
    assert [t.shape for t in handlers.gpu_tensors] == [(NUM_BLOCKS, p) for p in page_sizes]
    assert [tuple(t.shape) for t in handlers.cpu_tensors] == [
        (6 * block_size_factor, p) for p in page_sizes
    ]

    stored = [5, 2, 9, 0]
    for seed, (name, spec) in enumerate(specs.items()):
        assert isinstance(spec, FullAttentionSpec)
        view = kv.views[name]
        assert isinstance(view, torch.Tensor)
        before = view.clone()
        write_kv(impl, view, spec, dtypes[name], stored, seed)
        assert not torch.equal(before, view)
    round_trip(connector, kv, page_sizes, block_size_factor, stored)
    # Out-of-range GPU blocks are rejected before anything is copied.
    job = connector.store([NUM_BLOCKS - 1, NUM_BLOCKS] * block_size_factor, [1, 4])
    assert [(r.job_id, r.success) for r in connector.get_finished()] == [(job, False)]
    connector.shutdown()


def test_kernel_block_split_views_register_with_config_num_blocks(impl: str) -> None:
    """A 32-token page split into 16-token kernel blocks: the view has 2*num_blocks rows."""
    specs: dict[str, KVCacheSpec] = {
        f"layers.{i}.attn": FullAttentionSpec(
            block_size=32, num_kv_heads=2, head_size=64 * (i + 1), dtype=torch.bfloat16
        )
        for i in range(2)
    }
    group = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=dict(specs))
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=NUM_BLOCKS * s.page_size_bytes, shared_by=[n])
            for n, s in specs.items()
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(specs), group)],
    )
    kv = allocate_worker_kv_cache(
        config, specs, DEVICE, kernel_block_sizes=dict.fromkeys(specs, 16)
    )
    assert all(v.shape[0] == 2 * NUM_BLOCKS for v in kv.views.values())
    connector = make_connector(config, impl, block_size_factor=1, gpu_block_size=32)
    connector.register_kv_caches(kv.views)
    assert connector.spec.handlers is not None
    assert connector.spec.handlers.num_gpu_blocks == NUM_BLOCKS
    page_sizes = [s.page_size_bytes for s in specs.values()]
    round_trip(connector, kv, page_sizes, 1, [3, 8, 1])
    connector.shutdown()


MAMBA_SHAPES = ((3, 64), (4, 16, 8))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)


def mamba_hybrid_config(padded: bool) -> tuple[KVCacheConfig, dict[str, KVCacheSpec]]:
    """Attention (bf16, page 8192 bytes) + Mamba (conv + SSM state, 2432 bytes).

    ``padded``: Mamba pages padded to 8192 bytes and each buffer shared by one attention and
    one Mamba layer (the hybrid planner's layout). Otherwise every layer has its own buffer and
    the Mamba pages keep their real size.
    """
    attn = attn_spec("bfloat16", 2, 64)
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=MAMBA_SHAPES,
        dtypes=MAMBA_DTYPES,
        page_size_padded=attn.page_size_bytes if padded else None,
    )
    assert attn.page_size_bytes == 8192 and mamba.real_page_size_bytes == 2432
    attn_names = ["layers.0.attn", "layers.2.attn"]
    mamba_names = ["layers.1.mixer", "layers.3.mixer"]
    specs: dict[str, KVCacheSpec] = {n: attn for n in attn_names}
    specs.update({n: mamba for n in mamba_names})
    if padded:
        tensors = [
            KVCacheTensor(size=NUM_BLOCKS * 8192, shared_by=[a, m])
            for a, m in zip(attn_names, mamba_names, strict=True)
        ]
    else:
        tensors = [
            KVCacheTensor(size=NUM_BLOCKS * specs[n].page_size_bytes, shared_by=[n])
            for n in attn_names + mamba_names
        ]
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(attn_names, attn), KVCacheGroupSpec(mamba_names, mamba)],
    )
    return config, specs


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_mamba_attention_hybrid_round_trip(impl: str, padded: bool) -> None:
    config, specs = mamba_hybrid_config(padded)
    kv = allocate_worker_kv_cache(config, specs, DEVICE)
    connector = make_connector(config, impl, block_size_factor=1)
    connector.register_kv_caches(kv.views, config)
    handlers = connector.spec.handlers
    assert handlers is not None
    canonical = canonicalize_kv_caches(kv.views, config)
    refs = [[r.tensor_idx for r in group] for group in canonical.group_data_refs]
    if padded:
        # Layers sharing a KVCacheTensor are registered once; both groups use both buffers.
        assert refs == [[0, 1], [0, 1]]
        page_sizes = [8192, 8192]
    else:
        assert len(canonical.tensors) == 4 and sorted(sum(refs, [])) == [0, 1, 2, 3]
        page_sizes = [8192, 8192, 2432, 2432]
    assert [t.page_size_bytes for t in canonical.tensors] == page_sizes
    assert [t.shape[1] for t in handlers.gpu_tensors] == page_sizes

    attn_blocks, mamba_blocks = [1, 4], [2, 6]
    g = torch.Generator().manual_seed(7)
    for seed, (name, spec) in enumerate(specs.items()):
        view = kv.views[name]
        if isinstance(spec, FullAttentionSpec):
            assert isinstance(view, torch.Tensor)
            write_kv(impl, view, spec, "bfloat16", attn_blocks, seed)
        else:
            assert isinstance(view, tuple)
            for state in view:
                for b in mamba_blocks:
                    state[b] = torch.randn(state.shape[1:], generator=g).to(state.dtype)
    round_trip(connector, kv, page_sizes, 1, [1, 2, 4, 6])
    connector.shutdown()


def test_register_twice_rejected() -> None:
    config, specs, _ = uniform_type_config("bfloat16", equal_sized_tensors=False)
    kv = allocate_worker_kv_cache(config, specs, DEVICE)
    connector = make_connector(config, "reference", 1)
    connector.register_kv_caches(kv.views)
    with pytest.raises(RuntimeError, match="already registered"):
        connector.register_kv_caches(kv.views)
    connector.shutdown()


def test_register_rejects_inconsistent_inputs() -> None:
    config, specs = mamba_hybrid_config(padded=True)
    kv = allocate_worker_kv_cache(config, specs, DEVICE)
    # A layer the config does not know.
    extra = dict(kv.views)
    extra["layers.9.attn"] = kv.raw[0]
    with pytest.raises(ValueError, match=r"layers \['layers.9.attn'\] are in no KVCacheTensor"):
        build_kv_cache_page_views(extra, config)
    # Layers that share a KVCacheTensor must start at the same address.
    moved = dict(kv.views)
    moved["layers.1.mixer"] = kv.views["layers.3.mixer"]
    with pytest.raises(ValueError, match="share one buffer but"):
        build_kv_cache_page_views(moved, config)
    # A config whose shared layers disagree on the page size.
    unpadded_config, _ = mamba_hybrid_config(padded=False)
    bad = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=NUM_BLOCKS * 8192, shared_by=["layers.0.attn", "layers.1.mixer"])
        ],
        kv_cache_groups=unpadded_config.kv_cache_groups,
    )
    with pytest.raises(ValueError, match="must have the same page size"):
        build_kv_cache_page_views(kv.views, bad)
    # A buffer smaller than num_blocks pages.
    small = KVCacheConfig(
        num_blocks=NUM_BLOCKS + 1,
        kv_cache_tensors=config.kv_cache_tensors,
        kv_cache_groups=config.kv_cache_groups,
    )
    with pytest.raises(ValueError, match="smaller than num_blocks=11 pages"):
        build_kv_cache_page_views(kv.views, small)
