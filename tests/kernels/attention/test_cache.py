"""reshape_and_cache_flash (torch.ops._C_cache_ops) against the reference codecs, byte for byte.

Every cache starts as random bytes; the expected cache is the same bytes after the reference
writer (vllm.kv_quant) has written the mapped tokens, so a byte comparison of the whole buffer
also proves that unmapped slots, skipped tokens (slot < 0) and padding tokens (T < T_pad) are
left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm import _custom_ops as ops
from vllm.kv_quant import (
    ScaleLayout,
    fp8_format_from_cache_dtype,
    fp8_write_cache,
    nvfp4_write_cache,
)
from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim, nvfp4_kv_cache_split_views

from ..quantization.nvfp4_utils import dequant_nvfp4_kv_cache_nhd

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]
SOURCE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXPLICIT_UNQUANTIZED = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
QUANTIZED = ["fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"]
# Every valid (kv_cache_dtype, source dtype) pair: explicit unquantized strings need their dtype.
KIND_AND_DTYPE = (
    [("auto", d) for d in SOURCE_DTYPES]
    + list(EXPLICIT_UNQUANTIZED.items())
    + [(k, d) for k in QUANTIZED for d in SOURCE_DTYPES]
)


def _id(value: object) -> str:
    return str(value).removeprefix("torch.")


@dataclasses.dataclass
class Case:
    """Arguments of one reshape_and_cache_flash call; the caches are views of `buffers`."""

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_scale_layout: str = "linear"
    v_scale_layout: str | None = None
    buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def args(self) -> tuple:
        return (
            self.key,
            self.value,
            self.key_cache,
            self.value_cache,
            self.slot_mapping,
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
            self.k_scale_layout,
            self.v_scale_layout,
        )

    def run(self) -> None:
        ops.reshape_and_cache_flash(*self.args())

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.buffers]


def cache_last_dim(kind: str, head_size: int) -> int:
    return nvfp4_kv_cache_full_dim(head_size) if kind == "nvfp4" else head_size


def _poisoned(numel: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """A flat uint8 buffer of random bytes holding `numel` elements of `dtype`."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def _side_view(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], hnd: bool):
    """Logical [B, (2,) N, H, F] view of `raw`; HND buffers are [B, (2,) H, N, F] underneath."""
    if not hnd:
        return raw.view(dtype).view(shape)
    *lead, n, h, f = shape
    return raw.view(dtype).view(*lead, h, n, f).transpose(-3, -2)


def make_caches(
    kind: str,
    dtype: torch.dtype,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    head_size_v: int,
    hnd: bool,
    device: str,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(key_cache, value_cache, raw buffers): slices of one (B, 2, N, H, F) cache when the head
    sizes agree (the usual allocation), two separate sides otherwise."""
    cache_dtype = dtype if kind in ("auto", *EXPLICIT_UNQUANTIZED) else torch.uint8
    fk = cache_last_dim(kind, head_size)
    fv = cache_last_dim(kind, head_size_v)
    if fk == fv:
        shape = (num_blocks, 2, block_size, num_heads, fk)
        raw = _poisoned(torch.Size(shape).numel(), cache_dtype, device, gen)
        kv = _side_view(raw, cache_dtype, shape, hnd)
        return kv[:, 0], kv[:, 1], [raw]
    sides, raws = [], []
    for f in (fk, fv):
        shape = (num_blocks, block_size, num_heads, f)
        raw = _poisoned(torch.Size(shape).numel(), cache_dtype, device, gen)
        sides.append(_side_view(raw, cache_dtype, shape, hnd))
        raws.append(raw)
    return sides[0], sides[1], raws


def make_source(
    num_tokens_padded: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    row_padding: int,
    device: str,
    gen: torch.Generator,
) -> torch.Tensor:
    """[T_pad, H, D] with rows H*D + row_padding elements apart (a slice of a fused tensor)."""
    width = num_heads * head_size
    base = torch.randn(num_tokens_padded, width + row_padding, generator=gen) * 4
    return base.to(dtype).to(device)[:, :width].view(num_tokens_padded, num_heads, head_size)


def make_scale(kind: str, num_heads: int, per_head: bool, gen: torch.Generator, device: str):
    n = num_heads if per_head else 1
    if kind == "nvfp4":  # amax / (448 * 6) is typical; larger values saturate block scales
        low, high = 2e-4, 2e-2
    elif kind.startswith("fp8"):
        low, high = 5e-3, 5e-2
    else:
        return torch.ones(n, device=device)
    return (low + (high - low) * torch.rand(n, generator=gen)).to(device)


def make_slots(
    num_tokens: int, num_slots: int, skip_every: int, gen: torch.Generator, device: str
) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    return slots.to(device)


def make_case(
    device: str,
    kind: str,
    dtype: torch.dtype,
    *,
    num_blocks: int = 6,
    block_size: int = 16,
    num_heads: int = 4,
    head_size: int = 64,
    head_size_v: int | None = None,
    hnd: bool = False,
    per_head_scale: bool = False,
    num_tokens: int = 40,
    padding: int = 3,
    row_padding: int = 0,
    skip_every: int = 7,
    k_scale_layout: str = "linear",
    v_scale_layout: str | None = None,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    head_size_v = head_size if head_size_v is None else head_size_v
    t_pad = num_tokens + padding
    key = make_source(t_pad, num_heads, head_size, dtype, row_padding, device, gen)
    value = make_source(t_pad, num_heads, head_size_v, dtype, row_padding, device, gen)
    key_cache, value_cache, buffers = make_caches(
        kind, dtype, num_blocks, block_size, num_heads, head_size, head_size_v, hnd, device, gen
    )
    return Case(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=make_slots(num_tokens, num_blocks * block_size, skip_every, gen, device),
        kv_cache_dtype=kind,
        k_scale=make_scale(kind, num_heads, per_head_scale, gen, device),
        v_scale=make_scale(kind, num_heads, per_head_scale, gen, device),
        k_scale_layout=k_scale_layout,
        v_scale_layout=v_scale_layout,
        buffers=buffers,
    )


def reference_write(
    side: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    kind: str,
    scale: torch.Tensor,
    layout: str,
) -> None:
    if kind == "nvfp4":
        nvfp4_write_cache(x, side, slots, scale, layout)
    elif kind.startswith("fp8"):
        fp8_write_cache(x, side, slots, scale, fp8_format_from_cache_dtype(kind))
    else:
        keep = slots >= 0
        kept = slots[keep]
        block_size = side.shape[1]
        side[kept // block_size, kept % block_size] = x[: slots.shape[0]][keep]


def _rebased(view: torch.Tensor, old: list[torch.Tensor], new: list[torch.Tensor]) -> torch.Tensor:
    """`view` re-expressed over the clone in `new` of the buffer in `old` that it lives in."""
    for o, n in zip(old, new, strict=True):
        if view.untyped_storage().data_ptr() == o.untyped_storage().data_ptr():
            return torch.as_strided(
                n.view(view.dtype), view.shape, view.stride(), view.storage_offset()
            )
    raise AssertionError("view does not live in any buffer")


def expected_buffers(case: Case) -> list[torch.Tensor]:
    expected = case.snapshot()
    v_layout = case.k_scale_layout if case.v_scale_layout is None else case.v_scale_layout
    for x, cache, scale, layout in (
        (case.key, case.key_cache, case.k_scale, case.k_scale_layout),
        (case.value, case.value_cache, case.v_scale, v_layout),
    ):
        side = _rebased(cache, case.buffers, expected)
        reference_write(side, x, case.slot_mapping, case.kv_cache_dtype, scale, layout)
    return expected


def assert_bytes_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        diff = (g != e).nonzero()
        assert diff.numel() == 0, (
            f"{diff.shape[0]} of {g.numel()} bytes differ, first at {diff[:8]}"
        )


def check_against_reference(case: Case) -> None:
    expected = expected_buffers(case)
    if bool((case.slot_mapping >= 0).any()):  # the comparison below must not be vacuous
        assert any(not torch.equal(b, e) for b, e in zip(case.buffers, expected, strict=True))
    case.run()
    assert_bytes_equal(case.buffers, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,dtype", KIND_AND_DTYPE, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("per_head_scale", [False, True], ids=["scale1", "scaleH"])
def test_matches_reference(
    device: str, kind: str, dtype: torch.dtype, hnd: bool, per_head_scale: bool
) -> None:
    check_against_reference(
        make_case(device, kind, dtype, hnd=hnd, per_head_scale=per_head_scale, row_padding=5)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("shape", [(), (1, 1), (1, 1, 1)], ids=["0d", "1x1", "1x1x1"])
def test_one_value_scale_in_any_shape(device: str, kind: str, shape: tuple[int, ...]) -> None:
    """Upstream engines pass 0-d scales (``layer._k_scale``, ``key.amax() / 64``): any
    one-element shape is the per-tensor scale, on the op and on the reference writer."""
    case = make_case(device, kind, torch.bfloat16)
    case.k_scale = case.k_scale.reshape(shape)
    case.v_scale = case.v_scale.reshape(shape)
    check_against_reference(case)


HEAD_SIZES = [46, 64, 80, 128, 256]
HEAD_AND_BLOCK = [
    (kind, head_size, block_size)
    for kind in ("auto", "fp8_e4m3", "nvfp4")
    for head_size in HEAD_SIZES
    for block_size in (8, 16, 32)
    if kind != "nvfp4" or head_size % 16 == 0
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,head_size,block_size", HEAD_AND_BLOCK)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_head_and_block_sizes(
    device: str, kind: str, head_size: int, block_size: int, hnd: bool
) -> None:
    case = make_case(
        device,
        kind,
        torch.bfloat16,
        num_blocks=4,
        block_size=block_size,
        num_heads=2,
        head_size=head_size,
        hnd=hnd,
        per_head_scale=True,
        num_tokens=min(30, 4 * block_size),
    )
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind,head_size,head_size_v", [("auto", 80, 46), ("fp8_e5m2", 64, 80), ("nvfp4", 128, 64)]
)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_head_size_v_differs(
    device: str, kind: str, head_size: int, head_size_v: int, hnd: bool
) -> None:
    case = make_case(
        device, kind, torch.float16, head_size=head_size, head_size_v=head_size_v, hnd=hnd
    )
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "k_layout,v_layout",
    [
        (ScaleLayout.INTERLEAVE4, None),
        ("interleave4", "linear"),
        ("linear", ScaleLayout.INTERLEAVE4),
    ],
    ids=["both", "k_only", "v_only"],
)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_interleave4_and_dequant(
    device: str, k_layout: ScaleLayout | str, v_layout: ScaleLayout | str | None, hnd: bool
) -> None:
    """Scale layouts (enum or str) match the reference; the cache dequantizes back close to the
    input through nvfp4_kv_cache_split_views and dequant_nvfp4_kv_cache_nhd."""
    case = make_case(
        device, "nvfp4", torch.bfloat16, head_size=128, hnd=hnd, per_head_scale=True, skip_every=0
    )
    case.k_scale_layout = ScaleLayout.parse(k_layout).value
    case.v_scale_layout = None if v_layout is None else ScaleLayout.parse(v_layout).value
    expected = expected_buffers(case)
    ops.reshape_and_cache_flash(*case.args()[:8], k_layout, v_layout)
    assert_bytes_equal(case.buffers, expected)

    block_size = case.key_cache.shape[1]
    slots = case.slot_mapping
    pages, rows = slots // block_size, slots % block_size
    for side, scale, layout, x in (
        (case.key_cache, case.k_scale, k_layout, case.key),
        (case.value_cache, case.v_scale, v_layout or k_layout, case.value),
    ):
        (data,), (sf,) = nvfp4_kv_cache_split_views(side)
        deq = dequant_nvfp4_kv_cache_nhd(data, sf, scale, 128, block_size, layout)[pages, rows]
        src = x[: slots.shape[0]].float()
        amax = src.abs().amax(dim=-1, keepdim=True)
        in_range = (amax / (scale.view(1, -1, 1) * 6) < 448).expand_as(src)
        err = (deq - src).abs()[in_range]
        # E2M1 keeps ~1 significant bit: the error is at most half a step of the group scale.
        assert bool((err <= amax.expand_as(src)[in_range] * 0.25 + 1e-6).all())


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 16 values hitting E2M1/FP8 ties, saturation, zeros, NaN and Inf."""
    inf, nan = float("inf"), float("nan")
    ties = [
        6.0,
        0.25,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        -0.25,
        -0.75,
        -1.25,
        -1.75,
        -2.5,
        -3.5,
        -5.0,
    ]
    rows = [
        [*ties, 0.0],
        [0.0] * 16,
        [-0.0] * 16,
        [nan] + [1.0] * 15,
        [inf] + [0.5] * 15,
        [-inf, inf] + [-3.0] * 14,
        [1e30, -1e30, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e-30] + [0.1] * 8,
        [2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-16, 2.0**-17, 3 * 2.0**-17, -(2.0**-10), 1e-8] * 2,
        [nan, -nan, 0.0, -0.0] * 4,
        [0.0, 0.0, 0.0, 0.0] * 3 + [2.0**-14, 2.0**-24, -(2.0**-24), 6.0e-8],
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_special_values(device: str, kind: str, dtype: torch.dtype, scale: float) -> None:
    check_special_values(device, kind, dtype, [scale], [scale, 1.0 / scale])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
def test_subnormal_scale(device: str, kind: str, dtype: torch.dtype) -> None:
    """A subnormal scale is finite and > 0, hence valid, but its inverse overflows to Inf (for
    NVFP4: Inf multipliers, NaN for x = 0, which the CPU kernel's vector path does not handle)."""
    check_special_values(device, kind, dtype, [1e-40], [0.5, 1e-40])


def check_special_values(
    device: str, kind: str, dtype: torch.dtype, k_scale: list[float], v_scale: list[float]
) -> None:
    """The rows of _special_values as keys, reversed as values, both against the reference."""
    values = _special_values(dtype)  # [R, 16]
    num_heads, head_size = 2, 32
    t = values.shape[0] * 16 // (num_heads * head_size) + 1
    flat = values.flatten().repeat(2)[: t * num_heads * head_size]
    case = make_case(
        device,
        kind,
        dtype,
        num_heads=num_heads,
        head_size=head_size,
        num_tokens=t,
        padding=0,
        skip_every=0,
    )
    case.key = flat.view(t, num_heads, head_size).to(device)
    case.value = flat.flip(0).view(t, num_heads, head_size).to(device)
    case.k_scale = torch.tensor(k_scale, device=device)
    case.v_scale = torch.tensor(v_scale, device=device)
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_rounding_sweep(device: str) -> None:
    """fp32 values at, just below and just above every E2M1 threshold, and random ones: with a
    6.0 in each group and global scale 1, the E2M1 input is the value itself."""
    thresholds = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0])
    near = torch.cat(
        [
            thresholds,
            torch.nextafter(thresholds, torch.tensor(0.0)),
            torch.nextafter(thresholds, torch.tensor(8.0)),
            torch.tensor([0.0, 1e-30, 6.0, 6.5, 7.0, 8.0, 1e3]),
            torch.empty(400).uniform_(0, 7, generator=torch.Generator().manual_seed(3)),
        ]
    )
    values = torch.cat([near, -near])
    values = torch.cat([values, values[: (-values.numel()) % 15]]).view(-1, 15)
    groups = torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1)  # [G, 16]
    num_heads, head_size = 2, 64
    per_token = num_heads * head_size // 16
    groups = torch.cat([groups, groups[: (-groups.shape[0]) % per_token]])
    t = groups.shape[0] // per_token
    case = make_case(
        device,
        "nvfp4",
        torch.float32,
        num_blocks=-(-t // 16),
        num_heads=num_heads,
        head_size=head_size,
        num_tokens=t,
        padding=0,
        skip_every=0,
    )
    case.key = groups.reshape(t, num_heads, head_size).to(device)
    case.value = -case.key
    case.k_scale = torch.ones(1, device=device)
    case.v_scale = torch.ones(1, device=device)
    check_against_reference(case)


@st.composite
def random_cases(draw: st.DrawFn) -> dict:
    kind, dtype = draw(st.sampled_from(KIND_AND_DTYPE))
    nvfp4 = kind == "nvfp4"
    heads = st.sampled_from([16, 32, 48, 64, 128]) if nvfp4 else st.integers(1, 96)
    head_size, head_size_v = draw(heads), draw(heads)
    k_layout = draw(st.sampled_from(["linear", "interleave4"])) if nvfp4 else "linear"
    v_layout = draw(st.sampled_from([None, "linear", "interleave4"])) if nvfp4 else None
    # interleave4 needs N % 4 == 0, and (D / 16) % 4 == 0 on its side.
    if k_layout == "interleave4":
        head_size = 64 * draw(st.integers(1, 2))
    if (v_layout or k_layout) == "interleave4":
        head_size_v = 64 * draw(st.integers(1, 2))
    interleaved = "interleave4" in (k_layout, v_layout)
    block_size = draw(st.sampled_from([4, 8, 16] if interleaved else [1, 2, 3, 5, 8, 16]))
    num_blocks = draw(st.integers(1, 5))
    num_tokens = draw(st.integers(0, min(24, num_blocks * block_size)))
    return dict(
        kind=kind,
        dtype=dtype,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=draw(st.integers(1, 6)),
        head_size=head_size,
        head_size_v=head_size_v,
        hnd=draw(st.booleans()),
        per_head_scale=draw(st.booleans()),
        num_tokens=num_tokens,
        padding=draw(st.integers(0, 4)),
        row_padding=draw(st.integers(0, 9)),
        skip_every=draw(st.sampled_from([0, 2, 3])),
        k_scale_layout=k_layout,
        v_scale_layout=v_layout,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=random_cases())
def test_random_shapes(device: str, params: dict) -> None:
    kind, dtype = params.pop("kind"), params.pop("dtype")
    check_against_reference(make_case(device, kind, dtype, **params))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8", "nvfp4"])
def test_nothing_to_write(device: str, kind: str) -> None:
    """T = 0, or every slot negative: the cache is unchanged."""
    for num_tokens, skip_every in ((0, 0), (5, 1)):
        case = make_case(device, kind, torch.bfloat16, num_tokens=num_tokens, skip_every=skip_every)
        before = case.snapshot()
        case.run()
        assert_bytes_equal(case.buffers, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_unquantized_kinds_do_not_read_scales(device: str, bad: float) -> None:
    case = make_case(device, "auto", torch.bfloat16, per_head_scale=True)
    case.k_scale.fill_(bad)
    case.v_scale.fill_(bad)
    check_against_reference(case)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_explicit_unquantized_dtype_is_not_an_error(kind: str) -> None:
    """Regression: explicit unquantized strings once failed with 'Unsupported data type of kv
    cache: bfloat16'."""
    check_against_reference(make_case("cpu", kind, EXPLICIT_UNQUANTIZED[kind]))


@pytest.mark.parametrize("kind", ["fp8", "nvfp4", "auto"])
def test_opcheck(kind: str) -> None:
    case = make_case("cpu", kind, torch.bfloat16, num_tokens=8, per_head_scale=True)
    torch.library.opcheck(torch.ops._C_cache_ops.reshape_and_cache_flash.default, case.args())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(backend: str) -> None:
    """A compiled function (fullgraph, through the fake impl) writes the same bytes as eager."""
    torch._dynamo.reset()

    def write(key, value, kv_cache, slots, k_scale, v_scale) -> None:
        ops.reshape_and_cache_flash(
            key, value, kv_cache[:, 0], kv_cache[:, 1], slots, "nvfp4", k_scale, v_scale
        )

    compiled = torch.compile(write, backend=backend, fullgraph=True)
    eager_case = make_case("cpu", "nvfp4", torch.bfloat16, num_tokens=12, per_head_scale=True)
    compiled_case = make_case("cpu", "nvfp4", torch.bfloat16, num_tokens=12, per_head_scale=True)
    for case, fn in ((eager_case, write), (compiled_case, compiled)):
        kv = torch.stack([case.key_cache, case.value_cache], dim=1)  # fresh (B, 2, N, H, F)
        case.buffers = [kv]
        fn(case.key, case.value, kv, case.slot_mapping, case.k_scale, case.v_scale)
    assert_bytes_equal(compiled_case.buffers, eager_case.buffers)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written.


def _set(**fields: object) -> Callable[[Case], None]:
    def mutate(case: Case) -> None:
        for name, value in fields.items():
            setattr(case, name, value(case) if callable(value) else value)

    return mutate


def _cache_with_last_dim(last_dim: int, dtype: torch.dtype = torch.uint8):
    return lambda c: torch.zeros(*c.key_cache.shape[:3], last_dim, dtype=dtype, device=c.key.device)


# (id, kv_cache_dtype, mutation, message regex, checked on CPU only)
BAD_INPUTS = [
    ("unknown_dtype_string", "fp8", _set(kv_cache_dtype="fp8_e3m4"),
     r"kv_cache_dtype: unknown KV-cache dtype 'fp8_e3m4'; expected one of auto, float16, "
     r"bfloat16, float32, float, fp8, fp8_e4m3, fp8_e5m2, nvfp4", False),
    ("half_is_not_accepted", "auto", _set(kv_cache_dtype="half"),
     r"kv_cache_dtype: unknown KV-cache dtype 'half'; expected one of ", False),
    ("bad_k_layout", "nvfp4", _set(k_scale_layout="tiled"),
     r"k_scale_layout: expected 'linear' or 'interleave4', got 'tiled'", False),
    ("bad_v_layout", "nvfp4", _set(v_scale_layout="Linear"),
     r"v_scale_layout: expected 'linear' or 'interleave4', got 'Linear'", False),
    ("key_dtype", "fp8", _set(key=lambda c: c.key.double(), value=lambda c: c.value.double()),
     r"key: expected dtype float32, float16 or bfloat16, got float64", False),
    ("value_dtype", "fp8", _set(value=lambda c: c.value.half()),
     r"value: expected dtype bfloat16 \(key's dtype\), got float16", False),
    ("explicit_dtype_mismatch", "float16", _set(kv_cache_dtype="float32"),
     r"key: expected dtype float32 for kv_cache_dtype 'float32', got float16", False),
    ("auto_cache_dtype", "auto", _set(key_cache=lambda c: c.key_cache.float()),
     r"key_cache: expected dtype bfloat16 for kv_cache_dtype 'auto'.*got float32", False),
    ("fp8_cache_dtype", "fp8", _set(value_cache=lambda c: c.value_cache.view(torch.int8)),
     r"value_cache: expected dtype uint8 for kv_cache_dtype 'fp8'.*got int8", False),
    ("nvfp4_last_dim", "nvfp4", _set(key_cache=_cache_with_last_dim(64)),
     r"key_cache: expected last dim F\(D\) = D/2 \+ D/16 = 36 .*D = 64.*got 64", False),
    ("fp8_last_dim", "fp8", _set(value_cache=_cache_with_last_dim(36)),
     r"value_cache: expected last dim D = 64 .*got 36", False),
    ("cache_rank", "fp8", _set(key_cache=lambda c: c.key_cache[0]),
     r"key_cache: expected a 4-D tensor", False),
    ("cache_heads", "auto",
     _set(key_cache=lambda c: torch.zeros(6, 16, 3, 64, dtype=c.key.dtype, device=c.key.device)),
     r"key_cache: expected num_heads = key.size\(1\) = 4 at dim 2", False),
    ("cache_blocks_differ", "fp8", _set(value_cache=lambda c: c.value_cache[:5]),
     r"value_cache: expected \[num_blocks, block_size\] = \[6, 16\]", False),
    ("key_rank", "fp8", _set(key=lambda c: c.key.flatten(1)),
     r"key: expected a 3-D tensor \[T_pad, H, D\]", False),
    ("t_pad_differs", "fp8", _set(value=lambda c: c.value[:-1]),
     r"value: expected T_pad = key.size\(0\) = 43 tokens, got 42", False),
    ("heads_differ", "fp8", _set(value=lambda c: c.value[:, :3]),
     r"value: expected H = key.size\(1\) = 4 heads, got 3", False),
    ("key_not_token_contiguous", "auto",
     _set(key=lambda c: c.key.transpose(1, 2).contiguous().transpose(1, 2)),
     r"key: expected each token's \[H, D\] contiguous", False),
    ("more_slots_than_tokens", "fp8",
     _set(slot_mapping=lambda c: torch.arange(44, device=c.key.device)),
     r"slot_mapping: expected at most T_pad = key.size\(0\) = 43 entries, got 44", False),
    ("slot_mapping_int32", "fp8", _set(slot_mapping=lambda c: c.slot_mapping.int()),
     r"slot_mapping: expected dtype int64, got int32", False),
    ("slot_mapping_2d", "fp8", _set(slot_mapping=lambda c: c.slot_mapping.view(-1, 1)),
     r"slot_mapping: expected a 1-D tensor", False),
    ("scale_shape", "fp8", _set(k_scale=lambda c: torch.ones(3, device=c.key.device)),
     r"k_scale: expected one value \(shape \[\], \[1\], ...\) or \[H\] = \[4\], got shape \[3\]",
     False),
    ("scale_rank", "nvfp4", _set(v_scale=lambda c: torch.ones(1, 4, device=c.key.device)),
     r"v_scale: expected one value \(shape \[\], \[1\], ...\) or \[H\] = \[4\], got shape \[1, 4\]",
     False),
    ("scale_dtype", "fp8", _set(k_scale=lambda c: c.k_scale.half()),
     r"k_scale: expected dtype float32, got float16", False),
    ("nvfp4_head_size", "nvfp4",
     _set(key=lambda c: c.key[..., :40].contiguous(), key_cache=_cache_with_last_dim(22)),
     r"key: nvfp4 needs a head size that is a multiple of 16, got 40", False),
    ("nvfp4_head_size_v", "nvfp4",
     _set(value=lambda c: c.value[..., :24].contiguous(), value_cache=_cache_with_last_dim(13)),
     r"value: nvfp4 needs a head size that is a multiple of 16, got 24", False),
    ("interleave4_block_size", "nvfp4",
     _set(k_scale_layout="interleave4",
          key_cache=lambda c: c.key_cache[:, :6], value_cache=lambda c: c.value_cache[:, :6],
          slot_mapping=lambda c: c.slot_mapping.clamp(max=35)),
     r"k_scale_layout: interleave4 needs a block size that is a multiple of 4, got block_size 6",
     False),
    ("interleave4_groups", "nvfp4",
     _set(v_scale_layout="interleave4", value=lambda c: c.value[..., :32].contiguous(),
          value_cache=_cache_with_last_dim(18)),
     r"v_scale_layout: interleave4 needs head_size / 16 to be a multiple of 4, got head size 32",
     False),
    ("cache_not_dense", "fp8",
     _set(key_cache=lambda c: torch.zeros(6, 16, 4, 128, dtype=torch.uint8,
                                          device=c.key.device)[..., :64]),
     r"key_cache: expected each page's region dense in NHD order", False),
    ("pages_overlap", "nvfp4",
     _set(value_cache=lambda c: c.value_cache.as_strided(
         c.value_cache.shape, (100, *c.value_cache.stride()[1:]))),
     r"value_cache: expected a page stride of at least N\*H\*D' = 2304 elements", False),
    ("slot_out_of_range", "fp8",
     _set(slot_mapping=lambda c: torch.cat([c.slot_mapping[:-1], c.slot_mapping.new_tensor([96])])),
     r"slot_mapping: expected slots < num_blocks \* block_size = 96.*got slot_mapping\[39\] = 96",
     True),
    ("k_scale_zero", "fp8", _set(k_scale=lambda c: torch.zeros_like(c.k_scale)),
     r"k_scale: expected finite values > 0 for kv_cache_dtype 'fp8', got k_scale\[0\] = 0", True),
    ("v_scale_nan", "nvfp4",
     _set(v_scale=lambda c: torch.tensor([1.0, 2.0, float("nan"), 1.0], device=c.key.device)),
     r"v_scale: expected finite values > 0 for kv_cache_dtype 'nvfp4', got v_scale\[2\] = nan",
     True),
    ("k_scale_inf", "fp8_e5m2", _set(k_scale=lambda c: torch.full_like(c.k_scale, float("inf"))),
     r"k_scale: expected finite values > 0 .*got k_scale\[0\] = inf", True),
    ("v_scale_negative", "fp8_e4m3", _set(v_scale=lambda c: -c.v_scale),
     r"v_scale: expected finite values > 0", True),
    # A meta argument makes the dispatcher pick the fake kernel: it must not return silently.
    ("key_on_meta", "fp8", _set(key=lambda c: c.key.to("meta")),
     r"key: expected device (cpu|cuda:0) \(key_cache's device\), got meta", False),
    ("slot_mapping_on_meta", "nvfp4", _set(slot_mapping=lambda c: c.slot_mapping.to("meta")),
     r"slot_mapping: expected device (cpu|cuda:0) \(key_cache's device\), got meta", False),
    ("k_scale_on_meta", "auto", _set(k_scale=lambda c: c.k_scale.to("meta")),
     r"k_scale: expected device (cpu|cuda:0) \(key_cache's device\), got meta", False),
    ("v_scale_on_meta", "nvfp4", _set(v_scale=lambda c: c.v_scale.to("meta")),
     r"v_scale: expected device (cpu|cuda:0) \(key_cache's device\), got meta", False),
    ("value_cache_is_key_cache", "fp8", _set(value_cache=lambda c: c.key_cache),
     r"value_cache: expected a different tensor from key_cache, got the same bytes "
     r"\(value_cache page 0 overlaps key_cache page 0\)", False),
    ("value_cache_views_key_cache", "nvfp4",
     _set(value_cache=lambda c: c.key_cache.view(c.key_cache.shape)),
     r"value_cache: expected a different tensor from key_cache, got the same bytes", False),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind,mutate,message,cpu_only", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input(
    device: str, kind: str, mutate: Callable[[Case], None], message: str, cpu_only: bool
) -> None:
    if cpu_only and device != "cpu":
        pytest.skip("value checks of slots and scales run on the CPU only (docs/design.md §6)")
    dtype = torch.float16 if kind == "float16" else torch.bfloat16
    case = make_case(device, kind, dtype, per_head_scale=True)
    mutate(case)
    watched = [*case.buffers, case.key_cache, case.value_cache]
    before = [t.contiguous().view(torch.uint8).clone() for t in watched]
    with pytest.raises(RuntimeError, match=message):
        case.run()
    assert_bytes_equal([t.contiguous().view(torch.uint8) for t in watched], before)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("moved", ["key", "value", "value_cache", "slot_mapping", "k_scale"])
def test_mixed_devices(moved: str) -> None:
    case = make_case("cuda", "fp8", torch.bfloat16)
    setattr(case, moved, getattr(case, moved).cpu())
    before = case.snapshot()
    with pytest.raises(RuntimeError, match=rf"{moved}: expected device cuda:0"):
        case.run()
    assert_bytes_equal(case.buffers, before)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_skips_out_of_range_slots() -> None:
    """GPU kernels bound-check slots and skip those >= B*N (docs/design.md §6)."""
    case = make_case("cuda", "nvfp4", torch.bfloat16)
    expected = expected_buffers(case)
    case.slot_mapping = torch.cat([case.slot_mapping, case.slot_mapping.new_tensor([96, 10**9])])
    case.key = torch.cat([case.key, case.key[:2]])
    case.value = torch.cat([case.value, case.value[:2]])
    case.run()
    assert_bytes_equal(case.buffers, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via_env", [False, True])
def test_debug_checks_reject_bad_scales(
    device: str, via_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = make_case(device, "nvfp4", torch.bfloat16, per_head_scale=True)
    case.v_scale[1] = 0.0
    before = case.snapshot()
    if via_env:
        monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
    with pytest.raises(ValueError, match=r"v_scale: expected finite values > 0 .*v_scale\[1\] = 0"):
        ops.reshape_and_cache_flash(*case.args(), debug_checks=None if via_env else True)
    assert_bytes_equal(case.buffers, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_cache_sides_sharing_bytes(device: str, hnd: bool) -> None:
    """Upstream's kv_cache[:, 0] / kv_cache[:, 1] (distinct views of one buffer) are accepted
    (every other test writes them); sides whose pages share bytes are not, even when shifted by
    whole or partial pages, and nothing is written."""
    case = make_case(device, "auto", torch.bfloat16, num_blocks=6, hnd=hnd)
    kv = case.key_cache.unflatten(0, (3, 2))  # pages 2b and 2b + 1 of key_cache
    half_page = case.key_cache[0].numel() // 2
    sides = [
        (kv[:, 0], kv[:, 1], None),  # interleaved pages: accepted; else (V page, K page) shared
        (kv[:, 1], kv[:, 0], None),
        (case.key_cache[1:4], case.key_cache[:3], (1, 0)),  # V page 1 is K page 0
        (case.key_cache[:3], case.key_cache[2:5], (0, 2)),  # V page 0 is K page 2
        (
            case.key_cache[:3],
            case.key_cache.as_strided(
                (3, *case.key_cache.shape[1:]),
                case.key_cache.stride(),
                case.key_cache.storage_offset() + half_page,
            ),
            (0, 0),
        ),
    ]
    case.slot_mapping = make_slots(40, 3 * 16, 7, torch.Generator().manual_seed(1), device)
    for key_cache, value_cache, pages in sides:
        case.key_cache, case.value_cache = key_cache, value_cache
        if pages is None:
            check_against_reference(case)
            continue
        before = case.snapshot()
        v_page, k_page = pages
        with pytest.raises(
            RuntimeError,
            match=rf"value_cache: expected a different tensor from key_cache, got the same bytes "
            rf"\(value_cache page {v_page} overlaps key_cache page {k_page}\)",
        ):
            case.run()
        assert_bytes_equal(case.buffers, before)


def test_meta_tensors() -> None:
    """All tensors on meta (shape propagation) is fine, directly through torch.ops too; a meta
    cache side with real other arguments, or the reverse, is an error naming the argument."""
    case = make_case("cpu", "nvfp4", torch.bfloat16, num_tokens=8, per_head_scale=True)
    op = torch.ops._C_cache_ops.reshape_and_cache_flash
    args = list(case.args())
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    op(*meta)
    ops.reshape_and_cache_flash(*meta)
    before = case.snapshot()
    value_cache_on_meta = args[:3] + [args[3].to("meta")] + args[4:]
    with pytest.raises(
        RuntimeError, match=r"value_cache: expected device cpu \(key_cache's device\), got meta"
    ):
        op(*value_cache_on_meta)
    only_key_cache_on_meta = args[:2] + [args[2].to("meta")] + args[3:]
    with pytest.raises(
        RuntimeError, match=r"key: expected a meta tensor \(key_cache is on meta.*got .* cpu"
    ):
        op(*only_key_cache_on_meta)
    assert_bytes_equal(case.buffers, before)
