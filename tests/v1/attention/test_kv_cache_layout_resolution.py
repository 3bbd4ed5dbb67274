"""Upstream v0.33's whole-cache layout resolution: the layouts a worker's backends support,
the one layout of a model (checks, environment, recording on the cache config), and how a
v0.33 name maps to a page side's order."""

from __future__ import annotations

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backends import FlashInferBackend, ReferenceAttentionBackend
from vllm.v1.attention.backends import utils as backend_utils
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import (
    DEFAULT_LAYOUT_PREFERENCE,
    get_flashinfer_layout_string,
    get_kv_cache_layout,
    get_supported_kv_cache_layouts,
    record_kv_cache_layout,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout, layout_from_name

L = KVCacheLayout


@pytest.fixture(autouse=True)
def no_layout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend_utils.KV_CACHE_LAYOUT_ENV, raising=False)
    monkeypatch.setattr(backend_utils, "_layout_override", None)


def declaring(*layouts: KVCacheLayout | None) -> type:
    class Backend(ReferenceAttentionBackend):
        @classmethod
        def supported_kv_cache_layouts(cls):
            return None if layouts == (None,) else layouts

    return Backend


def spec(heads: int = 8, **kw) -> FullAttentionSpec:
    kw = {"dtype": torch.bfloat16, **kw}
    return FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64, **kw)


def test_supported_layouts_of_a_worker() -> None:
    assert get_supported_kv_cache_layouts([declaring(None)]) == list(DEFAULT_LAYOUT_PREFERENCE)
    same = declaring(L.BLHNC, L.LBHNC)
    assert get_supported_kv_cache_layouts([same, same, declaring(None)]) == [L.BLHNC, L.LBHNC]
    mixed = [declaring(L.LBHNC, L.BLHNC), declaring(L.BLHNC, L.LBHNC), declaring(L.BLHNC)]
    assert get_supported_kv_cache_layouts(mixed) == [L.BLHNC]
    with pytest.raises(ValueError, match="backends: expected a KV-cache layout they all support"):
        get_supported_kv_cache_layouts([declaring(L.LBNHC), declaring(L.LBHNC)])


def test_flashinfer_layouts_follow_its_required_interior(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import backend

    monkeypatch.setattr(backend, "get_device_capability", lambda device: None)
    assert FlashInferBackend.supported_kv_cache_layouts() is None
    monkeypatch.setattr(backend, "get_device_capability", lambda d: DeviceCapability(10, 0))
    assert FlashInferBackend.supported_kv_cache_layouts() == (L.LBHNC, L.BLHNC)


def config() -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(max_model_len=1024))


def test_resolution_takes_the_first_candidate_and_records_it() -> None:
    vllm_config = config()
    assert resolve_kv_cache_layout(vllm_config, [["BLHNC", "LBNHC"]] * 2, [spec()]) == L.BLHNC
    assert vllm_config.cache_config.kv_cache_layout == "BLHNC"
    # A recorded layout wins over what workers report.
    assert resolve_kv_cache_layout(vllm_config, [["LBNHC"]], [spec()]) == L.BLHNC


def test_pages_of_different_shapes_need_a_block_compact_layout() -> None:
    specs = [spec(heads=8), spec(heads=4)]
    assert resolve_kv_cache_layout(config(), [["BHLNC", "LBHNC"]], specs) == L.LBHNC
    with pytest.raises(ValueError, match="specs whose pages differ need a block-compact layout"):
        resolve_kv_cache_layout(config(), [["BHLNC", "LHBNC"]], specs)


def test_sharded_and_replicated_caches_need_a_block_outermost_layout() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    draft = spec(dcp_sharded=False)
    assert resolve_kv_cache_layout(config(), [["LBHNC", "BLHNC"]], [mla, draft]) == L.BLHNC
    with pytest.raises(ValueError, match="need a block-outermost layout"):
        resolve_kv_cache_layout(config(), [["LBHNC"]], [mla, draft])


def test_requested_layout_must_be_a_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend_utils.KV_CACHE_LAYOUT_ENV, "HND")  # v0.22's name for LBHNC
    assert resolve_kv_cache_layout(config(), [["LBNHC", "LBHNC"]], [spec()]) == L.LBHNC
    with pytest.raises(ValueError, match=r"VLLM_KV_CACHE_LAYOUT: expected one of \['LBNHC'\]"):
        resolve_kv_cache_layout(config(), [["LBNHC"]], [spec()])


@pytest.mark.parametrize(
    ("reported", "message"),
    [
        ([], "supported_layouts: expected each worker's non-empty list"),
        ([["LBHNC"], ["LBNHC"]], "expected every worker to report the same layouts"),
        ([["LBXYZ"]], "supported_layouts: expected one of LBHNC"),
    ],
)
def test_bad_reports(reported: list[list[str]], message: str) -> None:
    vllm_config = config()
    with pytest.raises(ValueError, match=message):
        resolve_kv_cache_layout(vllm_config, reported, [spec()])
    assert vllm_config.cache_config.kv_cache_layout is None


def test_recording_and_reading_a_resolved_layout() -> None:
    cache_config = CacheConfig()
    with pytest.raises(ValueError, match="kv_cache_layout: expected a resolved layout"):
        cache_config.get_resolved_kv_cache_layout()
    record_kv_cache_layout(cache_config, "NHD")
    assert cache_config.get_resolved_kv_cache_layout() == L.LBNHC
    record_kv_cache_layout(cache_config, "LBNHC")  # the same layout again is fine
    with pytest.raises(ValueError, match="layout_name: expected the resolved layout LBNHC"):
        record_kv_cache_layout(cache_config, "BLHNC")


def test_page_side_order_of_v033_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [get_flashinfer_layout_string(m) for m in (L.LBNHC, L.BLHNC, L.BHLNC)] == [
        "NHD",
        "HND",
        "HND",
    ]
    monkeypatch.setenv(backend_utils.KV_CACHE_LAYOUT_ENV, "BLHNC")
    assert get_kv_cache_layout() == "HND"
    assert layout_from_name("HND") is L.LBHNC
    with pytest.raises(ValueError, match="layout: expected one of"):
        layout_from_name("XYZ")


def test_customize_spec_keeps_the_encodings_page() -> None:
    per_token_head = spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert TritonAttentionBackend.customize_spec(per_token_head) is per_token_head
