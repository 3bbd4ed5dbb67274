"""``TritonAttentionBackend`` (``TRITON_ATTN``) against the reference backend (and CPU_ATTN) on
the same cache: every format x NHD / HND, GQA, prefill / chunked prefill / decode in one batch,
``head_size_v``, window, sinks, soft cap, split-K, key transforms, raw cache bytes decoded bit
for bit, upstream's ``unified_attention`` signature, argument errors and backend selection.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py); with one, natively
on CUDA tensors. Tolerances: the kernels round K, V and the softmax weights to the fp16 query
dtype before ``tl.dot`` (fp32 accumulation), 2^-11 relative per operand, so outputs of O(1)
values agree with the fp32 reference to ~1e-3; fp32 queries use IEEE fp32 dots (only the
summation order differs: 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from vllm.kv_quant import E2M1_VALUES, ScaleLayout
from vllm.kv_quant.formats import lookup
from vllm.v1.attention.backends import (
    AttentionLayerScales,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    TritonAttentionBackend,
    TritonAttentionImpl,
    get_attn_backend,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl, _kernel_missing
from vllm.v1.attention.ops.triton_unified_attention import (
    MAX_SPLITS,
    _side,
    kernel_format,
    plan_paged_attention,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

FORMATS = [
    ("auto", "linear"),
    ("float16", "linear"),
    ("float32", "linear"),
    ("fp8_e4m3", "linear"),
    ("fp8_e5m2", "linear"),
    ("nvfp4", "linear"),
    ("nvfp4", "interleave4"),
    ("nvfp4_mse", "interleave4"),
    ("int8_per_token_head", "linear"),
    ("fp8_per_token_head", "linear"),
]


@dataclass
class Case:
    """One batch: sequences of ``seq_lens`` tokens whose last ``query_lens`` are queries."""

    cache_dtype: str = "auto"
    scale_layout: str = "linear"
    layout: str = "NHD"
    num_kv_heads: int = 2
    group: int = 2
    head_size: int = 64
    head_size_v: int = 32
    block_size: int = 16
    seq_lens: list[int] = field(default_factory=lambda: [37, 21, 50])
    query_lens: list[int] = field(default_factory=lambda: [37, 6, 1])
    model_dtype: torch.dtype = torch.bfloat16  # the cache's dtype for "auto"
    query_dtype: torch.dtype = torch.float16
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    per_head_scale: bool = False
    num_splits: int | None = None

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        return lookup(self.cache_dtype).resolve_storage_dtype(self.model_dtype)


def make_side(case: Case, num_blocks: int, head_size: int) -> torch.Tensor:
    last = lookup(case.cache_dtype).last_dim(head_size)
    shape = (num_blocks, case.block_size, case.num_kv_heads, last)
    kw = dict(dtype=case.cache_torch_dtype, device=DEVICE)
    if case.layout == "NHD":
        return torch.zeros(shape, **kw)
    return torch.zeros(shape[0], shape[2], shape[1], shape[3], **kw).transpose(1, 2)


def impl_kwargs(case: Case) -> dict:
    return dict(
        num_kv_heads=case.num_kv_heads,
        sliding_window=case.sliding_window,
        kv_cache_dtype=case.cache_dtype,
        logits_soft_cap=case.logits_soft_cap,
        sinks=case.sinks,
        head_size_v=case.head_size_v,
        k_scale_layout=case.scale_layout,
    )


def setup(case: Case, seed: int = 0):
    """A cache written by the reference impl's writer (the compiled reshape_and_cache_flash)
    over a shuffled block table, the metadata, a query, the reference and Triton impls and the
    layer scales."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = case.num_kv_heads * case.group
    pages = [(s + case.block_size - 1) // case.block_size for s in case.seq_lens]
    num_blocks = max(pages) * len(case.seq_lens) + 2
    table = torch.randperm(num_blocks, generator=gen)[: max(pages) * len(case.seq_lens)]
    table = table.reshape(len(case.seq_lens), max(pages)).to(torch.int32).to(DEVICE)
    kv_cache = (
        make_side(case, num_blocks, case.head_size),
        make_side(case, num_blocks, case.head_size_v),
    )
    reference = ReferenceAttentionImpl(num_heads, case.head_size, **impl_kwargs(case))
    triton_impl = TritonAttentionImpl(num_heads, case.head_size, **impl_kwargs(case))
    triton_impl.num_splits = case.num_splits
    k_scale = torch.rand(case.num_kv_heads, generator=gen) + 0.25
    if not case.per_head_scale:
        k_scale = torch.tensor([0.6])
    layer = AttentionLayerScales(k_scale.to(DEVICE), (k_scale.flip(0) * 1.7).to(DEVICE))
    total = sum(case.seq_lens)
    key = torch.randn(total, case.num_kv_heads, case.head_size, generator=gen) * 2
    value = torch.randn(total, case.num_kv_heads, case.head_size_v, generator=gen)
    full = ReferenceAttentionMetadata.build(case.seq_lens, case.seq_lens, table, case.block_size)
    reference.do_kv_cache_update(
        layer, key.to(DEVICE), value.to(DEVICE), kv_cache, full.slot_mapping
    )
    metadata = ReferenceAttentionMetadata.build(
        case.seq_lens, case.query_lens, table, case.block_size
    )
    query = torch.randn(metadata.num_actual_tokens, num_heads, case.head_size, generator=gen)
    return reference, triton_impl, layer, kv_cache, metadata, query.to(DEVICE, case.query_dtype)


def tolerance(case: Case) -> float:
    """fp32: summation order only; fp16: operands rounded to 2^-11; bf16 (GPU): to 2^-8."""
    return {torch.float32: 1e-5, torch.float16: 4e-3}.get(case.query_dtype, 2e-2)


def check(case: Case, seed: int = 0, with_cpu_attn: bool = False) -> torch.Tensor:
    reference, triton_impl, layer, kv_cache, metadata, query = setup(case, seed)
    expected = reference.forward(layer, query, None, None, kv_cache, metadata)
    got = triton_impl.forward(layer, query, None, None, kv_cache, metadata)
    assert got.dtype == query.dtype and got.shape == expected.shape
    tol = tolerance(case)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    if with_cpu_attn and DEVICE.type == "cpu" and _kernel_missing() is None:
        cpu = CPUAttentionImpl(triton_impl.num_heads, case.head_size, **impl_kwargs(case))
        other = cpu.forward(layer, query, None, None, kv_cache, metadata)
        torch.testing.assert_close(got.float(), other.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS)
def test_matches_reference_every_format_and_layout(
    cache_dtype: str, scale_layout: str, layout: str
) -> None:
    """A prefill without prefix, a chunked prefill and a decode with a partial last page; GQA;
    head_size_v != head_size (64 for interleave4, which needs multiples of 64); the same cache
    read by CPU_ATTN agrees too."""
    head_size_v = 64 if scale_layout == "interleave4" else 32
    case = Case(
        cache_dtype,
        scale_layout,
        layout,
        head_size_v=head_size_v,
        model_dtype=torch.float16 if cache_dtype == "auto" and layout == "HND" else torch.bfloat16,
        per_head_scale=cache_dtype == "fp8_e5m2",
    )
    check(case, with_cpu_attn=True)


@pytest.mark.parametrize(
    ("cache_dtype", "num_splits"),
    [
        ("auto", 1),
        ("fp8_e4m3", 1),
        ("nvfp4", 1),
        ("int8_per_token_head", 1),
        ("fp8_per_token_head", 1),
        ("nvfp4", 3),
    ],
)
def test_window_sinks_soft_cap_odd_shapes_and_splits(cache_dtype: str, num_splits: int) -> None:
    """Group 5 (padded to 8 rows per token), head sizes that are no power of two, pages of 5
    tokens, a window, sinks, a soft cap, per-head scales, fp32 queries (IEEE dots), with and
    without split-K."""
    nvfp4 = cache_dtype == "nvfp4"
    check(
        Case(
            cache_dtype,
            layout="HND",
            num_kv_heads=3,
            group=5,
            head_size=48 if nvfp4 else 40,
            head_size_v=16 if nvfp4 else 24,
            block_size=5,
            seq_lens=[23, 40, 9],
            query_lens=[23, 11, 1],
            query_dtype=torch.float32,
            sliding_window=7,
            logits_soft_cap=3.0,
            sinks=torch.linspace(-2.0, 2.0, 15, device=DEVICE),
            per_head_scale=True,
            num_splits=num_splits,
        )
    )


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_long_decode_split_k(num_splits: int | None) -> None:
    """Single-query decode over 300 / 517 keys (10+ tiles): forced splits, one split, and the
    automatic choice; a GQA group of 8 on NVFP4 interleave4 pages."""
    check(
        Case(
            "nvfp4",
            "interleave4",
            num_kv_heads=2,
            group=8,
            head_size=64,
            head_size_v=64,
            seq_lens=[300, 517],
            query_lens=[1, 1],
            num_splits=num_splits,
        )
    )


@pytest.mark.parametrize("window", [1, 10_000])
def test_window_edges_and_non_causal(window: int) -> None:
    """A window of one key and one wider than every context, causal and not."""
    case = Case(sliding_window=window, seq_lens=[30, 17], query_lens=[9, 17])
    check(case)
    reference, triton_impl, layer, kv_cache, metadata, query = setup(case)
    metadata.causal = False
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    got = triton_impl.forward(layer, query, None, None, kv_cache, metadata).float()
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=4e-3)


def test_strided_query_output_buffer_and_5d_cache() -> None:
    """A query with a non-unit last stride, an output buffer with spare rows and a non-unit
    last stride, a flat query ``[T, Hq*D]``, and a 5-D ``(B, 2, N, H, D)`` cache."""
    case = Case("fp8_e4m3", head_size_v=64, seq_lens=[20, 9], query_lens=[5, 1])
    reference, triton_impl, layer, kv_cache, metadata, query = setup(case)
    five_d = torch.stack([kv_cache[0], kv_cache[1]], dim=1)
    expected = reference.forward(layer, query, None, None, kv_cache, metadata)
    strided = torch.zeros(query.shape[0], 4, 128, dtype=query.dtype, device=DEVICE)[..., ::2]
    strided.copy_(query)
    buffer = torch.full((9, 4, 128), 7.0, dtype=query.dtype, device=DEVICE)
    out = buffer[..., ::2]
    got = triton_impl.forward(layer, strided, None, None, five_d, metadata, out)
    assert got is out
    torch.testing.assert_close(out[:6].float(), expected.float(), atol=4e-3, rtol=4e-3)
    assert (buffer[6:] == 7).all() and (buffer[:6, :, 1::2] == 7).all()
    flat = triton_impl.forward(layer, query.reshape(6, -1), None, None, five_d, metadata)
    torch.testing.assert_close(flat, got[:6], atol=0, rtol=0)


def _random_bytes(side: torch.Tensor, gen: torch.Generator) -> None:
    """Fill a cache side with random bits of its dtype (every code, NaN, Inf, subnormals)."""
    width = side.element_size()
    bits = torch.randint(0, 256, (side.numel() * width,), dtype=torch.uint8, generator=gen)
    raw = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width])
    side.copy_(raw.view(side.dtype).reshape(side.shape).to(side.device))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN/Inf bytes, on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # beyond fp16's range
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS)
def test_raw_bytes_decode_bit_for_bit(
    cache_dtype: str, scale_layout: str, query_dtype: torch.dtype
) -> None:
    """A window of one key over random value-cache bytes: each query sees only its own key,
    its softmax weight is exactly 1, so the fp32 output is the decoded value row, which must
    equal the reference codec's bit for bit (NaN where it gives NaN) for every byte pattern,
    page and token position (block-scale placement included). fp16 queries too: one rounding
    of the codec's fp32 value to fp16 (per-token-head values then carry their row scale, not
    the probabilities, whose ``p * scale`` would round it to fp16 first)."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 33, (12,), generator=gen).tolist()
    case = Case(
        cache_dtype,
        scale_layout,
        head_size=64,
        head_size_v=64,
        seq_lens=seq_lens,
        query_lens=[1] * len(seq_lens),
        query_dtype=query_dtype,
        sliding_window=1,
        per_head_scale=True,
    )
    reference, triton_impl, layer, kv_cache, metadata, query = setup(case)
    _random_bytes(kv_cache[1], gen)  # keys stay finite: a NaN score would hide the value
    expected = reference.forward(layer, query, None, None, kv_cache, metadata)
    got = triton_impl.forward(layer, query, None, None, kv_cache, metadata)
    assert torch.equal(got.isnan(), expected.isnan())
    same = torch.where(expected.isnan(), 0.0, expected)
    assert torch.equal(torch.where(got.isnan(), 0.0, got), same)


def test_dot_operands_exact_in_half_precision() -> None:
    """The unscaled values the kernel feeds its fp16 / bf16 dots are exact there (the
    interpreter runs no bf16 dot, so this is the bf16 half of the bit-exact claim): every NVFP4
    E2M1 value times every finite e4m3 block scale, FP8 units (e4m3 * 2^-8, e5m2), int8."""
    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[e4m3.isfinite()]
    e5m2 = codes.view(torch.float8_e5m2).float()
    operands = {
        "nvfp4": (torch.tensor(E2M1_VALUES)[:, None] * e4m3[None, :]).flatten(),
        "e4m3_units": e4m3 / 256,
        "e5m2": e5m2[e5m2.isfinite()],
        "int8": torch.arange(-128, 128, dtype=torch.float32),
    }
    for name, values in operands.items():
        for dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(values.to(dtype).float(), values), (name, dtype)


def test_key_transforms_through_attention_kv_cache() -> None:
    """AttentionKVCache with TRITON_ATTN, a Hadamard key rotation and a key offset: the same
    bytes as with REFERENCE, and the same attention."""
    from vllm.v1.worker.attention_kv_cache import AttentionKVCache

    gen = torch.Generator().manual_seed(4)
    heads, dim = 2, 64
    k = torch.randn(40, heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(40, heads, dim, generator=gen).to(DEVICE)
    q = torch.randn(40, 4, dim, generator=gen).to(DEVICE, torch.float16)
    offset = torch.randn(heads, dim, generator=gen).to(DEVICE) * 0.1
    table = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    outs = []
    caches = []
    for backend in ("TRITON_ATTN", "REFERENCE"):
        cache = AttentionKVCache.create(
            "fp8_e4m3", 6, 16, heads, dim, num_heads=4, device=DEVICE, backend=backend,
            key_rotation="hadamard",
        )  # fmt: skip
        cache.set_kv_scales(torch.tensor([0.02]), torch.tensor([0.01]))
        cache.set_key_offset(offset)
        meta = cache.metadata([40], [40], table)
        cache.write(k, v, meta.slot_mapping)
        outs.append(cache.attend(q, meta).float())
        caches.append(cache)
    assert caches[0].backend is TritonAttentionBackend
    assert isinstance(caches[0].impl, TritonAttentionImpl)
    assert torch.equal(caches[0].key_cache, caches[1].key_cache)
    torch.testing.assert_close(outs[0], outs[1], atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize(
    "cache_dtype", ["auto", "fp8_e4m3", "nvfp4", "int8_per_token_head", "fp8_per_token_head"]
)
def test_bf16_query(cache_dtype: str) -> None:
    """bf16 queries: per-token-head caches take the probabilities-times-row-scale path. Under
    the interpreter (whose bf16 arithmetic is wrong) the launch runs on fp32 copies of the query
    and output (FP32Staging); on a GPU the kernels compute in bf16."""
    check(replace(Case(cache_dtype), query_dtype=torch.bfloat16), seed=5)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's fp32 staging: CPU only")
def test_bf16_query_is_staged_through_fp32_under_the_interpreter() -> None:
    from vllm.v1.attention.ops.triton_unified_attention import FP32Staging

    query = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    out = torch.empty(3, 4, 32, dtype=torch.bfloat16)
    staging = FP32Staging.needed(query, out)
    assert staging is not None
    assert staging.query_fp32.dtype == staging.out_fp32.dtype == torch.float32
    assert FP32Staging.needed(query.half(), out.half()) is None


# ------------------------------------------------------------------------ errors, selection


@pytest.mark.parametrize("splits", [0, MAX_SPLITS + 1, True, 2.0])
def test_bad_num_splits_fails_before_writing(splits: object) -> None:
    case = Case(seq_lens=[20], query_lens=[4])
    _, triton_impl, layer, kv_cache, metadata, query = setup(case)
    before = [side.clone() for side in kv_cache]
    key = torch.randn(4, 2, 64, device=DEVICE)
    value = torch.randn(4, 2, 32, device=DEVICE)
    triton_impl.num_splits = splits  # type: ignore[assignment]
    message = rf"num_splits: expected None or an int in 1\.\.{MAX_SPLITS}, got"
    with pytest.raises(ValueError, match=message):
        triton_impl.forward(layer, query, key, value, kv_cache, metadata)
    assert all(torch.equal(a, b) for a, b in zip(kv_cache, before, strict=True))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the shared bad-argument cases are CPU tensors")
@pytest.mark.parametrize("kind", ["auto", "nvfp4"])
def test_shared_bad_arguments_raise_before_the_write(kind: str) -> None:
    """Every case of test_forward_checks_before_write on TRITON_ATTN: the error, and the cache
    bytes unchanged."""
    from tests.v1.attention.test_forward_checks_before_write import (
        BAD,
        HEAD_SIZE,
        NUM_HEADS,
        NUM_KV_HEADS,
        _forward_args,
    )

    impl = TritonAttentionImpl(NUM_HEADS, HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=kind)
    for name, mutate, message in BAD:
        if name == "k_scale" and kind == "auto":
            continue  # an unquantized cache reads no scale values
        args, raw = _forward_args(kind)
        before = raw.clone()
        mutate(args)
        with pytest.raises(ValueError, match=message):
            impl.forward(**args)
        assert torch.equal(raw, before), name


def test_reference_checks_apply() -> None:
    _, triton_impl, layer, kv_cache, metadata, query = setup(Case())
    with pytest.raises(ValueError, match=r"query: expected shape \[T, 4, 64\], got \[44, 4, 32\]"):
        triton_impl.forward(layer, query[..., :32], None, None, kv_cache, metadata)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU cache is refused only on a CUDA host")
def test_cpu_cache_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends import triton_attn

    _, triton_impl, layer, kv_cache, metadata, query = setup(Case())
    monkeypatch.setattr(triton_attn, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"kv_cache: expected a CUDA tensor .*got cpu"):
        triton_impl.forward(layer, query, None, None, kv_cache, metadata)
    reasons = TritonAttentionBackend.validate_configuration(64, torch.float16, "auto", 16, None)
    assert reasons == ["TRITON_ATTN does not run on CPU"]


def test_selector_picks_triton_where_flashinfer_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends import CPUAttentionBackend, FlashInferBackend, registry

    h100 = (9, 0)
    monkeypatch.setattr(registry, "flashinfer_missing", lambda: True)
    for cache_dtype in ("auto", "fp8_e4m3", "nvfp4", "int8_per_token_head"):
        chosen = get_attn_backend(128, torch.bfloat16, cache_dtype, 16, h100)
        assert chosen is TritonAttentionBackend
    with pytest.raises(ValueError, match="FLASHINFER: the flashinfer package is not installed"):
        get_attn_backend(128, torch.int8, "auto", 16, h100)
    monkeypatch.setattr(registry, "flashinfer_missing", lambda: False)
    assert get_attn_backend(128, torch.bfloat16, "auto", 16, h100) is FlashInferBackend
    # FlashInfer cannot read NVFP4 on sm_90: TRITON_ATTN does, before REFERENCE.
    assert get_attn_backend(128, torch.bfloat16, "nvfp4", 16, h100) is TritonAttentionBackend
    if _kernel_missing() is None:
        assert get_attn_backend(128, torch.bfloat16, "auto", 16, None) is CPUAttentionBackend
    reasons = TritonAttentionBackend.validate_configuration(64, torch.float16, "auto", 16, (7, 5))
    assert reasons == ["TRITON_ATTN does not run on sm_75"]
    assert TritonAttentionBackend.get_impl_cls() is TritonAttentionImpl


@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_rows_off_4_byte_boundaries(cache_dtype: str) -> None:
    """Per-token-head rows are ``D + 4`` bytes (D a multiple of 4): an allocated cache's rows
    start on 4-byte boundaries (``row_align`` 4: 4-byte loads, each inline scale one fp32
    load), a cache view one byte off does not (``row_align`` 1: byte loads). Both read the
    same bytes to the same output."""
    gen = torch.Generator().manual_seed(5)
    blocks, block, heads, d = 3, 16, 2, 64
    rows = torch.randint(-100, 100, (2, blocks, block, heads, d), generator=gen, dtype=torch.int8)
    if cache_dtype == "fp8_per_token_head":  # finite e4m3 bytes
        rows = rows.view(torch.uint8) & 0x77
    scales = torch.rand(2, blocks, block, heads, 1, generator=gen) / 50 + 0.01
    raw = torch.cat([rows.view(torch.uint8), scales.view(torch.uint8)], -1)  # [2, B, N, H, 68]
    aligned = raw.clone().to(DEVICE)
    shifted = torch.zeros(raw.numel() + 1, dtype=torch.uint8, device=DEVICE)
    shifted[1:] = raw.flatten().to(DEVICE)
    odd = shifted[1:].view(raw.shape)
    storage = lookup(cache_dtype).resolve_storage_dtype(torch.bfloat16)
    fmt = lookup(cache_dtype)
    query = torch.randn(3, 2 * heads, d, generator=gen).to(DEVICE)
    outs = []
    for cache, align in ((aligned, 4), (odd, 1)):
        key_cache, value_cache = cache.view(storage).unbind(0)
        side = _side(key_cache, kernel_format(fmt), d, ScaleLayout.LINEAR, None)
        assert side.row_align == align
        out = torch.empty_like(query)
        seq_lens = torch.tensor([37, 9], dtype=torch.int32)
        table = torch.tensor([[2, 0, 1], [1, 0, 0]], dtype=torch.int32)
        one = torch.ones(1)
        plan_paged_attention(out, query, key_cache, value_cache, table, seq_lens,
                             torch.tensor([0, 2, 3], dtype=torch.int32), cache_dtype, one, one,
                             d**-0.5, 2, 37)()  # fmt: skip
        outs.append(out.cpu())
    assert outs[0].isfinite().all()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
