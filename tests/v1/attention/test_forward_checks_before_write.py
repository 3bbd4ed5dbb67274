"""``forward(key=..., value=...)`` of the reference and ``CPU_ATTN`` impls checks every argument
before the new tokens move (issue 20): a bad ``output``, bad metadata or a bad ``simd`` raises
with the cache bytes unchanged, in bf16 and NVFP4 alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm.v1.attention.backends import AttentionLayerScales, ReferenceAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl
from vllm.v1.attention.backends.reference import ReferenceAttentionImpl
from vllm.v1.attention.backends.utils import check_sequences

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

IMPLS = [ReferenceAttentionImpl, CPUAttentionImpl]
FORMATS = {"auto": (torch.bfloat16, 64), "nvfp4": (torch.uint8, 36)}  # cache dtype, last dim
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 4


def _metadata(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(args: dict[str, Any]) -> None:
        args["attn_metadata"] = replace(args["attn_metadata"], **fields)

    return mutate


def _arg(**values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(args: dict[str, Any]) -> None:
        args.update({k: v() if callable(v) else v for k, v in values.items()})

    return mutate


def _int32(*values: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.tensor(values, dtype=torch.int32)


def _bf16(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Callable[[], torch.Tensor]:
    return lambda: torch.zeros(*shape, dtype=dtype)


# (id, mutation of forward's keyword arguments, message regex); 3 new tokens of one sequence.
BAD = [
    ("output_heads", _arg(output=_bf16(3, 3, 64)),
     r"output: expected shape \[T, 4, 64\], got \[3, 3, 64\]"),
    ("output_rank", _arg(output=_bf16(3, 256)), r"output: expected shape \[T, 4, 64\]"),
    ("output_rows", _arg(output=_bf16(2, 4, 64)),
     r"output: expected at least num_actual_tokens=3 rows, got 2"),
    ("output_dtype", _arg(output=_bf16(3, 4, 64, dtype=torch.float32)),
     r"output: expected dtype torch.bfloat16 on cpu \(the query's\), got torch.float32"),
    ("query_dtype", _arg(query=_bf16(3, 4, 64, dtype=torch.float64)),
     r"query: expected one of torch.float16, torch.bfloat16, torch.float32, got torch.float64"),
    ("query_start_loc_end", _metadata(query_start_loc=_int32(0, 2)()),
     r"query_start_loc: expected 2 entries from 0 to num_actual_tokens=3, got \[0, 2\]"),
    ("query_start_loc_entries", _metadata(query_start_loc=_int32(0, 1, 3)()),
     r"query_start_loc: expected 2 entries"),
    ("seq_lens_short", _metadata(seq_lens=_int32(2)()),
     r"seq_lens: sequence 0 has 2 tokens but 3 query tokens"),
    ("block_table_page", _metadata(block_table=torch.tensor([[0, 9]])),
     r"block_table: sequence 0 uses pages \[0, 9\], the cache has 4 pages"),
    ("block_table_columns", _metadata(seq_lens=_int32(9)()),
     r"block_table: sequence 0 of 9 tokens needs 3 pages of 4 tokens, the table has 2 columns"),
    ("block_table_rows", _metadata(block_table=torch.tensor([0, 1])),
     r"block_table: expected shape \[1, max_blocks\], got \[2\]"),
    ("k_scale", _arg(layer=AttentionLayerScales(torch.zeros(1), torch.ones(1))),
     r"k_scale: a quantized KV cache needs finite scales > 0"),
]  # fmt: skip


def _forward_args(kind: str) -> tuple[dict[str, Any], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dtype, last_dim = FORMATS[kind]
    raw = torch.randint(0, 256, (4 * 2 * BLOCK_SIZE * NUM_KV_HEADS * last_dim * dtype.itemsize,),
                        dtype=torch.uint8, generator=gen)  # fmt: skip
    kv_cache = raw.view(dtype).view(4, 2, BLOCK_SIZE, NUM_KV_HEADS, last_dim)
    new = torch.randn(3, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    args = dict(
        layer=AttentionLayerScales(torch.ones(1), torch.ones(1)),
        query=torch.randn(3, NUM_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16),
        key=new,
        value=-new,
        kv_cache=kv_cache,
        attn_metadata=ReferenceAttentionMetadata.build([6], [3], torch.tensor([[0, 1]]), 4),
    )
    return args, raw


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("mutate,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_argument_raises_before_the_write(
    impl_cls: type[ReferenceAttentionImpl],
    kind: str,
    mutate: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    if message.startswith("k_scale") and kind == "auto":
        pytest.skip("an unquantized cache reads no scale values")
    impl = impl_cls(NUM_HEADS, HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=kind)
    args, raw = _forward_args(kind)
    before = raw.clone()
    impl.forward(**args)  # the unchanged arguments are good: they write
    assert not torch.equal(raw, before)
    args, raw = _forward_args(kind)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        impl.forward(**args)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_cpu_attn_bad_simd_raises_before_the_write(kind: str) -> None:
    impl = CPUAttentionImpl(NUM_HEADS, HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=kind)
    impl.simd = "sse9"
    args, raw = _forward_args(kind)
    before = raw.clone()
    with pytest.raises(ValueError, match=r"simd: expected 'auto' or one of .*, got 'sse9'"):
        impl.forward(**args)
    assert torch.equal(raw, before)


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: a CUDA cache on a machine without a GPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("where", ["cuda", "meta"])
def test_cpu_attn_cache_off_the_cpu_raises_before_the_write(kind: str, where: str) -> None:
    """CPU_ATTN's kernel runs on the CPU only: a CUDA cache was written through the CUDA op and
    only then rejected by paged_attention."""
    impl = CPUAttentionImpl(NUM_HEADS, HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=kind)
    args, raw = _forward_args(kind)
    args["output"] = torch.zeros(3, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    before = raw.clone()
    if where == "cuda":  # every tensor claims cuda:0: without the check, the write goes through
        args = {k: v.as_subclass(_ReportsCuda) if isinstance(v, torch.Tensor) else v
                for k, v in args.items()}  # fmt: skip
    else:
        args["kv_cache"] = args["kv_cache"].to("meta")
    device = "cuda:0" if where == "cuda" else "meta"
    with pytest.raises(ValueError, match=rf"kv_cache: expected a tensor on cpu, got {device}"):
        impl.forward(**args)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
def test_interleave4_geometry_raises_before_the_write(
    impl_cls: type[ReferenceAttentionImpl],
) -> None:
    """A named interleave4 layout that the pages cannot hold (head size 32: S = 2 scales)."""
    impl = impl_cls(NUM_HEADS, 32, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype="nvfp4",
                    k_scale_layout="interleave4")  # fmt: skip
    kv_cache = torch.zeros(4, 2, BLOCK_SIZE, NUM_KV_HEADS, 18, dtype=torch.uint8)
    new = torch.randn(3, NUM_KV_HEADS, 32).to(torch.bfloat16)
    metadata = ReferenceAttentionMetadata.build([6], [3], torch.tensor([[0, 1]]), 4)
    layer = AttentionLayerScales(torch.ones(1), torch.ones(1))
    query = torch.randn(3, NUM_HEADS, 32).to(torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match=r"interleave4 .*needs"):
        impl.forward(layer, query, new, new, kv_cache, metadata)
    assert not kv_cache.any()


def test_check_sequences_reads_only_the_pages_a_sequence_attends() -> None:
    """Out-of-range ids outside what a sequence reads (past its last page, before its sliding
    window, rows of sequences without queries) are not errors; inside, they are."""
    table = torch.tensor([[-1, 0, 1, 99], [2, 3, -5, -5], [99, 99, 99, 99]], dtype=torch.int32)
    # Sequence 0: 12 tokens, 1 query, window 4 -> keys 8..11, page 2 only (block 4).
    # Sequence 1: 8 tokens, 2 queries, no window in reach -> pages 0..1. Sequence 2: no queries.
    check_sequences([0, 1, 3, 3], [12, 8, 5], table, 4, 4, 4)
    with pytest.raises(ValueError, match=r"block_table: sequence 0 uses pages \[-1, 1\]"):
        check_sequences([0, 1, 3, 3], [12, 8, 5], table, 4, 4, None)
    with pytest.raises(ValueError, match=r"block_table: sequence 1 uses pages \[-5, 3\]"):
        check_sequences([0, 1, 3, 3], [12, 9, 5], table, 4, 4, 4)
    with pytest.raises(ValueError, match=r"seq_lens: sequence 2 has 5 tokens but 6 query tokens"):
        check_sequences([0, 1, 3, 9], [12, 8, 5], table, 4, 4, 4)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_cpu_attn_decode_dispatches_few_ops(kind: str) -> None:
    """Per-call cost of the checks (a small decode call is ~40 us): one view per cache side, one
    aminmax of the page ids read and its two host reads; no query of the SIMD levels, no scale
    layouts recomputed (issue 20 review: these once doubled the cost of forward)."""
    impl = CPUAttentionImpl(NUM_HEADS, HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=kind)
    args, _ = _forward_args(kind)
    args["output"] = torch.zeros(3, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    impl.forward(**args)  # the first call per block size works out the scale layouts
    with _CountOps() as counted:
        impl.forward(**args)
    assert counted.ops == Counter({
        "aten.unbind.int": 1,  # key_cache, value_cache
        "aten.aminmax.default": 1,  # page ids read
        "aten._local_scalar_dense.default": 2,
        "_C_cache_ops.reshape_and_cache_flash.default": 1,
        "aten._to_copy.default": 1,  # the int64 block table as int32
        "_C_cache_ops.paged_attention.default": 1,
    })  # fmt: skip
