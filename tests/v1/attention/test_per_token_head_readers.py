"""Per-token-head INT8 / FP8 caches read by the attention backends: the reference backend and
CPU_ATTN (at every SIMD level it was built with) attend over exactly the codec's dequantized keys
and values."""

from __future__ import annotations

import math

import pytest
import torch
from kv_cache_test_utils import DEVICES, PER_TOKEN_HEAD_DTYPES

from vllm.accuracy.cache_io import extension_status
from vllm.kv_quant import dequantize_per_token_head, quantize_per_token_head
from vllm.kv_quant.formats import lookup
from vllm.v1.attention.backends import (
    AttentionLayerScales,
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    kv_cache_layout,
    split_kv_cache,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

KINDS = PER_TOKEN_HEAD_DTYPES


def readers(device: str, **impl_args: object) -> list[tuple[str, ReferenceAttentionImpl]]:
    """(name, impl) of every backend reading a cache on ``device``: the reference backend, and on
    the CPU with the extension built CPU_ATTN at each of its SIMD levels."""
    out = [("reference", ReferenceAttentionImpl(**impl_args))]  # type: ignore[arg-type]
    if device == "cpu" and extension_status()[0]:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl

        for simd in ops.paged_attention_simd_levels():
            cpu = CPUAttentionImpl(**impl_args)  # type: ignore[arg-type]
            cpu.simd = simd
            out.append((f"CPU_ATTN {simd}", cpu))
    return out


def make_cache(
    device: str, kind: str, num_kv_heads: int, head_size: int, head_size_v: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = lookup(kind)
    assert fmt.storage_dtype is not None
    spec = FullAttentionSpec(
        block_size=8,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=fmt.storage_dtype,
        kv_quant_mode=fmt.quant_mode,
    )
    num_blocks = 12
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=["l"])],
        kv_cache_groups=[KVCacheGroupSpec(["l"], spec)],
    )
    with kv_cache_layout(layout):
        caches = init_layer_kv_caches(
            config, [ReferenceAttentionBackend], device, model_dtype=torch.float32, cache_dtype=kind
        )
    return split_kv_cache(caches["l"])


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of one sequence, in float64."""
    seq_len, q_len, group = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
    out = torch.empty(q_len, q.shape[1], v.shape[2], dtype=torch.float64)
    for h in range(q.shape[1]):
        for i in range(q_len):
            p = seq_len - q_len + i
            s = k[: p + 1, h // group].double() @ q[i, h].double() * scale
            out[i, h] = torch.softmax(s, 0) @ v[: p + 1, h // group].double()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_backends_read_the_codec_values(device: str, kind: str, layout: str) -> None:
    g = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_size, head_size_v, block_size = 4, 2, 64, 32, 8
    key_cache, value_cache = make_cache(device, kind, num_kv_heads, head_size, head_size_v, layout)
    seq_lens, query_lens = [29, 17, 6], [29, 1, 3]
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_size, generator=g) * 3
    v = torch.randn(total, num_kv_heads, head_size_v, generator=g)
    k[5, 1] = 0.0  # a zero row
    table = torch.randperm(12, generator=g).reshape(3, 4)
    positions = torch.cat([torch.arange(s) for s in seq_lens])
    req = torch.repeat_interleave(torch.arange(3), torch.tensor(seq_lens))
    slots = table[req, positions // block_size] * block_size + positions % block_size
    impl = ReferenceAttentionImpl(
        num_heads,
        head_size,
        num_kv_heads=num_kv_heads,
        kv_cache_dtype=kind,
        head_size_v=head_size_v,
    )
    # Upstream engines keep placeholder scales of 1.0 on the layer; any value is ignored.
    layer = AttentionLayerScales(torch.zeros((), device=device), torch.zeros((), device=device))
    impl.do_kv_cache_update(
        layer, k.to(device), v.to(device), (key_cache, value_cache), slots.to(device)
    )
    # The bytes are the codec's, and the reader attends over the codec's values.
    rows_k = key_cache[table[req, positions // block_size], positions % block_size].cpu()
    q_k, s_k = quantize_per_token_head(k, kind)
    assert torch.equal(rows_k[..., :head_size], q_k)
    assert torch.equal(rows_k[..., head_size:].contiguous().view(torch.float32).squeeze(-1), s_k)
    deq_k = dequantize_per_token_head(rows_k, kind)
    rows_v = value_cache[table[req, positions // block_size], positions % block_size].cpu()
    deq_v = dequantize_per_token_head(rows_v, kind)

    q = torch.randn(sum(query_lens), num_heads, head_size, generator=g)
    metadata = ReferenceAttentionMetadata.build(seq_lens, query_lens, table.to(device), block_size)
    refs, k_off, q_off = [], 0, 0
    for s, ql in zip(seq_lens, query_lens, strict=True):
        refs.append(
            oracle(
                q[q_off : q_off + ql],
                deq_k[k_off : k_off + s],
                deq_v[k_off : k_off + s],
                1 / math.sqrt(head_size),
            )
        )
        k_off, q_off = k_off + s, q_off + ql
    names = []
    for name, reader in readers(
        device,
        num_heads=num_heads,
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        kv_cache_dtype=kind,
        head_size_v=head_size_v,
    ):
        out = reader.forward(layer, q.to(device), None, None, (key_cache, value_cache), metadata)
        torch.testing.assert_close(
            out.cpu().double(),
            torch.cat(refs),
            atol=2e-5,
            rtol=2e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )
        names.append(name)
    assert len(names) > 1 or device != "cpu" or not extension_status()[0], names
