"""``CPUAttentionBackend`` (``CPU_ATTN``) against the reference backend: every cache format x
NHD / HND x every compiled SIMD level, GQA, prefill / chunked prefill / decode in one batch,
``head_size_v``, sliding window, sinks, soft cap, split-K on long contexts, raw cache bytes
(every FP8 / E2M1 code), the scale-shape rule and the argument errors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kv_quant.formats import lookup
from vllm.v1.attention.backends import (
    AttentionBackendEnum,
    AttentionLayerScales,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionImpl,
    CPUAttentionMetadata,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

SIMD_LEVELS = ops.paged_attention_simd_levels()

# (kv_cache_dtype, NVFP4 scale layout)
FORMATS = [
    ("auto", "linear"),
    ("float16", "linear"),
    ("float32", "linear"),
    ("fp8_e4m3", "linear"),
    ("fp8_e5m2", "linear"),
    ("nvfp4", "linear"),
    ("nvfp4", "interleave4"),
    ("nvfp4_mse", "linear"),
    ("nvfp4_mse", "interleave4"),
    ("nvfp4_4over6", "linear"),
    ("nvfp4_4over6", "interleave4"),
]
# Rows with their own inline scales (k_scale / v_scale ignored); no block-scale layout.
PER_TOKEN_HEAD = [
    ("int8_per_token_head", "linear"),
    ("fp8_per_token_head", "linear"),
    ("int4_per_token_head", "linear"),
]


@dataclass
class Case:
    """One batch: sequences of ``seq_lens`` tokens whose last ``query_lens`` are queries."""

    cache_dtype: str = "auto"
    scale_layout: str | None = "linear"
    layout: str = "NHD"
    num_kv_heads: int = 2
    group: int = 2
    head_size: int = 64
    head_size_v: int = 64
    block_size: int = 16
    seq_lens: list[int] = field(default_factory=lambda: [37, 21, 50])
    query_lens: list[int] = field(default_factory=lambda: [37, 6, 1])
    model_dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    per_head_scale: bool = False
    five_d: bool = False

    @property
    def quantized(self) -> bool:
        return lookup(self.cache_dtype).is_quantized

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        return lookup(self.cache_dtype).resolve_storage_dtype(self.model_dtype)

    def last_dim(self, head_size: int) -> int:
        return lookup(self.cache_dtype).last_dim(head_size)


def make_side(case: Case, num_blocks: int, head_size: int) -> torch.Tensor:
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.last_dim(head_size))
    if case.layout == "NHD":
        return torch.zeros(shape, dtype=case.cache_torch_dtype)
    b, n, h, d = shape
    return torch.zeros(b, h, n, d, dtype=case.cache_torch_dtype).transpose(1, 2)


def setup(case: Case, seed: int = 0):
    """Cache written by the reference writer, metadata over a shuffled block table, a query,
    both impls and the layer scales."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = case.num_kv_heads * case.group
    pages = [(s + case.block_size - 1) // case.block_size for s in case.seq_lens]
    max_pages = max(pages)
    num_blocks = max_pages * len(case.seq_lens) + 2
    table = torch.randperm(num_blocks, generator=gen)[: max_pages * len(case.seq_lens)]
    table = table.reshape(len(case.seq_lens), max_pages).to(torch.int32)
    if case.five_d:
        assert case.head_size == case.head_size_v
        shape = CPUAttentionBackend.get_kv_cache_shape(
            num_blocks, case.block_size, case.num_kv_heads, case.head_size, case.cache_dtype
        )
        kv_cache = torch.zeros(shape, dtype=case.cache_torch_dtype)
    else:
        kv_cache = (
            make_side(case, num_blocks, case.head_size),
            make_side(case, num_blocks, case.head_size_v),
        )
    kwargs = dict(
        num_kv_heads=case.num_kv_heads,
        sliding_window=case.sliding_window,
        kv_cache_dtype=case.cache_dtype,
        logits_soft_cap=case.logits_soft_cap,
        sinks=case.sinks,
        head_size_v=case.head_size_v,
        k_scale_layout=case.scale_layout,
    )
    reference = ReferenceAttentionImpl(num_heads, case.head_size, **kwargs)
    cpu = CPUAttentionImpl(num_heads, case.head_size, **kwargs)
    if case.per_head_scale:
        k_scale = torch.rand(case.num_kv_heads, generator=gen) + 0.25
    else:
        k_scale = torch.tensor([0.6])
    layer = AttentionLayerScales(k_scale, k_scale.flip(0) * 1.7)
    total = sum(case.seq_lens)
    source = case.cache_torch_dtype if not case.quantized else torch.float32
    key = (torch.randn(total, case.num_kv_heads, case.head_size, generator=gen) * 2).to(source)
    value = torch.randn(total, case.num_kv_heads, case.head_size_v, generator=gen).to(source)
    full = ReferenceAttentionMetadata.build(case.seq_lens, case.seq_lens, table, case.block_size)
    reference.do_kv_cache_update(layer, key, value, kv_cache, full.slot_mapping)
    metadata = CPUAttentionMetadata.build(case.seq_lens, case.query_lens, table, case.block_size)
    query = torch.randn(metadata.num_actual_tokens, num_heads, case.head_size, generator=gen).to(
        case.model_dtype
    )
    return reference, cpu, layer, kv_cache, metadata, query


def check(case: Case, simd: str = "auto", seed: int = 0) -> torch.Tensor:
    reference, cpu, layer, kv_cache, metadata, query = setup(case, seed)
    cpu.simd = simd
    expected = reference.forward(layer, query, None, None, kv_cache, metadata)
    got = cpu.forward(layer, query, None, None, kv_cache, metadata)
    assert got.dtype == query.dtype and got.shape == expected.shape
    tol = 2e-2 if case.model_dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS + PER_TOKEN_HEAD)
def test_matches_reference_every_format_layout_and_simd_level(
    cache_dtype: str, scale_layout: str, layout: str, simd: str
) -> None:
    """A batch of a prefill without prefix, a chunked prefill and a decode with a partial last
    page; GQA; head_size_v != head_size (both multiples of 64 for interleave4)."""
    head_size_v = 64 if scale_layout == "interleave4" else 32
    model_dtype = torch.float32 if cache_dtype == "float32" else torch.bfloat16
    case = Case(
        cache_dtype,
        scale_layout,
        layout,
        head_size_v=head_size_v,
        model_dtype=model_dtype,
        per_head_scale=cache_dtype == "fp8_e5m2",
    )
    check(case, simd)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize(
    "cache_dtype",
    [
        "auto",
        "fp8_e4m3",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    ],
)
def test_window_sinks_soft_cap_and_odd_shapes(cache_dtype: str, simd: str) -> None:
    nvfp4 = cache_dtype == "nvfp4"  # INT4 rows: 40 and 24 are multiples of 8 (Hadamard blocks 8)
    check(
        Case(
            cache_dtype,
            layout="HND",
            num_kv_heads=3,
            group=5,  # chunks of 4 query heads and a remainder of 1
            head_size=48 if nvfp4 else 40,  # not a whole number of vectors
            head_size_v=16 if nvfp4 else 24,
            block_size=5,
            seq_lens=[23, 40, 9],
            query_lens=[23, 11, 1],
            sliding_window=7,
            logits_soft_cap=3.0,
            sinks=torch.linspace(-2.0, 2.0, 15),
            per_head_scale=True,
        ),
        simd,
    )


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS + PER_TOKEN_HEAD)
def test_decode_at_model_shape_with_odd_key_counts(
    cache_dtype: str, scale_layout: str, simd: str
) -> None:
    """Decode at the benchmark's model shape (8 KV heads x 128, groups of 8 query heads: two
    chunks of 4 rows on the bf16 dot path) over key counts that leave a lone last key of a
    page, a page, and a long split range; the query heads see different scales."""
    model_dtype = torch.float32 if cache_dtype == "float32" else torch.bfloat16
    check(
        Case(
            cache_dtype,
            scale_layout,
            num_kv_heads=8,
            group=8,
            head_size=128,
            head_size_v=128,
            seq_lens=[1, 17, 33, 1201],
            query_lens=[1, 1, 1, 1],
            model_dtype=model_dtype,
            per_head_scale=cache_dtype.startswith("fp8"),
        ),
        simd,
    )


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("scale_layout", ["linear", "interleave4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_nvfp4_chunks_of_sixteen_keys(
    block_size: int, layout: str, scale_layout: str, group: int
) -> None:
    """NVFP4 at head size 128 with a bf16 query, pages of one or two 16-key chunks: the chunk
    path of AVX-512 BF16 builds (keys transposed, block scales applied in fp32). Rows per KV
    head in blocks of 4 and single rows, a block straddling two query tokens (group 3, two
    queries), chunks cut by the sequence end and by a window start, sinks, soft cap, per-head
    scales."""
    base = Case(
        "nvfp4",
        scale_layout,
        layout,
        group=group,
        head_size=128,
        head_size_v=128,
        block_size=block_size,
        seq_lens=[1, 17, 70, 300],
        query_lens=[1, 2, 1, 1],
        per_head_scale=True,
    )
    check(base)
    num_heads = base.num_kv_heads * group
    check(
        replace(
            base,
            sliding_window=37,
            logits_soft_cap=4.0,
            sinks=torch.linspace(-1.0, 1.0, num_heads),
        ),
        seed=1,
    )


@pytest.mark.parametrize("scale_layout", ["linear", "interleave4"])
def test_nvfp4_chunks_ignore_the_bytes_of_slots_past_the_end(scale_layout: str) -> None:
    """Every E2M1 code and block-scale byte in the tokens attended; slots past each sequence's
    end (the last page's tail) hold random bytes with NaN block scales (0x7F), which the chunk
    path loads with their chunk but must not let into the output."""
    case = Case(
        "nvfp4",
        scale_layout,
        num_kv_heads=2,
        group=4,
        head_size=128,
        head_size_v=128,
        seq_lens=[5, 21, 100],
        query_lens=[1, 1, 1],
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    gen = torch.Generator().manual_seed(2)
    n, h, groups = case.block_size, case.num_kv_heads, case.head_size // 16
    scale_region = n * h * case.head_size // 2  # each page: [data | scales], NHD within each

    def scale_byte(token: int, head: int, group: int) -> int:
        row, col = token, group
        if scale_layout == "interleave4":  # 4-token interleave, see docs/design.md
            row = token // 4 * 4 + group // (groups // 4)
            col = group % (groups // 4) * 4 + token % 4
        return scale_region + (row * h + head) * groups + col

    for side in kv_cache:
        pages = torch.randint(
            0, 256, (side.shape[0], side[0].numel()), dtype=torch.uint8, generator=gen
        )
        scales = pages[:, scale_region:]
        scales[(scales & 0x7F) == 0x7F] = 0x3C  # no NaN scales in attended tokens
        for seq, seq_len in enumerate(case.seq_lens):
            last = int(metadata.block_table[seq, (seq_len - 1) // n])
            for token in range((seq_len - 1) % n + 1, n):
                for head in range(h):
                    for group in range(groups):
                        pages[last, scale_byte(token, head, group)] = 0x7F
        side.copy_(pages.view(side.shape))
    expected = reference.forward(layer, query * 0.05, None, None, kv_cache, metadata).float()
    got = cpu.forward(layer, query * 0.05, None, None, kv_cache, metadata).float()
    assert torch.isfinite(expected).all()
    # Block scales up to 448 make outputs in the thousands: bf16 rounding relative to that scale.
    torch.testing.assert_close(got, expected, atol=2e-3 * expected.abs().max(), rtol=2e-2)


def test_lone_last_key_with_infinite_value_stays_inf() -> None:
    """A page's last key without a partner (17 keys) whose V row holds +Inf: the output element
    is +Inf as in the reference (the kernels pair the lone key with zeros, not with a zero
    weight times a row, which would give NaN)."""
    case = Case(
        num_kv_heads=8, group=4, head_size=128, head_size_v=128, seq_lens=[17], query_lens=[1]
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    value_cache = kv_cache[1]
    block = int(metadata.block_table[0, 1])  # key 16: the second page's first token
    value_cache[block, 0, 3, 5] = float("inf")
    got = cpu.forward(layer, query, None, None, kv_cache, metadata).float()
    expected = reference.forward(layer, query, None, None, kv_cache, metadata).float()
    assert torch.isinf(expected[0, 12:16, 5]).all()  # query heads of KV head 3
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 1, 10_000])
def test_window_edges_and_non_causal(window: int | None) -> None:
    """A window of one token, one larger than every context, and none."""
    case = Case(sliding_window=window, seq_lens=[30, 17], query_lens=[9, 17])
    check(case)
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    metadata.causal = False
    torch.testing.assert_close(
        cpu.forward(layer, query, None, None, kv_cache, metadata).float(),
        reference.forward(layer, query, None, None, kv_cache, metadata).float(),
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize(
    ("cache_dtype", "scale_layout"), [("auto", "linear"), *FORMATS[3:], *PER_TOKEN_HEAD]
)
def test_long_context_split_k_and_partial_last_page(cache_dtype: str, scale_layout: str) -> None:
    """Decode over 3001 tokens (a partial last page) and a chunked prefill over 1500: the key
    range is split (split-K) and the partials merged."""
    check(
        Case(
            cache_dtype,
            scale_layout,
            num_kv_heads=1,
            group=4,
            seq_lens=[3001, 1500],
            query_lens=[1, 3],
            sliding_window=2000,
        )
    )


def test_empty_queries_and_sink_dominated_rows() -> None:
    """Sequences with no query tokens in the batch write nothing; sinks far above every score
    take the whole softmax mass, so the rows are ~0 (as in the reference)."""
    sinks = torch.full((4,), 60.0)
    out = check(Case(seq_lens=[10, 33, 8], query_lens=[0, 4, 0], sinks=sinks))
    assert out.abs().max() < 1e-6


def test_five_d_cache_and_output_buffer() -> None:
    case = Case("fp8_e4m3", five_d=True)
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    expected = reference.forward(layer, query, None, None, kv_cache, metadata)
    rows = metadata.num_actual_tokens
    output = torch.full((rows + 3, 4, 64), 7.0, dtype=query.dtype)
    padded = torch.cat([query, torch.zeros(3, 4, 64, dtype=query.dtype)])
    returned = cpu.forward(layer, padded, None, None, kv_cache, metadata, output=output)
    assert returned is output
    torch.testing.assert_close(output[:rows].float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert bool((output[rows:] == 7.0).all())  # rows past num_actual_tokens untouched
    # A non-contiguous output (last dim strided) is written too.
    strided = torch.zeros(rows, 4, 128, dtype=query.dtype)[:, :, ::2]
    cpu.forward(layer, query, None, None, kv_cache, metadata, output=strided)
    torch.testing.assert_close(strided.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize(("cache_dtype", "scale_layout"), FORMATS[3:])
def test_raw_cache_bytes(cache_dtype: str, scale_layout: str, simd: str) -> None:
    """Caches of random bytes (every FP8 code, subnormals and max included; every E2M1 code and
    block-scale byte) but NaN: the decoders agree with the reference codecs."""
    case = Case(
        cache_dtype, scale_layout, model_dtype=torch.float32, seq_lens=[64, 29], query_lens=[2, 1]
    )
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    gen = torch.Generator().manual_seed(1)
    for side in kv_cache:
        raw = torch.randint(0, 256, side.shape, dtype=torch.uint8, generator=gen)
        # No NaN bytes (e4m3 data and NVFP4 scales: 0x7F; e5m2: exponent 11111, Inf too).
        special = 0x7C if cache_dtype == "fp8_e5m2" else 0x7F
        raw[(raw & special) == special] = 0x3C
        side.copy_(raw)
    cpu.simd = simd
    expected = reference.forward(layer, query * 0.05, None, None, kv_cache, metadata)
    got = cpu.forward(layer, query * 0.05, None, None, kv_cache, metadata)
    torch.testing.assert_close(got, expected, atol=1e-3 * expected.abs().max(), rtol=1e-4)


@pytest.mark.parametrize(
    ("k_scale", "v_scale"),
    [
        (torch.tensor(0.5), torch.tensor(2.0)),
        (torch.tensor([0.5]), torch.tensor([[2.0]])),
        (torch.tensor([0.5, 0.25]), torch.tensor([2.0, 3.0])),
    ],
)
def test_scale_shapes(k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Any one-element fp32 tensor is a per-tensor scale, ``[H]`` a per-head one."""
    reference, cpu, layer, kv_cache, metadata, query = setup(Case("fp8_e4m3"))
    expected = reference.forward(
        AttentionLayerScales(k_scale.reshape(-1), v_scale.reshape(-1)),
        query,
        None,
        None,
        kv_cache,
        metadata,
    )
    got = cpu.forward(AttentionLayerScales(k_scale, v_scale), query, None, None, kv_cache, metadata)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("head_size", "expected_layout"), [(64, "interleave4"), (80, "linear")])
def test_default_scale_layout_is_the_writers(head_size: int, expected_layout: str) -> None:
    """No scale layout named anywhere, as an upstream engine calls: the CPU kernel resolves the
    writer's default (interleave4 where the geometry allows it, else linear)."""
    case = Case("nvfp4", None, head_size=head_size, head_size_v=head_size)
    _, cpu, layer, kv_cache, metadata, query = setup(case)
    explicit = ReferenceAttentionImpl(
        case.num_kv_heads * case.group,
        head_size,
        num_kv_heads=case.num_kv_heads,
        kv_cache_dtype="nvfp4",
        k_scale_layout=expected_layout,
    )
    expected = explicit.forward(layer, query, None, None, kv_cache, metadata)
    got = cpu.forward(layer, query, None, None, kv_cache, metadata)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_bad_scale_shapes_and_dtypes_name_the_argument() -> None:
    _, cpu, _, kv_cache, metadata, query = setup(Case("fp8_e4m3"))
    float64 = AttentionLayerScales(torch.ones(1, dtype=torch.float64), torch.ones(1))
    with pytest.raises(
        ValueError, match=r"k_scale: expected a torch.float32 tensor, got torch.float64"
    ):
        cpu.forward(float64, query, None, None, kv_cache, metadata)
    three = AttentionLayerScales(torch.ones(1), torch.ones(3))
    with pytest.raises(ValueError, match=r"v_scale: expected one value .* got shape \[3\]"):
        cpu.forward(three, query, None, None, kv_cache, metadata)


def test_errors_name_the_argument() -> None:
    case = Case("fp8_e4m3")
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    bad_layer = AttentionLayerScales(torch.tensor([0.0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"k_scale: a quantized KV cache needs finite scales"):
        cpu.forward(bad_layer, query, None, None, kv_cache, metadata)
    with pytest.raises(ValueError, match=r"query: expected shape \[T, 4, 64\]"):
        cpu.forward(layer, query[:, :3], None, None, kv_cache, metadata)
    bad_table = metadata.block_table.clone()
    bad_table[1, 0] = 10_000
    bad = CPUAttentionMetadata.build(case.seq_lens, case.query_lens, bad_table, case.block_size)
    # Checked by the impl (before any write), so ValueError as the reference's.
    with pytest.raises(ValueError, match=r"block_table: sequence 1 uses pages \[\d+, 10000\]"):
        cpu.forward(layer, query, None, None, kv_cache, bad)
    cpu.simd = "sse9"
    levels = ", ".join(SIMD_LEVELS)
    with pytest.raises(ValueError, match=rf"simd: expected 'auto' or one of {levels}, got 'sse9'"):
        cpu.forward(layer, query, None, None, kv_cache, metadata)


def test_op_errors_name_the_argument() -> None:
    reference, cpu, layer, kv_cache, metadata, query = setup(Case())
    key_cache, value_cache = kv_cache
    out = torch.empty(query.shape[0], 4, 64, dtype=query.dtype)
    args = dict(
        out=out,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=metadata.block_table.to(torch.int32),
        seq_lens=metadata.seq_lens,
        query_start_loc=metadata.query_start_loc,
        kv_cache_dtype="auto",
        k_scale=torch.ones(1),
        v_scale=torch.ones(1),
        scale=0.125,
    )
    for change, pattern in [
        (dict(seq_lens=metadata.seq_lens.long()), r"seq_lens: expected a contiguous 1-D int32"),
        (dict(block_table=metadata.block_table.long()), r"block_table: expected an int32"),
        (dict(out=out.float()), r"out: expected dtype bfloat16"),
        (dict(k_scale=torch.ones(3)), r"k_scale: expected one value .* or \[H\] = \[2\]"),
        (dict(sinks=torch.ones(3)), r"sinks: expected a contiguous float32 tensor \[num_heads\]"),
        (dict(kv_cache_dtype="int4"), r"kv_cache_dtype: unknown KV-cache dtype 'int4'"),
        (dict(value_cache=value_cache[:, :, :, :32]), r"value_cache: expected shape"),
        (dict(sliding_window=-1), r"sliding_window: expected a window in tokens"),
        (dict(query_start_loc=torch.tensor([0, 37, 60, 44], dtype=torch.int32)), r"seq_lens: "),
        (dict(query=query[:5]), r"query: expected at least 44 rows"),
        # A meta argument selects the fake kernel, which must not return without a word.
        (dict(out=out.to("meta")), r"out: expected device cpu \(key_cache's device\), got meta"),
        (dict(block_table=metadata.block_table.to("meta")), r"block_table: expected device cpu"),
    ]:
        with pytest.raises((RuntimeError, ValueError), match=pattern):
            ops.paged_attention(**{**args, **change})


def test_registered_and_selectable_on_cpu_only() -> None:
    assert AttentionBackendEnum.parse("cpu_attn").get_class() is CPUAttentionBackend
    assert CPUAttentionBackend.get_kv_cache_shape(3, 16, 2, 64, "nvfp4") == (3, 2, 16, 2, 36)
    assert CPUAttentionBackend.validate_configuration(64, torch.bfloat16, "nvfp4", 16, None) == []
    reasons = CPUAttentionBackend.validate_configuration(64, torch.bfloat16, "auto", 16, (9, 0))
    assert reasons == ["CPU_ATTN does not run on sm_90"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scale_layout", ["linear", "interleave4"])
@pytest.mark.parametrize(("dtype", "search"), [("nvfp4_mse", True), ("nvfp4_4over6", "4over6")])
def test_searched_nvfp4_cache_is_the_codecs_and_reads_as_nvfp4(
    layout: str, scale_layout: str, dtype: str, search: bool | str
) -> None:
    """The writer of a block-scale policy (the compiled op behind do_kv_cache_update) gives the
    codec's bytes (quantize_nvfp4(scale_search=...)), which differ from nvfp4's; both readers read
    the cache through the plain NVFP4 dequantization."""
    from vllm.kv_quant import (
        dequantize_nvfp4,
        nvfp4_read_cache,
        nvfp4_write_cache,
        quantize_nvfp4,
    )

    case = Case(dtype, scale_layout, layout, head_size_v=64)
    reference, cpu, layer, kv_cache, metadata, query = setup(case)
    plain_case = Case("nvfp4", scale_layout, layout, head_size_v=64)
    _, _, _, plain_cache, _, _ = setup(plain_case)
    gen = torch.Generator().manual_seed(0)  # setup's draws, replayed for the source tensors
    num_blocks = kv_cache[0].shape[0]
    pages = max((n + case.block_size - 1) // case.block_size for n in case.seq_lens)
    table = torch.randperm(num_blocks, generator=gen)[: pages * len(case.seq_lens)]
    table = table.reshape(len(case.seq_lens), pages).to(torch.int32)
    total = sum(case.seq_lens)
    key = torch.randn(total, case.num_kv_heads, case.head_size, generator=gen) * 2
    value = torch.randn(total, case.num_kv_heads, case.head_size_v, generator=gen)
    slots = ReferenceAttentionMetadata.build(
        case.seq_lens, case.seq_lens, table, case.block_size
    ).slot_mapping
    for x, side, scale, plain in (
        (key, kv_cache[0], layer._k_scale, plain_cache[0]),
        (value, kv_cache[1], layer._v_scale, plain_cache[1]),
    ):
        expected = torch.zeros_like(side)
        nvfp4_write_cache(x, expected, slots, scale, scale_layout, scale_search=search)
        assert torch.equal(side, expected)
        assert not torch.equal(side, plain)
        d = x.shape[-1]
        rows = nvfp4_read_cache(side, scale, d, scale_layout).flatten(0, 1)[slots]
        plain_rows = nvfp4_read_cache(plain, scale, d, scale_layout).flatten(0, 1)[slots]
        packed, block_scales = quantize_nvfp4(x, scale, scale_search=search)
        assert torch.equal(rows, dequantize_nvfp4(packed, block_scales, scale))
        assert float((rows - x).pow(2).sum()) < float((plain_rows - x).pow(2).sum())
    expected_out = reference.forward(layer, query, None, None, kv_cache, metadata)
    got_out = cpu.forward(layer, query, None, None, kv_cache, metadata)
    torch.testing.assert_close(got_out.float(), expected_out.float(), atol=2e-2, rtol=2e-2)
