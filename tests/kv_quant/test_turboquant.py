"""TurboQuant (vllm.kv_quant.turboquant): the presets' sizes, the Lloyd-Max tables bit for bit
against upstream v0.33.0's solver (run from its sdist), the reference codec's bytes against an
independent bit-level oracle and its round trip, the registry entries, the refusal by the
kernels, the page math, and the errors on bad input."""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vllm.kv_quant.formats import kernel_cache_kind, lookup
from vllm.kv_quant.hadamard import hadamard_rotate
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    get_centroids,
    solve_lloyd_max,
    turboquant_decode_slots,
    turboquant_encode_slots,
    turboquant_read_cache,
    turboquant_write_cache,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

UPSTREAM_SDIST = Path(
    os.environ.get("VLLM_UPSTREAM_SDIST", "/work/shared/upstream/vllm-0.33.0.tar.gz")
)
PRESETS = list(TQ_PRESETS)
SLOT_BYTES_128 = {  # upstream's table at head dim 128: (key, value, slot)
    "turboquant_k8v4": (128, 68, 196),
    "turboquant_4bit_nc": (66, 68, 134),
    "turboquant_k3v4_nc": (50, 68, 118),
    "turboquant_3bit_nc": (50, 52, 102),
}


def load_upstream_module(path: str, tmp_dir: Path, **shims: ModuleType) -> ModuleType:
    """Upstream v0.33.0's module ``path`` (relative to its source root), executed from its sdist
    under a private name; ``shims`` stand in for modules it imports that need the engine. Skips
    when the sdist is absent."""
    if not UPSTREAM_SDIST.is_file():
        pytest.skip(f"upstream sdist not found at {UPSTREAM_SDIST} (set VLLM_UPSTREAM_SDIST)")
    with tarfile.open(UPSTREAM_SDIST) as sdist:
        member = next(m for m in sdist.getmembers() if m.name.endswith("/" + path))
        source = sdist.extractfile(member).read()  # type: ignore[union-attr]
    file = tmp_dir / Path(path).name  # Triton's jit reads the kernels' source from a file
    file.write_bytes(source)
    name = "_upstream_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        for shim_name, shim in shims.items():
            mp.setitem(sys.modules, shim_name, shim)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _tables(cfg: TurboQuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(PiT, midpoints, centroids) as upstream's backend builds them: the symmetric Hadamard."""
    pit = hadamard_rotate(torch.eye(cfg.head_dim))
    centroids, midpoints = solve_lloyd_max(cfg.head_dim, cfg.mse_bits)
    return pit, midpoints, centroids


def _inputs(n: int, h: int, d: int, seed: int, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(n, h, d, generator=gen).to(dtype)
    value = (torch.randn(n, h, d, generator=gen) * 2).to(dtype)
    return key, value


def test_presets_and_sizes() -> None:
    assert [m.name.lower() for m in KVQuantMode if m.is_turboquant] == PRESETS
    for name, (kps, vps, slot) in SLOT_BYTES_128.items():
        cfg = TurboQuantConfig.from_cache_dtype(name, 128)
        assert (cfg.key_packed_size, cfg.value_packed_size, cfg.slot_size) == (kps, vps, slot)
    odd = TurboQuantConfig(head_dim=6, key_quant_bits=3, value_quant_bits=3)
    assert odd.slot_size == 3 + 2 + 3 + 4 and odd.slot_size_aligned == 12
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'fp8'"):
        TurboQuantConfig.from_cache_dtype("fp8", 128)


@pytest.mark.parametrize("d,bits", [(64, 2), (96, 3), (128, 3), (128, 4), (256, 4)])
def test_lloyd_max_tables_equal_upstream(d: int, bits: int, tmp_path: Path) -> None:
    upstream = load_upstream_module(
        "vllm/model_executor/layers/quantization/turboquant/centroids.py", tmp_path
    )
    ours = solve_lloyd_max(d, bits)
    theirs = upstream.solve_lloyd_max(d, bits)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert get_centroids(d, bits) is get_centroids(d, bits)
    assert torch.equal(get_centroids(d, bits), theirs[0])


def test_lloyd_max_bad_input() -> None:
    with pytest.raises(ValueError, match="d: expected a positive int, got 0"):
        solve_lloyd_max(0, 3)
    with pytest.raises(ValueError, match="bits: expected a positive int, got 0"):
        solve_lloyd_max(128, 0)


def _bitstream(codes: list[int], bits: int) -> bytes:
    word = sum(c << (bits * i) for i, c in enumerate(codes))
    return word.to_bytes(len(codes) * bits // 8, "little")


def _fp16(x: float) -> bytes:
    return struct.pack("<e", x)


def _oracle_slot(key: torch.Tensor, value: torch.Tensor, cfg, pit, midpoints) -> bytes:
    """One slot from scalar Python, one element at a time (an independent reading of the
    format; the rotation matmul is the one shared input)."""
    if cfg.key_fp8:
        out = bytes(int(b) for b in key.float().to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        k = key.float().reshape(1, -1)
        norm = k.norm(dim=1, keepdim=True)
        y = ((k / (norm + 1e-8)) @ pit)[0].tolist()
        mids = midpoints.tolist()
        codes = [sum(1 for m in mids if yi >= m) for yi in y]
        out = _bitstream(codes, cfg.key_mse_bits) + _fp16(float(norm))
    v = value.float()
    lo, hi = v.min(), v.max()
    levels = 2**cfg.value_quant_bits - 1
    scale = (hi - lo) / torch.tensor(float(levels))
    scale = scale if float(scale) > float(torch.tensor(1e-8)) else torch.tensor(1e-8)
    codes = [min(max(int(float((x - lo) / scale + 0.5)), 0), levels) for x in v]
    return out + _bitstream(codes, cfg.value_quant_bits) + _fp16(float(scale)) + _fp16(float(lo))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("d", [64, 96])
def test_codec_bytes_equal_the_oracle(preset: str, d: int) -> None:
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    pit = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(1)))[0]
    pit = pit.float().contiguous()
    _, midpoints, _ = _tables(TurboQuantConfig.from_cache_dtype(preset, 128))
    key, value = _inputs(3, 2, d, seed=d)
    key[0, 0] = 0.0  # zero key: norm 0, unit vector 0
    value[0, 1] = 1.25  # constant value: the scale floor
    value[1, 0, :3] = torch.tensor([65504.0, -65504.0, 6e-8])  # fp16 extremes and a subnormal
    slots = turboquant_encode_slots(key, value, cfg, pit, midpoints)
    assert slots.shape == (3, 2, cfg.slot_size) and slots.dtype == torch.uint8
    for t in range(3):
        for h in range(2):
            want = _oracle_slot(key[t, h], value[t, h], cfg, pit, midpoints)
            assert bytes(slots[t, h].tolist()) == want, (t, h)


@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_quality(preset: str) -> None:
    cfg = TurboQuantConfig.from_cache_dtype(preset, 128)
    pit, midpoints, centroids = _tables(cfg)
    key, value = _inputs(16, 4, 128, seed=7, dtype=torch.bfloat16)
    got_k, got_v = turboquant_decode_slots(
        turboquant_encode_slots(key, value, cfg, pit, midpoints), cfg, centroids, pit.T
    )
    cos = torch.nn.functional.cosine_similarity(got_k, key.float(), dim=-1)
    assert float(cos.min()) > {8: 0.999, 4: 0.98, 3: 0.95}[cfg.key_quant_bits]
    step = (value.float().amax(-1) - value.float().amin(-1)) / (2**cfg.value_quant_bits - 1)
    assert bool(((got_v - value.float()).abs() <= step.unsqueeze(-1) * 0.5 + 1e-2).all())


def test_fp8_keys_saturate_and_nan() -> None:
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 8)
    key = torch.tensor([500.0, -1e4, float("inf"), float("nan"), 0.1, 2**-10, 3 * 2**-10, -0.0])
    slots = turboquant_encode_slots(key.view(1, 1, 8), torch.zeros(1, 1, 8), cfg)
    assert slots[0, 0, :8].tolist() == [0x7E, 0xFE, 0x7E, 0x7F, 0x1D, 0x00, 0x02, 0x80]


def test_cache_write_read_skips_and_padding() -> None:
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k3v4_nc", 64)
    pit, midpoints, centroids = _tables(cfg)
    key, value = _inputs(3, 2, 64, seed=3)
    cache = torch.full((2, 4, 2, cfg.slot_size_aligned + 2), 0xAB, dtype=torch.uint8)
    before = cache.clone()
    turboquant_write_cache(key, value, cache, torch.tensor([5, -1, 0]), cfg, pit, midpoints)
    slots = turboquant_encode_slots(key, value, cfg, pit, midpoints)
    assert torch.equal(cache[1, 1, :, : cfg.slot_size], slots[0])
    assert torch.equal(cache[0, 0, :, : cfg.slot_size], slots[2])
    assert torch.equal(cache[..., cfg.slot_size :], before[..., cfg.slot_size :])  # padding
    untouched = torch.ones(2, 4, dtype=torch.bool)
    untouched[1, 1] = untouched[0, 0] = False
    assert torch.equal(cache[untouched], before[untouched])
    got = turboquant_read_cache(cache, torch.tensor([5, 0]), cfg, centroids, pit.T)
    want = turboquant_decode_slots(slots[[0, 2]], cfg, centroids, pit.T)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_bad_input_writes_nothing() -> None:
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 64)
    pit, midpoints, centroids = _tables(cfg)
    key, value = _inputs(2, 2, 64, seed=5)
    cache = torch.zeros(1, 4, 2, cfg.slot_size_aligned, dtype=torch.uint8)
    slots = torch.tensor([0, 1])
    bad = [
        ((key.int(), value, cache, slots), "key: expected dtype float16, bfloat16 or float32"),
        ((key, value[:1], cache, slots), "value: expected key's shape"),
        ((key[..., :60], value[..., :60], cache, slots), "key: expected head dim 64"),
        ((key, value, cache.float(), slots), "kv_cache: expected uint8"),
        ((key, value, cache[..., :10], slots), "contiguous slots of >= 70 bytes"),
        ((key, value, cache, slots.float()), "slot_mapping: expected int32/int64"),
        ((key, value, cache, torch.tensor([0, 4])), r"< 4 \(negative to skip a token\), got 4"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            turboquant_write_cache(*args, cfg, pit, midpoints)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"PiT: expected float32 \[64, 64\], got None"):
        turboquant_write_cache(key, value, cache, slots, cfg, None, midpoints)
    with pytest.raises(ValueError, match=r"midpoints: expected float32 \[15\]"):
        turboquant_write_cache(key, value, cache, slots, cfg, pit, midpoints[:3])
    assert not cache.any()
    with pytest.raises(ValueError, match=r"slots: expected uint8 \[..., >= 70\]"):
        turboquant_decode_slots(cache[0, 0, :, :60], cfg, centroids)
    with pytest.raises(ValueError, match=r"centroids: expected float32 \[16\]"):
        turboquant_decode_slots(cache[0, 0], cfg, None)
    with pytest.raises(ValueError, match="slot_mapping: expected every slot to be non-negative"):
        turboquant_read_cache(cache, torch.tensor([0, -1]), cfg, centroids)


@pytest.mark.parametrize("preset", PRESETS)
def test_registry_entry_page_math_and_kernel_refusal(preset: str) -> None:
    fmt = lookup(preset)
    mode = KVQuantMode[preset.upper()]
    assert fmt.quant_mode is mode and fmt.storage_dtype == torch.uint8 and fmt.cache_kind is None
    with pytest.raises(ValueError, match=f"format '{preset}' has no kernel support"):
        kernel_cache_kind(preset)
    for d in (64, 96, 128, 256):
        slot = TurboQuantConfig.from_cache_dtype(preset, d).slot_size_aligned
        assert 2 * fmt.last_dim(d) == slot
        common = dict(block_size=16, num_kv_heads=4, head_size=d, dtype=torch.uint8)
        unpacked = FullAttentionSpec(kv_quant_mode=mode, **common)  # type: ignore[arg-type]
        packed = FullAttentionSpec(kv_quant_mode=mode, state_content_bytes=slot, **common)  # type: ignore[arg-type]
        assert unpacked.page_size_bytes == packed.page_size_bytes == 16 * 4 * slot
        assert unpacked.kv_cache_format is fmt
    with pytest.raises(ValueError, match="head_size: expected a positive head size, got 0"):
        fmt.last_dim(0)
