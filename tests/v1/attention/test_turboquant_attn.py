"""The TURBOQUANT backend (vllm.v1.attention.backends.turboquant_attn) without the engine: spec
packing and cache shape against the registry's page math, the builder's decode / prefill split,
and one mixed batch (decodes, a first-chunk prefill, a short and a long continuation) against
attention in fp32 torch over what each path reads: the codec's decoded cache, or the batch's
own keys and values (also inside a workspace the builder reserved and locked), and the
refusals. Kernels run under Triton's interpreter without a GPU (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

from vllm.kv_quant.turboquant import TQ_PRESETS, TurboQuantConfig, turboquant_decode_slots
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.turboquant_attn import (
    CONTINUATION_DECODE_THRESHOLD,
    TurboQuantAttentionBackend,
    TurboQuantAttentionImpl,
    TurboQuantMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
from vllm.v1.worker import workspace

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here"),
    pytest.mark.usefixtures("single_intra_op_thread"),
]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
def test_spec_packing_and_cache_shape_are_the_page_math(preset: str) -> None:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode[preset.upper()])  # fmt: skip
    packed = TurboQuantAttentionBackend.customize_spec(spec)
    slot = TurboQuantConfig.from_cache_dtype(preset, 128).slot_size_aligned
    assert spec.state_content_bytes is None and packed.state_content_bytes == slot
    assert packed.page_size_bytes == spec.page_size_bytes == BLOCK * 4 * slot
    shape = TurboQuantAttentionBackend.get_kv_cache_shape(3, BLOCK, 4, 128, preset)
    assert shape == (3, 4, BLOCK, slot)
    assert torch.Size(shape).numel() == 3 * packed.page_size_bytes
    plain = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=128,
                              dtype=torch.bfloat16)  # fmt: skip
    assert TurboQuantAttentionBackend.customize_spec(plain) is plain
    assert TurboQuantAttentionBackend.supports_kv_cache_dtype(preset)
    assert not TurboQuantAttentionBackend.supports_kv_cache_dtype("auto")


def test_builder_splits_decodes_from_prefills() -> None:
    qsl = torch.tensor([0, 1, 2, 7, 10], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([9, 4, 5, 30]),
        num_reqs=4, num_actual_tokens=10, max_query_len=5, max_seq_len=30,
        block_table_tensor=torch.zeros(4, 2, dtype=torch.int32),
        slot_mapping=torch.arange(10), seq_lens_cpu_upper_bound=torch.tensor([9, 4, 5, 30]),
    )  # fmt: skip
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.TURBOQUANT_K8V4)  # fmt: skip
    builder = TurboQuantMetadataBuilder(spec, ["layers.0.attn"], None, DEVICE)
    assert builder.reorder_batch_threshold == 1
    metadata = builder.build(0, cam)
    assert (metadata.num_decodes, metadata.num_decode_tokens) == (2, 2)
    assert metadata.is_prefill and metadata.num_actual_tokens == 10


@contextmanager
def _locked_workspace(hq: int, hk: int, d: int, max_model_len: int, splits: int) -> Iterator[None]:
    """A workspace manager that the builder reserved for these shapes, then locked: a request
    beyond the reservation is an AssertionError."""
    workspace.init_workspace_manager(DEVICE)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=2048,
                                         enable_chunked_prefill=True),
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=torch.float16,
                                     get_num_attention_heads=lambda parallel_config: hq),
        parallel_config=SimpleNamespace(),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=splits),
    )  # fmt: skip
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hk, head_size=d, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.TURBOQUANT_K3V4_NC)  # fmt: skip
    try:
        TurboQuantMetadataBuilder(spec, ["layers.0.attn"], config, DEVICE)
        workspace.lock_workspace()
        yield
    finally:
        workspace.reset_workspace_manager()


@pytest.mark.parametrize(
    ("preset", "reserved"),
    [("turboquant_k8v4", False), ("turboquant_k3v4_nc", False), ("turboquant_k3v4_nc", True)],
)
def test_mixed_batch(preset: str, reserved: bool) -> None:
    """Two decodes, a first-chunk prefill (raw K/V), a short continuation (decode per token)
    and a long one (codec prefix + raw chunk), GQA 2, block table shuffled; ``reserved``: run
    inside a workspace the builder reserved and locked (the impl asks for no more)."""
    gen = torch.Generator().manual_seed(0)
    d, hk, hq = 64, 2, 4
    seq_lens = [20, 35, 6, 24, CONTINUATION_DECODE_THRESHOLD + 9]
    query_lens = [1, 1, 6, 5, CONTINUATION_DECODE_THRESHOLD + 1]
    impl = TurboQuantAttentionImpl(hq, d, 0.125, num_kv_heads=hk, kv_cache_dtype=preset)
    impl.max_num_kv_splits = 3
    scope = _locked_workspace(hq, hk, d, max(seq_lens), 3) if reserved else nullcontext()
    layer = torch.nn.Module()  # holds the impl's _tq_* tables
    pages = -(-max(seq_lens) // BLOCK)
    num_blocks = pages * len(seq_lens)
    shape = TurboQuantAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK, hk, d, preset)
    cache = torch.zeros(shape[0], shape[2], shape[1], shape[3], dtype=torch.uint8)
    cache = cache.to(DEVICE).transpose(1, 2)  # LBNHC in memory, (B, H, N, C) logical
    table = torch.randperm(num_blocks, generator=gen).reshape(len(seq_lens), pages).to(torch.int32)
    keys = [torch.randn(n, hk, d, generator=gen) for n in seq_lens]
    values = [torch.randn(n, hk, d, generator=gen) for n in seq_lens]

    def slots_of(i: int, positions: range) -> torch.Tensor:
        return torch.tensor([int(table[i, t // BLOCK]) * BLOCK + t % BLOCK for t in positions])

    # Context tokens of earlier steps, then this batch's tokens (do_kv_cache_update's call).
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if n > q:
            old_k, old_v = keys[i][: n - q].to(DEVICE), values[i][: n - q].to(DEVICE)
            old_slots = slots_of(i, range(n - q)).to(DEVICE)
            impl.do_kv_cache_update(layer, old_k, old_v, cache, old_slots)
    new_k = torch.cat([k[n - q :] for k, n, q in zip(keys, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([v[n - q :] for v, n, q in zip(values, seq_lens, query_lens, strict=True)])
    slot_mapping = torch.cat([slots_of(i, range(n - q, n)) for i, (n, q) in
                              enumerate(zip(seq_lens, query_lens, strict=True))])  # fmt: skip
    impl.do_kv_cache_update(
        layer, new_k.to(DEVICE), new_v.to(DEVICE), cache, slot_mapping.to(DEVICE)
    )
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), num_reqs=5,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=table.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE), seq_lens_cpu_upper_bound=torch.tensor(seq_lens),
    )  # fmt: skip
    metadata = TurboQuantMetadataBuilder(None, [], None, DEVICE).build(0, cam)
    query = torch.randn(int(qsl[-1]), hq, d, generator=gen).to(DEVICE, torch.float16)
    with scope:
        out = impl.forward(layer, query.reshape(query.shape[0], -1),
                           new_k.to(DEVICE, torch.float16), new_v.to(DEVICE, torch.float16),
                           cache, metadata)  # fmt: skip
    assert out.shape == (query.shape[0], hq * d) and out.dtype == torch.float16

    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    pi, centroids = layer._tq_Pi, layer._tq_centroids
    dec_k, dec_v = turboquant_decode_slots(cache.transpose(1, 2), cfg, centroids, pi)
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(n)
        page, row = table[i].long()[pos // BLOCK], pos % BLOCK
        k, v = dec_k[page, row], dec_v[page, row]  # everything from the cache
        if q == n:  # first chunk: its own keys and values
            k, v = new_k[int(qsl[i]) : int(qsl[i + 1])], new_v[int(qsl[i]) : int(qsl[i + 1])]
            k, v = k.half().float(), v.half().float()
        elif q > CONTINUATION_DECODE_THRESHOLD:  # codec prefix (held in fp16) + own chunk
            chunk = slice(int(qsl[i]), int(qsl[i + 1]))
            k = torch.cat([k[: n - q].half().float(), new_k[chunk].half().float()])
            v = torch.cat([v[: n - q].half().float(), new_v[chunk].half().float()])
        qq = query[int(qsl[i]) : int(qsl[i + 1])].float().transpose(0, 1)
        s = qq @ k.repeat_interleave(2, 1).permute(1, 2, 0) * 0.125
        mask = torch.arange(n)[None, :] > torch.arange(n - q, n)[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        ref = (p @ v.repeat_interleave(2, 1).transpose(0, 1)).transpose(0, 1)
        got = out[int(qsl[i]) : int(qsl[i + 1])].reshape(q, hq, d).float()
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)  # fp16 output rounding


def test_refusals() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of turboquant_k8v4"):
        TurboQuantAttentionImpl(4, 64, 0.125, kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="sliding_window: TURBOQUANT serves"):
        TurboQuantAttentionImpl(4, 64, 0.125, kv_cache_dtype="turboquant_k8v4", sliding_window=8)
    with pytest.raises(ValueError, match="head_size: expected a power of two"):
        TurboQuantAttentionImpl(4, 96, 0.125, kv_cache_dtype="turboquant_k8v4")
    impl = TurboQuantAttentionImpl(4, 64, 0.125, num_kv_heads=2, kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(ValueError, match=r"kv_cache: expected uint8 \(num_blocks, 2, block_size"):
        impl.do_kv_cache_update(None, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64),
                                torch.zeros(1, 16, 2, 196, dtype=torch.uint8),
                                torch.zeros(1, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="cache_dtype_str: expected one of"):
        TurboQuantAttentionBackend.get_kv_cache_shape(1, 16, 2, 64, "fp8")


def test_registry_selects_turboquant_by_name() -> None:
    from vllm.triton_utils import triton_interpreted
    from vllm.v1.attention.backends.registry import get_attn_backend

    capability = (9, 0) if DEVICE.type == "cuda" or not triton_interpreted() else None
    chosen = get_attn_backend(128, torch.bfloat16, "turboquant_3bit_nc", 16, capability,
                              backend="TURBOQUANT")  # fmt: skip
    assert chosen is TurboQuantAttentionBackend
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto' not supported by TURBOQUANT"):
        get_attn_backend(128, torch.bfloat16, "auto", 16, capability, backend="TURBOQUANT")
    # Unnamed, on a GPU: the preset's own backend, before the generic readers (upstream's).
    assert get_attn_backend(128, torch.float16, "turboquant_k8v4", 16, (9, 0)) is (
        TurboQuantAttentionBackend
    )
