"""OffloadingSpecFactory: specs by registered name or by module path, imported lazily."""

from __future__ import annotations

import sys

import pytest
import torch
from tiering_test_utils import StubSpec

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class NotASpec:
    pass


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(size=4 * spec.page_size_bytes, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


def create(extra: dict) -> OffloadingSpec:
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    )
    return OffloadingSpecFactory.create_spec(config, kv_cache_config())


def test_default_is_the_cpu_spec() -> None:
    spec = create({"num_cpu_blocks": 8})
    assert type(spec) is CPUOffloadingSpec
    assert spec.extra_config["num_cpu_blocks"] == 8


def test_registered_tiering_spec() -> None:
    spec = create({"spec_name": "TieringOffloadingSpec", "num_cpu_blocks": 2})
    assert type(spec) is TieringOffloadingSpec


def test_the_mooncake_store_is_a_tier_not_a_spec() -> None:
    with pytest.raises(ValueError, match="Unsupported spec type: MooncakeOffloadingSpec"):
        create({"spec_name": "MooncakeOffloadingSpec"})


def test_spec_from_a_module_path() -> None:
    spec = create({"spec_name": "StubSpec", "spec_module_path": "tiering_test_utils"})
    assert type(spec) is StubSpec
    with pytest.raises(TypeError, match="expected an OffloadingSpec subclass"):
        create({"spec_name": "NotASpec", "spec_module_path": __name__})


def test_unknown_name_and_missing_transfer_config() -> None:
    with pytest.raises(ValueError, match="Unsupported spec type: Nope"):
        create({"spec_name": "Nope"})
    with pytest.raises(ValueError, match="kv_transfer_config"):
        OffloadingSpecFactory.create_spec(VllmConfig(), kv_cache_config())


def test_registration_is_lazy_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OffloadingSpecFactory, "_registry", dict(OffloadingSpecFactory._registry))
    module = "tests_factory_not_imported_yet"
    OffloadingSpecFactory.register_spec("Lazy", module, "StubSpec")
    assert module not in sys.modules
    with pytest.raises(ValueError, match="'Lazy' is already registered"):
        OffloadingSpecFactory.register_spec("Lazy", module, "StubSpec")
    with pytest.raises(ValueError, match="'CPUOffloadingSpec' is already registered"):
        OffloadingSpecFactory.register_spec("CPUOffloadingSpec", module, "X")
