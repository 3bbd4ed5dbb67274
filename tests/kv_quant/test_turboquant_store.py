"""TurboQuant's Triton store (vllm.v1.attention.ops.triton_turboquant_store) byte for byte against
the reference codec, and against upstream v0.33.0's own Triton store run from its sdist, under
Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) or on a
GPU: every preset, head dims 64 / 96 (a row shorter than its block) / 128, fp16 / bf16 / fp32
sources, zero keys, constant values, fp16 extremes, skipped slots, padding bytes, a cache whose
blocks are not adjacent, and the errors on bad input (nothing written)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    solve_lloyd_max,
    turboquant_write_cache,
)
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.triton_turboquant_store import (
    triton_compile_cases,
    triton_turboquant_store,
)

from .test_turboquant import load_upstream_module

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytestmark = pytest.mark.skip(reason="Triton runs CPU tensors only under its interpreter")


def _case(preset: str, d: int, dtype: torch.dtype, seed: int, heads: int = 2):
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    gen = torch.Generator().manual_seed(seed)
    pit = torch.linalg.qr(torch.randn(d, d, generator=gen))[0].float().contiguous()
    _, midpoints = solve_lloyd_max(128, cfg.mse_bits)
    key = torch.randn(4, heads, d, generator=gen)
    value = torch.randn(4, heads, d, generator=gen) * 3
    key[1, 0] = 0.0
    value[1, 1] = -2.5
    value[2, 0, :2] = torch.tensor([65504.0, -65504.0])
    key[3, 1, :2] = torch.tensor([300.0, -1e-3])
    tensors = (key.to(dtype), value.to(dtype), pit, midpoints)
    return cfg, tuple(t.to(DEVICE) for t in tensors)


def _store(cfg, key, value, cache, slots, pit, midpoints, store=triton_turboquant_store) -> None:
    store(
        key,
        value,
        cache,
        slots,
        pit,
        midpoints,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
    )


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
@pytest.mark.parametrize(
    "d,dtype", [(64, torch.float16), (96, torch.bfloat16), (128, torch.float32)]
)
def test_store_equals_codec(preset: str, d: int, dtype: torch.dtype) -> None:
    cfg, (key, value, pit, midpoints) = _case(preset, d, dtype, seed=d)
    # Blocks 0 and 2 of a 3-block buffer: a cache whose blocks are not adjacent.
    storage = torch.full((3, 4, 2, cfg.slot_size_aligned + 1), 0x5A, dtype=torch.uint8)
    cache = storage.to(DEVICE)[::2]
    want = cache.clone()
    slots = torch.tensor([7, -1, 0, 2], dtype=torch.int32, device=DEVICE)
    _store(cfg, key, value, cache, slots, pit, midpoints)
    turboquant_write_cache(key, value, want, slots, cfg, pit, midpoints)
    assert torch.equal(cache.cpu(), want.cpu())
    assert bool((cache[..., cfg.slot_size :] == 0x5A).all())  # padding untouched
    assert bool((cache[0, 1] == 0x5A).all())  # a slot no token names


def _upstream_store(tmp_path: Path) -> ModuleType:
    decode = ModuleType("vllm.v1.attention.ops.triton_turboquant_decode")
    decode._use_fp8_e4b15 = lambda device=0: 0  # type: ignore[attr-defined]  # e4m3 (sm >= 89)
    return load_upstream_module(
        "vllm/v1/attention/ops/triton_turboquant_store.py",
        tmp_path,
        **{"vllm.v1.attention.ops.triton_turboquant_decode": decode},
    )


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
@pytest.mark.parametrize("d", [64, 96])
def test_store_equals_upstream_store(preset: str, d: int, tmp_path: Path) -> None:
    """Upstream's kernel on the same inputs. Its in-kernel FP8 cast is the platform's; under
    the interpreter that cast ignores ties, mantissa carries, saturation and subnormals, so FP8
    keys here are normal e4m3 values, which every rounding keeps (the codec's rounding is
    pinned in test_turboquant.py)."""
    upstream = _upstream_store(tmp_path)
    cfg, (key, value, pit, midpoints) = _case(preset, d, torch.float16, seed=3 * d)
    if cfg.key_fp8:
        key = torch.where(key.abs() < 2**-6, torch.full_like(key, 0.5), key).clamp(-448, 448)
        key = key.to(torch.float8_e4m3fn).to(key.dtype)
    ours = torch.zeros(2, 4, 2, cfg.slot_size_aligned, dtype=torch.uint8, device=DEVICE)
    theirs = ours.clone()
    slots = torch.tensor([5, 0, -1, 3], dtype=torch.int32, device=DEVICE)
    _store(cfg, key, value, ours, slots, pit, midpoints)
    _store(cfg, key, value, theirs, slots, pit, midpoints, store=upstream.triton_turboquant_store)
    assert torch.equal(ours.cpu(), theirs.cpu())


def bad_store_calls(cache: torch.Tensor) -> list[tuple[tuple, dict, str]]:
    """``(positional, keyword arguments, message)`` of store calls that must fail, each with one
    bad argument, into ``cache`` (uint8 ``[2, 4, 2, slot]`` for ``turboquant_k3v4_nc`` at D 64)."""
    cfg, (key, value, pit, midpoints) = _case("turboquant_k3v4_nc", 64, torch.float16, seed=1)
    slots = torch.arange(4, dtype=torch.int32, device=DEVICE)
    args = dict(mse_bits=3, key_packed_size=cfg.key_packed_size, value_quant_bits=4)
    bad = [
        ((key, value, cache.transpose(2, 3), slots, pit, midpoints), args, "kv_cache: expected"),
        ((key, value, cache[..., :20], slots, pit, midpoints), args, "contiguous slots of >= 62"),
        ((key, value, cache, slots[:2], pit, midpoints), args, r"slot_mapping: expected"),
        ((key, value, cache, slots, pit.double(), midpoints), args, "PiT: expected float32"),
        ((key, value, cache, slots, pit, midpoints[:3]), args, r"midpoints: expected float32 \[7"),
        ((key, value, cache, slots, pit, midpoints), {**args, "key_packed_size": 50},
         "key_packed_size: expected 26 for head dim 64, got 50"),
        ((key, value, cache, slots, pit, midpoints), {**args, "mse_bits": 2},
         "mse_bits/value_quant_bits: expected 3 or 4"),
        ((key, value.int(), cache, slots, pit, midpoints), args, "value: expected dtype"),
        ((key, value[:, :1], cache, slots, pit, midpoints), args, "value: expected key's shape"),
        ((key, value.to("meta"), cache, slots, pit, midpoints), args, "value: expected device"),
    ]  # fmt: skip
    if DEVICE == "cpu":  # a GPU launch skips slots past the cache rather than syncing
        past = torch.tensor([0, 1, 8, 2], dtype=torch.int32)
        bad.append(((key, value, cache, past, pit, midpoints), args, "expected slots < 8"))
    return bad


def test_store_bad_input_writes_nothing() -> None:
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k3v4_nc", 64)
    cache = torch.zeros(2, 4, 2, cfg.slot_size_aligned, dtype=torch.uint8, device=DEVICE)
    for positional, keywords, message in bad_store_calls(cache):
        with pytest.raises(ValueError, match=message):
            triton_turboquant_store(*positional, **keywords)
    assert not cache.any()


def test_compile_cases_cover_every_preset() -> None:
    names = [case.name for case in triton_compile_cases()]
    assert names == [f"store/{p}/d{d}" for p in TQ_PRESETS for d in (128, 96)]
    assert all(not case.enable_fp_fusion for case in triton_compile_cases())
