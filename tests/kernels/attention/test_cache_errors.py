"""reshape_and_cache_flash on bad input: a clear error naming the argument and nothing written
(bad dtypes, shapes, layouts, slots and scale values, mixed and meta devices, cache sides
that share bytes). Helpers: cache_utils.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops

from .cache_utils import (
    HAS_CUDA,
    Case,
    assert_bytes_equal,
    check_against_reference,
    make_case,
    make_slots,
)


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
     r"key_cache: expected dtype float32 for kv_cache_dtype 'float32', got float16", False),
    ("auto_cache_float64", "auto", _set(key_cache=lambda c: c.key_cache.double()),
     r"key_cache: expected dtype float32, float16 or bfloat16 for kv_cache_dtype 'auto', "
     r"got float64", False),
    ("auto_value_cache_dtype", "auto", _set(key_cache=lambda c: c.key_cache.float()),
     r"value_cache: expected dtype float32 \(key_cache's dtype\), got bfloat16", False),
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
