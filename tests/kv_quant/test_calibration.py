"""KV-scale calibration (vllm/kv_quant/calibration.py): running amax per tensor or per KV head,
each format's ``amax / MAX`` convention, non-finite values ignored, zeros giving 1.0."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import (
    NVFP4_SCALE_MAX,
    KVScaleObserver,
    dequantize_fp8,
    kv_scale_max,
    kv_scales_from_amax,
    quantize_fp8,
    quantize_nvfp4,
)

H, D = 3, 64


def _batch(scale: float, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(7, H, D, generator=gen) * scale).to(dtype)


def test_scale_max_per_format() -> None:
    assert kv_scale_max("fp8") == kv_scale_max("fp8_e4m3") == 448.0
    assert kv_scale_max("fp8_e5m2") == 57344.0
    assert kv_scale_max("nvfp4") == NVFP4_SCALE_MAX == 448.0 * 6
    for no_scale in ("auto", "bfloat16", "float16", "int8_per_token_head", "fp8_per_token_head"):
        assert kv_scale_max(no_scale) is None
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV-cache dtype 'fp4'"):
        kv_scale_max("fp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_per_tensor_running_amax(dtype: torch.dtype) -> None:
    obs = KVScaleObserver()
    batches = [
        (_batch(2.0, 1, dtype), _batch(0.5, 2, dtype)),
        (_batch(5.0, 3, dtype), _batch(0.1, 4, dtype)),
    ]
    for k, v in batches:
        obs.observe(k, v)
    k_amax = max(k.float().abs().max() for k, _ in batches)
    v_amax = max(v.float().abs().max() for _, v in batches)
    for name, scale_max in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0), ("nvfp4", 2688.0)):
        k_scale, v_scale = obs.scales(name)
        assert k_scale.shape == v_scale.shape == torch.Size([])  # upstream's 0-d layer scale
        assert k_scale.dtype == torch.float32
        torch.testing.assert_close(k_scale, k_amax / scale_max, rtol=0, atol=0)
        torch.testing.assert_close(v_scale, v_amax / scale_max, rtol=0, atol=0)
    assert obs.nonfinite == 0


def test_per_head_scales() -> None:
    obs = KVScaleObserver(per_head=True)
    k = _batch(1.0, 5, torch.float32) * torch.tensor([1.0, 10.0, 100.0])[None, :, None]
    v = _batch(1.0, 6, torch.float32)[..., :32]  # V may have its own head size
    obs.observe(k, v)
    k_scale, v_scale = obs.scales("fp8")
    assert k_scale.shape == v_scale.shape == torch.Size([H])
    torch.testing.assert_close(k_scale, k.abs().amax(dim=(0, 2)) / 448.0, rtol=0, atol=0)
    with pytest.raises(ValueError, match="key: expected 3 KV heads, got 2"):
        obs.observe(k[:, :2], v[:, :2])


def test_formats_without_scales_get_ones() -> None:
    obs = KVScaleObserver(per_head=True)
    obs.observe(_batch(3.0, 7), _batch(3.0, 8))
    for name in ("auto", "bfloat16", "int8_per_token_head", "fp8_per_token_head"):
        k_scale, v_scale = obs.scales(name)
        assert torch.equal(k_scale, torch.ones(H)) and torch.equal(v_scale, torch.ones(H))


def test_nonfinite_values_are_ignored_and_counted() -> None:
    obs = KVScaleObserver()
    k = _batch(1.0, 9, torch.float32)
    v = _batch(1.0, 10, torch.float32)
    finite_amax = k.abs().max()
    k[0, 0, 0], k[1, 1, 1], v[2, 2, 2] = float("nan"), float("inf"), float("-inf")
    obs.observe(k, v)
    obs.observe(k, v)
    k_scale, v_scale = obs.scales("fp8")
    assert torch.isfinite(k_scale) and torch.isfinite(v_scale)
    assert k_scale <= finite_amax / 448.0
    assert obs.nonfinite == 6


def test_zero_observation_gives_scale_one() -> None:
    obs = KVScaleObserver(per_head=True)
    k = _batch(1.0, 11, torch.float32)
    k[:, 1] = 0.0
    obs.observe(k[:0], k[:0])  # an empty batch: ignored
    with pytest.raises(RuntimeError, match="scales: no K/V observed yet"):
        obs.scales("nvfp4")
    obs.observe(k, torch.zeros(7, H, D))
    k_scale, v_scale = obs.scales("nvfp4")
    assert k_scale[1] == 1.0 and k_scale[0] > 0 and torch.equal(v_scale, torch.ones(H))
    assert torch.equal(kv_scales_from_amax(torch.tensor(1e-45), "nvfp4"), torch.tensor(1.0))


def test_bad_batches_are_rejected_before_anything_changes() -> None:
    obs = KVScaleObserver()
    obs.observe(_batch(1.0, 12), _batch(1.0, 13))
    before = (obs.k_amax, obs.v_amax)
    big = _batch(100.0, 14)
    with pytest.raises(
        ValueError, match=r"key: expected a float tensor \[T, H, D\], got torch.int8"
    ):
        obs.observe(big.to(torch.int8), big)
    with pytest.raises(ValueError, match=r"value: expected a float tensor \[T, H, D\], got list"):
        obs.observe(big, [1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value: expected 3 KV heads, got 2"):
        obs.observe(big, big[:, :2])
    with pytest.raises(ValueError, match="value: expected 7 tokens like key, got 6"):
        obs.observe(big, big[:6])
    with pytest.raises(ValueError, match="key: expected device cpu, got meta"):
        obs.observe(big.to("meta"), big.to("meta"))
    assert (obs.k_amax, obs.v_amax) == before
    with pytest.raises(ValueError, match="per_head: expected a bool, got 'head'"):
        KVScaleObserver(per_head="head")  # type: ignore[arg-type]


def test_calibrated_scales_use_each_format_fully_without_clipping() -> None:
    """The convention's point: FP8's largest code and NVFP4's largest block scale (448) land on
    the observed amax, and the amax reads back (no value of the calibration data saturates)."""
    obs = KVScaleObserver()
    k, v = _batch(3.0, 15, torch.float32), _batch(0.2, 16, torch.float32)
    obs.observe(k, v)
    k_scale, _ = obs.scales("fp8_e4m3")
    back = dequantize_fp8(quantize_fp8(k, k_scale), k_scale)
    torch.testing.assert_close(back.abs().max(), k.abs().max(), rtol=2**-4, atol=0)
    k_scale, _ = obs.scales("nvfp4")
    _, block_scales = quantize_nvfp4(k, k_scale)
    assert int(block_scales.max()) == 0x7E  # e4m3 448, the top of the block-scale range


def test_key_mean_per_head_and_channel_ignores_non_finite() -> None:
    observer = KVScaleObserver()
    key = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4)
    observer.observe(key, torch.zeros(2, 2, 4))
    odd = key.clone() + 10
    odd[0, 1, 2] = float("nan")
    observer.observe(odd, torch.zeros(2, 2, 4))
    mean = observer.key_mean()
    assert mean.dtype == torch.float32 and mean.shape == (2, 4)
    want = (key.sum(0) + odd.nan_to_num(0).sum(0)) / 4
    want[1, 2] = (key[:, 1, 2].sum() + odd[1, 1, 2]) / 3
    torch.testing.assert_close(mean, want)
    with pytest.raises(ValueError, match=r"key: expected \[T, 2, 4\] like the batches before"):
        observer.observe(torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises(RuntimeError, match="key_mean: no K/V observed yet"):
        KVScaleObserver().key_mean()
