"""reshape_and_cache_flash (torch.ops._C_cache_ops) against the reference codecs, byte for byte.

Every cache starts as random bytes; the expected cache is the same bytes after the reference
writer (vllm.kv_quant) has written the mapped tokens, so a byte comparison of the whole buffer
also proves that unmapped slots, skipped tokens (slot < 0) and padding tokens (T < T_pad) are
left alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops
from vllm.kv_quant import ScaleLayout
from vllm.kv_quant.formats import lookup
from vllm.utils.torch_utils import nvfp4_kv_cache_split_views

from ..quantization.nvfp4_utils import dequant_nvfp4_kv_cache_nhd
from .cache_utils import (
    EXPLICIT_UNQUANTIZED,
    HAS_CUDA,
    KIND_AND_DTYPE,
    SOURCE_DTYPES,
    _id,
    assert_bytes_equal,
    check_against_reference,
    expected_buffers,
    make_case,
)


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
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_mse", "nvfp4_4over6"])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_special_values(device: str, kind: str, dtype: torch.dtype, scale: float) -> None:
    check_special_values(device, kind, dtype, [scale], [scale, 1.0 / scale])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "nvfp4", "nvfp4_mse", "nvfp4_4over6"])
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
    nvfp4 = lookup(kind).is_nvfp4
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
