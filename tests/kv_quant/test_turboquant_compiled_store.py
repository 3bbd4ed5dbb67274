"""The extension's TurboQuant store (``vllm._packed_cache_ops.turboquant_store``, the compiled op
``_C_cache_ops::turboquant_store``) byte for byte against the reference codec, on the CPU (and
on a GPU when there is one): every preset, head dims 64 / 96 / 128, fp16 / bf16 / fp32 sources
and mixed key / value dtypes, zero keys, constant values, fp16 extremes, FP8 saturation and NaN,
Lloyd-Max codes on their decision boundaries, skipped slots, padding bytes, a cache whose blocks
are not adjacent, rows with odd strides, and the errors on bad input (nothing written)."""

from __future__ import annotations

import pytest
import torch

from vllm._extension import compiled_kernel
from vllm._packed_cache_ops import turboquant_store
from vllm.kv_quant.turboquant import TQ_PRESETS, TurboQuantConfig, turboquant_write_cache

from .test_turboquant_store import DEVICE, _case, _store, bad_store_calls

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def test_the_op_has_a_kernel_here() -> None:
    assert compiled_kernel("turboquant_store", torch.device(DEVICE)) is not None


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_equals_codec(preset: str, d: int, dtype: torch.dtype) -> None:
    cfg, (key, value, pit, midpoints) = _case(preset, d, dtype, seed=d + DTYPES.index(dtype))
    # Blocks 0 and 2 of a 3-block buffer: a cache whose blocks are not adjacent.
    storage = torch.full((3, 4, 2, cfg.slot_size_aligned + 1), 0x5A, dtype=torch.uint8)
    cache = storage.to(DEVICE)[::2]
    want = cache.clone()
    slots = torch.tensor([7, -1, 0, 2], dtype=torch.int32, device=DEVICE)
    _store(cfg, key, value, cache, slots, pit, midpoints, store=turboquant_store)
    turboquant_write_cache(key, value, want, slots, cfg, pit, midpoints)
    assert torch.equal(cache.cpu(), want.cpu())
    assert bool((cache[..., cfg.slot_size :] == 0x5A).all())  # padding untouched
    assert bool((cache[0, 1] == 0x5A).all())  # a slot no token names


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_k3v4_nc"])
@pytest.mark.parametrize("d", [40, 72, 256])
def test_row_writer_edges(preset: str, d: int) -> None:
    """The CPU writer codes rows in vector lanes and hands some rows to the per-value writer:
    head sizes that are no multiple of the lanes (40, 72), value rows whose extreme is a signed
    zero with the other zero later (the first one's sign is stored), a NaN value first or later
    (the codec assumes finite values: those slots are only written, not compared), a huge value."""
    cfg, (key, value, pit, midpoints) = _case(preset, d, torch.float32, seed=d, heads=4)
    for head, (first, second) in enumerate([(0.0, -0.0), (-0.0, 0.0)]):
        value[0, head] = torch.rand(d) + 0.5  # all positive: the minimum is a zero
        value[0, head, 3], value[0, head, d - 2] = first, second
        value[1, head] = -torch.rand(d) - 0.5  # all negative: the maximum is a zero
        value[1, head, 5], value[1, head, d - 1] = first, second
    value[0, 2, 0] = 0.0  # a zero extreme in the first position
    value[2, 0, 0] = float("nan")
    value[2, 1, d // 2] = float("nan")
    value[2, 2, 7] = 3e38
    cache = torch.zeros(2, 4, 4, cfg.slot_size_aligned, dtype=torch.uint8, device=DEVICE)
    want = cache.clone()
    slots = torch.tensor([0, 5, 2, 7], device=DEVICE)
    _store(cfg, key, value, cache, slots, pit, midpoints, store=turboquant_store)
    turboquant_write_cache(key, value, want, slots, cfg, pit, midpoints)
    finite = torch.isfinite(value).all(-1).cpu()
    assert int((~finite).sum()) == 2
    block, offset = slots.cpu() // 4, slots.cpu() % 4
    assert torch.equal(cache.cpu()[block, offset][finite], want.cpu()[block, offset][finite])


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
def test_mixed_dtypes_and_strided_rows(preset: str) -> None:
    """A bf16 key with an fp32 value; heads spaced apart and rows read through a transpose."""
    cfg, (key, value, pit, midpoints) = _case(preset, 64, torch.bfloat16, seed=5, heads=3)
    value = value.float()
    wide = torch.zeros(4, 3, 80, dtype=key.dtype, device=DEVICE)
    wide[..., :64] = key
    key = wide[..., :64]  # heads 80 elements apart
    value = value.transpose(1, 2).contiguous().transpose(1, 2)  # rows not contiguous
    cache = torch.zeros(2, 4, 3, cfg.slot_size_aligned, dtype=torch.uint8, device=DEVICE)
    want = cache.clone()
    slots = torch.tensor([1, 6, 3, 4], device=DEVICE)
    _store(cfg, key, value, cache, slots, pit, midpoints, store=turboquant_store)
    turboquant_write_cache(key, value, want, slots, cfg, pit, midpoints)
    assert torch.equal(cache.cpu(), want.cpu())


def test_fp8_key_edges() -> None:
    """Saturation past 448, NaN of either sign (0x7F), ties and e4m3 subnormals."""
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 64)
    specials = [1e6, -1e6, 449.0, -464.0, float("nan"), -float("nan"), float("inf"), 2**-10]
    specials += [2**-9 * 1.5, 1.0625, 1.1875, -0.0, 3 * 2**-10, 240.0, 248.0, 232.0]
    key = torch.randn(2, 1, 64)
    key[0, 0, : len(specials)] = torch.tensor(specials)
    value = torch.randn(2, 1, 64)
    cache = torch.zeros(1, 2, 1, cfg.slot_size_aligned, dtype=torch.uint8)
    want = cache.clone()
    slots = torch.tensor([0, 1])
    empty = torch.empty(0)
    _store(cfg, key, value, cache, slots, empty, empty, store=turboquant_store)
    turboquant_write_cache(key, value, want, slots, cfg)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_codes_on_their_boundaries(bits: int) -> None:
    """The raw op codes y as the number of midpoints <= y: a y equal to a midpoint takes the
    upper code, NaN codes 0, ±Inf the extremes; codes pack as a little-endian bit stream."""
    d = 64
    midpoints = torch.sort(torch.randn(2**bits - 1)).values
    y = torch.randn(1, 1, d) * 0.3
    y[0, 0, : midpoints.numel()] = midpoints
    y[0, 0, -3:] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    norms = torch.tensor([[3.25]])
    value = torch.zeros(1, 1, d)
    cache = torch.zeros(1, 1, 1, d * bits // 8 + 2 + d // 2 + 4, dtype=torch.uint8)
    op = torch.ops._C_cache_ops.turboquant_store
    op(y, value, cache, torch.tensor([0]), norms, midpoints, bits, 4)
    codes = torch.searchsorted(midpoints, y[0, 0], right=True)
    codes[torch.isnan(y[0, 0])] = 0
    stream = sum(int(c) << (bits * i) for i, c in enumerate(codes.tolist()))
    key_bytes = list(stream.to_bytes(d * bits // 8, "little")) + [0x80, 0x42]  # fp16(3.25)
    assert cache[0, 0, 0, : len(key_bytes)].tolist() == key_bytes


def test_bad_input_writes_nothing() -> None:
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k3v4_nc", 64)
    cache = torch.zeros(2, 4, 2, cfg.slot_size_aligned, dtype=torch.uint8, device=DEVICE)
    for positional, keywords, message in bad_store_calls(cache):
        with pytest.raises(ValueError, match=message):
            turboquant_store(*positional, **keywords)
    assert not cache.any()


def test_raw_op_names_the_bad_argument() -> None:
    """The op's own checks, for callers that skip the Python wrapper."""
    op = torch.ops._C_cache_ops.turboquant_store
    y, value = torch.zeros(2, 1, 64), torch.zeros(2, 1, 64)
    cache = torch.zeros(1, 4, 1, 128, dtype=torch.uint8)
    slots, norms, mids = torch.tensor([0, 1]), torch.ones(2, 1), torch.zeros(7)
    cases = [
        ((y.half(), value, cache, slots, norms, mids, 3, 4), "key: expected dtype float32"),
        ((y, value, cache, slots, norms[:1], mids, 3, 4), "key_norms: expected a contiguous"),
        ((y, value, cache, slots, norms, None, 3, 4), "midpoints: expected a float32 tensor"),
        ((y, value, cache, slots, norms, mids, 5, 4), "key_bits: expected 3, 4 or 8"),
        ((y, value, cache, slots, None, None, 8, 2), "value_bits: expected 3 or 4"),
        ((y.half(), value, cache, slots, None, None, 8, 4), "key: expected dtype float32 .value"),
        ((y, value, cache[..., :40], slots, norms, mids, 3, 4), "kv_cache: expected a"),
        ((y, value, cache, slots.int(), norms, mids, 3, 4), "slot_mapping: expected a contiguous"),
        (
            (y, value, cache, torch.tensor([0, 4]), norms, mids, 3, 4),
            "expected slots < num_blocks \\* block_size = 4",
        ),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(*args)
    assert not cache.any()


def test_fake_kernel_traces() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, (key, value, pit, midpoints) = _case("turboquant_4bit_nc", 64, torch.float32, seed=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cache = torch.zeros(2, 4, 2, cfg.slot_size_aligned, dtype=torch.uint8)
        y, norms = torch.zeros(4, 2, 64), torch.zeros(8)
        slots = torch.arange(4)
        torch.ops._C_cache_ops.turboquant_store(y, value, cache, slots, norms, midpoints, 4, 4)
        with pytest.raises(ValueError, match="kv_cache: expected"):
            torch.ops._C_cache_ops.turboquant_store(
                y, value, cache[:, :, :1], slots, norms, midpoints, 4, 4
            )
