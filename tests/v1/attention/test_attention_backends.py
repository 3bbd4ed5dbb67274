"""Backend layer: shapes and stride orders (docs/design.md §7), the KV-cache layout setting,
FlashInfer validation per dtype × device capability, the selector, and slot mappings."""

from __future__ import annotations

import re

import pytest
import torch

from vllm.v1.attention.backends import (
    AttentionBackendEnum,
    CPUAttentionBackend,
    CPUAttentionImpl,
    CPUAttentionMetadata,
    DeviceCapability,
    FlashInferBackend,
    KVCacheScaleLayouts,
    MLACommonBackend,
    MultipleOf,
    ReferenceAttentionBackend,
    TritonAttentionBackend,
    compute_compressed_slot_mapping,
    compute_slot_mapping,
    get_attn_backend,
    get_device_capability,
    get_kv_cache_layout,
    kv_cache_layout,
    map_to_kernel_blocks,
    registry,
    set_kv_cache_layout,
    split_kv_cache,
)
from vllm.v1.attention.backends.utils import KV_CACHE_LAYOUT_ENV

H100, H20_SM89, A100, B200, RTX5090, T4, V100 = (
    (9, 0),
    (8, 9),
    (8, 0),
    (10, 0),
    (12, 0),
    (7, 5),
    (7, 0),
)


@pytest.fixture(autouse=True)
def _clean_layout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(KV_CACHE_LAYOUT_ENV, raising=False)
    set_kv_cache_layout(None)
    yield
    set_kv_cache_layout(None)


@pytest.fixture(autouse=True)
def _flashinfer_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selector's GPU order as on a host with FlashInfer, whatever this host has (a GPU
    host without the package skips FLASHINFER: test_triton_attn_backend.py covers that)."""
    monkeypatch.setattr(registry, "flashinfer_missing", lambda: False)


# --------------------------------------------------------------------------- layout


def test_layout_default_env_setter_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_kv_cache_layout() == "NHD"
    monkeypatch.setenv(KV_CACHE_LAYOUT_ENV, "HND")
    assert get_kv_cache_layout() == "HND"
    set_kv_cache_layout("NHD")  # code wins over the environment
    assert get_kv_cache_layout() == "NHD"
    with kv_cache_layout("HND") as layout:
        assert layout == get_kv_cache_layout() == "HND"
        with kv_cache_layout("NHD"):
            assert get_kv_cache_layout() == "NHD"
        assert get_kv_cache_layout() == "HND"
    assert get_kv_cache_layout() == "NHD"
    set_kv_cache_layout(None)
    assert get_kv_cache_layout() == "HND"


def test_unknown_layout_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown KV-cache layout 'NDH'.*'NHD', 'HND'"):
        set_kv_cache_layout("NDH")
    with pytest.raises(ValueError, match="'HND_FLASH'"), kv_cache_layout("HND_FLASH"):
        pass
    monkeypatch.setenv(KV_CACHE_LAYOUT_ENV, "nhd")
    message = r"VLLM_KV_CACHE_LAYOUT: expected one of LBHNC, .*NHD, HND, got 'nhd'"
    with pytest.raises(ValueError, match=message):
        FlashInferBackend.get_kv_cache_stride_order()


# --------------------------------------------------------------------- shapes / strides


@pytest.mark.parametrize("backend", [FlashInferBackend, ReferenceAttentionBackend])
def test_kv_cache_shapes(backend) -> None:
    assert backend.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)
    assert backend.get_kv_cache_shape(10, 16, 8, 128, "fp8_e5m2") == (10, 2, 16, 8, 128)
    assert backend.get_kv_cache_shape(10, 16, 8, 64, "nvfp4") == (10, 2, 16, 8, 36)
    assert backend.get_kv_cache_shape(10, 16, 8, 128, "nvfp4") == (10, 2, 16, 8, 72)
    assert backend.get_kv_cache_shape(10, 16, 8, 256, "nvfp4") == (10, 2, 16, 8, 144)
    assert backend.get_kv_cache_shape(0, 16, 8, 64) == (0, 2, 16, 8, 64)
    with pytest.raises(ValueError, match="multiple of 16, got 72"):
        backend.get_kv_cache_shape(10, 16, 8, 72, "nvfp4")
    with pytest.raises(ValueError, match="block_size.*got 0"):
        backend.get_kv_cache_shape(10, 0, 8, 64)


def test_stride_orders() -> None:
    for backend in (FlashInferBackend, ReferenceAttentionBackend):
        with kv_cache_layout("NHD"):
            assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
        with kv_cache_layout("HND"):
            assert backend.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
    with kv_cache_layout("HND"):
        assert MLACommonBackend.get_kv_cache_stride_order() == (0, 1, 2)


def test_mla_shapes() -> None:
    assert MLACommonBackend.get_kv_cache_shape(7, 64, 1, 576) == (7, 64, 576)
    assert MLACommonBackend.get_kv_cache_shape(7, 2, 1, 512, "fp8_ds_mla") == (7, 2, 584)
    with pytest.raises(ValueError, match="1 KV head"):
        MLACommonBackend.get_kv_cache_shape(7, 2, 4, 512)


def test_backend_properties() -> None:
    assert FlashInferBackend.get_name() == "FLASHINFER"
    assert FlashInferBackend.is_kvcache_nvfp4("nvfp4")
    assert not FlashInferBackend.is_kvcache_nvfp4("fp8")
    assert FlashInferBackend.get_supported_head_sizes() == [64, 128, 256]
    assert FlashInferBackend.get_supported_kernel_block_sizes() == [16, 32, 64]
    assert ReferenceAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(1)]
    assert FlashInferBackend.supports_block_size(256)
    assert not FlashInferBackend.supports_block_size(8)
    assert ReferenceAttentionBackend.supports_block_size(3)
    assert FlashInferBackend.get_nvfp4_scale_layout(16, 128).value == "interleave4"
    # REFERENCE reads what the op writes by default: upstream's interleave4 where it fits.
    assert ReferenceAttentionBackend.get_nvfp4_scale_layout(16, 128).value == "interleave4"
    assert ReferenceAttentionBackend.get_nvfp4_scale_layout(6, 128).value == "linear"
    assert ReferenceAttentionBackend.get_nvfp4_scale_layout(16, 80).value == "linear"
    # The per-cache record (K, V) that writers and readers take comes from the same method.
    assert FlashInferBackend.get_kv_cache_scale_layouts(16, 128) == KVCacheScaleLayouts(
        FlashInferBackend.get_nvfp4_scale_layout(16, 128),
        FlashInferBackend.get_nvfp4_scale_layout(16, 128),
    )
    assert tuple(ReferenceAttentionBackend.get_kv_cache_scale_layouts(16, 128, 80)) == (
        "interleave4",
        "linear",
    )
    assert FlashInferBackend.get_required_kv_cache_layout(B200) == "HND"
    assert FlashInferBackend.get_required_kv_cache_layout(H100) is None
    assert ReferenceAttentionBackend.get_required_kv_cache_layout(B200) is None
    assert get_device_capability("cpu") is None
    assert str(DeviceCapability(10, 0)) == "sm_100"


# ------------------------------------------------------------------------ validation


def fi_reasons(kv_cache_dtype: str, capability, **kw) -> list[str]:
    args = dict(head_size=128, dtype=torch.bfloat16, block_size=16)
    args.update(kw)
    with kv_cache_layout("HND"):
        return FlashInferBackend.validate_configuration(
            args["head_size"],
            args["dtype"],
            kv_cache_dtype,
            args["block_size"],
            capability,
            head_size_v=kw.get("head_size_v"),
        )


@pytest.mark.parametrize(
    ("kv_cache_dtype", "capability"),
    [
        ("auto", A100),
        ("bfloat16", H100),
        ("auto", T4),
        ("fp8", H20_SM89),
        ("fp8_e4m3", H100),
        ("fp8_e5m2", B200),
        ("fp8", RTX5090),
        ("nvfp4", B200),
        ("nvfp4", (10, 3)),
    ],
)
def test_flashinfer_serves(kv_cache_dtype: str, capability) -> None:
    assert fi_reasons(kv_cache_dtype, capability) == []


@pytest.mark.parametrize(
    ("kv_cache_dtype", "capability", "kw", "message"),
    [
        ("auto", None, {}, r"FlashInfer needs an NVIDIA GPU.*CPU.*ReferenceAttentionBackend"),
        ("auto", V100, {}, r"compute capability 7.5 to 12.1, got 7.0"),
        ("fp8", A100, {}, r"FP8 KV cache \(fp8\).*8.9 \(sm_89\) or newer, got sm_80"),
        ("fp8_e5m2", A100, {}, r"FP8 KV cache \(fp8_e5m2\)"),
        ("nvfp4", H100, {}, r"NVFP4 KV cache.*trtllm-gen.*sm_100 family.*got sm_90"),
        ("nvfp4", RTX5090, {}, r"sm_100 family \(compute capability 10.x\), got sm_120"),
        ("nvfp4", A100, {}, r"NVFP4 KV cache.*got sm_80"),
        ("auto", H100, {"head_size": 96}, r"head size 96 not supported.*64, 128, 256"),
        ("auto", H100, {"block_size": 8}, r"block size 8 not supported.*16, 32, 64"),
        ("auto", H100, {"dtype": torch.float32}, r"model dtype torch.float32 not supported"),
        ("float32", H100, {}, r"kv_cache_dtype 'float32' not supported by FLASHINFER"),
        ("int8", H100, {}, r"'int8' is not a KV-cache dtype.*auto, float16"),
        ("float16", H100, {}, r"must hold the model dtype.*'float16'.*torch.bfloat16"),
        ("auto", H100, {"head_size_v": 64}, r"head_size_v=64 != head_size=128"),
    ],
)
def test_flashinfer_rejects(kv_cache_dtype: str, capability, kw: dict, message: str) -> None:
    reasons = fi_reasons(kv_cache_dtype, capability, **kw)
    assert reasons, "expected FlashInfer to refuse"
    assert any(re.search(message, r) for r in reasons), reasons
    with pytest.raises(ValueError, match=message):
        args = dict(head_size=128, dtype=torch.bfloat16, block_size=16)
        args.update({k: v for k, v in kw.items() if k != "head_size_v"})
        with kv_cache_layout("HND"):
            FlashInferBackend.check_configuration(
                args["head_size"],
                args["dtype"],
                kv_cache_dtype,
                args["block_size"],
                capability,
                head_size_v=kw.get("head_size_v"),
            )


def test_flashinfer_on_blackwell_needs_hnd() -> None:
    with kv_cache_layout("NHD"):
        reasons = FlashInferBackend.validate_configuration(128, torch.bfloat16, "nvfp4", 16, B200)
    assert len(reasons) == 1 and "needs the HND KV-cache layout" in reasons[0]
    assert "VLLM_KV_CACHE_LAYOUT=HND" in reasons[0]


def test_reference_backend_validation() -> None:
    for dtype in ("auto", "float32", "fp8_e5m2", "nvfp4"):
        for capability in (None, A100, H100):
            assert (
                ReferenceAttentionBackend.validate_configuration(
                    80 if dtype != "nvfp4" else 64,
                    torch.float16,
                    dtype,
                    7,
                    capability,
                    head_size_v=48,
                )
                == []
            )
    reasons = ReferenceAttentionBackend.validate_configuration(
        72, torch.bfloat16, "nvfp4", 16, None
    )
    assert reasons == ["NVFP4 KV cache needs a head size that is a multiple of 16, got 72"]
    reasons = ReferenceAttentionBackend.validate_configuration(
        64, torch.bfloat16, "auto", 16, None, use_mla=True
    )
    assert reasons == ["REFERENCE serves no MLA layers, got use_mla=True"]
    with pytest.raises(ValueError, match="cannot serve this configuration: model dtype torch.int8"):
        ReferenceAttentionBackend.check_configuration(64, torch.int8, "auto", 16, None)

    class Restricted(ReferenceAttentionBackend):
        supported_head_sizes = [64, 128]

    reasons = Restricted.validate_configuration(
        64, torch.bfloat16, "auto", 16, None, head_size_v=96
    )
    assert reasons == ["head_size_v 96 not supported by REFERENCE"]


def test_selector() -> None:
    with kv_cache_layout("HND"):
        assert get_attn_backend(128, torch.bfloat16, "nvfp4", 16, B200) is FlashInferBackend
        assert get_attn_backend(128, torch.bfloat16, "nvfp4", 16, None) is CPUAttentionBackend
        named = get_attn_backend(128, torch.bfloat16, "nvfp4", 16, None, backend="REFERENCE")
        assert named is ReferenceAttentionBackend
        # What FlashInfer cannot serve on a GPU goes to TRITON_ATTN (issue 23).
        assert get_attn_backend(128, torch.bfloat16, "nvfp4", 16, H100) is TritonAttentionBackend
        assert (
            get_attn_backend(512, torch.bfloat16, "fp8_ds_mla", 2, H100, use_mla=True)
            is MLACommonBackend
        )
        with pytest.raises(ValueError, match=r"FLASHINFER: NVFP4 KV cache.*got sm_90"):
            get_attn_backend(128, torch.bfloat16, "nvfp4", 16, H100, backend="flashinfer")
        with pytest.raises(ValueError, match=r"FLASHINFER: FlashInfer needs an NVIDIA GPU"):
            get_attn_backend(128, torch.bfloat16, "auto", 16, None, backend="FLASHINFER")
        with pytest.raises(ValueError, match=r"unknown attention backend 'flash_attn'.*FLASHINFER"):
            get_attn_backend(128, torch.bfloat16, "auto", 16, H100, backend="flash_attn")
        with pytest.raises(ValueError, match=r"no attention backend.*FLASHINFER: .*REFERENCE: "):
            get_attn_backend(128, torch.int8, "auto", 16, H100)
    assert AttentionBackendEnum.REFERENCE.get_class() is ReferenceAttentionBackend
    with pytest.raises(ValueError, match="device_capability"):
        get_attn_backend(128, torch.bfloat16, "auto", 16, "sm_90")  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_selector_prefers_cpu_attn_on_cpu(kv_cache_dtype: str, layout: str) -> None:
    """On the CPU the compiled backend is chosen wherever it serves the request (any model
    dtype, cache format, layout and head_size_v), and is exported with the others."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        chosen = get_attn_backend(
            64,
            dtype,
            kv_cache_dtype,
            16,
            None,
            head_size_v=48 if dtype != torch.float32 else None,
            kv_cache_layout=layout,
        )
        assert chosen is CPUAttentionBackend
    assert CPUAttentionBackend.get_impl_cls() is CPUAttentionImpl
    assert CPUAttentionBackend.get_metadata_cls() is CPUAttentionMetadata
    # Not on a GPU, and not for MLA: those orders are unchanged.
    assert get_attn_backend(128, torch.bfloat16, "auto", 16, H100) is FlashInferBackend
    assert get_attn_backend(72, torch.bfloat16, "auto", 16, H100) is TritonAttentionBackend


def test_selector_falls_back_to_reference_without_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a loadable ``paged_attention`` CPU_ATTN says so and REFERENCE serves the CPU."""
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "_kernel_missing", lambda: "the compiled extension (test)")
    reasons = CPUAttentionBackend.validate_configuration(64, torch.bfloat16, "auto", 16, None)
    assert reasons == ["CPU_ATTN needs the compiled extension (test)"]
    assert get_attn_backend(64, torch.bfloat16, "auto", 16, None) is ReferenceAttentionBackend


# ---------------------------------------------------------------------- slot mappings


def test_compressed_slot_mapping_worked_example() -> None:
    """Block 256, ratio 4 (64 slots per page), block table [5, 7], positions 240..279."""
    positions = torch.arange(240, 280)
    slots = compute_compressed_slot_mapping(torch.tensor([5, 7]), positions, 256, 4)
    expected = torch.full((40,), -1, dtype=torch.int64)
    stored = (positions + 1) % 4 == 0
    expected[stored] = torch.tensor(
        [5 * 64 + i for i in range(60, 64)] + [7 * 64 + i for i in range(6)]
    )
    assert torch.equal(slots, expected)
    assert slots.dtype == torch.int64
    assert int((slots >= 0).sum()) == 10


def test_compressed_slot_mapping_matches_loop() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 50, (3, 4), generator=g)
    req = torch.randint(0, 3, (200,), generator=g)
    pos = torch.randint(0, 4 * 128, (200,), generator=g)
    got = compute_compressed_slot_mapping(table, pos, 128, 8, req)
    for i in range(200):
        p, r = int(pos[i]), int(req[i])
        want = int(table[r, p // 128]) * 16 + (p % 128) // 8 if (p + 1) % 8 == 0 else -1
        assert int(got[i]) == want
    # Ratio 1 is the plain mapping.
    assert torch.equal(
        compute_compressed_slot_mapping(table, pos, 128, 1, req),
        compute_slot_mapping(table, pos, 128, req),
    )


def test_plain_slot_mapping_and_kernel_blocks() -> None:
    table = torch.tensor([[3, 9, 4], [0, 1, 2]])
    pos = torch.tensor([0, 15, 16, 40, 5])
    req = torch.tensor([0, 0, 0, 0, 1])
    slots = compute_slot_mapping(table, pos, 16, req)
    assert slots.tolist() == [48, 63, 144, 72, 5]
    kernel_table = map_to_kernel_blocks(table, 4)
    assert kernel_table[0].tolist() == [12, 13, 14, 15, 36, 37, 38, 39, 16, 17, 18, 19]
    assert torch.equal(compute_slot_mapping(kernel_table, pos, 4, req), slots)
    assert map_to_kernel_blocks(table, 1) is table


def test_slot_mapping_errors() -> None:
    table = torch.tensor([[3, 9]])
    with pytest.raises(ValueError, match="needs block index 2, but the table has 2 columns"):
        compute_slot_mapping(table, torch.tensor([40]), 16)
    with pytest.raises(ValueError, match="non-negative token positions"):
        compute_slot_mapping(table, torch.tensor([-1]), 16)
    with pytest.raises(
        ValueError, match="compress_ratio: expected a positive divisor of block_size=256"
    ):
        compute_compressed_slot_mapping(table, torch.tensor([1]), 256, 3)
    with pytest.raises(ValueError, match="req_indices: needed"):
        compute_slot_mapping(torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1]), 16)
    with pytest.raises(ValueError, match=r"req_indices: expected values in \[0, 1\)"):
        compute_slot_mapping(table, torch.tensor([1]), 16, torch.tensor([1]))
    with pytest.raises(ValueError, match="blocks_per_kv_block"):
        map_to_kernel_blocks(table, 0)
    with pytest.raises(ValueError, match="block_size: expected a positive int .*got 0"):
        compute_slot_mapping(table, torch.tensor([1]), 0)
    with pytest.raises(ValueError, match=r"positions: expected shape \[T\], got \[1, 1\]"):
        compute_slot_mapping(table, torch.tensor([[1]]), 16)
    with pytest.raises(ValueError, match=r"block_table: expected shape \[max_blocks\] or"):
        compute_slot_mapping(table[None], torch.tensor([1]), 16)
    with pytest.raises(ValueError, match=r"req_indices: expected shape \[2\] .*got \[1\]"):
        compute_slot_mapping(table, torch.tensor([1, 2]), 16, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"kv_cache: expected a \(key_cache, value_cache\) pair"):
        split_kv_cache((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)))
    with pytest.raises(ValueError, match=r"kv_cache: expected a \(B, 2, N, H, D'\) tensor"):
        split_kv_cache(torch.zeros(1, 3, 2, 3, 4))
    assert compute_slot_mapping(table, torch.zeros(0, dtype=torch.int64), 16).numel() == 0
