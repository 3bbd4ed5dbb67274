"""The backend contract at upstream's paths and the registry beyond upstream's own test file
(tests/test_attention_backend_registry.py): one definition of the base classes under both
import paths, the feature flags of validate_configuration (our backends' answers, bad input),
and the registry's errors, overrides and their effect on the selector."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest
import torch

from vllm.v1.attention import backend as backend_module
from vllm.v1.attention.backend import (
    FEATURE_HOOKS,
    AttentionBackend,
    AttentionImpl,
    AttentionType,
)
from vllm.v1.attention.backends import (
    CPUAttentionBackend,
    FlashInferBackend,
    MLACommonBackend,
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    TritonAttentionBackend,
    abstract,
    registry,
)
from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    get_attn_backend,
    register_backend,
)
from vllm.v1.attention.selector import AttentionSelectorConfig

ROOT = Path(__file__).resolve().parents[3]
H100 = (9, 0)


class DcpImpl(ReferenceAttentionImpl):
    supports_dcp = True


class DcpBackend(ReferenceAttentionBackend):
    """REFERENCE whose impl opts into decode context parallelism."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return DcpImpl


class NotABackend:
    pass


@pytest.fixture(autouse=True)
def restore_registry() -> Iterator[None]:
    """Undo what a test registered: added members and overrides."""
    saved = {
        enum_cls: (
            dict(enum_cls._member_map_),
            list(enum_cls._member_names_),
            dict(enum_cls._value2member_map_),
        )
        for enum_cls in (AttentionBackendEnum, MambaAttentionBackendEnum)
    }
    overrides = dict(registry._OVERRIDES)
    yield
    for enum_cls, (members, names, values) in saved.items():
        for name in set(enum_cls._member_map_) - set(members):
            enum_cls._member_map_.pop(name)
            delattr(enum_cls, name)
        enum_cls._member_names_[:] = names
        enum_cls._value2member_map_.clear()
        enum_cls._value2member_map_.update(values)
    registry._OVERRIDES.clear()
    registry._OVERRIDES.update(overrides)


# ------------------------------------------------------------------------------ one definition


def test_one_definition_under_both_paths() -> None:
    for name in ("AttentionBackend", "AttentionImpl", "AttentionLayer", "MultipleOf"):
        assert getattr(abstract, name) is getattr(backend_module, name)
    assert issubclass(ReferenceAttentionBackend, AttentionBackend)


@pytest.mark.parametrize("first", ["backend", "selector", "backends", "backends.registry"])
def test_any_module_imports_first(first: str) -> None:
    """The backends package's __init__ imports backend.py (through abstract.py): whichever is
    imported first, none meets a half-initialised module."""
    code = (
        f"import vllm.v1.attention.{first}\n"
        "from vllm.v1.attention.backend import AttentionBackend\n"
        "from vllm.v1.attention.backends.abstract import AttentionBackend as Old\n"
        "from vllm.v1.attention.backends import ReferenceAttentionBackend as R\n"
        "assert Old is AttentionBackend and issubclass(R, AttentionBackend)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_attention_type_is_a_str() -> None:
    assert AttentionType.DECODER == "decoder" and isinstance(AttentionType.ENCODER_ONLY, str)
    assert {t.value for t in AttentionType} == {
        "decoder",
        "encoder",
        "encoder_only",
        "encoder_decoder",
    }


# ------------------------------------------------------------------------------ feature flags


def _config(**features: bool | str) -> dict[str, object]:
    config = AttentionSelectorConfig(64, torch.float16, "auto", 16, **features)  # type: ignore[arg-type]
    return config._asdict()


def test_selector_config_fields_are_the_validate_arguments() -> None:
    fields = set(AttentionSelectorConfig._fields)
    assert fields - {"head_size", "dtype", "kv_cache_dtype", "block_size"} == {
        *FEATURE_HOOKS,
        "use_mla",
        "use_sparse",
        "attn_type",
    }
    for backend_cls in (ReferenceAttentionBackend, FlashInferBackend):
        assert backend_cls.validate_configuration(device_capability=H100, **_config()) == []


@pytest.mark.parametrize("backend_cls", [ReferenceAttentionBackend, TritonAttentionBackend])
def test_the_readers_serve_sinks_windows_non_causal_and_per_head_scales(
    backend_cls: type[AttentionBackend],
) -> None:
    served = _config(
        has_sink=True,
        has_sliding_window=True,
        use_non_causal=True,
        use_per_head_quant_scales=True,
        use_kv_connector=True,
        use_adaptive_verification=True,
    )
    assert backend_cls.validate_configuration(device_capability=H100, **served) == []
    assert CPUAttentionBackend.supports_sink() and CPUAttentionBackend.supports_sliding_window()


def test_upstream_defaults_for_a_backend_that_claims_nothing() -> None:
    asked = _config(
        has_sink=True,
        use_rswa=True,
        use_mm_prefix=True,
        use_batch_invariant=True,
        use_pcp=True,
        use_dcp=True,
        use_sparse=True,
        attn_type=AttentionType.ENCODER_ONLY,
    )
    assert FlashInferBackend.validate_configuration(device_capability=H100, **asked) == [
        "attention sinks not supported",
        "partial multimodal token full attention not supported",
        "batch invariance not supported",
        "PCP not supported",
        "DCP not supported",
        "R-SWA not supported",
        "sparse not supported",
        "attention type encoder_only not supported",
    ]


def test_dcp_and_pcp_are_the_impls_opt_in() -> None:
    assert FlashInferBackend.get_impl_cls() is None and MLACommonBackend.get_impl_cls() is None
    assert not FlashInferBackend.supports_dcp() and not ReferenceAttentionBackend.supports_dcp()
    assert DcpBackend.supports_dcp() and not DcpBackend.supports_pcp()
    assert (
        DcpBackend.validate_configuration(64, torch.float16, "auto", 16, None, use_dcp=True) == []
    )


def test_subclass_overrides_pass_the_flags_on() -> None:
    """CPU_ATTN and TRITON_ATTN add their own reasons to the base's, flags included."""
    reasons = TritonAttentionBackend.validate_configuration(
        64, torch.float16, "auto", 16, (7, 5), use_dcp=True
    )
    assert reasons == ["TRITON_ATTN does not run on sm_75", "DCP not supported"]
    reasons = CPUAttentionBackend.validate_configuration(
        64, torch.float16, "auto", 16, None, use_pcp=True
    )
    assert "PCP not supported" in reasons


def test_bad_feature_flags_are_refused() -> None:
    args = (64, torch.float16, "auto", 16, None)
    with pytest.raises(ValueError, match=r"features: expected keywords among has_sink, .*got 'x'"):
        ReferenceAttentionBackend.validate_configuration(*args, x=True)
    with pytest.raises(ValueError, match=r"has_sink: expected a bool, got 'yes'"):
        ReferenceAttentionBackend.validate_configuration(*args, has_sink="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"use_sparse: expected a bool, got 1"):
        ReferenceAttentionBackend.validate_configuration(*args, use_sparse=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"attn_type: expected an AttentionType \(a str\), got 3"):
        ReferenceAttentionBackend.validate_configuration(*args, attn_type=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ registry


def test_unknown_names_list_the_members() -> None:
    for lookup in (
        lambda: AttentionBackendEnum["NOPE"],
        lambda: AttentionBackendEnum.parse("nope"),
    ):
        with pytest.raises(ValueError, match=r"unknown attention backend '(NOPE|nope)'.*CUSTOM"):
            lookup()
    with pytest.raises(
        ValueError,
        match=r"backend: expected a backend name or a member of AttentionBackendEnum, got 3",
    ):
        AttentionBackendEnum.parse(3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"unknown attention backend 'NOPE'; expected one of CUSTOM"
    ):
        MambaAttentionBackendEnum["NOPE"]


def test_custom_needs_registering_and_keeps_its_own_identity() -> None:
    with pytest.raises(ValueError, match=r"AttentionBackendEnum.CUSTOM: no backend class regis"):
        AttentionBackendEnum.CUSTOM.get_class()
    AttentionBackendEnum.register("UNSET")  # no default path: a second None-valued member
    assert AttentionBackendEnum(None) is AttentionBackendEnum.CUSTOM
    assert MambaAttentionBackendEnum.CUSTOM is not AttentionBackendEnum.CUSTOM
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.DcpBackend")
    assert not MambaAttentionBackendEnum.CUSTOM.is_overridden()
    assert AttentionBackendEnum.CUSTOM.get_path(include_classname=False) == __name__


def test_override_and_clear() -> None:
    member = AttentionBackendEnum.REFERENCE
    register_backend(member, f"{__name__}.DcpBackend")
    assert member.get_class() is DcpBackend
    assert get_attn_backend(64, torch.float16, "auto", 16, None, backend="reference") is DcpBackend
    member.clear_override()
    member.clear_override()  # nothing to clear: no error
    assert not member.is_overridden() and member.get_class() is ReferenceAttentionBackend


def test_an_overridden_flashinfer_is_chosen_without_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "flashinfer_missing", lambda: True)
    assert get_attn_backend(64, torch.float16, "auto", 16, H100) is TritonAttentionBackend
    register_backend(AttentionBackendEnum.FLASHINFER, f"{__name__}.DcpBackend")
    assert get_attn_backend(64, torch.float16, "auto", 16, H100) is DcpBackend


def test_a_registered_name_is_selectable() -> None:
    register_backend("my_backend", f"{__name__}.DcpBackend")
    assert AttentionBackendEnum.parse("my_backend") is AttentionBackendEnum["my_backend"]
    assert get_attn_backend(64, torch.float16, "auto", 16, None, backend="my_backend") is DcpBackend


def test_bad_registrations_are_refused() -> None:
    with pytest.raises(ValueError, match=r"name: Invalid or reserved backend name; .* got '1x'"):
        AttentionBackendEnum.register("1x", "a.B")
    with pytest.raises(ValueError, match=r"value: expected a class path 'package.module.Class', "):
        AttentionBackendEnum.register("NO_DOT", "NoDot")
    with pytest.raises(ValueError, match=r"class_path: expected a class path .*got 3"):
        register_backend(AttentionBackendEnum.CUSTOM, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"backend: expected a MambaAttentionBackendEnum member"):
        register_backend(AttentionBackendEnum.CUSTOM, "a.B", is_mamba=True)

    class Local(AttentionBackend):
        pass

    with pytest.raises(ValueError, match=r"cls: expected a module-level class .*<locals>"):
        register_backend(AttentionBackendEnum.CUSTOM)(Local)
    with pytest.raises(ValueError, match=r"cls: expected a module-level class .*got 3"):
        register_backend(AttentionBackendEnum.CUSTOM)(3)  # type: ignore[type-var]
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_paths_that_do_not_resolve_to_a_backend() -> None:
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.Missing")
    with pytest.raises(ImportError, match=r"CUSTOM: \S+ has no Missing"):
        AttentionBackendEnum.CUSTOM.get_class()
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.NotABackend")
    with pytest.raises(ValueError, match=r"expected .*NotABackend' to be an AttentionBackend sub"):
        AttentionBackendEnum.CUSTOM.get_class()


def test_registry_enums_are_enums() -> None:
    assert issubclass(AttentionBackendEnum, Enum) and issubclass(MambaAttentionBackendEnum, Enum)
    assert [m.name for m in MambaAttentionBackendEnum] == ["CUSTOM"]


def test_flashinfer_lists_upstreams_cache_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """v0.33's list: the NVFP4 page of ``nvfp4_4over6`` is an NVFP4 page, read by trtllm-gen on
    sm_10x only, as ``nvfp4``."""
    assert FlashInferBackend.supported_kv_cache_dtypes == [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "nvfp4",
        "nvfp4_4over6",
    ]
    assert FlashInferBackend.is_kvcache_nvfp4("nvfp4_4over6")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")  # FlashInfer's layout on sm_10x
    asked = {**_config(), "kv_cache_dtype": "nvfp4_4over6"}
    for capability, ok in (((10, 0), True), ((9, 0), False)):
        reasons = FlashInferBackend.validate_configuration(device_capability=capability, **asked)
        assert (reasons == []) == ok, reasons
