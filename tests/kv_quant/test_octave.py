"""The three Octave KV caches: slot geometry and page math, the codec's bytes against upstream
v0.33.0's own pure-torch reference (run from its sdist) on random and edge inputs, the store's
padding rule, the paged reference attention, the registry entries and the refusals."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.config.cache import CacheConfig
from vllm.kv_quant.formats import KVQuantMode, kernel_cache_kind, lookup
from vllm.kv_quant.octave import OctaveFormat, register_rope_dim, registered_rope_dim
from vllm.kv_quant.octave_codec import (
    fwht_blocks,
    octave_cache_store,
    octave_decode,
    octave_encode,
    rotate,
    sign_bits,
    signs,
    unrotate,
)
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.ops import rocm_octave as sq
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode, is_quantized_kv_cache

from .test_turboquant import load_upstream_module

NAMES = ["octave_k3v4", "octave_k3v3", "octave_k3v3_compact"]
GEOMETRIES = [(256, 64), (128, 64), (192, 64), (256, 128), (512, 64), (64, 0)]


def _cases() -> list[tuple[str, int, int]]:
    return [
        (name, d, r)
        for name in NAMES
        for d, r in GEOMETRIES
        if not (name.endswith("compact") and d & (d - 1))
    ]


def _inputs(t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(t, h, d, generator=gen)
    key[..., 5] *= 30  # an outlier channel
    value = torch.randn(t, h, d, generator=gen)
    key[0], value[1] = 0.0, 0.0  # all-zero rows: scale 0
    key[2, 0] = 1e-20  # far below the rms floor's reach
    value[3, -1] = 65504.0  # scale overflows fp16 to inf
    return key, value


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory):
    return load_upstream_module(
        "vllm/v1/attention/ops/rocm_octave.py", tmp_path_factory.mktemp("octave")
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaNs included."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name,d,r", _cases())
def test_codec_is_upstreams_reference(upstream, name: str, d: int, r: int) -> None:
    """Upstream's reference leaves its two sums' order to torch (per CPU and device), ours is
    fixed, so a sum can differ by an ulp: then a fp16 scale by one ulp, or rarely a code (and
    with it the scale; measured: a few slots in 10^4). All other slots are byte for byte
    upstream's; the decoded caches agree ten times closer than upstream's own kernel-vs-reference
    bound."""
    fmt = OctaveFormat.from_cache_dtype(name, d, r)
    ufmt = upstream.OctaveFormat.from_cache_dtype(name, d, r)
    key, value = _inputs(2000, 4, d, seed=7 * d + r)
    ours = octave_encode(key, value, fmt)
    theirs = upstream.reference_quantize(key, value, ufmt)
    assert (ours != theirs).any(-1).float().mean().item() <= 0.002
    scales = slice(fmt.off_scales, fmt.off_scales + 2 * fmt.num_scales)
    same_codes = (ours[..., : fmt.off_scales] == theirs[..., : fmt.off_scales]).all(-1)
    a = ours[..., scales].contiguous().view(torch.int16).int()
    b = theirs[..., scales].contiguous().view(torch.int16).int()
    assert int((a - b).abs()[same_codes].max()) <= 1
    for x, y in zip(octave_decode(ours, fmt), octave_decode(theirs, fmt), strict=True):
        finite = x.isfinite().all(-1) & y.isfinite().all(-1)
        assert ((x - y)[finite].norm() / y[finite].norm()).item() < 1e-3


@pytest.mark.parametrize("name,d,r", _cases())
def test_decode_is_upstreams_reference_bit_for_bit(upstream, name: str, d: int, r: int) -> None:
    fmt = OctaveFormat.from_cache_dtype(name, d, r)
    ufmt = upstream.OctaveFormat.from_cache_dtype(name, d, r)
    assert fmt.slot_bytes == ufmt.slot_bytes and fmt.kernel_code == ufmt.kernel_code
    key, value = _inputs(37, 3, d, seed=d + r)
    slots = octave_encode(key, value, fmt)
    for rotated in (False, True):
        ours = octave_decode(slots, fmt, rotated=rotated)
        theirs = upstream.reference_dequantize(slots, ufmt, rotated=rotated)
        assert _same(ours[0], theirs[0]) and _same(ours[1], theirs[1])


def test_signs_and_rotation_are_upstreams(upstream) -> None:
    assert torch.equal(sign_bits(256), upstream.sign_bits(256))
    assert torch.equal(signs(96), upstream.signs(96, "cpu"))
    x = torch.randn(4, 256)
    for block in (64, 256):
        assert torch.equal(fwht_blocks(x, block), upstream.fwht_blocks(x, block))
        assert torch.allclose(unrotate(rotate(x, signs(256), block), signs(256), block), x,
                              atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "name,slot_bytes", [("octave_k3v4", 248), ("octave_k3v3", 216), ("octave_k3v3_compact", 196)]
)
def test_slot_bytes_and_page_math(name: str, slot_bytes: int) -> None:
    """upstream's test_slot_bytes_match_kernel_layout, and the spec's page: one slot per
    (token, KV head), as upstream's once its backend sets state_content_bytes."""
    assert sq.OctaveFormat.from_cache_dtype(name, 256, 64).slot_bytes == slot_bytes
    register_rope_dim(256, 64)
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=256,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode(name),
    )
    assert spec.kv_cache_format is lookup(name)
    assert spec.page_size_bytes == 16 * 2 * slot_bytes
    packed = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=256,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode(name),
        state_content_bytes=slot_bytes,
    )
    assert packed.page_size_bytes == spec.page_size_bytes


def test_worked_layout_example() -> None:
    """One k3v3 slot at D = 64, R = 64 (docs' example): 32 bytes of 4-bit K codes, no 3-bit K
    codes, 24 bytes of 3-bit V codes (16 of the 2-bit plane, 8 of the 1-bit plane), the K and V
    fp16 scales, padding to 64. Rotated V is +1 on dims 0..31 and -1 on 32..63: rms 1, so
    ``x / rms * 59 = ±59`` takes codes 5 (+45) and 2 (-45); K is zero: code 7, scale 0."""
    fmt = OctaveFormat.from_cache_dtype("octave_k3v3", 64, 64)
    assert (fmt.off_k_nope, fmt.off_v, fmt.off_scales, fmt.slot_bytes) == (32, 32, 56, 64)
    rotated_v = torch.cat([torch.ones(32), -torch.ones(32)])
    value = unrotate(rotated_v, signs(64), 64).view(1, 1, 64)
    slot = octave_encode(torch.zeros(1, 1, 64), value, fmt)[0, 0].tolist()
    assert slot[:32] == [0x77] * 32  # two 4-bit codes 7 per byte
    assert slot[32:40] == [0x55] * 8  # dims 0..31: low bits 01 at bits 0, 2, 4, 6
    assert slot[40:48] == [0xAA] * 8  # dims 32..63: low bits 10
    assert slot[48:56] == [0xFF] * 4 + [0x00] * 4  # high bits: 1 for code 5, 0 for code 2
    v_scale = torch.tensor([64 / (64 * 45) * 64]).half().view(torch.uint8).tolist()
    assert slot[56:60] == [0, 0, *v_scale] and slot[60:] == [0] * 4
    k, v = octave_decode(torch.tensor(slot, dtype=torch.uint8).view(1, 1, 64), fmt, rotated=True)
    assert k.abs().max() == 0 and torch.allclose(v.view(-1), rotated_v, rtol=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_store_skips_padding_slots(name: str) -> None:
    """upstream's test_store_skips_padding_slots, on the CPU store."""
    fmt = OctaveFormat.from_cache_dtype(name, 256, 64)
    key, value = _inputs(8, 2, 256, seed=0)
    cache = torch.randint(0, 256, (2, 2, 16, fmt.slot_bytes), dtype=torch.uint8)
    before = cache.clone()
    slots = torch.full((8,), -1, dtype=torch.long)
    slots[3] = 21
    octave_cache_store(key, value, cache, slots, fmt)
    written = torch.zeros_like(cache, dtype=torch.bool)
    written[1, :, 5] = True
    assert torch.equal(cache[~written], before[~written])
    assert torch.equal(cache[1, :, 5], octave_encode(key[3:4], value[3:4], fmt)[0])


def test_reference_attention_matches_dense_attention() -> None:
    torch.manual_seed(3)
    fmt = sq.OctaveFormat.from_cache_dtype("octave_k3v4", 128, 64)
    kv_heads, group, block = 2, 3, 16
    lens = [5, 40]
    cache = torch.zeros(8, kv_heads, block, fmt.slot_bytes, dtype=torch.uint8)
    table = torch.tensor([[6, 0, 0], [1, 4, 2]], dtype=torch.int32)
    keys, values = [], []
    for req, n in enumerate(lens):
        key, value = torch.randn(n, kv_heads, 128), torch.randn(n, kv_heads, 128)
        pos = torch.arange(n)
        slots = (table[req, pos // block] * block + pos % block).long()
        octave_cache_store(key, value, cache, slots, fmt)
        keys.append(key)
        values.append(value)
    query = torch.randn(3, kv_heads * group, 128)
    q_to_req, q_to_klen = torch.tensor([0, 1, 1]), torch.tensor([5, 33, 0])
    out = sq.reference_attention(query, cache, table, q_to_req, q_to_klen, fmt, 1 / 16)
    for i in range(2):
        n, req = int(q_to_klen[i]), int(q_to_req[i])
        slots = octave_encode(keys[req][:n], values[req][:n], fmt)
        k, v = octave_decode(slots, fmt)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[i], k) / 16, -1)
        assert torch.allclose(out[i], torch.einsum("ht,thd->hd", probs, v), atol=1e-5)
    assert out[2].abs().max() == 0  # a query with no tokens
    # 3-bit NoPE / 4-bit V codes on Gaussian data: ~20% and ~10% of the norm as error
    k, v = octave_decode(octave_encode(keys[1], values[1], fmt), fmt)
    assert (k - keys[1]).norm() / keys[1].norm() < 0.2
    assert (v - values[1]).norm() / values[1].norm() < 0.12


def test_upstream_quant_mode_cases() -> None:
    """upstream test_per_token_kv_cache.py's test_octave (module-skipped there without CUDA)."""
    for name in NAMES:
        mode = get_kv_quant_mode(name)
        assert mode.name.lower() == name and mode.is_octave and not mode.is_per_token_head
        assert is_quantized_kv_cache(name)
        assert kv_cache_dtype_str_to_dtype(name, None) == torch.uint8
        assert CacheConfig(cache_dtype=name).cache_dtype == name
        fmt = lookup(name)
        assert fmt.quant_mode is KVQuantMode[name.upper()] and fmt.cache_kind is None
        with pytest.raises(ValueError, match=f"format '{name}' has no kernel support"):
            kernel_cache_kind(name)


def test_rope_dims_and_registry_rows() -> None:
    register_rope_dim(128, 64)
    register_rope_dim(128, 64)  # the same again is fine
    with pytest.raises(ValueError, match="rope_dim: head size 128 already has 64 rotary dims"):
        register_rope_dim(128, 0)
    assert lookup("octave_k3v4").last_dim(128) == 64  # half of the 128-byte slot
    assert (
        lookup("octave_k3v3_compact").last_dim(1024) == 772 // 2
    )  # compact: 384 + 384 + 4; no rope
    with pytest.raises(ValueError, match="none registered for head size 320"):
        lookup("octave_k3v3").last_dim(320)
    with pytest.raises(ValueError, match="none registered for head size 320"):
        registered_rope_dim(320)
    hf = SimpleNamespace(rope_parameters={"partial_rotary_factor": 0.25})
    assert sq.rope_dim_from_hf_config(hf, 256) == 64
    assert sq.rope_dim_from_hf_config(SimpleNamespace(partial_rotary_factor=0.5), 128) == 64
    assert sq.rope_dim_from_hf_config(SimpleNamespace(), 128) == 128


def test_bad_input_is_refused_before_writing() -> None:
    with pytest.raises(ValueError, match="v_bits: expected 3 or 4, got 2"):
        OctaveFormat(256, 64, 2)
    with pytest.raises(ValueError, match="head_size: Octave needs head_size and rope_dim"):
        OctaveFormat(256, 32, 3)
    with pytest.raises(ValueError, match="head_size: compact Octave K needs a power of two"):
        OctaveFormat.from_cache_dtype("octave_k3v3_compact", 192, 64)
    with pytest.raises(ValueError, match="cache_dtype: expected one of octave_k3v4"):
        OctaveFormat.from_cache_dtype("turboquant_k8v4", 256, 64)
    fmt = OctaveFormat.from_cache_dtype("octave_k3v3", 128, 64)
    key = torch.zeros(2, 1, 128)
    cache = torch.zeros(1, 1, 16, fmt.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"key: expected shape \[T, H, 128\], got \[2, 1, 64\]"):
        octave_cache_store(key[..., :64], key, cache, torch.tensor([0, 1]), fmt)
    with pytest.raises(ValueError, match="slot_mapping: slot 16 is out of range"):
        octave_cache_store(key, key, cache, torch.tensor([0, 16]), fmt)
    with pytest.raises(ValueError, match="cache: expected a uint8"):
        octave_cache_store(key, key, cache[..., :8], torch.tensor([0, 1]), fmt)
    with pytest.raises(ValueError, match="key: expected 2 KV heads"):
        octave_cache_store(key, key, torch.zeros(1, 2, 16, 112, dtype=torch.uint8),
                           torch.tensor([0, 1]), fmt)  # fmt: skip
    assert not cache.any()
    with pytest.raises(ValueError, match="slots: expected 112 bytes per slot, got 8"):
        octave_decode(cache[0, :, :, :8], fmt)
    with pytest.raises(ValueError, match="n: expected a positive multiple of 32"):
        sign_bits(48)


def test_compiled_op_refuses_them() -> None:
    key = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 124, dtype=torch.uint8)
    scale = torch.ones(1)
    for name in NAMES:
        with pytest.raises(ValueError, match=f"format '{name}' has no kernel support"):
            ops.reshape_and_cache_flash(
                key, key, cache, cache, torch.zeros(1, dtype=torch.long), name, scale, scale
            )


def test_module_paths() -> None:
    assert Path(sq.__file__).parts[-4:] == ("v1", "attention", "ops", "rocm_octave.py")
    assert sq.reference_quantize is octave_encode and math.isclose(sq.LUT_ONE, 64.0)
