"""The ULTRAQUANT backend (vllm.v1.attention.backends.ultraquant_attn) without the engine: its
identity over TurboQuant's backend, the registry's choice, one mixed batch (decodes, a
first-chunk prefill, a short and a long continuation) written through ``do_kv_cache_update``
and read by ``forward``, against fp32 attention over the reference codec's values of the same
keys and values, the same batch inside a locked workspace that TurboQuant's builder reserved,
and the refusals. Small shapes: the unified path decodes the whole cache per request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.turboquant_attn import (
    CONTINUATION_DECODE_THRESHOLD,
    TurboQuantAttentionBackend,
    TurboQuantMetadataBuilder,
)
from vllm.v1.attention.backends.ultraquant_attn import (
    UltraQuantAttentionBackend,
    UltraQuantAttentionImpl,
)
from vllm.v1.attention.ops.flydsl_ultraquant_decode import flydsl_ultraquant_decode_attention
from vllm.v1.attention.ops.ultraquant.format import slot_size
from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix, ultraquant_encode_decode
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
from vllm.v1.worker import workspace

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK, D, HK, HQ, SCALE = 16, 32, 2, 4, 0.2
LONG = CONTINUATION_DECODE_THRESHOLD + 3
SEQ_LENS = [20, 35, 6, 24, LONG + 10]
QUERY_LENS = [1, 1, 6, 5, LONG]


def _run_batch(impl: UltraQuantAttentionImpl, layer: torch.nn.Module) -> dict[str, object]:
    """Store each request's context, then this batch's tokens, and run ``forward`` over it."""
    gen = torch.Generator().manual_seed(0)
    pages = -(-max(SEQ_LENS) // BLOCK)
    num_blocks = pages * len(SEQ_LENS)
    shape = UltraQuantAttentionBackend.get_kv_cache_shape(
        num_blocks, BLOCK, HK, D, "ultraquant_4bit"
    )
    cache = torch.zeros(shape[0], shape[2], shape[1], shape[3], dtype=torch.uint8)
    cache = cache.to(DEVICE).transpose(1, 2)  # LBNHC in memory, (B, H, N, C) logical
    table = torch.randperm(num_blocks, generator=gen).reshape(len(SEQ_LENS), pages).int()
    keys = [torch.randn(n, HK, D, generator=gen).bfloat16() for n in SEQ_LENS]
    values = [torch.randn(n, HK, D, generator=gen).bfloat16() for n in SEQ_LENS]

    def slots_of(i: int, positions: range) -> torch.Tensor:
        return torch.tensor([int(table[i, t // BLOCK]) * BLOCK + t % BLOCK for t in positions])

    pairs = list(zip(SEQ_LENS, QUERY_LENS, strict=True))
    for i, (n, q) in enumerate(pairs):
        if n > q:
            impl.do_kv_cache_update(layer, keys[i][: n - q].to(DEVICE),
                                    values[i][: n - q].to(DEVICE), cache,
                                    slots_of(i, range(n - q)).to(DEVICE))  # fmt: skip
    new_k = torch.cat([k[n - q :] for k, (n, q) in zip(keys, pairs, strict=True)]).to(DEVICE)
    new_v = torch.cat([v[n - q :] for v, (n, q) in zip(values, pairs, strict=True)]).to(DEVICE)
    slot_mapping = torch.cat([slots_of(i, range(n - q, n)) for i, (n, q) in enumerate(pairs)])
    impl.do_kv_cache_update(layer, new_k, new_v, cache, slot_mapping.to(DEVICE))
    qsl = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE),
        num_reqs=len(SEQ_LENS), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(QUERY_LENS), max_seq_len=max(SEQ_LENS),
        block_table_tensor=table.to(DEVICE), slot_mapping=slot_mapping.to(DEVICE),
        seq_lens_cpu_upper_bound=torch.tensor(SEQ_LENS),
    )  # fmt: skip
    metadata = TurboQuantMetadataBuilder(None, [], None, DEVICE).build(0, cam)
    query = torch.randn(int(qsl[-1]), HQ, D, generator=gen).to(DEVICE, torch.bfloat16)
    out = impl.forward(layer, query.reshape(query.shape[0], -1), new_k, new_v, cache, metadata)
    return dict(out=out, query=query, keys=keys, values=values, qsl=qsl.tolist())


def _reference(batch: dict, i: int) -> torch.Tensor:
    """Request ``i``'s attention in fp32 over what its path reads (module docstring)."""
    n, q = SEQ_LENS[i], QUERY_LENS[i]
    start, stop = batch["qsl"][i], batch["qsl"][i + 1]
    query = batch["query"][start:stop].float().cpu()
    k, v = batch["keys"][i].float(), batch["values"][i].float()
    h = hadamard_matrix(D, torch.device("cpu"))
    if q == n:  # first chunk: its own keys and values
        qr, kr, vr = query, k, v
    elif q <= CONTINUATION_DECODE_THRESHOLD:  # the unified path over the whole cache
        qr = (query @ h).to(torch.float8_e4m3fn).float()
        kr, vr = ultraquant_encode_decode(k), ultraquant_encode_decode(v, rotate=False)
    else:  # the cached prefix, decoded into bf16 buffers, then the chunk as given
        qr = query @ h
        old_k = ultraquant_encode_decode(k[: n - q]).bfloat16().float()
        old_v = ultraquant_encode_decode(v[: n - q], rotate=False).bfloat16().float()
        kr, vr = torch.cat([old_k, k[n - q :] @ h]), torch.cat([old_v, v[n - q :]])
    kr, vr = kr.repeat_interleave(HQ // HK, 1), vr.repeat_interleave(HQ // HK, 1)
    s = qr.transpose(0, 1) @ kr.permute(1, 2, 0) * SCALE
    mask = torch.arange(n)[None, :] > torch.arange(n - q, n)[:, None]
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return (p @ vr.transpose(0, 1)).transpose(0, 1)


def _impl() -> UltraQuantAttentionImpl:
    return UltraQuantAttentionImpl(HQ, D, SCALE, num_kv_heads=HK, kv_cache_dtype="ultraquant_4bit")


def test_backend_identity_and_spec() -> None:
    backend = UltraQuantAttentionBackend
    assert backend.get_name() == "ULTRAQUANT" and issubclass(backend, TurboQuantAttentionBackend)
    assert backend.get_preferred_block_size(16) == backend.get_preferred_block_size(128) == 64
    assert backend.get_impl_cls() is UltraQuantAttentionImpl
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HK, head_size=256, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.ULTRAQUANT_4BIT)  # fmt: skip
    packed = backend.customize_spec(spec)
    assert packed.state_content_bytes == slot_size(256) == 272
    assert packed.page_size_bytes == BLOCK * HK * 272
    tq = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HK, head_size=128, dtype=torch.uint8,
                           kv_quant_mode=KVQuantMode.TURBOQUANT_K8V4)  # fmt: skip
    assert backend.customize_spec(tq) is tq
    assert backend.get_kv_cache_shape(3, BLOCK, HK, 256, "ultraquant_4bit") == (3, HK, BLOCK, 272)
    assert backend.supports_kv_cache_dtype("ultraquant_4bit")
    assert not backend.supports_kv_cache_dtype("turboquant_k8v4")
    assert not TurboQuantAttentionBackend.supports_kv_cache_dtype("ultraquant_4bit")


def test_registry_picks_ultraquant_for_its_format() -> None:
    from vllm.v1.attention.backends.registry import get_attn_backend

    # Unnamed on a GPU: the format's own backend, before the generic readers (upstream's).
    assert get_attn_backend(256, torch.bfloat16, "ultraquant_4bit", 64, (9, 0)) is (
        UltraQuantAttentionBackend
    )
    reasons = UltraQuantAttentionBackend.validate_configuration(
        80, torch.float16, "ultraquant_4bit", 64, (9, 0)
    )
    assert any("model dtype torch.float16 not supported" in r for r in reasons)
    assert any("head size 80 not supported" in r for r in reasons)


def test_mixed_batch_against_the_codec() -> None:
    """Two decodes, a first-chunk prefill, a short and a long continuation, GQA 2, shuffled
    block table; decodes route to the unified path (no FlyDSL here)."""
    impl = _impl()
    assert not impl._flydsl_decode_eligible
    batch = _run_batch(impl, torch.nn.Module())
    out = batch["out"]
    assert out.shape == (sum(QUERY_LENS), HQ * D) and out.dtype == torch.bfloat16
    for i in range(len(SEQ_LENS)):
        start, stop = batch["qsl"][i], batch["qsl"][i + 1]
        got = out[start:stop].reshape(stop - start, HQ, D).float().cpu()
        torch.testing.assert_close(got, _reference(batch, i), atol=1e-2, rtol=1e-2)


@pytest.fixture
def locked_workspace():
    """A workspace manager reserved by TurboQuant's builder for this test's shapes, then
    locked: a request beyond the reservation is an AssertionError."""
    workspace.init_workspace_manager(DEVICE)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048,
                                         enable_chunked_prefill=True),
        model_config=SimpleNamespace(max_model_len=max(SEQ_LENS), dtype=torch.bfloat16,
                                     get_num_attention_heads=lambda parallel_config: HQ),
        parallel_config=SimpleNamespace(),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=32),
    )  # fmt: skip
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HK, head_size=D, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.ULTRAQUANT_4BIT)  # fmt: skip
    try:
        TurboQuantMetadataBuilder(spec, ["layers.0.attn"], config, DEVICE)
        workspace.lock_workspace()
        yield
    finally:
        workspace.reset_workspace_manager()


def test_forward_fits_the_reserved_workspace(locked_workspace: None) -> None:
    batch = _run_batch(_impl(), torch.nn.Module())
    for i in range(len(SEQ_LENS)):
        start, stop = batch["qsl"][i], batch["qsl"][i + 1]
        got = batch["out"][start:stop].reshape(stop - start, HQ, D).float().cpu()
        torch.testing.assert_close(got, _reference(batch, i), atol=1e-2, rtol=1e-2)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of ultraquant_4bit"):
        UltraQuantAttentionImpl(4, 64, 0.1, kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(ValueError, match="head_size: expected a power of two of at least 32"):
        UltraQuantAttentionImpl(4, 16, 0.1, kv_cache_dtype="ultraquant_4bit")
    with pytest.raises(ValueError, match="head_size: expected a power of two"):
        UltraQuantAttentionImpl(4, 96, 0.1, kv_cache_dtype="ultraquant_4bit")
    for name in ("sliding_window", "sinks", "logits_soft_cap"):
        with pytest.raises(ValueError, match=f"{name}: ULTRAQUANT serves"):
            UltraQuantAttentionImpl(4, 64, 0.1, kv_cache_dtype="ultraquant_4bit",
                                    **{name: 8 if name == "sliding_window" else 1.0})  # fmt: skip
    with pytest.raises(ValueError, match="attn_type: ULTRAQUANT serves decoder"):
        UltraQuantAttentionImpl(4, 64, 0.1, kv_cache_dtype="ultraquant_4bit", attn_type="encoder")
    with pytest.raises(ValueError, match="cache_dtype_str: expected one of ultraquant_4bit"):
        UltraQuantAttentionBackend.get_kv_cache_shape(1, 16, 2, 64, "turboquant_k8v4")
    impl = _impl()
    small = torch.zeros(1, HK, BLOCK, slot_size(D) - 1, dtype=torch.uint8)
    kv = torch.zeros(1, HK, D)
    with pytest.raises(ValueError, match=rf"kv_cache: expected uint8 \(num_blocks, {HK}, "):
        impl.do_kv_cache_update(torch.nn.Module(), kv, kv, small, torch.zeros(1).long())
    cache = torch.zeros(1, HK, BLOCK, slot_size(D), dtype=torch.uint8)
    with pytest.raises(ValueError, match="layer: expected the attention layer"):
        impl.do_kv_cache_update(None, kv, kv, cache, torch.zeros(1).long())
    assert not cache.any()
    with pytest.raises(RuntimeError, match="FlyDSL UltraQuant decode is not available"):
        flydsl_ultraquant_decode_attention(torch.zeros(1, 8, 256), cache, cache, cache, 0.1)


def test_forward_refusals_write_nothing() -> None:
    impl, layer = _impl(), torch.nn.Module()
    cache = torch.zeros(1, HK, BLOCK, slot_size(D), dtype=torch.uint8)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([3]), num_reqs=1,
        num_actual_tokens=3, max_query_len=3, max_seq_len=3,
        block_table_tensor=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(3),
    )  # fmt: skip
    metadata = TurboQuantMetadataBuilder(None, [], None, DEVICE).build(0, cam)
    query = torch.ones(3, HQ * D, dtype=torch.bfloat16)
    output = torch.full_like(query, 7.0)
    with pytest.raises(ValueError, match="key, value: expected the batch's keys and values"):
        impl.forward(layer, query, None, None, cache, metadata, output)
    with pytest.raises(ValueError, match="output_scale: expected None"):
        impl.forward(layer, query, None, None, cache, metadata, output, torch.ones(1))
    assert bool((output == 7.0).all())
    assert bool((impl.forward(layer, query, None, None, cache, None, output) == 0).all())
