"""The attention impl applies its encoding's key transform itself: an engine that builds the impl
from an encoding id and calls ``do_kv_cache_update`` / ``forward`` directly (as upstream's engine
does) stores the same page bytes and gets the same attention as :class:`AttentionKVCache`; an
encoding that needs positions says so instead of storing wrong keys; calibrated state saved to a
file and loaded again gives the same cache; the spec counts every byte the cache allocates."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import KeyRope, KVScaleObserver
from vllm.kv_quant.calibrated import KVCacheCalibration, LayerCalibration
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.v1.attention.backends.abstract import AttentionLayerScales
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.reference import ReferenceAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.attention_kv_cache import AttentionKVCache
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

pytest.importorskip("vllm._custom_ops")

H, HQ, D, BLOCK, PAGES = 2, 4, 64, 16, 6
ROPE = KeyRope.from_base(D, 128, base=10000.0)
TABLE = torch.tensor([[4, 0, 2, 5]])
CHUNKS = ((0, 23), (23, 24), (24, 40))

ENCODINGS = [
    "fp8_e4m3/head+hadamard+offset",
    "nvfp4_mse+offset+prerope+sink",
    "nvfp4_4over6+hadamard+offset+prerope+sink",
    "fp8_e5m2+sink2",
    "nvfp4+hadamard+prerope",
    "int8_per_token_head",
]
BACKENDS = {"CPU_ATTN": CPUAttentionBackend, "REFERENCE": ReferenceAttentionBackend}


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(H, D, generator=gen) * 3 + torch.randn(40, H, D, generator=gen)
    k = ROPE.rotate(pre, torch.arange(40))
    return k, torch.randn(40, H, D, generator=gen), torch.randn(40, HQ, D, generator=gen)


def _calibrated(encoding: str, backend: str, k: torch.Tensor, v: torch.Tensor) -> AttentionKVCache:
    enc = KVCacheEncoding.parse(encoding)
    rope = ROPE if enc.key.prerope else None
    cache = AttentionKVCache.create(
        encoding, PAGES, BLOCK, H, D, num_heads=HQ, backend=backend, model_dtype=torch.float32,
        key_rope=rope,
    )  # fmt: skip
    positions = torch.arange(40)
    if enc.key.offset:
        raw = ROPE.unrotate(k, positions) if rope is not None else k
        cache.set_key_offset(raw.mean(0))
    observer = KVScaleObserver(per_head=enc.per_head_scales)
    observer.observe(cache.stored_key(k, positions if rope is not None else None), v)
    cache.set_kv_scales(*observer.scales(enc.format.name))
    return cache


def _run(cache: AttentionKVCache, k, v, q) -> torch.Tensor:  # type: ignore[no-untyped-def]
    outs = []
    for start, stop in CHUNKS:
        meta = cache.metadata([stop], [stop - start], TABLE)
        outs.append(cache.forward(q[start:stop], k[start:stop], v[start:stop], meta))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_an_engine_driving_the_impl_gets_what_the_cache_gets(encoding: str, backend: str) -> None:
    k, v, q = _data(len(encoding))
    cache = _calibrated(encoding, backend, k, v)
    expected = _run(cache, k, v, q)

    # The engine's way: a spec carrying the encoding, the worker's allocation, the impl built
    # from the encoding id, the layer holding scales only, the calls upstream's engine makes.
    enc = KVCacheEncoding.parse(encoding)
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=enc.format.storage_dtype,
        kv_quant_mode=enc.format.quant_mode, encoding=enc,
    )  # fmt: skip
    config = KVCacheConfig(
        num_blocks=PAGES,
        kv_cache_tensors=[KVCacheTensor(PAGES * spec.page_size_bytes, ["layer"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    backend_cls = BACKENDS[backend]
    kv_cache = init_layer_kv_caches(config, [backend_cls], "cpu", model_dtype=torch.float32)[
        "layer"
    ]
    impl = backend_cls.get_impl_cls()(
        HQ, D, num_kv_heads=H, kv_cache_dtype=encoding,
        key_rope=ROPE if enc.key.prerope else None,
    )  # fmt: skip
    impl.set_key_offset(cache.key_offset)
    layer = AttentionLayerScales(cache.k_scale, cache.v_scale)
    outs = []
    for start, stop in CHUNKS:
        meta = cache.metadata([stop], [stop - start], TABLE)
        impl.do_kv_cache_update(
            layer, k[start:stop], v[start:stop], kv_cache, meta.slot_mapping,
            positions=meta.token_positions(),
        )  # fmt: skip
        outs.append(impl.forward(layer, q[start:stop], None, None, kv_cache, meta))
    assert torch.equal(_bytes(kv_cache), _bytes(cache.kv_cache))  # the same pages, sinks too
    torch.testing.assert_close(torch.cat(outs), expected, rtol=0, atol=0)


def _bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's storage (K, V and sink rows of every page)."""
    storage = kv_cache.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def test_keys_stored_before_rope_need_positions_not_silence() -> None:
    impl = CPUAttentionBackend.get_impl_cls()(
        HQ, D, num_kv_heads=H, kv_cache_dtype="nvfp4+prerope+sink", key_rope=ROPE
    )
    k, v, _ = _data(0)
    cache = AttentionKVCache.create("nvfp4+prerope+sink", PAGES, BLOCK, H, D, key_rope=ROPE)
    before = _bytes(cache.kv_cache).clone()
    slots = cache.metadata([40], [40], TABLE).slot_mapping
    with pytest.raises(ValueError, match="positions: expected each key's position"):
        impl.do_kv_cache_update(AttentionLayerScales(), k, v, cache.kv_cache, slots)
    assert torch.equal(_bytes(cache.kv_cache), before)
    with pytest.raises(ValueError, match="key_rope: expected the model's KeyRope"):
        CPUAttentionBackend.get_impl_cls()(HQ, D, num_kv_heads=H, kv_cache_dtype="nvfp4+prerope")
    with pytest.raises(ValueError, match="key_rope: expected None"):
        CPUAttentionBackend.get_impl_cls()(HQ, D, num_kv_heads=H, kv_cache_dtype="nvfp4",
                                           key_rope=ROPE)  # fmt: skip
    enc = KVCacheEncoding.parse("nvfp4+prerope").with_rope(ROPE)
    other_rope = KeyRope.from_base(D, 128, base=500.0)
    with pytest.raises(ValueError, match="key_rope: expected the RoPE table the encoding names"):
        CPUAttentionBackend.get_impl_cls()(
            HQ, D, num_kv_heads=H, kv_cache_dtype=enc, key_rope=other_rope
        )


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_calibration_saved_and_loaded_gives_the_same_cache(encoding: str, tmp_path) -> None:
    k, v, q = _data(7)
    cache = _calibrated(encoding, "CPU_ATTN", k, v)
    calibration = KVCacheCalibration(
        cache.encoding, {"layer": LayerCalibration(cache.k_scale, cache.v_scale, cache.key_offset)}
    )
    path = tmp_path / "calibration.json"
    calibration.save(path)
    loaded = KVCacheCalibration.load(path)
    assert loaded.encoding == cache.encoding and loaded.fingerprint == calibration.fingerprint
    assert loaded.layers["layer"].same_values(calibration.layers["layer"])
    rope = ROPE if cache.encoding.key.prerope else None
    fresh = AttentionKVCache.create(
        encoding, PAGES, BLOCK, H, D, num_heads=HQ, model_dtype=torch.float32, key_rope=rope
    )
    fresh.load_calibration(loaded, "layer")
    torch.testing.assert_close(_run(fresh, k, v, q), _run(cache, k, v, q), rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer: expected one of layer, got 'other'"):
        fresh.load_calibration(loaded, "other")
    other = AttentionKVCache.create("fp8_e4m3/head+offset", PAGES, BLOCK, H, D)
    if cache.encoding.id != "fp8_e4m3/head+offset":
        with pytest.raises(ValueError, match="calibration: expected one of encoding"):
            other.load_calibration(loaded, "layer")


def test_a_bad_calibration_file_names_what_is_wrong(tmp_path) -> None:
    enc = KVCacheEncoding.parse("fp8/head+offset")
    good = KVCacheCalibration(
        enc,
        {"0": LayerCalibration(torch.tensor([0.5, 0.25]), torch.tensor(0.1), torch.zeros(2, 4))},
    )
    path = tmp_path / "c.json"
    good.save(path)
    text = path.read_text()
    for bad, message in (
        ("not json", "expected a calibration file"),
        (text.replace('"version": 1', '"version": 2'), "expected version 1"),
        (text.replace('"fp8_e4m3/head+offset"', '"fp8_e4m3/head"'), "fingerprint: expected"),
        (text.replace("0.5", "-0.5"), r"k_scale: expected one value or \[H\] values > 0"),
        (text.replace("0.5", "NaN"), "non-finite"),
        (text.replace("0.1", "0.1000000000000001"), "expected fp32 values"),
    ):
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            KVCacheCalibration.load(path)
    with pytest.raises(ValueError, match="expected a key offset for encoding"):
        KVCacheCalibration(enc, {"0": LayerCalibration(torch.tensor(0.5), torch.tensor(0.5))})


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_the_spec_counts_every_byte_the_cache_allocates(encoding: str) -> None:
    rope = ROPE if KVCacheEncoding.parse(encoding).key.prerope else None
    cache = AttentionKVCache.create(encoding, PAGES, BLOCK, H, D, key_rope=rope)
    assert cache.kv_cache.untyped_storage().nbytes() == PAGES * cache.spec.page_size_bytes
    assert cache.spec.encoding == cache.encoding
