"""Helpers of the KV-offload tests: hand-built KV-cache configs, worker-style views, writers.

The views follow docs/design.md §7 (what ``_reshape_kv_cache`` gives): one int8 buffer per
``KVCacheTensor``; per layer ``num_blocks = raw.numel() // page_size_bytes``; attention caches
``(B_kernel, 2, N_kernel, H, D')`` in NHD order with a block stride of one page; Mamba layers get
one view per state tensor, state ``i`` at byte offset ``Σ_{j<i} size_j`` of each page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.utils.torch_utils import get_dtype_size, nvfp4_kv_cache_full_dim
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

try:
    from vllm import _custom_ops as ops

    HAVE_EXTENSION = True
except ImportError:
    ops = None
    HAVE_EXTENSION = False

EXTENSION_SKIP_REASON = "vllm._custom_ops (the compiled extension) is not built"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the worker's "GPU" KV cache lives (a CPU tensor on CPU-only machines)."""

IMPLS = [
    pytest.param(
        "extension", marks=pytest.mark.skipif(not HAVE_EXTENSION, reason=EXTENSION_SKIP_REASON)
    ),
    "reference",
]
"""Copy implementations under test: the compiled ops, and the pure-torch reference."""


def reference_swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, block_mapping: torch.Tensor
) -> None:
    """Pure-torch ``swap_blocks``: page ``m[i,0]`` of ``src`` → page ``m[i,1]`` of ``dst``, where
    page ``p`` is bytes ``[p*bs, (p+1)*bs)`` from the tensor's data_ptr."""
    assert block_mapping.dtype == torch.int64 and block_mapping.device.type == "cpu"
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2

    def pages(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        offset = t.data_ptr() - storage.data_ptr()
        n = (storage.nbytes() - offset) // block_size_in_bytes
        out = torch.empty(0, dtype=torch.uint8, device=t.device)
        return out.set_(storage, offset, (n, block_size_in_bytes), (block_size_in_bytes, 1))

    s, d = pages(src), pages(dst)
    d[block_mapping[:, 1].to(d.device)] = s[block_mapping[:, 0].to(s.device)].to(d.device)


def swap_blocks_for(impl: str):
    """The ``swap_blocks`` of an implementation name: ``extension`` or ``reference``."""
    if impl == "extension":
        assert ops is not None
        return ops.swap_blocks
    return reference_swap_blocks


def attention_view(raw: torch.Tensor, spec: AttentionSpec, kernel_block_size: int | None = None):
    """The worker's ``(B_kernel, 2, N_kernel, H, D')`` view of an attention layer's buffer."""
    page = spec.page_size_bytes
    num_blocks = raw.numel() // page
    kernel = kernel_block_size or spec.block_size
    split = spec.block_size // kernel
    last = (
        nvfp4_kv_cache_full_dim(spec.head_size) if spec.kv_quant_mode.is_nvfp4 else spec.head_size
    )
    elsize = get_dtype_size(spec.dtype)
    assert page % elsize == 0
    if split > 1:
        assert spec.page_size_padded is None, "padding with kernel-block splitting"
    shape = (num_blocks * split, 2, kernel, spec.num_kv_heads, last)
    kernel_page = math.prod(shape[1:])
    block_stride = kernel_page if split > 1 else page // elsize
    stride = (block_stride, kernel * spec.num_kv_heads * last, spec.num_kv_heads * last, last, 1)
    return raw.view(spec.dtype).as_strided(shape, stride, 0)


def mamba_views(raw: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """The worker's per-state views ``(B, *shape_i)`` of a Mamba layer's buffer."""
    page = spec.page_size_bytes
    num_blocks = raw.numel() // page
    views = []
    offset = 0
    for shape, dtype, size in zip(spec.shapes, spec.dtypes, spec.state_sizes_bytes, strict=True):
        elsize = get_dtype_size(dtype)
        assert page % elsize == 0 and offset % elsize == 0
        inner = torch.empty(shape).stride()
        views.append(
            raw.view(dtype).as_strided(
                (num_blocks, *shape), (page // elsize, *inner), offset // elsize
            )
        )
        offset += size
    return tuple(views)


def layer_view(raw: torch.Tensor, spec: KVCacheSpec, kernel_block_size: int | None = None):
    if isinstance(spec, AttentionSpec):
        return attention_view(raw, spec, kernel_block_size)
    assert isinstance(spec, MambaSpec)
    return mamba_views(raw, spec)


@dataclass
class WorkerKVCache:
    """Raw buffers (one per KVCacheTensor) and per-layer views of a hand-built config."""

    config: KVCacheConfig
    raw: list[torch.Tensor]
    layer_to_raw: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]

    def snapshot(self) -> list[torch.Tensor]:
        return [r.clone() for r in self.raw]


def allocate_worker_kv_cache(
    config: KVCacheConfig,
    layer_specs: dict[str, KVCacheSpec],
    device: str | torch.device = "cpu",
    kernel_block_sizes: dict[str, int] | None = None,
    seed: int = 0,
) -> WorkerKVCache:
    """Allocate one int8 buffer per KVCacheTensor (random bytes) and the per-layer views."""
    g = torch.Generator().manual_seed(seed)
    raw: list[torch.Tensor] = []
    layer_to_raw: dict[str, torch.Tensor] = {}
    views: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for tensor in config.kv_cache_tensors:
        buf = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=g).to(device)
        raw.append(buf)
        for name in tensor.shared_by:
            layer_to_raw[name] = buf
            kernel = (kernel_block_sizes or {}).get(name)
            views[name] = layer_view(buf, layer_specs[name], kernel)
    return WorkerKVCache(config, raw, layer_to_raw, views)


KV_CACHE_DTYPE_OF_STORAGE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_kv(
    impl: str,
    view: torch.Tensor,
    spec: AttentionSpec,
    kv_cache_dtype: str,
    blocks: list[int],
    seed: int,
) -> None:
    """Write random K/V for every slot of ``blocks`` (page ids) of an attention layer view.

    ``impl="extension"`` uses ``reshape_and_cache_flash``; ``"reference"`` the pure-torch codecs
    of :mod:`vllm.kv_quant` (the same bytes by contract). Quantized caches get their scales.
    """
    assert view.shape[0] * view.shape[2] % spec.block_size == 0
    g = torch.Generator().manual_seed(seed)
    n = spec.block_size
    slots = torch.tensor(
        [b * n + t for b in blocks for t in range(n)], dtype=torch.int64, device=view.device
    )
    assert spec.head_size_v is not None
    shape_k = (slots.numel(), spec.num_kv_heads, spec.head_size)
    shape_v = (slots.numel(), spec.num_kv_heads, spec.head_size_v)
    key = (torch.randn(shape_k, generator=g) * 3).to(torch.bfloat16).to(view.device)
    value = (torch.randn(shape_v, generator=g) * 3).to(torch.bfloat16).to(view.device)
    k_scale = torch.tensor([0.037], dtype=torch.float32, device=view.device)
    v_scale = torch.tensor([0.021], dtype=torch.float32, device=view.device)
    # Logical (B, N, H, D') sides with the page's kernel split undone: slots index tokens.
    kernel = view.shape[2]
    assert kernel == n, "write_kv expects unsplit views"
    key_cache, value_cache = view[:, 0], view[:, 1]
    if impl == "extension":
        assert ops is not None
        ops.reshape_and_cache_flash(
            key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale
        )
        return
    from vllm.kv_quant import fp8_write_cache, nvfp4_write_cache

    if kv_cache_dtype == "nvfp4":
        nvfp4_write_cache(key, key_cache, slots, k_scale)
        nvfp4_write_cache(value, value_cache, slots, v_scale)
    elif kv_cache_dtype.startswith("fp8"):
        fp8_write_cache(key, key_cache, slots, k_scale)
        fp8_write_cache(value, value_cache, slots, v_scale)
    else:
        key_cache[slots // n, slots % n] = key.to(key_cache.dtype)
        value_cache[slots // n, slots % n] = value.to(value_cache.dtype)


def page_bytes(raw: torch.Tensor, page_size: int, block: int) -> torch.Tensor:
    """Bytes of page ``block`` of a raw buffer."""
    return raw.view(torch.uint8)[block * page_size : (block + 1) * page_size]


def make_connector(
    config: KVCacheConfig,
    impl: str,
    block_size_factor: int,
    num_cpu_blocks: int = 6,
    gpu_block_size: int = 16,
) -> OffloadingConnectorWorker:
    extra = {"num_cpu_blocks": num_cpu_blocks, "block_size": gpu_block_size * block_size_factor}
    spec = CPUOffloadingSpec(
        VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector_extra_config=extra)),
        config,
        swap_blocks=swap_blocks_for(impl),
    )
    return OffloadingConnectorWorker(spec)


def finish(connector: OffloadingConnectorWorker, job_id: int) -> None:
    connector.wait([job_id])
    results = connector.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job_id, True)]


def round_trip(
    connector: OffloadingConnectorWorker,
    kv: WorkerKVCache,
    page_sizes: list[int],
    block_size_factor: int,
    stored_blocks: list[int],
) -> None:
    """Store ``stored_blocks`` to CPU, clobber them on the GPU, load them into other blocks;
    every byte of every buffer must be as expected (moved pages equal, all others unchanged)."""
    assert len(stored_blocks) % block_size_factor == 0
    num_cpu = len(stored_blocks) // block_size_factor
    cpu_blocks = [5, 0, 3, 2][:num_cpu]
    before_store = kv.snapshot()
    finish(connector, connector.store(stored_blocks, cpu_blocks))
    assert all(torch.equal(a, b) for a, b in zip(before_store, kv.raw, strict=True))

    handlers = connector.spec.handlers
    assert handlers is not None
    for i, page in enumerate(page_sizes):
        for j, gpu_block in enumerate(stored_blocks):
            cpu_page = cpu_blocks[j // block_size_factor] * block_size_factor
            cpu_page += j % block_size_factor
            assert torch.equal(
                handlers.cpu_tensors[i][cpu_page].cpu(),
                page_bytes(before_store[i], page, gpu_block).cpu(),
            )

    # Reuse: the stored GPU pages get other contents.
    g = torch.Generator().manual_seed(123)
    for raw, page in zip(kv.raw, page_sizes, strict=True):
        for b in stored_blocks:
            noise = torch.randint(0, 256, (page,), dtype=torch.uint8, generator=g)
            page_bytes(raw, page, b).copy_(noise.to(raw.device))
    before_load = kv.snapshot()

    free = [b for b in range(kv.config.num_blocks) if b not in stored_blocks]
    load_to = list(reversed(stored_blocks))[: len(stored_blocks) - 1] + free[:1]
    expected = [t.clone() for t in before_load]
    for i, page in enumerate(page_sizes):
        for dst, src in zip(load_to, stored_blocks, strict=True):
            page_bytes(expected[i], page, dst).copy_(page_bytes(before_store[i], page, src))
    jobs = [connector.load(cpu_blocks, load_to)]
    if block_size_factor > 1:
        # The tail of an offloaded block: the last page of CPU block cpu_blocks[0].
        tail_dst = free[1]
        jobs.append(connector.load(cpu_blocks[:1], [tail_dst], block_size_factor - 1))
        src = stored_blocks[block_size_factor - 1]
        for i, page in enumerate(page_sizes):
            page_bytes(expected[i], page, tail_dst).copy_(page_bytes(before_store[i], page, src))
    connector.wait(jobs)
    assert sorted((r.job_id, r.success) for r in connector.get_finished()) == [
        (j, True) for j in jobs
    ]
    for i, (got, want) in enumerate(zip(kv.raw, expected, strict=True)):
        assert torch.equal(got.cpu(), want.cpu()), f"buffer {i} differs"
