"""Helpers of the ``reshape_and_cache_flash`` tests (test_cache.py: results, test_cache_errors.py:
bad input): a :class:`Case` of the op's arguments over caches of random bytes, and the
byte-for-byte comparison with the reference writer of :mod:`vllm.kv_quant`."""

from __future__ import annotations

import dataclasses

import torch
from kv_cache_test_utils import SCALED_DTYPES

from vllm import _custom_ops as ops
from vllm.kv_quant import (
    fp8_format_from_cache_dtype,
    fp8_write_cache,
    nvfp4_write_cache,
    per_token_head_write_cache,
)
from vllm.kv_quant.formats import CacheKind, lookup
from vllm.kv_quant.int4_per_token_head import int4_per_token_head_write_cache

HAS_CUDA = torch.cuda.is_available()
# One launch of a Triton kernel as a spy records it: (grid, arguments, keyword arguments).
Launch = tuple[tuple[int, ...], tuple, dict]
SOURCE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXPLICIT_UNQUANTIZED = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
QUANTIZED = SCALED_DTYPES
# (kv_cache_dtype, source dtype) pairs of the same-dtype tests: an explicit unquantized string
# with its own dtype (other source dtypes are cast: test_cache_cast.py).
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
    return lookup(kind).last_dim(head_size)


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
    cache_dtype = lookup(kind).resolve_storage_dtype(dtype)
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
    if lookup(kind).is_nvfp4:  # amax / (448 * 6) is typical; larger values saturate block scales
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
    cache_dtype: torch.dtype | None = None,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    head_size_v = head_size if head_size_v is None else head_size_v
    t_pad = num_tokens + padding
    key = make_source(t_pad, num_heads, head_size, dtype, row_padding, device, gen)
    value = make_source(t_pad, num_heads, head_size_v, dtype, row_padding, device, gen)
    # The caches' element dtype: an auto cache's from cache_dtype when given (the op casts).
    key_cache, value_cache, buffers = make_caches(
        kind, cache_dtype or dtype, num_blocks, block_size, num_heads, head_size, head_size_v, hnd,
        device, gen,
    )  # fmt: skip
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
    if lookup(kind).is_nvfp4:
        nvfp4_write_cache(x, side, slots, scale, layout, scale_search=lookup(kind).scale_search)
    elif lookup(kind).cache_kind is CacheKind.INT4_PER_TOKEN_HEAD:
        int4_per_token_head_write_cache(x, side, slots)
    elif lookup(kind).is_per_token_head:
        per_token_head_write_cache(x, side, slots, kind)
    elif kind.startswith("fp8"):
        fp8_write_cache(x, side, slots, scale, fp8_format_from_cache_dtype(kind))
    else:  # unquantized: torch's cast to the cache dtype (round to nearest even)
        keep = slots >= 0
        kept = slots[keep]
        block_size = side.shape[1]
        side[kept // block_size, kept % block_size] = x[: slots.shape[0]][keep].to(side.dtype)


def _rebased(view: torch.Tensor, old: list[torch.Tensor], new: list[torch.Tensor]) -> torch.Tensor:
    """`view` re-expressed over the clone in `new` of the buffer in `old` that it lives in."""
    size = view.element_size()
    for o, n in zip(old, new, strict=True):
        if view.untyped_storage().data_ptr() == o.untyped_storage().data_ptr():
            # The view's place in bytes from the buffer's start, which may lie inside its storage.
            start = view.storage_offset() * size - o.storage_offset() * o.element_size()
            start += n.storage_offset() * n.element_size()
            assert start % size == 0, "the view's place is not a whole number of its elements"
            offset = start // size
            return torch.as_strided(n.view(view.dtype), view.shape, view.stride(), offset)
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
