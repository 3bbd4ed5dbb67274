"""A softmax ``scale`` that is not a finite number is refused when the impl is built, and index
tensors (token positions, block tables, sequence lengths, query offsets, request indices) of a
non-integer dtype are refused before anything is written, at every entry point of the write and
read paths. Before: a NaN / infinite scale gave all-NaN output (REFERENCE) or was refused only
after K/V were written (CPU_ATTN); ``positions + 0.7`` wrote the same bytes as ``positions`` and
a float block table ``[[1.9, 2.2]]`` read pages 1 and 2."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from vllm.kv_quant import KeyRope
from vllm.kv_quant.key_transform import KeyTransform
from vllm.v1.attention.backends import (
    AttentionLayerScales,
    CPUAttentionImpl,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    TritonAttentionImpl,
)
from vllm.v1.attention.backends.utils import (
    compute_compressed_slot_mapping,
    compute_slot_mapping,
    map_to_kernel_blocks,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

IMPLS = [ReferenceAttentionImpl, CPUAttentionImpl, TritonAttentionImpl]
HQ, H, D, BLOCK = 4, 2, 64, 4
ROPE = KeyRope.from_base(D, 64)
FLOAT_ERROR = "{}: expected an integer tensor, got torch.float32"


def _float_error(name: str) -> str:
    return re.escape(FLOAT_ERROR.format(name))


# --------------------------------------------------------------------------- softmax scale


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "scale", [math.nan, math.inf, -math.inf, "0.125", True, 10**400, torch.tensor([1.0, 2.0])]
)
def test_a_scale_that_is_not_a_finite_number_is_refused(
    impl_cls: type[ReferenceAttentionImpl], scale: object
) -> None:
    message = f"scale: expected None or a finite float (the softmax scale), got {scale!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        impl_cls(HQ, D, scale=scale, num_kv_heads=H)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
def test_finite_scales_are_kept_as_upstream_keeps_them(
    impl_cls: type[ReferenceAttentionImpl],
) -> None:
    """Upstream takes any finite scale (``float(scale)``): zero and negative ones included."""
    assert impl_cls(HQ, D, num_kv_heads=H).scale == 1 / math.sqrt(D)
    for scale in (0.125, 2, 0.0, -0.5, torch.tensor(0.25)):
        impl = impl_cls(HQ, D, scale=scale, num_kv_heads=H)  # type: ignore[arg-type]
        assert impl.scale == float(scale) and type(impl.scale) is float


# ------------------------------------------------------------------- write: token positions


def _write_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, H, D, generator=gen).to(torch.bfloat16)
    kv_cache = torch.zeros(4, 2, BLOCK, H, D, dtype=torch.uint8)
    return key, -key, kv_cache, torch.tensor([4, 5, 6])


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8+prerope", "fp8"])
def test_fractional_positions_are_refused_before_the_write(
    impl_cls: type[ReferenceAttentionImpl], kv_cache_dtype: str
) -> None:
    """Keys stored before RoPE are turned back by their positions: ``p + 0.7`` used to write
    the bytes of ``p``. An encoding that does not read them refuses them all the same."""
    rope = ROPE if "prerope" in kv_cache_dtype else None
    impl = impl_cls(HQ, D, num_kv_heads=H, kv_cache_dtype=kv_cache_dtype, key_rope=rope)
    layer = AttentionLayerScales(torch.ones(1), torch.ones(1))
    key, value, kv_cache, slots = _write_args()
    positions = torch.tensor([4, 5, 6])
    with pytest.raises(ValueError, match=_float_error("positions")):
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots, positions + 0.7)
    assert not kv_cache.any()
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots, positions.to(torch.int32))
    assert kv_cache.any()


def test_key_rope_and_key_transform_refuse_fractional_positions() -> None:
    key = torch.randn(3, H, D)
    positions = torch.tensor([0.0, 1.7, 2.2])
    for turn in (ROPE.rotate, ROPE.unrotate):
        with pytest.raises(ValueError, match=_float_error("positions")):
            turn(key, positions)
    prerope = KeyTransform(rope=ROPE)
    for transform in (prerope, KeyTransform()):
        with pytest.raises(ValueError, match=_float_error("positions")):
            transform.stored_key(key, positions)
    with pytest.raises(ValueError, match=_float_error("positions")):
        prerope.rebuild_key(key, positions)


# --------------------------------------------------------------------- read: the metadata


def _forward_args() -> tuple[dict[str, object], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(4, 2, BLOCK, H, D, generator=gen).to(torch.bfloat16)
    new = torch.randn(3, H, D, generator=gen).to(torch.bfloat16)
    args: dict[str, object] = dict(
        layer=AttentionLayerScales(torch.ones(1), torch.ones(1)),
        query=torch.randn(3, HQ, D, generator=gen).to(torch.bfloat16),
        key=new,
        value=-new,
        kv_cache=kv_cache,
        attn_metadata=ReferenceAttentionMetadata.build([6], [3], torch.tensor([[1, 2]]), BLOCK),
    )
    return args, kv_cache


FLOAT_METADATA = {
    "block_table": torch.tensor([[1.9, 2.2]]),
    "seq_lens": torch.tensor([6.0]),
    "query_start_loc": torch.tensor([0.0, 3.0]),
}


@pytest.mark.parametrize("impl_cls", IMPLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("field", list(FLOAT_METADATA))
def test_float_metadata_is_refused_before_the_write(
    impl_cls: type[ReferenceAttentionImpl], field: str
) -> None:
    impl = impl_cls(HQ, D, num_kv_heads=H)
    args, kv_cache = _forward_args()
    args["attn_metadata"] = replace(args["attn_metadata"], **{field: FLOAT_METADATA[field]})
    before = kv_cache.clone()
    with pytest.raises(ValueError, match=_float_error(field)):
        impl.forward(**args)  # type: ignore[arg-type]
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ([6], [3], torch.tensor([[1.9, 2.2]])), _float_error("block_table")),
        (lambda: (torch.tensor([6.0]), [3], torch.tensor([[1, 2]])), _float_error("seq_lens")),
        (lambda: ([6], torch.tensor([3.0]), torch.tensor([[1, 2]])), _float_error("query_lens")),
        (
            lambda: ([6.5], [3], torch.tensor([[1, 2]])),
            re.escape("seq_lens: expected ints, got [6.5]"),
        ),
        (
            lambda: ([6], [2.5], torch.tensor([[1, 2]])),
            re.escape("query_lens: expected ints, got [2.5]"),
        ),
        (
            lambda: ([True], [1], torch.tensor([[1, 2]])),
            re.escape("seq_lens: expected ints, got [True]"),
        ),
    ],
    ids=["block_table", "seq_lens", "query_lens", "seq_lens_list", "query_lens_list", "bools"],
)
def test_metadata_build_refuses_non_integer_input(
    build: Callable[[], tuple[object, object, torch.Tensor]], message: str
) -> None:
    seq_lens, query_lens, table = build()
    with pytest.raises(ValueError, match=message):
        ReferenceAttentionMetadata.build(seq_lens, query_lens, table, BLOCK)  # type: ignore[arg-type]


def test_slot_mapping_helpers_refuse_float_indices() -> None:
    table, positions, req = torch.tensor([[1, 2]]), torch.tensor([0, 5]), torch.tensor([0, 0])
    compressed = functools.partial(compute_compressed_slot_mapping, compress_ratio=2)
    for compute in (compute_slot_mapping, compressed):
        for args, name in (
            (dict(block_table=table.float(), positions=positions), "block_table"),
            (dict(block_table=table, positions=positions + 0.7), "positions"),
            (dict(block_table=table, positions=positions, req_indices=req.float()), "req_indices"),
        ):
            with pytest.raises(ValueError, match=_float_error(name)):
                compute(block_size=BLOCK, **args)
    with pytest.raises(ValueError, match=_float_error("block_table")):
        map_to_kernel_blocks(table.float(), 2)
