"""Key sink rows written with the pages (``reshape_and_cache_flash(..., key_sinks,
key_sink_scale)``, docs/design.md §6, §11.1): the compiled op (CPU; CUDA when there is a GPU) and
the Triton writer (under its interpreter without a GPU), byte for byte against
vllm.kv_quant.key_sinks.write_key_sinks on the sink rows and against the op without sinks (and
the reference codecs) on the pages. Each page is ``[K rows | V rows | S*H*D sink bytes]`` of one
buffer of random bytes, the cache sides and the sink rows strided views into it, so bytes no
writer may touch are checked too. Every format, NHD / HND pages, [S][H][D] / [H][S][D] sink
rows, per-tensor and per-head sink scales, skipped and padding tokens, edge values and scales;
every bad argument raises before anything is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from kv_cache_test_utils import DEVICES, PER_TOKEN_HEAD_DTYPES

from vllm import _custom_ops as ops
from vllm.kv_quant.formats import lookup
from vllm.kv_quant.fp8 import fp32_to_fp8_bytes, quantize_fp8
from vllm.kv_quant.key_sinks import write_key_sinks
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops import triton_reshape_and_cache_flash as writer
from vllm.v1.attention.ops import triton_reshape_and_cache_flash_cases as cases
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

from .cache_utils import (
    KIND_AND_DTYPE,
    SOURCE_DTYPES,
    Case,
    Launch,
    _id,
    _rebased,
    assert_bytes_equal,
    expected_buffers,
    make_scale,
    make_slots,
    make_source,
)
from .test_cache import _special_values
from .test_triton_reshape_and_cache_flash import INTERPRETED, TRITON_DEVICES

PER_TOKEN_HEAD = PER_TOKEN_HEAD_DTYPES
ALL_KINDS = [*KIND_AND_DTYPE, *((k, d) for k in PER_TOKEN_HEAD for d in SOURCE_DTYPES)]


@dataclasses.dataclass
class SinkCase:
    """A Case whose caches and key sink rows share the pages of ``case.buffers[0]``."""

    case: Case
    key_sinks: torch.Tensor
    key_sink_scale: torch.Tensor

    def args(self) -> tuple:
        return (*self.case.args(), self.key_sinks, self.key_sink_scale)

    @property
    def raw(self) -> torch.Tensor:
        return self.case.buffers[0]


def make_sink_case(
    device: str,
    kind: str,
    dtype: torch.dtype,
    *,
    num_blocks: int = 3,
    block_size: int = 4,
    num_heads: int = 2,
    head_size: int = 32,
    sink_rows: int = 2,
    hnd: bool = False,
    sinks_hsd: bool = False,
    per_head: bool = False,
    num_tokens: int = 10,
    padding: int = 2,
    skip_every: int = 4,
    row_padding: int = 3,
    seed: int = 0,
) -> SinkCase:
    """Pages of ``2*N*H*F`` cache elements then ``S*H*D`` sink bytes (rounded up to whole
    elements), as one uint8 buffer of random bytes; the caches ``(B, 2, N, H, F)`` (HND: N and
    H swapped underneath) and the sink rows ``(B, S, H, D)`` (``sinks_hsd``: [H][S][D] in the
    page) are views of it with the page stride."""
    gen = torch.Generator().manual_seed(seed)
    storage = lookup(kind).resolve_storage_dtype(dtype)
    size = torch.empty((), dtype=storage).element_size()
    f = lookup(kind).last_dim(head_size)
    n, h, d, s = block_size, num_heads, head_size, sink_rows
    side = n * h * f  # elements
    page = 2 * side + -(-s * h * d // size)  # elements
    raw = torch.randint(0, 256, (num_blocks * page * size,), dtype=torch.uint8, generator=gen)
    raw = raw.to(device)
    strides = (page, side, f, n * f, 1) if hnd else (page, side, h * f, f, 1)
    kv = torch.as_strided(raw.view(storage), (num_blocks, 2, n, h, f), strides)
    sink_strides = (page * size, d, s * d, 1) if sinks_hsd else (page * size, h * d, d, 1)
    sinks = torch.as_strided(raw, (num_blocks, s, h, d), sink_strides, 2 * side * size)
    t_pad = num_tokens + padding
    case = Case(
        key=make_source(t_pad, h, d, dtype, row_padding, device, gen),
        value=make_source(t_pad, h, d, dtype, 0, device, gen),
        key_cache=kv[:, 0],
        value_cache=kv[:, 1],
        slot_mapping=make_slots(num_tokens, num_blocks * n, skip_every, gen, device),
        kv_cache_dtype=kind,
        k_scale=make_scale(kind, h, per_head, gen, device),
        v_scale=make_scale(kind, h, per_head, gen, device),
        buffers=[raw],
    )
    sink_scale = (5e-3 + 4.5e-2 * torch.rand(h if per_head else 1, generator=gen)).to(device)
    return SinkCase(case, sinks, sink_scale)


def expected_with_sinks(sc: SinkCase) -> list[torch.Tensor]:
    """The buffer after the op without sinks wrote the pages, then write_key_sinks the sink rows;
    checked equal to the reference codecs' pages plus write_key_sinks."""
    case = sc.case
    block_size = case.key_cache.shape[1]
    expected = case.snapshot()
    ops.reshape_and_cache_flash(
        case.key,
        case.value,
        _rebased(case.key_cache, case.buffers, expected),
        _rebased(case.value_cache, case.buffers, expected),
        *case.args()[4:],
    )
    reference = expected_buffers(case)
    for buffers in (expected, reference):
        sinks = _rebased(sc.key_sinks, case.buffers, buffers)
        write_key_sinks(sinks, case.key, case.slot_mapping, block_size, sc.key_sink_scale)
    assert_bytes_equal(expected, reference)
    return expected


def run_op(sc: SinkCase) -> None:
    ops.reshape_and_cache_flash(*sc.args())


def run_triton(sc: SinkCase) -> None:
    triton_reshape_and_cache_flash(*sc.args())


def check(sc: SinkCase, run: Callable[[SinkCase], None]) -> None:
    expected = expected_with_sinks(sc)
    before = sc.raw.clone()
    sinks_before = sc.key_sinks.clone()
    run(sc)
    assert_bytes_equal(sc.case.buffers, expected)
    # Not vacuous: the pages and the sink rows both changed.
    assert not torch.equal(sc.key_sinks, sinks_before)
    assert not torch.equal(sc.raw, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,dtype", ALL_KINDS, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_op_writes_sinks(
    device: str, kind: str, dtype: torch.dtype, hnd: bool, per_head: bool
) -> None:
    check(make_sink_case(device, kind, dtype, hnd=hnd, per_head=per_head, sinks_hsd=hnd), run_op)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sink_rows", [1, 4], ids=["S1", "S=N"])
@pytest.mark.parametrize("kind", ["fp8_e5m2", "nvfp4", "auto"])
def test_op_sink_rows_range(device: str, sink_rows: int, kind: str) -> None:
    """S from 1 to block_size; head size 64 (NVFP4 interleave4-capable, 16-byte rows)."""
    sc = make_sink_case(device, kind, torch.bfloat16, sink_rows=sink_rows, head_size=64,
                        num_tokens=12, padding=0, skip_every=5)  # fmt: skip
    check(sc, run_op)


def _special_case(device: str, kind: str, dtype: torch.dtype, sink_scale: list[float]) -> SinkCase:
    """The edge-value rows of the cache tests (ties, saturation, zeros, NaN, Inf, subnormals)
    as keys, every token in a sink row (S = N)."""
    values = _special_values(dtype)
    t = values.shape[0] * 16 // 64 + 1
    sc = make_sink_case(device, kind, dtype, num_blocks=2 * t, sink_rows=4, num_tokens=t,
                        padding=1, skip_every=0)  # fmt: skip
    flat = values.flatten().repeat(2)[: t * 64].view(t, 2, 32)
    sc.case.key = torch.cat([flat, flat[:1]]).to(device)  # one padding row
    sc.case.value = sc.case.key.flip(0)
    sc.key_sink_scale = torch.tensor(sink_scale, device=device)
    return sc


# Ordinary, large (some keys underflow), tiny normal and subnormal (most saturate), and per
# head. A zero scale is refused like a zero k_scale (test_bad_sinks).
SPECIAL_SCALES = [[1.0], [3.0], [1e30], [2.0**-126], [1e-40], [0.5, 1e-40]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "nvfp4", "int8_per_token_head"])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("sink_scale", SPECIAL_SCALES, ids=str)
def test_op_special_values(
    device: str, kind: str, dtype: torch.dtype, sink_scale: list[float]
) -> None:
    check(_special_case(device, kind, dtype, sink_scale), run_op)


def _division_case(device: str) -> SinkCase:
    """fp32 keys at, and one ulp either side of, e4m3 ties times the sink scale 3: some of them
    quantize differently as ``x * (1 / 3)`` than as the codec's ``x / 3``."""
    mantissas = torch.arange(17, 32, 2, dtype=torch.float32) / 16  # 1.0625 .. 1.9375: ties
    x = torch.cat([mantissas * 2.0**e for e in range(-8, 8)]) * 3.0
    x = torch.cat([x, torch.nextafter(x, 2 * x), torch.nextafter(x, 0 * x)])
    t = -(-x.numel() // 64)
    sc = make_sink_case(device, "fp8_e4m3", torch.float32, num_blocks=t, sink_rows=4,
                        num_tokens=t, padding=1, skip_every=0)  # fmt: skip
    sc.case.key = torch.cat([x, x[: (t + 1) * 64 - x.numel()]]).view(t + 1, 2, 32).to(device)
    sc.key_sink_scale = torch.tensor(3.0, device=device)
    by_inverse = fp32_to_fp8_bytes(x * (1 / sc.key_sink_scale.cpu()), "e4m3")
    assert not torch.equal(quantize_fp8(x, torch.tensor(3.0)), by_inverse)
    return sc


@pytest.mark.parametrize("device", DEVICES)
def test_op_divides(device: str) -> None:
    check(_division_case(device), run_op)


# The Triton writer under the interpreter: a program per token, so few, small cases.
TRITON_CASES = [
    ("fp8_e4m3", torch.bfloat16, False, False),
    ("nvfp4", torch.float16, True, True),
    ("auto", torch.float32, True, True),
    ("bfloat16", torch.float16, False, True),
    ("int8_per_token_head", torch.bfloat16, False, True),
    ("fp8_per_token_head", torch.float32, True, False),
]
triton_only = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")


@triton_only
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind,dtype,hnd,per_head", TRITON_CASES, ids=_id)
def test_triton_writes_sinks(
    device: str, kind: str, dtype: torch.dtype, hnd: bool, per_head: bool
) -> None:
    check(make_sink_case(device, kind, dtype, hnd=hnd, per_head=per_head, sinks_hsd=not hnd,
                         num_tokens=6, skip_every=3), run_triton)  # fmt: skip


@triton_only
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_divides(device: str) -> None:
    check(_division_case(device), run_triton)


@triton_only
@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")  # x / 0, x / 1e-40
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kind", ["fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("sink_scale", [[1.0], [1e-40], [0.5, 1e-40]], ids=str)
def test_triton_special_values(device: str, kind: str, sink_scale: list[float]) -> None:
    check(_special_case(device, kind, torch.bfloat16, sink_scale), run_triton)


@triton_only
@pytest.mark.parametrize("kind", ["nvfp4", "int8_per_token_head"])
def test_compile_case_is_the_launch(kind: str, launches: list[Launch]) -> None:
    """A ``key_sinks`` AOT compile case (tools/compile_triton_kernels.py) compiles what a launch
    into a cache of its geometry with one sink row per page after the K and V rows runs."""
    if not INTERPRETED:
        pytest.skip("launches CPU tensors through Triton's interpreter")
    sc = make_sink_case("cpu", kind, torch.bfloat16, num_blocks=2, block_size=cases.CASE_BLOCK_SIZE,
                        num_heads=cases.CASE_HEADS, head_size=cases.CASE_HEAD_SIZE,
                        sink_rows=cases.CASE_SINK_ROWS, num_tokens=1, padding=0, skip_every=0,
                        row_padding=0)  # fmt: skip
    sc.case.k_scale_layout = "interleave4"
    run_triton(sc)
    [(grid, args, kwargs)] = launches
    constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "enable_fp_fusion")}
    name = f"key_sinks/{kind}/interleave4" if kind == "nvfp4" else f"key_sinks/{kind}"
    launched = cases._case(name, writer.WriterLaunch(grid, args, constexprs, kwargs["num_warps"]))
    compiled = {c.name: c for c in cases.triton_compile_cases()}[launched.name]
    assert compiled.signature == launched.signature
    assert compiled.constexprs == launched.constexprs and compiled.constexprs["SINKS"]
    assert set(compiled.divisible_by_16) == set(launched.divisible_by_16)
    assert compiled.num_warps == launched.num_warps


def _sinks(shape=None, dtype=None, strides=None) -> Callable[[SinkCase], torch.Tensor]:
    def make(sc: SinkCase) -> torch.Tensor:
        sinks = sc.key_sinks
        if dtype is not None:
            sinks = sinks.view(dtype)
        if shape is not None or strides is not None:
            size = list(sinks.shape) if shape is None else shape
            sinks = torch.as_strided(sinks, size, strides or sinks.stride(), sinks.storage_offset())
        return sinks

    return make


# (id, field, new value from the case, message): B = 3, N = 4, H = 2, D = 32, S = 2.
BAD_SINKS = [
    ("sinks_without_scale", "key_sink_scale", lambda sc: None,
     r"key_sink_scale: expected a tensor with key_sinks \(both or neither\), got None"),
    ("scale_without_sinks", "key_sinks", lambda sc: None,
     r"key_sinks: expected a tensor with key_sink_scale \(both or neither\), got None"),
    ("dtype", "key_sinks", _sinks(dtype=torch.int8), r"key_sinks: expected dtype uint8, got int8"),
    ("rank", "key_sinks", lambda sc: sc.key_sinks[0],
     r"key_sinks: expected shape \[num_blocks, S, H, D\] = \[3, S, 2, 32\] with 1 <= S <= "
     r"block_size = 4, got shape \[2, 2, 32\]"),
    ("blocks", "key_sinks", lambda sc: sc.key_sinks[:2],
     r"key_sinks: expected shape .*got shape \[2, 2, 2, 32\]"),
    ("no_rows", "key_sinks", lambda sc: sc.key_sinks[:, :0],
     r"key_sinks: expected shape .* with 1 <= S <= block_size = 4, got shape \[3, 0, 2, 32\]"),
    ("more_rows_than_block_size", "key_sinks", _sinks(shape=[3, 5, 2, 32], strides=[1, 1, 1, 1]),
     r"key_sinks: expected shape .*got shape \[3, 5, 2, 32\]"),
    ("heads", "key_sinks", lambda sc: sc.key_sinks[:, :, :1],
     r"key_sinks: expected shape .*got shape \[3, 2, 1, 32\]"),
    ("head_size", "key_sinks", lambda sc: sc.key_sinks[..., :16],
     r"key_sinks: expected shape .*got shape \[3, 2, 2, 16\]"),
    ("last_dim_strided", "key_sinks", _sinks(shape=[3, 2, 2, 32], strides=[1, 128, 64, 2]),
     r"key_sinks: expected a contiguous last dim \(stride 1\), got strides \[1, 128, 64, 2\]"),
    ("sinks_on_meta", "key_sinks", lambda sc: sc.key_sinks.to("meta"),
     r"key_sinks: expected device (cpu|cuda:0) \(key_cache's device\), got meta"),
    ("scale_on_meta", "key_sink_scale", lambda sc: sc.key_sink_scale.to("meta"),
     r"key_sink_scale: expected device (cpu|cuda:0) \(key_cache's device\), got meta"),
    ("scale_dtype", "key_sink_scale", lambda sc: sc.key_sink_scale.half(),
     r"key_sink_scale: expected dtype float32, got float16"),
    ("scale_shape", "key_sink_scale", lambda sc: torch.ones(3, device=sc.raw.device),
     r"key_sink_scale: expected one value \(shape \[\], \[1\], ...\) or \[H\] = \[2\], got "
     r"shape \[3\]"),
    ("scale_rank", "key_sink_scale", lambda sc: torch.ones(1, 2, device=sc.raw.device),
     r"key_sink_scale: expected one value .*got shape \[1, 2\]"),
    ("scale_not_contiguous", "key_sink_scale", lambda sc: torch.ones(4, device=sc.raw.device)[::2],
     r"key_sink_scale: expected a contiguous tensor, got stride 2"),
    # Other arguments' errors leave the sink rows as they are too.
    ("slot_out_of_range_cpu", "slot_mapping",
     lambda sc: torch.cat([sc.case.slot_mapping[:-1], sc.case.slot_mapping.new_tensor([12])]),
     r"slot_mapping: expected slots < num_blocks \* block_size = 12"),
    ("k_scale_zero_cpu", "k_scale", lambda sc: torch.zeros_like(sc.case.k_scale),
     r"k_scale: expected finite values > 0"),
    ("sink_scale_zero_cpu", "key_sink_scale", lambda sc: torch.zeros_like(sc.key_sink_scale),
     r"key_sink_scale: expected finite values > 0"),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "writer", ["op", pytest.param("triton", marks=triton_only)], ids=["op", "triton"]
)
@pytest.mark.parametrize(
    "field,mutate,message", [b[1:] for b in BAD_SINKS], ids=[b[0] for b in BAD_SINKS]
)
def test_bad_sinks(
    device: str,
    writer: str,
    field: str,
    mutate: Callable[[SinkCase], torch.Tensor | None],
    message: str,
) -> None:
    """Nothing is written: the pages, the sink rows and every other byte stay as they were."""
    if device != "cpu" and (field == "slot_mapping" or "finite values" in message):
        pytest.skip("value checks of slots and scales run on the CPU only (docs/design.md §6)")
    sc = make_sink_case(device, "fp8", torch.bfloat16)
    value = mutate(sc)
    if field in ("key_sinks", "key_sink_scale"):
        setattr(sc, field, value)
    else:
        setattr(sc.case, field, value)
    before = sc.raw.clone()
    with pytest.raises(RuntimeError, match=message):
        (run_op if writer == "op" else run_triton)(sc)
    assert_bytes_equal([sc.raw], [before])


@pytest.mark.parametrize("case_id", ["dtype", "rank", "no_rows", "heads", "last_dim_strided"])
def test_fake_impl_rejects_as_the_op(case_id: str) -> None:
    """Shape propagation (every tensor on meta) applies the op's key sink rules and messages."""
    [(_, field, mutate, message)] = [b for b in BAD_SINKS if b[0] == case_id]
    sc = make_sink_case("cpu", "fp8", torch.bfloat16)
    setattr(sc, field, mutate(sc))
    with pytest.raises(RuntimeError, match=message):
        torch.ops._C_cache_ops.reshape_and_cache_flash(*_on_meta(sc.args()))


def _on_meta(args: tuple) -> list:
    """The arguments as meta tensors of the same shapes, strides and dtypes."""
    return [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]


def test_fake_impl_accepts_sinks() -> None:
    sc = make_sink_case("cpu", "nvfp4", torch.float16, per_head=True)
    torch.ops._C_cache_ops.reshape_and_cache_flash(*_on_meta(sc.args()))


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_opcheck(kind: str) -> None:
    """The schema (key_sinks mutable), the fake impl and autograd registration agree with the
    CPU kernel on a call with sink rows in the cache's pages."""
    sc = make_sink_case("cpu", kind, torch.bfloat16, per_head=True)
    torch.library.opcheck(torch.ops._C_cache_ops.reshape_and_cache_flash.default, sc.args())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(backend: str) -> None:
    """A compiled function (fullgraph, through the fake impl) writing pages and sink rows that
    are views of one buffer writes the same bytes as eager."""
    torch._dynamo.reset()
    cases = [make_sink_case("cpu", "nvfp4", torch.bfloat16, per_head=True) for _ in range(2)]
    first = cases[0]
    views = [(t.shape, t.stride(), t.storage_offset())
             for t in (first.case.key_cache, first.case.value_cache, first.key_sinks)]  # fmt: skip
    before = first.raw.clone()

    def write(key, value, raw, slots, k_scale, v_scale, sink_scale) -> None:
        key_cache, value_cache, sinks = (torch.as_strided(raw, *v) for v in views)
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "nvfp4", k_scale,
                                    v_scale, None, None, sinks, sink_scale)  # fmt: skip

    compiled = torch.compile(write, backend=backend, fullgraph=True)
    for sc, fn in zip(cases, (write, compiled), strict=True):
        c = sc.case
        fn(c.key, c.value, sc.raw, c.slot_mapping, c.k_scale, c.v_scale, sc.key_sink_scale)
    assert_bytes_equal(cases[1].case.buffers, cases[0].case.buffers)
    assert not torch.equal(first.raw, before)
