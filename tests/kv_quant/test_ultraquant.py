"""The ``ultraquant_4bit`` format: registry entry, page math and the reference codec (FP4 E2M1
codes, UE8M0 group-of-32 scales), checked against a scalar model written from the contract."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kv_quant.formats import kernel_cache_kind, lookup
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.ultraquant import (
    FP4_BITS_TO_VALUE,
    ue8m0_decode,
    ue8m0_encode,
    ultraquant_row_dim,
    ultraquant_slot_size,
)
from vllm.v1.attention.ops.ultraquant import format as uqf
from vllm.v1.attention.ops.ultraquant.reference import (
    hadamard_matrix,
    reference_ultraquant_attention,
    ultraquant_dequant,
    ultraquant_encode,
    ultraquant_encode_decode,
)

from .test_turboquant import load_upstream_module

_LEVELS = sorted({abs(v) for v in FP4_BITS_TO_VALUE})


def _scalar_encode(group: list[float]) -> tuple[list[int], int]:
    """Codes and scale byte of one group of 32 fp32 values, value by value."""
    s_raw = 0.156 * max(abs(v) for v in group)
    if s_raw == 0 or not math.isfinite(s_raw):
        return [0] * len(group), 0
    e = min(max(math.floor(math.log2(s_raw) + 0.5), -126), 127)
    codes = []
    for v in group:
        t = v / 2.0**e
        mag = min(_LEVELS, key=lambda lv: (abs(abs(t) - lv), -lv if t < 0 else lv))
        if mag == 0.0:
            codes.append(0)
        else:
            codes.append(FP4_BITS_TO_VALUE.index(-mag if t < 0 else mag))
    return codes, e + 127


def test_registry_entry_and_page_math() -> None:
    fmt = lookup("ultraquant_4bit")
    assert fmt.quant_mode is KVQuantMode.ULTRAQUANT_4BIT and fmt.storage_dtype == torch.uint8
    assert fmt.is_quantized and fmt.cache_kind is None and not fmt.has_kernel
    # Slot = K codes + K scales + V codes + V scales; the registry row is one side (half).
    for d, slot in ((32, 34), (64, 68), (128, 136), (256, 272), (512, 544)):
        assert ultraquant_slot_size(d) == uqf.slot_size(d) == slot
        assert fmt.last_dim(d) == ultraquant_row_dim(d) == slot // 2
        # Two-sided page math equals upstream's one packed slot per (token, head).
        assert 2 * 16 * 8 * fmt.last_dim(d) == 16 * 8 * uqf.slot_size(d)
    assert (uqf.k_codes_offset(256), uqf.k_scales_offset(256)) == (0, 128)
    assert (uqf.v_codes_offset(256), uqf.v_scales_offset(256)) == (136, 264)
    with pytest.raises(ValueError, match="no kernel support"):
        kernel_cache_kind("ultraquant_4bit")


@pytest.mark.parametrize("d", [0, 48, 100, -32])
def test_bad_head_size(d: int) -> None:
    with pytest.raises(ValueError, match="head_dim: expected"):
        ultraquant_slot_size(d)


def test_ue8m0_scalar_helpers() -> None:
    assert [ue8m0_encode(s) for s in (0.0, -1.0, math.inf, math.nan)] == [0, 0, 0, 0]
    assert ue8m0_encode(1.0) == 127 and ue8m0_encode(2.0**-126) == 1
    assert ue8m0_encode(2.0**-127) == 0  # below the smallest normal: the zero sentinel
    assert ue8m0_encode(3.0e38) == 255 - 1  # 2^128 rounds past the top: clamped to 2^127
    assert ue8m0_encode(2.8) == 128 and ue8m0_encode(3.0) == 129
    assert ue8m0_decode(0) == 0.0 and ue8m0_decode(127) == 1.0 and ue8m0_decode(254) == 2.0**127
    with pytest.raises(ValueError, match="byte: expected"):
        ue8m0_decode(256)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encode_matches_scalar_model(rotate: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    x = (torch.randn(3, 2, 64) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)).to(dtype)
    enc = ultraquant_encode(x, rotate=rotate)
    assert enc.codes_packed.shape == (3, 2, 32) and enc.scale_bytes.shape == (3, 2, 2)
    r = x.float() @ hadamard_matrix(64, x.device).T if rotate else x.float()
    for row, packed, scales in zip(
        r.reshape(-1, 64),
        enc.codes_packed.reshape(-1, 32),
        enc.scale_bytes.reshape(-1, 2),
        strict=True,
    ):
        codes = [int(b) >> s & 0xF for b in packed for s in (0, 4)]
        for g in range(2):
            want_codes, want_byte = _scalar_encode(row[32 * g : 32 * g + 32].tolist())
            assert int(scales[g]) == want_byte
            assert codes[32 * g : 32 * g + 32] == want_codes


def test_edge_values() -> None:
    x = torch.zeros(4, 32)
    x[1] = 1.0  # s_raw = 0.156 → 2^-3: every value 8 → saturates at 6
    x[2, 0] = 2.0**10  # powers of two: only the amax position keeps a large code
    x[2, 1] = 2.0**5
    x[3] = 1e-45  # subnormal amax: exponent clamped to -126 (byte 1), codes round to 0
    x[3, 0] = float("nan")
    enc = ultraquant_encode(x, rotate=False)
    assert enc.scale_bytes.flatten().tolist() == [0, 124, 134, 0]
    assert enc.codes_packed[0].eq(0).all()  # all-zero group: byte 0 and +0 codes
    assert enc.codes_packed[1].eq(0x77).all()
    dq = ultraquant_dequant(enc, 32)
    assert dq[1].eq(6 * 2.0**-3).all() and dq[0].eq(0).all() and dq[3].eq(0).all()
    # 2^5 / 2^7 = 0.25 sits on a boundary: it takes the lower level, 0.
    assert dq[2, 0] == 6 * 2.0**7 and dq[2, 1] == 0
    tiny = ultraquant_encode(torch.full((1, 32), 1e-39), rotate=False)
    assert tiny.scale_bytes.item() == 1 and tiny.codes_packed.eq(0).all()
    huge = ultraquant_encode(torch.full((1, 32), 3e38), rotate=False)
    assert huge.scale_bytes.item() == 127 + 125 and ultraquant_dequant(huge, 32).isfinite().all()


def test_round_trip_error_bound_and_errors() -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 128)
    y = ultraquant_encode_decode(x, rotate=False)
    amax = x.reshape(64, 4, 32).abs().amax(-1, keepdim=True)
    # s <= sqrt(2) * 0.156 * amax: half the widest step (s) or the saturation loss
    # (amax - 6 * s, s >= 0.156 * amax / sqrt(2)) bounds every error.
    err = (y - x).reshape(64, 4, 32).abs()
    assert (err <= amax * 0.34).all()
    with pytest.raises(ValueError, match="x: expected a last dim"):
        ultraquant_encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="head_dim: expected twice"):
        ultraquant_dequant(ultraquant_encode(x), 64)
    with pytest.raises(ValueError, match="dim: expected a power of two"):
        hadamard_matrix(96, torch.device("cpu"))


def test_reference_attention_shapes_and_sinks() -> None:
    torch.manual_seed(5)
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 5, 2, 64)
    v = torch.randn(2, 5, 2, 64)
    out = reference_ultraquant_attention(q, k, v, scale=0.125)
    assert out.shape == (2, 4, 64) and out.dtype == q.dtype
    # A huge sink takes all the mass: the output goes to zero.
    sunk = reference_ultraquant_attention(q, k, v, scale=0.125, sinks=torch.full((4,), 1e4))
    assert sunk.abs().max() < 1e-6
    with pytest.raises(ValueError, match="query: expected a head count"):
        reference_ultraquant_attention(q[:, :3], k, v, scale=0.125)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_equal_upstreams_reference(rotate: bool, dtype: torch.dtype, tmp_path) -> None:
    """Upstream v0.33.0's reference codec, run from its sdist, on rows spanning 24 decades of
    magnitude, zeros, NaN / Inf groups and subnormals: the same codes and scale bytes."""
    upstream = load_upstream_module("vllm/v1/attention/ops/ultraquant/reference.py", tmp_path)
    gen = torch.Generator().manual_seed(11)
    scales = 10.0 ** torch.linspace(-12, 12, 64).view(64, 1, 1)
    x = torch.randn(64, 4, 128, generator=gen) * scales
    x[0] = 0.0
    x[1, 0, 5] = float("nan")
    x[1, 1, 40] = float("inf")
    x[2] = torch.randn(4, 128, generator=gen) * 1e-40  # subnormal groups
    x = x.to(dtype)
    ours = ultraquant_encode(x, rotate=rotate)
    theirs = upstream.ultraquant_encode(x, rotate=rotate)
    assert torch.equal(ours.scale_bytes, theirs.scale_bytes)
    assert torch.equal(ours.codes_packed, theirs.codes_packed)


def test_scale_snap_is_exact_on_the_boundary() -> None:
    """``s_raw = m * 2^E`` snaps up exactly when ``m > sqrt(2)``: the fp32 mantissas either side
    of ``sqrt(2)``, at exponents where upstream's fp32 ``floor(log2(s) + 0.5)`` rounds the one
    below up as well (e.g. ``m = 0x3FB504F3``, E = 0: log2 = 0.49999997, + 0.5 rounds to 1).
    ``constant_c = 1`` makes ``s_raw`` the group's amax."""
    below = torch.tensor([0x3FB504F3], dtype=torch.int32).view(torch.float32).item()
    above = torch.tensor([0x3FB504F4], dtype=torch.int32).view(torch.float32).item()
    assert below < math.sqrt(2) < above
    for e in (-100, -10, -3, 0, 5, 60):
        for m, snapped in ((below, e), (above, e + 1)):
            x = torch.zeros(1, 32)
            x[0, 0] = m * 2.0**e
            encoded = ultraquant_encode(x, rotate=False, constant_c=1.0)
            assert encoded.scale_bytes.item() == snapped + 127
