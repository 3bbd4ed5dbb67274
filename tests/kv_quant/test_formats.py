"""The KV-cache format registry: every format fact the code used to re-derive from strings, the
one lookup and its error, the tables derived from it, and its agreement with the C++ kernels."""

import re
from pathlib import Path
from typing import get_args

import pytest
import torch

from vllm.config.cache import CACHE_DTYPES, CacheDType
from vllm.kv_quant import formats as registry
from vllm.kv_quant.formats import (
    CacheKind,
    KVCacheFormat,
    KVQuantMode,
    accepted_names_of,
    cache_dtype_names,
    find_dtype_name,
    format_for_storage,
    kernel_cache_kind,
    lookup,
)
from vllm.utils.torch_utils import (
    MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP,
    STR_DTYPE_TO_TORCH_DTYPE,
    is_quantized_kv_cache,
    kv_cache_dtype_str_to_dtype,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

REPO = Path(__file__).resolve().parents[2]

# name: (canonical, storage dtype, quant mode, label, last dim at D=128, fp8 variant,
#        scale layouts, mla_only, C++ CacheKind)
FACTS = {
    "auto": ("auto", None, KVQuantMode.NONE, "auto", 128, None, (), False, "kUnquantized"),
    "float16": ("float16", torch.float16, KVQuantMode.NONE, "fp16", 128, None, (), False,
                "kUnquantized"),
    "bfloat16": ("bfloat16", torch.bfloat16, KVQuantMode.NONE, "bf16", 128, None, (), False,
                 "kUnquantized"),
    "float32": ("float32", torch.float32, KVQuantMode.NONE, "fp32", 128, None, (), False,
                "kUnquantized"),
    "float": ("float32", torch.float32, KVQuantMode.NONE, "fp32", 128, None, (), False,
              "kUnquantized"),
    "fp8": ("fp8_e4m3", torch.uint8, KVQuantMode.FP8_PER_TENSOR, "fp8", 128, "e4m3", (), False,
            "kFp8E4M3"),
    "fp8_e4m3": ("fp8_e4m3", torch.uint8, KVQuantMode.FP8_PER_TENSOR, "fp8", 128, "e4m3", (),
                 False, "kFp8E4M3"),
    "fp8_e5m2": ("fp8_e5m2", torch.uint8, KVQuantMode.FP8_PER_TENSOR, "fp8", 128, "e5m2", (),
                 False, "kFp8E5M2"),
    "nvfp4": ("nvfp4", torch.uint8, KVQuantMode.NVFP4, "nvfp4", 72, None,
              ("linear", "interleave4"), False, "kNvfp4"),
    "nvfp4_mse": ("nvfp4_mse", torch.uint8, KVQuantMode.NVFP4, "nvfp4_mse", 72, None,
                  ("linear", "interleave4"), False, "kNvfp4"),
    "nvfp4_4over6": ("nvfp4_4over6", torch.uint8, KVQuantMode.NVFP4, "nvfp4_4over6", 72, None,
                     ("linear", "interleave4"), False, "kNvfp4"),
    "int8_per_token_head": ("int8_per_token_head", torch.int8, KVQuantMode.INT8_PER_TOKEN_HEAD,
                            "int8_pth", 132, None, (), False, "kInt8PerTokenHead"),
    "fp8_per_token_head": ("fp8_per_token_head", torch.uint8, KVQuantMode.FP8_PER_TOKEN_HEAD,
                           "fp8_pth", 132, None, (), False, "kFp8PerTokenHead"),
    # TurboQuant: one packed K+V slot per head; the per-side row is half of it (196/134/118/102)
    "turboquant_k8v4": ("turboquant_k8v4", torch.uint8, KVQuantMode.TURBOQUANT_K8V4, "tq_k8v4",
                        98, None, (), False, None),
    "turboquant_4bit_nc": ("turboquant_4bit_nc", torch.uint8, KVQuantMode.TURBOQUANT_4BIT_NC,
                           "tq_4bit_nc", 67, None, (), False, None),
    "turboquant_k3v4_nc": ("turboquant_k3v4_nc", torch.uint8, KVQuantMode.TURBOQUANT_K3V4_NC,
                           "tq_k3v4_nc", 59, None, (), False, None),
    "turboquant_3bit_nc": ("turboquant_3bit_nc", torch.uint8, KVQuantMode.TURBOQUANT_3BIT_NC,
                           "tq_3bit_nc", 51, None, (), False, None),
    # 64 values packed two per byte, then the scale word (zero point in its low 4 bits)
    "int4_per_token_head": ("int4_per_token_head", torch.uint8, KVQuantMode.INT4_PER_TOKEN_HEAD,
                            "int4_pth", 68, None, (), False, "kInt4PerTokenHead"),
    # packed K+V slot of 128 + 2 * 4 bytes (FP4 codes, UE8M0 group scales); the row is half of it
    "ultraquant_4bit": ("ultraquant_4bit", torch.uint8, KVQuantMode.ULTRAQUANT_4BIT, "uq4",
                        68, None, (), False, None),
    # one 352-byte DeepSeek-V3.2 MLA record per token, for head size 576 only (None: 128 raises)
    "nvfp4_ds_mla": ("nvfp4_ds_mla", torch.uint8, KVQuantMode.NVFP4_DS_MLA, "nvfp4_ds_mla",
                     None, None, (), False, None),
    # Octave: one packed K+V slot per head, half of it per side; block K's slot depends on the
    # model's registered rotary dims (None here; tests/kv_quant/test_octave.py), compact K's not
    "octave_k3v4": ("octave_k3v4", torch.uint8, KVQuantMode.OCTAVE_K3V4, "oct_k3v4", None,
                    None, (), False, None),
    "octave_k3v3": ("octave_k3v3", torch.uint8, KVQuantMode.OCTAVE_K3V3, "oct_k3v3", None,
                    None, (), False, None),
    "octave_k3v3_compact": ("octave_k3v3_compact", torch.uint8, KVQuantMode.OCTAVE_K3V3_COMPACT,
                            "oct_k3v3c", 50, None, (), False, None),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FACTS))
def test_format_facts(name: str) -> None:
    canonical, storage, mode, label, last_dim, variant, layouts, mla_only, kind = FACTS[name]
    fmt = lookup(name)
    assert (fmt.name, fmt.storage_dtype, fmt.quant_mode, fmt.label) == (
        canonical,
        storage,
        mode,
        label,
    )
    if last_dim is not None:
        assert fmt.last_dim(128) == last_dim
    cpp_kind = None if fmt.cache_kind is None else fmt.cache_kind.cpp_name
    assert (fmt.fp8_variant, fmt.scale_layouts, fmt.mla_only, cpp_kind) == (
        variant,
        layouts,
        mla_only,
        kind,
    )
    assert fmt.is_quantized == is_quantized_kv_cache(name) == (mode != KVQuantMode.NONE)
    assert fmt.is_auto == (name == "auto")


def test_fp8_ds_mla_is_an_mla_only_record() -> None:
    fmt = lookup("fp8_ds_mla")
    assert fmt.mla_only and fmt.is_fp8 and fmt.storage_dtype == torch.uint8
    assert fmt.last_dim(512) == 584 and fmt.cache_kind is None  # DeepSeek-V4
    assert fmt.last_dim(576) == 656  # DeepSeek-V3.2
    with pytest.raises(ValueError, match="head_size: the fp8_ds_mla record is defined for head"):
        fmt.last_dim(128)
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV-cache dtype 'fp8_ds_mla'"):
        lookup("fp8_ds_mla", include_mla_only=False)
    with pytest.raises(ValueError, match="format 'fp8_ds_mla' has no kernel support"):
        kernel_cache_kind("fp8_ds_mla")


def test_nvfp4_row_size() -> None:
    nvfp4 = lookup("nvfp4")
    assert [nvfp4.last_dim(d) for d in (16, 64, 128, 256)] == [9, 36, 72, 144]
    assert nvfp4.block_scale_group == 16
    with pytest.raises(ValueError, match="head_size: NVFP4 KV cache needs a positive multiple"):
        nvfp4.last_dim(24)


def test_accepted_names_and_the_one_error() -> None:
    names = (
        "auto, float16, bfloat16, float32, float, fp8, fp8_e4m3, fp8_e5m2, nvfp4, nvfp4_mse, "
        "nvfp4_4over6, int8_per_token_head, fp8_per_token_head, int4_per_token_head, "
        "nvfp4_ds_mla, octave_k3v4, octave_k3v3, octave_k3v3_compact, turboquant_k8v4, "
        "turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc, ultraquant_4bit"
    )
    assert ", ".join(cache_dtype_names()) == names
    with_mla = cache_dtype_names(include_mla_only=True)
    assert [n for n in with_mla if n != "fp8_ds_mla"] == [*cache_dtype_names()]
    assert "fp8_ds_mla" in with_mla
    for bad in ("half", "int8", "FP8", "", None):
        with pytest.raises(ValueError) as err:
            lookup(bad, "cache_dtype", include_mla_only=False)  # type: ignore[arg-type]
        assert str(err.value) == (
            f"cache_dtype: unknown KV-cache dtype {bad!r}; expected one of {names}"
        )


def test_upstream_typing_and_tables_are_the_registry() -> None:
    """``CacheDType`` stays upstream's ``Literal``; it must list exactly the registry's names."""
    assert get_args(CacheDType) == CACHE_DTYPES == cache_dtype_names()
    assert {
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float": torch.float32,
        "fp8": torch.uint8,
        "fp8_e4m3": torch.uint8,
        "fp8_e5m2": torch.uint8,
        "nvfp4": torch.uint8,
        "nvfp4_mse": torch.uint8,
        "nvfp4_4over6": torch.uint8,
        "int8_per_token_head": torch.int8,  # as upstream's table
        "fp8_per_token_head": torch.uint8,
        "turboquant_k8v4": torch.uint8,
        "turboquant_4bit_nc": torch.uint8,
        "turboquant_k3v4_nc": torch.uint8,
        "turboquant_3bit_nc": torch.uint8,
        "int4_per_token_head": torch.uint8,
        "ultraquant_4bit": torch.uint8,
        "nvfp4_ds_mla": torch.uint8,
        "octave_k3v4": torch.uint8,
        "octave_k3v3": torch.uint8,
        "octave_k3v3_compact": torch.uint8,
    } == STR_DTYPE_TO_TORCH_DTYPE
    assert MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP == {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}
    assert kv_cache_dtype_str_to_dtype("half", None) == torch.float16  # upstream accepts it
    assert kv_cache_dtype_str_to_dtype("auto", "bfloat16") == torch.bfloat16
    assert find_dtype_name("half") is lookup("float16") and find_dtype_name("int8") is None
    assert not is_quantized_kv_cache("int8")  # a predicate: an unknown name is not quantized


def test_backend_lists_expand_aliases() -> None:
    assert accepted_names_of(lookup("fp8"), lookup("float32")) == [
        "fp8",
        "fp8_e4m3",
        "float32",
        "float",
    ]


def test_spec_format_property() -> None:
    common = dict(block_size=16, num_kv_heads=8, head_size=128)
    cases = [
        (torch.bfloat16, KVQuantMode.NONE, "bfloat16"),
        (torch.float32, KVQuantMode.NONE, "float32"),
        (torch.uint8, KVQuantMode.NONE, "auto"),  # an unquantized dtype no format names
        (torch.uint8, KVQuantMode.FP8_PER_TENSOR, "fp8_e4m3"),
        (torch.float8_e4m3fn, KVQuantMode.FP8_PER_TENSOR, "fp8_e4m3"),
        (torch.uint8, KVQuantMode.NVFP4, "nvfp4"),
        (torch.int8, KVQuantMode.INT8_PER_TOKEN_HEAD, "int8_per_token_head"),
        (torch.uint8, KVQuantMode.FP8_PER_TOKEN_HEAD, "fp8_per_token_head"),
    ]
    for dtype, mode, name in cases:
        spec = FullAttentionSpec(dtype=dtype, kv_quant_mode=mode, **common)  # type: ignore[arg-type]
        assert spec.kv_cache_format is lookup(name)
        assert format_for_storage(mode, dtype) is lookup(name)
    mla = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
    )
    assert mla.kv_cache_format is lookup("fp8_ds_mla") and mla.page_size_bytes == 64 * 584
    with pytest.raises(ValueError, match="dtype: no KV-cache format stores NVFP4 caches as"):
        format_for_storage(KVQuantMode.NVFP4, torch.float16)
    with pytest.raises(ValueError, match=r"dtype: expected a KV-cache storage dtype .*int32"):
        format_for_storage(KVQuantMode.NONE, torch.int32)  # no format stores int32


def test_quant_mode_formats_one_per_mode() -> None:
    """What plan's columns and bench's kinds show: the first selectable format of each quantized
    mode (fp8_e5m2 shares e4m3's pages; fp8_ds_mla is MLA-only)."""
    names = [f.name for f in registry.quant_mode_formats()]
    assert names == [
        "fp8_e4m3",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    ]
    assert len({f.quant_mode for f in registry.quant_mode_formats()}) == len(names)


def test_registration_rules() -> None:
    with pytest.raises(ValueError, match="accepted_names: must include the canonical name 'x'"):
        KVCacheFormat(
            name="x",
            accepted_names=("y",),
            storage_dtype=None,
            quant_mode=KVQuantMode.NONE,
            label="x",
        )
    clash = KVCacheFormat(
        name="fp8_alt",
        accepted_names=("fp8_alt", "fp8"),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.FP8_PER_TENSOR,
        label="fp8",
    )
    with pytest.raises(ValueError, match="'fp8_alt' reuses the registered KV-cache dtype name"):
        registry.register_format(clash)
    assert registry.find_format("fp8_alt") is None


def test_cpp_cache_kinds_are_the_registry_kinds() -> None:
    """One enum of format kinds: Python's ``CacheKind`` is the kernels' ``CacheKind``
    enumerator for enumerator (names and values), and every kind is some format's."""
    header = (REPO / "csrc" / "cache_kernels.h").read_text()
    enum = re.search(r"enum class CacheKind \{([^}]*)\}", header)
    assert enum is not None
    cpp_kinds = {
        name.strip(): int(value)
        for name, value in (item.split("=") for item in enum.group(1).split(","))
    }
    assert {kind.cpp_name: kind.value for kind in CacheKind} == cpp_kinds
    assert {f.cache_kind for f in registry.formats() if f.cache_kind is not None} == set(CacheKind)


def test_cpp_parser_accepts_exactly_the_registry_names() -> None:
    """The compiled op's own name table (``csrc/dispatch_utils.h``) lists the names the
    registry gives a kernel, in the same order, and accepts each of them."""
    ops = pytest.importorskip("vllm._custom_ops")
    kernel_names = [
        name
        for f in registry.formats()
        if f.cache_kind is not None and f.has_kernel
        for name in f.accepted_names
    ]
    key = torch.randn(2, 1, 16, dtype=torch.float32)
    slots = torch.tensor([0, 1])
    one = torch.ones((), dtype=torch.float32)
    with pytest.raises(RuntimeError) as err:
        torch.ops._C_cache_ops.reshape_and_cache_flash(
            key, key, key.new_zeros(1, 2, 1, 16), key.new_zeros(1, 2, 1, 16), slots, "nope",
            one, one, "linear", None,
        )  # fmt: skip
    assert f"expected one of {', '.join(kernel_names)}" in str(err.value)
    for name in kernel_names:
        fmt = lookup(name)
        source = key if fmt.is_quantized else key.to(fmt.resolve_storage_dtype(key.dtype))
        cache = torch.zeros(1, 2, 1, fmt.last_dim(16), dtype=fmt.resolve_storage_dtype(key.dtype))
        ops.reshape_and_cache_flash(source, source, cache, cache.clone(), slots, name, one, one)
        assert cache.any()
        assert kernel_cache_kind(name) == fmt.cache_kind


def test_scale_layout_names_are_the_codecs_layouts() -> None:
    from vllm.kv_quant.scale_layout import ScaleLayout

    named = {layout for fmt in registry.formats() for layout in fmt.scale_layouts}
    assert named == {layout.value for layout in ScaleLayout}


def test_few_modules_spell_the_dtype_list() -> None:
    """The list of quantized dtype names is written in at most three modules of ``vllm``: the
    registry, upstream's ``CacheDType`` literal, and one more; everything else asks the
    registry (a string literal naming two or more quantized formats counts as a spelling)."""
    import ast

    quantized = {n for f in registry.formats() if f.is_quantized for n in f.accepted_names}
    spelling = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in quantized
        }
        if len(named) >= 2:
            spelling.append(str(path.relative_to(REPO)))
    assert "vllm/kv_quant/formats.py" in spelling and "vllm/config/cache.py" in spelling
    assert len(spelling) <= 3, spelling
