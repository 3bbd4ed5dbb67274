"""Offline calibration of a whole encoding (vllm/kv_quant/calibrator.py): the passes, the values
against a from-scratch computation on all the data at once, streaming that keeps no per-token
state, the errors, and the saved result serving a cache."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import FP8_E4M3_MAX, NVFP4_SCALE_MAX, KeyRope, hadamard_rotate
from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.kv_quant.calibrator import KVCacheCalibrator
from vllm.kv_quant.encoding import RopeIdentity

T, H, D = 24, 3, 64
LAYERS = ("model.layers.0", "model.layers.1")


def _data(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, bf16 K (with a large per-channel mean, the offset's job) and V ``[T, H, D]``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, name in enumerate(LAYERS):
        mean = 4 * torch.randn(H, D, generator=gen)
        key = (torch.randn(T, H, D, generator=gen) + mean + i).to(torch.bfloat16)
        value = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
        out[name] = (key, value)
    return out


def _calibrate(
    encoding: str, data: dict, rope: KeyRope | None = None, splits: tuple[int, ...] = (T,)
) -> KVCacheCalibrator:
    """Stream ``data`` through a calibrator in batches of ``splits`` tokens, pass by pass."""
    calibrator = KVCacheCalibrator(encoding, key_rope=rope)
    while not calibrator.done:
        start = 0
        for size in splits:
            positions = torch.arange(start, start + size)
            for name, (key, value) in data.items():
                sl = slice(start, start + size)
                calibrator.observe(name, key[sl], value[sl], positions)
            start += size
        calibrator.finish_pass()
    return calibrator


def _amax_scale(x: torch.Tensor, per_head: bool, scale_max: float) -> torch.Tensor:
    x = x.float().abs()
    return (x.amax(dim=(0, 2)) if per_head else x.amax()) / scale_max


def test_passes() -> None:
    assert KVCacheCalibrator("fp8").passes == 1
    assert KVCacheCalibrator("fp8_e4m3/head+hadamard+offset").passes == 2
    assert KVCacheCalibrator("int8_per_token_head").passes == 1


@pytest.mark.parametrize("splits", [(T,), (5, 0, 11, 8)])
def test_offset_rotation_per_head(splits: tuple[int, ...]) -> None:
    """``+hadamard+offset``, per head: the offset is the mean key; the scales are the amax of
    the rotated, offset keys as the writer receives them (rounded to bf16) over MAX."""
    data = _data()
    calibration = _calibrate("fp8_e4m3/head+hadamard+offset", data, splits=splits).calibration()
    assert calibration.encoding.id == "fp8_e4m3/head+hadamard+offset"
    assert sorted(calibration.layers) == sorted(LAYERS)
    for name, (key, value) in data.items():
        got = calibration.layers[name]
        offset = key.float().mean(0)
        assert got.key_offset is not None
        torch.testing.assert_close(got.key_offset, offset, rtol=0, atol=1e-5)
        stored = hadamard_rotate(key.float() - got.key_offset).to(torch.bfloat16)
        assert torch.equal(got.k_scale, _amax_scale(stored, True, FP8_E4M3_MAX))
        assert torch.equal(got.v_scale, _amax_scale(value, True, FP8_E4M3_MAX))
        # the offset does its job: the stored keys span less than the raw ones
        assert bool((got.k_scale < _amax_scale(key, True, FP8_E4M3_MAX)).all())


def test_prerope_offset_sinks_nvfp4() -> None:
    """``+offset+prerope+sink``: the offset is the mean of the keys with RoPE undone at their
    positions, the K scale that of the pre-RoPE keys minus it; the RoPE is bound into the
    result's encoding."""
    rope = KeyRope.from_base(D, T)
    data = _data(1)
    with pytest.raises(ValueError, match="key_rope: expected the model's KeyRope"):
        KVCacheCalibrator("nvfp4_mse+offset+prerope+sink")
    calibration = _calibrate("nvfp4_mse+offset+prerope+sink", data, rope, (7, 17)).calibration()
    assert calibration.encoding.key.rope == RopeIdentity.of(rope)
    assert calibration.encoding.key.sink_tokens == 1
    positions = torch.arange(T)
    for name, (key, value) in data.items():
        got = calibration.layers[name]
        unroped = rope.unrotate(key.float(), positions)
        assert got.key_offset is not None
        torch.testing.assert_close(got.key_offset, unroped.mean(0), rtol=0, atol=1e-5)
        stored = (unroped - got.key_offset).to(torch.bfloat16)
        assert got.k_scale.dim() == 0
        assert torch.equal(got.k_scale, _amax_scale(stored, False, NVFP4_SCALE_MAX))
        assert torch.equal(got.v_scale, _amax_scale(value, False, NVFP4_SCALE_MAX))


@pytest.mark.parametrize("encoding", ["bf16", "int8_per_token_head", "turboquant_k8v4"])
def test_formats_without_scales_get_ones(encoding: str) -> None:
    calibration = _calibrate(encoding, _data()).calibration()
    for layer in calibration.layers.values():
        assert layer.k_scale.item() == layer.v_scale.item() == 1.0 and layer.key_offset is None


def _state_elements(calibrator: KVCacheCalibrator) -> int:
    """Elements of every tensor the calibrator holds."""
    tensors = [t for t in calibrator._offsets.values()]
    for observer in calibrator._observers.values():
        tensors += [t for t in vars(observer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors)


def test_memory_does_not_grow_with_the_data() -> None:
    data = _data()
    long = {n: (k.repeat(20, 1, 1), v.repeat(20, 1, 1)) for n, (k, v) in data.items()}
    short_cal = _calibrate("nvfp4+hadamard+offset", data, splits=(T,))
    long_cal = KVCacheCalibrator("nvfp4+hadamard+offset")
    while not long_cal.done:
        for step in range(20):
            for name, (key, value) in long.items():
                long_cal.observe(
                    name, key[step * T : (step + 1) * T], value[step * T : (step + 1) * T]
                )
        long_cal.finish_pass()
    assert _state_elements(long_cal) == _state_elements(short_cal)
    # the same data repeated: the same scales, the same offset up to the mean's rounding
    for name in LAYERS:
        a, b = short_cal.calibration().layers[name], long_cal.calibration().layers[name]
        assert torch.equal(a.v_scale, b.v_scale)
        assert a.key_offset is not None and b.key_offset is not None
        torch.testing.assert_close(a.key_offset, b.key_offset, rtol=0, atol=1e-5)


def test_errors() -> None:
    key = torch.randn(4, H, D)
    calibrator = KVCacheCalibrator("fp8+offset+prerope", key_rope=KeyRope.from_base(D, 16))
    with pytest.raises(ValueError, match="positions: expected each key's position"):
        calibrator.observe("a", key, key)
    with pytest.raises(ValueError, match=r"positions: expected \[4\] \(one per key\), got \[3\]"):
        calibrator.observe("a", key, key, torch.arange(3))
    with pytest.raises(ValueError, match=r"key: expected a float tensor \[T, H, D\], got list"):
        calibrator.observe("a", [1.0], key, torch.arange(4))
    with pytest.raises(ValueError, match=r"key: expected a float tensor .* got torch.int64"):
        calibrator.observe("a", torch.zeros(4, H, D, dtype=torch.int64), key, torch.arange(4))
    with pytest.raises(ValueError, match="layer: expected a non-empty layer name"):
        calibrator.observe("", key, key, torch.arange(4))
    with pytest.raises(ValueError, match="value: expected 3 KV heads, got 2"):
        calibrator.observe("a", key, key[:, :2], torch.arange(4))
    with pytest.raises(RuntimeError, match="finish_pass: no K/V observed in this pass"):
        calibrator.finish_pass()
    with pytest.raises(RuntimeError, match=r"calibration: expected 2 finished pass\(es\), got 0"):
        calibrator.calibration()
    calibrator.observe("a", key, key, torch.arange(4))
    calibrator.observe("b", key[:0], key[:0], torch.arange(0))
    with pytest.raises(RuntimeError, match="finish_pass: layer 'b' observed no token"):
        calibrator.finish_pass()
    calibrator.observe("b", key, key, torch.arange(4))
    calibrator.finish_pass()
    with pytest.raises(
        ValueError, match=r"layer: expected one of the layers of the first pass \(a, b\), got 'c'"
    ):
        calibrator.observe("c", key, key, torch.arange(4))
    calibrator.observe("a", key, key, torch.arange(4))
    with pytest.raises(RuntimeError, match="finish_pass: layer 'b' observed no token"):
        calibrator.finish_pass()
    calibrator.observe("b", key, key, torch.arange(4))
    calibrator.finish_pass()
    with pytest.raises(RuntimeError, match="observe: calibration finished"):
        calibrator.observe("a", key, key, torch.arange(4))
    with pytest.raises(RuntimeError, match="finish_pass: calibration finished"):
        calibrator.finish_pass()
    with pytest.raises(ValueError, match="encoding: unknown KV-cache dtype 'fp8_ds_mla'"):
        KVCacheCalibrator("fp8_ds_mla")


def test_saved_calibration_serves_a_cache(tmp_path) -> None:
    """The README's recipe: calibrate offline, save, load into a serving cache of the encoding;
    the serving cache then writes the same bytes as a cache given the values by hand."""
    pytest.importorskip("vllm._custom_ops", reason="a CPU AttentionKVCache needs the extension")
    from vllm.v1.worker.attention_kv_cache import AttentionKVCache

    data = _data(2)
    encoding = "fp8_e4m3/head+hadamard+offset"
    calibrator = _calibrate(encoding, data, splits=(10, 14))
    path = tmp_path / "calibration.json"
    calibrator.calibration().save(path)
    loaded = KVCacheCalibration.load(path)
    key, value = data[LAYERS[1]]
    caches = []
    for by_hand in (False, True):
        cache = AttentionKVCache.create(encoding, 4, 16, H, D, num_heads=H)
        values = loaded.layers[LAYERS[1]]
        if by_hand:
            cache.set_key_offset(values.key_offset)
            cache.set_kv_scales(values.k_scale, values.v_scale)
        else:
            cache.load_calibration(loaded, LAYERS[1])
        meta = cache.metadata(seq_lens=[T], query_lens=[T], block_table=torch.tensor([[1, 3]]))
        cache.write(key, value, meta.slot_mapping)
        caches.append(cache.kv_cache)
    assert torch.equal(caches[0], caches[1])
    assert calibrator.calibration().fingerprint == loaded.fingerprint
