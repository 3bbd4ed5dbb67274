"""The Triton cache writer (vllm.v1.attention.ops.triton_reshape_and_cache_flash) byte for byte
against the reference codecs (vllm.kv_quant) and the compiled op on the same inputs: every
format, source dtype, page order (NHD / HND), scale kind and NVFP4 scale layout; casts into
unquantized caches; odd shapes and strides; ties, saturation, zeros, subnormal scales, NaN and
Inf; skipped and padding tokens; the compiled op's errors on bad input, nothing written.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes are small; with one, the CUDA cases run it natively. The helpers
(Case, make_case, check_against_reference, the edge-value rows, the bad-input table) are those
of the compiled op's tests.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kv_cache_test_utils import PER_TOKEN_HEAD_DTYPES

from vllm import _custom_ops as ops
from vllm.kv_quant.formats import lookup
from vllm.triton_utils import HAS_TRITON
from vllm.triton_utils.aot import case_from_launch, runtime_arg_names
from vllm.v1.attention.ops import triton_reshape_and_cache_flash as writer
from vllm.v1.attention.ops import triton_reshape_and_cache_flash_cases as cases
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

from .cache_utils import (
    EXPLICIT_UNQUANTIZED,
    KIND_AND_DTYPE,
    SOURCE_DTYPES,
    Case,
    Launch,
    _id,
    _rebased,
    assert_bytes_equal,
    check_against_reference,
    expected_buffers,
    make_case,
)
from .test_cache import _special_values, random_cases
from .test_cache_errors import BAD_INPUTS

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
TRITON_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED,
            reason="Triton runs CPU tensors only under its interpreter (TRITON_INTERPRET=1, set "
            "by tests/conftest.py when there is no GPU)",
        ),
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
PER_TOKEN_HEAD = PER_TOKEN_HEAD_DTYPES
# Rotated INT4 rows: the writer hands them to upstream's reshape_and_cache_int4.
INT4 = "int4_per_token_head"
ALL_KINDS = [*(k for k, _ in KIND_AND_DTYPE), *PER_TOKEN_HEAD, INT4]
# Small pages: the interpreter costs ~1 ms per program (a token's heads), nvfp4_mse ~0.5 s.
SMALL = dict(num_blocks=3, block_size=4, num_heads=2, num_tokens=6, padding=2, skip_every=4)
TINY_MSE = dict(num_blocks=2, block_size=4, num_heads=1, num_tokens=3, padding=1, skip_every=3)


class TritonCase(Case):
    """A Case whose run() is the Triton writer (same arguments as the compiled op)."""

    def run(self) -> None:
        triton_reshape_and_cache_flash(*self.args())


def as_triton(case: Case) -> TritonCase:
    return TritonCase(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})


def small_case(device: str, kind: str, dtype: torch.dtype, **overrides: object) -> Case:
    shape = TINY_MSE if kind == "nvfp4_mse" else SMALL
    return make_case(device, kind, dtype, **{**shape, **overrides})


def op_bytes(case: Case) -> list[torch.Tensor]:
    """The case's buffers after the compiled op has written the case's tokens into a copy."""
    op_buffers = case.snapshot()
    ops.reshape_and_cache_flash(
        case.key,
        case.value,
        _rebased(case.key_cache, case.buffers, op_buffers),
        _rebased(case.value_cache, case.buffers, op_buffers),
        *case.args()[4:],
    )
    return op_buffers


def check_triton(case: Case) -> None:
    """The Triton writer's bytes equal the reference codec's and the compiled op's."""
    expected_op = op_bytes(case)
    check_against_reference(as_triton(case))
    assert_bytes_equal(case.buffers, expected_op)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "kind,dtype",
    [*KIND_AND_DTYPE, *((k, d) for k in (*PER_TOKEN_HEAD, INT4) for d in SOURCE_DTYPES)],
    ids=_id,
)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_matches_reference_and_op(device: str, kind: str, dtype: torch.dtype, hnd: bool) -> None:
    check_triton(small_case(device, kind, dtype, hnd=hnd, row_padding=3))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_mse"])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_scale_shapes(device: str, kind: str, shape: tuple[int, ...]) -> None:
    """Per-head [H] scales, and one value in any shape (upstream engines pass 0-d tensors)."""
    per_head = small_case(device, kind, torch.bfloat16, per_head_scale=True, hnd=True)
    check_triton(per_head)
    case = small_case(device, kind, torch.float16, seed=1)
    case.k_scale = case.k_scale.reshape(shape)
    case.v_scale = case.v_scale.reshape(shape)
    check_triton(case)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("src", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("cache", SOURCE_DTYPES, ids=_id)
def test_cast_into_unquantized_cache(device: str, src: torch.dtype, cache: torch.dtype) -> None:
    """K/V of any float dtype are rounded to nearest even into the cache's dtype, as ``.to()``
    does (the interpreter's own fp32 -> bf16 conversion truncates: the kernel rounds on bits)."""
    check_triton(small_case(device, "auto", src, cache_dtype=cache))
    name = next(n for n, d in EXPLICIT_UNQUANTIZED.items() if d == cache)
    check_triton(small_case(device, name, src, cache_dtype=cache, hnd=True, seed=2))


def _rounding_rows(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values that fp16 / bf16 must round: ties both ways, carries into the exponent,
    overflow to Inf, fp16 subnormals and their ties; the same values negated (NaN:
    NAN_CASTS)."""
    step = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
    values = torch.cat(
        [
            step,
            torch.tensor([65504.0, 65519.0, 65520.0, 3.4e38, float("inf")]),
            torch.tensor([2.0**-25, 3 * 2.0**-25, 2.0**-24 * 1.5, 2.0**-15, 6.1e-5, 1e-40]),
            torch.tensor([2.0 - 2.0**-12, 2.0 - 2.0**-9, 1.0 - 2.0**-25, 0.0, -0.0, 7.0]),
        ]
    )
    return torch.cat([values, -values]).to(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16], ids=_id)
def test_cast_rounding_edges(device: str, cache: torch.dtype) -> None:
    """Every non-NaN rounding edge against torch's cast and the compiled op (NaN: the next
    test, since torch's cast is no reference for NaN bits)."""
    values = _rounding_rows(torch.float32)
    case = make_case(
        device, "auto", torch.float32, cache_dtype=cache, num_blocks=2, block_size=4,
        num_heads=1, head_size=values.numel(), num_tokens=2, padding=0, skip_every=0,
    )  # fmt: skip
    case.key = values.view(1, 1, -1).repeat(2, 1, 1).to(device)
    case.value = -case.key
    check_triton(case)


# fp32 NaN bits -> the fp16 / bf16 bits the compiled op writes (csrc float_to_fp16_bits: quiet
# 0x7E00 with the sign; float_to_bf16_bits: the high half with the quiet bit set). torch's own
# cast is device dependent here: on CUDA __float2half / __float2bfloat16 give the canonical NaN
# 0x7FFF whatever the sign, on the CPU fp16 gives these bits and bf16 0x7FC0 or 0xFFFF
# depending on the code path.
NAN_CASTS = [
    (0x7FC00000, 0x7E00, 0x7FC0),
    (0xFFC00000, 0xFE00, 0xFFC0),
    (0x7F800001, 0x7E00, 0x7FC0),  # signalling, lowest payload bit
    (0xFF812345, 0xFE00, 0xFFC1),
    (0x7FFFFFFF, 0x7E00, 0x7FFF),
    (0xFFFFFFFF, 0xFE00, 0xFFFF),
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16], ids=_id)
def test_cast_nan_codes(device: str, cache: torch.dtype) -> None:
    """NaN of any sign and payload becomes the codec's NaN code (NAN_CASTS) on every device, as
    the compiled op writes it; the value side sees the table rotated."""
    column = 1 if cache == torch.float16 else 2
    n = len(NAN_CASTS)
    case = as_triton(make_case(
        device, "auto", torch.float32, cache_dtype=cache, num_blocks=2, block_size=4,
        num_heads=2, head_size=8 * n, num_tokens=5, padding=1, skip_every=3,
    ))  # fmt: skip
    bits = torch.tensor([row[0] for row in NAN_CASTS], dtype=torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # the int32 of each bit pattern
    codes = torch.tensor([row[column] for row in NAN_CASTS], dtype=torch.int64)
    shape = case.key.shape
    tiled = [(bits.roll(r), codes.roll(r)) for r in (0, n // 2)]
    case.key, case.value = (
        b.repeat(shape.numel() // n).to(torch.int32).view(torch.float32).view(shape).to(device)
        for b, _ in tiled
    )
    op_buffers = op_bytes(case)
    case.run()
    assert_bytes_equal(case.buffers, op_buffers)
    kept = case.slot_mapping[case.slot_mapping >= 0]
    assert kept.numel() > 0
    block_size = case.key_cache.shape[1]
    for side, (_, side_codes) in zip((case.key_cache, case.value_cache), tiled, strict=True):
        written = side[kept // block_size, kept % block_size].view(torch.int16).to(torch.int64)
        want = side_codes.repeat(shape[1] * shape[2] // n).view(shape[1:]).to(written.device)
        assert torch.equal(written & 0xFFFF, want.expand_as(written)), (written & 0xFFFF, want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4_mse"])
@pytest.mark.parametrize(
    "k_layout,v_layout",
    [("linear", "interleave4"), ("interleave4", "linear"), ("interleave4", None), (None, None)],
)
def test_nvfp4_scale_layouts(
    device: str, kind: str, k_layout: str | None, v_layout: str | None
) -> None:
    """Each side's block-scale layout, V following a named K, and the geometry's default
    (None: interleave4 where it fits)."""
    case = small_case(
        device, kind, torch.bfloat16, k_scale_layout=k_layout, v_scale_layout=v_layout
    )
    check_triton(case)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_nvfp4_default_layout_where_interleave4_does_not_fit(device: str) -> None:
    """Block size 3 and head size 48: no interleave4, the default is linear on both sides."""
    case = small_case(
        device, "nvfp4", torch.float16, block_size=3, head_size=48, head_size_v=80,
        k_scale_layout=None, v_scale_layout=None,
    )  # fmt: skip
    check_triton(case)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ALL_KINDS[::2] + ["fp8_per_token_head", "nvfp4"])
@pytest.mark.parametrize(
    "head_size,head_size_v,block_size,num_heads",
    [(16, 48, 1, 1), (32, 64, 3, 3), (80, 16, 5, 2)],
)
def test_odd_shapes(
    device: str, kind: str, head_size: int, head_size_v: int, block_size: int, num_heads: int
) -> None:
    """Head sizes that are not powers of two (K and V different), blocks of 1, 3, 5 tokens."""
    case = small_case(
        device, kind, torch.bfloat16, head_size=head_size, head_size_v=head_size_v,
        block_size=block_size, num_heads=num_heads, num_tokens=min(5, 3 * block_size),
        row_padding=7, hnd=block_size == 3,
    )  # fmt: skip
    check_triton(case)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8_e5m2", "nvfp4", *PER_TOKEN_HEAD])
def test_head_blocks(device: str, kind: str, launches: list) -> None:
    """A token's heads over several programs, the last one part-filled: 3 heads of 512 (V 256)
    make rows of 512 padded elements, so a program writes 2 heads (WRITER_TILE_ELEMENTS)."""
    case = small_case(
        device, kind, torch.float16, num_heads=3, head_size=512, head_size_v=256, num_tokens=3,
        padding=1, skip_every=0,
    )  # fmt: skip
    check_triton(case)
    assert [(grid, kw["HEADS"]) for grid, _, kw in launches] == [((3, 2), 2)]


def _one_byte_off(case: Case) -> Case:
    """``case`` with its buffers, and the cache views in them, one byte further on."""
    moved = []
    for raw in case.buffers:
        shifted = torch.zeros(raw.numel() + 1, dtype=torch.uint8, device=raw.device)
        shifted[1:] = raw
        moved.append(shifted[1:])
    key_cache = _rebased(case.key_cache, case.buffers, moved)
    value_cache = _rebased(case.value_cache, case.buffers, moved)
    return dataclasses.replace(case, key_cache=key_cache, value_cache=value_cache, buffers=moved)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", PER_TOKEN_HEAD)
@pytest.mark.parametrize("shift,row_align", [(False, 4), (True, 1)], ids=["aligned", "byte_off"])
def test_per_token_head_row_alignment(
    device: str, kind: str, shift: bool, row_align: int, launches: list
) -> None:
    """Rows of D + 4 bytes go out a word at a time, the scale as one word, when every row and
    scale is 4-byte aligned (ROW_ALIGN 4, as in an allocated cache); a cache view one byte off
    is stored byte by byte. Both store the codec's bytes."""
    case = small_case(device, kind, torch.bfloat16, hnd=True)
    if shift:
        case = _one_byte_off(case)
        assert case.key_cache.data_ptr() % 4 == 1
    check_triton(case)
    assert [kw["ROW_ALIGN"] for _, _, kw in launches] == [row_align]


@pytest.mark.parametrize(
    "case_name,kind,per_head",
    [
        ("bf16->bf16", "bfloat16", False),
        ("fp8_e4m3/per_head", "fp8_e4m3", True),
        ("int8_per_token_head", "int8_per_token_head", False),
        ("fp8_per_token_head", "fp8_per_token_head", False),
        ("nvfp4/interleave4", "nvfp4", False),
        ("nvfp4_mse/linear", "nvfp4_mse", False),
    ],
)
def test_compile_cases_are_the_launches(
    case_name: str,
    kind: str,
    per_head: bool,
    launches: list[Launch],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The AOT compile cases (tools/compile_triton_kernels.py) compile what a launch through
    the public function into a cache of their geometry (8 heads of 128, 16-token NHD pages,
    bf16 K/V) runs: the same argument types, constants (integers equal to 1), arguments that
    are multiples of 16, constexprs and warps."""
    if not INTERPRETED:
        pytest.skip("launches CPU tensors through Triton's interpreter")
    layout = case_name.split("/")[-1] if kind.startswith("nvfp4") else "linear"
    case = make_case("cpu", kind, torch.bfloat16, num_heads=cases.CASE_HEADS,
                     head_size=cases.CASE_HEAD_SIZE, block_size=cases.CASE_BLOCK_SIZE,
                     num_tokens=1, padding=0, skip_every=0, per_head_scale=per_head,
                     k_scale_layout=layout)  # fmt: skip
    as_triton(case).run()
    [(grid, args, kwargs)] = launches
    monkeypatch.undo()  # the kernel itself again, for the cases
    constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "enable_fp_fusion")}
    launched = cases._case(
        case_name, writer.WriterLaunch(grid, args, constexprs, kwargs["num_warps"])
    )
    compiled = {c.name: c for c in cases.triton_compile_cases()}[launched.name]
    assert compiled.signature == launched.signature
    assert compiled.constexprs == launched.constexprs
    assert set(compiled.divisible_by_16) == set(launched.divisible_by_16)
    assert compiled.num_warps == launched.num_warps == 4
    assert grid == (1, 1)


def test_compile_cases_specialise_as_triton() -> None:
    """vllm.triton_utils.aot.case_from_launch types, constants and hints arguments as
    Triton's launch does (an integer equal to 1 a constant, 0 and other multiples of 16 hinted,
    i64 past 2^31)."""
    kernel = writer.reshape_and_cache_flash_kernel
    names = runtime_arg_names(kernel)
    tensor = torch.zeros(4, dtype=torch.uint8)
    values = {"key_stride": 1, "value_stride": 2**31 + 16, "k_block_stride": 0,
              "k_token_stride": 24, "key_ptr": tensor[1:]}  # fmt: skip
    args = tuple(values.get(n, tensor) for n in names)
    got = case_from_launch("x", kernel, args, {}, num_warps=4)
    assert got.constexprs == {"key_stride": 1} and "key_stride" not in got.signature
    assert got.signature["value_stride"] == "i64" and got.signature["k_token_stride"] == "i32"
    assert got.signature["key_ptr"] == "*u8"
    hinted = set(got.divisible_by_16)
    assert {"value_stride", "k_block_stride", "value_ptr"} <= hinted
    assert not {"k_token_stride", "key_ptr"} & hinted


def _special_case(device: str, kind: str, dtype: torch.dtype, k_scale, v_scale) -> Case:
    """The compiled op's edge-value rows (E2M1 / FP8 ties, saturation, zeros, NaN, Inf,
    subnormals) as keys, reversed as values."""
    values = _special_values(dtype)
    num_heads, head_size = 2, 32
    t = values.shape[0] * 16 // (num_heads * head_size) + 1
    flat = values.flatten().repeat(2)[: t * num_heads * head_size]
    case = make_case(
        device, kind, dtype, num_blocks=2, block_size=4, num_heads=num_heads,
        head_size=head_size, num_tokens=t, padding=0, skip_every=0,
    )  # fmt: skip
    case.key = flat.view(t, num_heads, head_size).to(device)
    case.value = flat.flip(0).view(t, num_heads, head_size).to(device)
    case.k_scale = torch.tensor(k_scale, device=device)
    case.v_scale = torch.tensor(v_scale, device=device)
    return case


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "nvfp4", *PER_TOKEN_HEAD])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_special_values(device: str, kind: str, dtype: torch.dtype, scale: float) -> None:
    check_triton(_special_case(device, kind, dtype, [scale], [scale, 1.0 / scale]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
def test_special_values_mse(device: str, dtype: torch.dtype) -> None:
    """nvfp4_mse keeps the plain scale for NaN, Inf and all-zero groups and searches the rest."""
    check_triton(_special_case(device, "nvfp4_mse", dtype, [0.5], [0.5, 2.0]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "nvfp4"])
def test_subnormal_scale(device: str, kind: str) -> None:
    """A subnormal scale is valid but its inverse overflows to Inf (NaN multipliers for 0)."""
    check_triton(_special_case(device, kind, torch.float32, [1e-40], [0.5, 1e-40]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8", "nvfp4", "int8_per_token_head"])
def test_skipped_tokens_write_nothing(device: str, kind: str) -> None:
    """Every slot < 0, or no token at all: the caches keep every byte."""
    case = as_triton(small_case(device, kind, torch.bfloat16))
    before = case.snapshot()
    case.slot_mapping = torch.full_like(case.slot_mapping, -1)
    case.run()
    case.slot_mapping = case.slot_mapping[:0]
    case.run()
    assert_bytes_equal(case.buffers, before)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_kernel_skips_out_of_range_slots(
    device: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA, like the compiled op, a slot >= num_blocks * block_size is skipped by the kernel
    (checking would sync): the bytes are the reference codec's with that token's slot -1 (the
    codec itself rejects such a slot) and the op's. On the CPU the host check raises instead
    (test_bad_input); it is switched off here so that the interpreter reaches the kernel's own
    bound."""
    case = as_triton(small_case(device, kind, torch.bfloat16))
    num_slots = case.key_cache.shape[0] * case.key_cache.shape[1]
    case.slot_mapping[0] = 10**6
    case.slot_mapping[4] = num_slots  # the first slot out of range
    in_range = dataclasses.replace(
        case, slot_mapping=case.slot_mapping.masked_fill(case.slot_mapping >= num_slots, -1)
    )
    expected = [expected_buffers(in_range)]
    assert any(not torch.equal(b, e) for b, e in zip(case.buffers, expected[0], strict=True))
    if device == "cuda":
        expected.append(op_bytes(case))
    else:
        monkeypatch.setattr(writer, "check_slot_mapping", lambda *args: None)
    case.run()
    for want in expected:
        assert_bytes_equal(case.buffers, want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=random_cases())
def test_random_shapes(device: str, params: dict) -> None:
    """The compiled op's random shapes (heads, head sizes, layouts, strides, padding), fewer
    tokens for the block-scale search."""
    kind, dtype = params.pop("kind"), params.pop("dtype")
    if kind == "nvfp4_mse":
        params["num_tokens"] = min(params["num_tokens"], 2)
        params["num_heads"] = 1
    check_triton(make_case(device, kind, dtype, **params))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "kind,mutate,message,cpu_only", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input(
    device: str, kind: str, mutate: Callable[[Case], None], message: str, cpu_only: bool
) -> None:
    """The compiled op's bad-input table: the same error (RuntimeError, same message) before
    anything is written."""
    if cpu_only and device != "cpu":
        pytest.skip("value checks of slots and scales run on the CPU only (docs/design.md §6)")
    dtype = torch.float16 if kind == "float16" else torch.bfloat16
    case = as_triton(make_case(device, kind, dtype, per_head_scale=True))
    mutate(case)
    watched = [*case.buffers, case.key_cache, case.value_cache]
    before = [t.contiguous().view(torch.uint8).clone() for t in watched]
    with pytest.raises(RuntimeError, match=message):
        case.run()
    assert_bytes_equal([t.contiguous().view(torch.uint8) for t in watched], before)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_non_tensor_slot_mapping(device: str) -> None:
    case = as_triton(small_case(device, "auto", torch.bfloat16))
    case.slot_mapping = [0, 1]  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="slot_mapping: expected a torch.Tensor, got list"):
        case.run()


def test_every_kernel_format_is_covered() -> None:
    """Every format the compiled op writes is among this file's kinds (a format added to the
    registry must be added to the writer and here)."""
    from vllm.kv_quant.formats import formats

    written = {f.name for f in formats() if f.cache_kind is not None and f.has_kernel}
    assert written == {lookup(k).name for k in ALL_KINDS}
