"""The Octave writers byte for byte against the reference codec
(:func:`vllm.kv_quant.octave_codec.octave_cache_store`): the extension's ``_C::octave_cache_store``
(upstream's op and schema; CPU, and CUDA when there is a GPU) and the Triton store (on a GPU, or
under the interpreter). Every format at head dims 64 to 512 (192: padded sums, V rotated in 64-dim
blocks), rotary dims 0 / 64 / 128 / all, fp32 / fp16 / bf16 rows, edge values (zero rows, values
far below the rms floor, an outlier channel, a scale past fp16, Inf, NaN), skipped slots,
strided rows and caches, and the errors on bad input (nothing written)."""

from __future__ import annotations

import pytest
import torch

from vllm._extension import compiled_kernel
from vllm._packed_cache_ops import compiled_packed_store
from vllm.kv_quant.formats import lookup
from vllm.kv_quant.octave import OctaveFormat
from vllm.kv_quant.octave_codec import octave_cache_store, sign_bits
from vllm.kv_quant.slot_codecs import compiled_store_op, slot_codec
from vllm.triton_utils import HAS_TRITON

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GEOMETRIES = [
    ("octave_k3v4", 256, 64),
    ("octave_k3v3", 256, 64),
    ("octave_k3v3_compact", 256, 0),
    ("octave_k3v4", 128, 128),
    ("octave_k3v3", 192, 64),
    ("octave_k3v4", 192, 0),
    ("octave_k3v3_compact", 64, 0),
    ("octave_k3v4", 512, 128),
]


def _inputs(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(t, h, d, generator=gen) * 2
    value = torch.randn(t, h, d, generator=gen)
    key[..., 3] *= 50  # an outlier channel, spread by the rotation
    key[0] = 0.0  # scale 0
    value[1, 0] = 1e-30 if dtype == torch.float32 else 1e-7  # rms at or near its floor
    value[2, -1] = 6e4  # the scale overflows fp16
    key[3, 0, 5] = float("inf")
    value[4, -1, 7] = float("nan")
    key[5, 0] = -key[5, 0].abs()  # a negative row
    return key.to(dtype), value.to(dtype)


def _op(key, value, cache, slots, fmt: OctaveFormat) -> None:
    s = sign_bits(fmt.head_size).to(cache.device)
    torch.ops._C.octave_cache_store(key, value, cache, slots, s, s, fmt.kernel_code)


def _triton(key, value, cache, slots, fmt: OctaveFormat) -> None:
    from vllm.v1.attention.ops.triton_octave_store import triton_octave_store

    triton_octave_store(key, value, cache, slots, fmt)


def _check_writer(write, device: str, name: str, d: int, rope: int, dtype, tokens: int) -> None:
    fmt = OctaveFormat.from_cache_dtype(name, d, rope)
    key, value = _inputs(tokens, 3, d, dtype, seed=d + rope + DTYPES.index(dtype))
    # Blocks 0, 2, 4 of a buffer: blocks not adjacent; random bytes where nothing is written.
    storage = torch.randint(0, 256, (9, 3, 8, fmt.slot_bytes), dtype=torch.uint8)
    got = storage.to(device)[::2]
    want = got.clone()
    slots = torch.randperm(5 * 8)[:tokens]
    slots[1::7] = -1
    octave_cache_store(key.float(), value.float(), want, slots.to(device), fmt)
    write(key.to(device), value.to(device), got, slots.to(device), fmt)
    assert torch.equal(got.cpu(), want.cpu())


def test_the_op_is_upstreams_and_has_a_kernel_here() -> None:
    assert compiled_store_op(lookup("octave_k3v3")) == "_C::octave_cache_store"
    for device in DEVICES:
        assert compiled_kernel("_C::octave_cache_store", torch.device(device)) is not None
    schema = str(torch.ops._C.octave_cache_store.default._schema)
    assert "int fmt" in schema and "Tensor k_signs" in schema and "Tensor v_signs" in schema


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,d,rope", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_store_equals_codec(device: str, name: str, d: int, rope: int, dtype) -> None:
    _check_writer(_op, device, name, d, rope, dtype, tokens=30)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")
@pytest.mark.parametrize("name,d,rope", GEOMETRIES[:6])
def test_triton_store_equals_codec(name: str, d: int, rope: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_writer(_triton, device, name, d, rope, torch.bfloat16, tokens=12)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_the_backends_cache_layout(device: str) -> None:
    """Heads spaced apart in the key, a transposed value, and the backends' (B, N, H, slot)
    storage passed through compiled_packed_store (which views it as the op's layout)."""
    fmt = OctaveFormat.from_cache_dtype("octave_k3v4", 128, 64)
    key, value = _inputs(6, 2, 128, torch.float16, seed=3)
    wide = torch.zeros(6, 2, 160, dtype=key.dtype)
    wide[..., :128] = key
    key = wide[..., :128].to(device)
    value = value.transpose(0, 1).contiguous().transpose(0, 1).to(device)
    store = compiled_packed_store(lookup("octave_k3v4"), 128, torch.device(device))
    assert store is not None
    got = torch.zeros(2, 4, 2, fmt.slot_bytes, dtype=torch.uint8, device=device)  # (B, N, H, slot)
    slots = torch.tensor([7, 0, -1, 3, 4, 1], device=device)
    store(key, value, got, slots)
    want = torch.zeros(2, 2, 4, fmt.slot_bytes, dtype=torch.uint8)
    octave_cache_store(key.float().cpu(), value.float().cpu(), want, slots.cpu(), fmt)
    assert torch.equal(got.transpose(1, 2).cpu(), want)
    codec = slot_codec(lookup("octave_k3v4"), 128, 64)
    assert torch.equal(got.view(-1, 2, fmt.slot_bytes)[7].cpu(), codec.encode(key, value)[0].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_store_skips_padding_slots(device: str) -> None:
    """upstream's test_store_skips_padding_slots on the op: slot -1 leaves every byte."""
    fmt = OctaveFormat.from_cache_dtype("octave_k3v3_compact", 256, 0)
    key, value = (t.to(device) for t in _inputs(8, 2, 256, torch.bfloat16, seed=0))
    cache = torch.randint(0, 256, (2, 2, 16, fmt.slot_bytes), dtype=torch.uint8, device=device)
    before = cache.clone()
    slots = torch.full((8,), -1, dtype=torch.long, device=device)
    slots[3] = 21
    _op(key, value, cache, slots, fmt)
    written = torch.zeros_like(cache, dtype=torch.bool)
    written[1, :, 5] = True
    assert torch.equal(cache[~written], before[~written])
    assert not torch.equal(cache[written], before[written])


def _bad_calls(fmt: OctaveFormat):
    d = fmt.head_size
    key = torch.randn(2, 1, d, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 16, fmt.slot_bytes, dtype=torch.uint8)
    slots = torch.tensor([0, 1])
    s = sign_bits(d)
    code = fmt.kernel_code
    yield (key, key, cache, slots, s, s, 5), "fmt: expected 3 or 4"
    yield (key, key, cache[..., :-4], slots, s, s, code), "cache: expected slots of"
    yield (key, key, cache.float(), slots, s, s, code), "cache: expected a uint8"
    yield (
        (key, key.half(), cache, slots, s, s, code),
        r"key: expected dtype float16 \(value.s\), got bfloat16",
    )
    yield (key[..., :32], key[..., :32], cache, slots, s, s, code), "value: expected a head dim"
    yield (key, key, cache, slots.int(), s, s, code), "slot_mapping: expected a contiguous int64"
    yield (key, key, cache, torch.tensor([0, 16]), s, s, code), "slot_mapping: expected slots < "
    yield (key, key, cache, slots, s[:1], s, code), "k_signs: expected a contiguous int32"
    yield (key, key, cache, slots, s, s.long(), code), "v_signs: expected a contiguous int32"


@pytest.mark.parametrize("name", ["octave_k3v4", "octave_k3v3_compact"])
def test_bad_input_is_refused_before_writing(name: str) -> None:
    fmt = OctaveFormat.from_cache_dtype(name, 128, 0 if name.endswith("compact") else 64)
    for args, message in _bad_calls(fmt):
        cache = args[2]
        with pytest.raises(RuntimeError, match=message):
            torch.ops._C.octave_cache_store(*args)
        assert not cache.any()


def test_the_fake_kernel_traces() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fmt = OctaveFormat.from_cache_dtype("octave_k3v3", 128, 64)
    with FakeTensorMode():
        key = torch.empty(4, 2, 128, dtype=torch.bfloat16)
        cache = torch.empty(3, 2, 16, fmt.slot_bytes, dtype=torch.uint8)
        s = torch.empty(4, dtype=torch.int32)
        slots = torch.empty(4, dtype=torch.int64)
        torch.ops._C.octave_cache_store(key, key, cache, slots, s, s, fmt.kernel_code)
        with pytest.raises(ValueError, match=r"k_signs: expected int32 \[4\]"):
            torch.ops._C.octave_cache_store(key, key, cache, slots, s[:2], s, fmt.kernel_code)
