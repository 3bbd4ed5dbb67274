"""``convert_fp8`` (docs/design.md §6): the op's bytes are the reference codec's
(:mod:`vllm.kv_quant.fp8`) in both directions, for both variants and every float dtype; plain
casts are torch's; every argument is checked before anything is written."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import vllm._custom_ops as ops
from tests.kernels.utils import opcheck
from vllm.kv_quant.fp8 import Fp8Format, dequantize_fp8, fp8_bytes_to_fp32, quantize_fp8

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = [("fp8", Fp8Format.E4M3), ("fp8_e4m3", Fp8Format.E4M3), ("fp8_e5m2", Fp8Format.E5M2)]
# Powers of two keep exact ties exact; the others round; 1e-40 is an fp32 subnormal.
SCALES = [1.0, 0.25, 0.37, 3.0e5, 1.0e-40, 1.0e-30, 1.0e30]


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_values(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal, except that any NaN matches any NaN (NaN bits differ between torch kernels)."""
    out, ref = out.cpu(), ref.cpu()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    nan = torch.isnan(ref.float())
    assert torch.equal(torch.isnan(out.float()), nan)
    assert torch.equal(_int_view(out)[~nan], _int_view(ref)[~nan])


def _fp8_edge_values(fmt: Fp8Format) -> torch.Tensor:
    """Every finite FP8 value, the ties between neighbours and one fp32 ulp either side of them,
    saturation, zeros, fp32 subnormals, NaN and Inf, with both signs."""
    grid = fp8_bytes_to_fp32(torch.arange(128, dtype=torch.uint8), fmt)
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exact: FP8 neighbours differ in a few low bits
    above = torch.tensor([fmt.max * 1.0001, fmt.max * 1.0625, fmt.max * 2, 1e30, 3.4e38])
    tiny = torch.tensor([1e-45, 1e-40, 1.2e-38, 0.0])
    base = torch.cat([grid, ties, above, tiny])
    values = torch.cat(
        [
            base,
            torch.nextafter(base, torch.full_like(base, math.inf)),
            torch.nextafter(base, torch.zeros_like(base)),
        ]
    )
    values = torch.cat([values, -values, torch.tensor([math.nan, -math.nan, math.inf, -math.inf])])
    return values.to(torch.float32)


def _random_values(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from 1e-12 to 1e8, random signs: below, across and beyond both FP8 ranges."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.pow(10.0, torch.empty(n).uniform_(-12, 8, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return magnitude * sign


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("kv_dtype", "fmt"), VARIANTS)
def test_quantize_is_the_codec(
    device: str, dtype: torch.dtype, kv_dtype: str, fmt: Fp8Format
) -> None:
    x = torch.cat([_fp8_edge_values(fmt), _random_values(20_000, 1)]).to(dtype)
    for scale in SCALES:
        ref = quantize_fp8(x, torch.tensor(scale, dtype=torch.float32), fmt)
        for out_dtype in (torch.uint8, fmt.torch_dtype):
            out = torch.full(x.shape, 0x55, dtype=torch.uint8, device=device).view(out_dtype)
            ops.convert_fp8(out, x.to(device), scale, kv_dtype)
            assert torch.equal(out.view(torch.uint8).cpu(), ref), (scale, out_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("kv_dtype", "fmt"), VARIANTS)
def test_dequantize_is_the_codec(
    device: str, dtype: torch.dtype, kv_dtype: str, fmt: Fp8Format
) -> None:
    """All 256 bytes (NaN and Inf codes included); scales that push fp16 outputs to Inf and to
    subnormals, and fp32 outputs to subnormals."""
    q = torch.arange(256, dtype=torch.uint8).repeat(4)
    for scale in [*SCALES, 1.0e3, 1.0e-6]:
        ref = dequantize_fp8(q, torch.tensor(scale, dtype=torch.float32), fmt, out_dtype=dtype)
        for in_dtype in (torch.uint8, fmt.torch_dtype):
            out = torch.empty(q.shape, dtype=dtype, device=device)
            ops.convert_fp8(out, q.view(in_dtype).to(device), scale, kv_dtype)
            assert_same_values(out, ref)


def _rounding_boundaries(dtype: torch.dtype) -> torch.Tensor:
    """For every finite value of the 16-bit ``dtype``: the value, the tie with the next one and
    one fp32 ulp either side of the tie, both signs; the overflow edge; NaN and Inf."""
    bits = torch.arange(0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int32)
    grid = bits.to(torch.int16).view(dtype).to(torch.float32)
    ties = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    top = grid[-1] + (grid[-1] - grid[-2]) / 2  # the tie with the first value past the max
    ties = torch.cat([ties, top.reshape(1)])
    up = torch.full_like(ties, math.inf)
    values = torch.cat(
        [grid, ties, torch.nextafter(ties, up), torch.nextafter(ties, torch.zeros_like(ties))]
    )
    return torch.cat([values, -values, torch.tensor([math.nan, math.inf, -math.inf])])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES, ids=str)
def test_auto_is_a_plain_cast(device: str, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """``auto``: torch's cast (round to nearest even, overflow to Inf, subnormals kept), checked
    on every rounding boundary of fp16 and bf16 and on random bit patterns; the scale is
    ignored (even 0)."""
    random_bits = torch.randint(
        -(2**31), 2**31, (200_000,), generator=torch.Generator().manual_seed(3)
    )
    x = torch.cat(
        [
            _rounding_boundaries(torch.float16),
            _rounding_boundaries(torch.bfloat16),
            random_bits.to(torch.int32).view(torch.float32),
        ]
    ).to(src_dtype)
    out = torch.empty(x.shape, dtype=dst_dtype, device=device)
    ops.convert_fp8(out, x.to(device), 0.0, "auto")
    assert_same_values(out, x.to(dst_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_arguments(device: str) -> None:
    """Strided and transposed views on either side give the contiguous result and leave the
    rest of dst's buffer alone."""
    x = _random_values(4 * 6 * 10, 4).reshape(4, 6, 10).to(torch.bfloat16).to(device)
    src = x.transpose(0, 2)[:, ::2]  # (10, 3, 4), not contiguous
    expected = torch.empty(src.shape, dtype=torch.uint8, device=device)
    ops.convert_fp8(expected, src.contiguous(), 0.5, "fp8")

    buffer = torch.full((10, 3, 8), 0xAB, dtype=torch.uint8, device=device)
    dst = buffer[:, :, ::2]
    ops.convert_fp8(dst, src, 0.5, "fp8")
    assert torch.equal(dst, expected)
    assert bool((buffer[:, :, 1::2] == 0xAB).all())

    back = torch.zeros(4, 3, 10, dtype=torch.float16, device=device).transpose(0, 2)
    ops.convert_fp8(back, dst, 0.5, "fp8")
    ref = dequantize_fp8(expected.cpu(), torch.tensor(0.5), Fp8Format.E4M3, torch.float16)
    assert_same_values(back, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_large_tensor_and_empty(device: str) -> None:
    """More elements than one CPU work chunk / one CUDA grid pass; empty tensors are a no-op."""
    x = _random_values(3 * 2**20 + 7, 5).to(device)
    out = torch.empty(x.shape, dtype=torch.uint8, device=device)
    ops.convert_fp8(out, x, 2.0, "fp8_e5m2")
    assert torch.equal(out.cpu(), quantize_fp8(x.cpu(), torch.tensor(2.0), Fp8Format.E5M2))
    ops.convert_fp8(torch.empty(0, 4, dtype=torch.uint8, device=device), x[:0].reshape(0, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dst_dtype", "src_dtype", "kv_dtype"),
    [
        (torch.float8_e4m3fn, torch.float32, "fp8"),  # upstream's tests/kernels/core/test_opcheck
        (torch.uint8, torch.bfloat16, "fp8_e5m2"),
        (torch.float16, torch.uint8, "fp8"),
        (torch.float32, torch.bfloat16, "auto"),
    ],
    ids=str,
)
def test_opcheck(
    device: str, dst_dtype: torch.dtype, src_dtype: torch.dtype, kv_dtype: str
) -> None:
    if src_dtype == torch.uint8:
        src = torch.randint(0, 256, (64, 32), dtype=torch.uint8)
    else:
        src = torch.randn(64, 32).to(src_dtype)
    dst = torch.empty(64, 32, dtype=dst_dtype, device=device)
    opcheck(torch.ops._C_cache_ops.convert_fp8, (dst, src.to(device), 1.0, kv_dtype))


def test_upstream_signature_and_meta() -> None:
    params = inspect.signature(ops.convert_fp8).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("output", inspect.Parameter.empty),
        ("input", inspect.Parameter.empty),
        ("scale", 1.0),
        ("kv_dtype", "fp8"),
    ]
    schema = str(torch.ops._C_cache_ops.convert_fp8.default._schema)
    assert "convert_fp8(Tensor($0! -> ) dst_cache, Tensor src_cache, float scale" in schema
    meta = torch.empty(8, dtype=torch.uint8, device="meta")
    ops.convert_fp8(meta, torch.empty(8, device="meta"))  # shape propagation: a no-op
    with pytest.raises(RuntimeError, match=r"src_cache: expected a meta tensor"):
        ops.convert_fp8(meta, torch.empty(8))


def _bad_calls() -> list:
    f32 = torch.ones(2, 3)
    u8 = torch.zeros(2, 3, dtype=torch.uint8)
    e4m3 = u8.view(torch.float8_e4m3fn)
    return [
        ((u8, f32, 1.0, "nvfp4"), r"kv_cache_dtype: expected one of auto, fp8, fp8_e4m3, "),
        ((u8, f32, 1.0, "float16"), r"kv_cache_dtype: expected .*, got 'float16'"),
        ((u8, f32, 1.0, "int8"), r"kv_cache_dtype: expected .*, got 'int8'"),
        ((torch.zeros(2, 3, dtype=torch.float16), f32, 1.0, "fp8"), r"dst_cache: expected "
         r"dtype uint8 or float8_e4m3fn \(the FP8 bytes that src_cache's float32 .*got float16"),
        ((e4m3, f32, 1.0, "fp8_e5m2"), r"dst_cache: expected dtype uint8 or float8_e5m2"),
        ((u8, u8.clone(), 1.0, "fp8"), r"dst_cache: expected dtype float32, float16 or bfloat16 "
         r"\(src_cache holds FP8 bytes to dequantize\), got uint8"),
        ((f32, torch.zeros(2, 3, dtype=torch.int32), 1.0, "fp8"), r"src_cache: expected dtype "
         r"float32, float16 or bfloat16 \(to quantize\) or uint8 or float8_e4m3fn .*got int32"),
        ((f32.clone(), e4m3, 1.0, "fp8_e5m2"), r"src_cache: expected .*got float8_e4m3fn"),
        ((u8, f32, 1.0, "auto"), r"dst_cache: expected dtype .* for kv_cache_dtype 'auto'"),
        ((f32.clone(), u8, 1.0, "auto"), r"src_cache: expected dtype .* 'auto' .*got uint8"),
        ((u8[:1], f32, 1.0, "fp8"), r"dst_cache: expected src_cache's shape \[2, 3\], got \[1"),
        ((u8, f32, 0.0, "fp8"), r"scale: expected a finite value > 0 that float32 holds, got 0"),
        ((u8, f32, -2.0, "fp8"), r"scale: expected .*got -2"),
        ((u8, f32, math.inf, "fp8"), r"scale: expected .*got inf"),
        ((u8, f32, math.nan, "fp8"), r"scale: expected .*got nan"),
        ((u8, f32, 1e-50, "fp8"), r"scale: expected .*got 1e-50"),
        ((u8, f32, 1e39, "fp8_e5m2"), r"scale: expected .*got 1e\+39"),
        ((torch.zeros(1, 3, dtype=torch.uint8).expand(2, 3), f32, 1.0, "fp8"),
         r"dst_cache: expected every element at its own address"),
    ]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), _bad_calls())
def test_rejects_bad_arguments_before_writing(args: tuple, message: str) -> None:
    dst = args[0]
    before = dst.clone()
    with pytest.raises(RuntimeError, match=message):
        ops.convert_fp8(*args)
    assert torch.equal(_int_view(dst), _int_view(before))


def test_rejects_overlapping_buffers() -> None:
    """Two sides in one buffer: apart is fine, any shared byte is refused before writing."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    src = buffer[:32].view(torch.float16).fill_(1.5)  # bytes 0..31
    ops.convert_fp8(buffer[32:48], src[:16], 1.0, "fp8")
    assert bool((buffer[32:48] == 0x3C).all())  # e4m3 1.5
    for dst in (buffer[16:32], buffer[31:47]):
        with pytest.raises(RuntimeError, match=r"dst_cache: expected memory apart from src_"):
            ops.convert_fp8(dst, src, 1.0, "fp8")
    assert bool((buffer[:32].view(torch.float16) == 1.5).all())
    with pytest.raises(RuntimeError, match=r"dst_cache: expected memory apart from src_"):
        ops.convert_fp8(buffer[:32].view(torch.float16), buffer[:16], 1.0, "fp8")
