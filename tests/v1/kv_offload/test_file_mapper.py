"""FileMapper: one folder per set of byte-deciding settings, one file per (block hash, group)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from tiering_test_utils import StubSpec

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.v1.attention.backends.utils import kv_cache_layout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.page_format import KVPageFormat


def mapper(root: str = "/r", **kw: object) -> FileMapper:
    args: dict = dict(
        model_name="org/model",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        dtype="bfloat16",
    )
    args.update(kw)
    return FileMapper(root, **args)


def test_path_layout_and_folder_digest() -> None:
    m = mapper(rank=5)
    fields = m.get_run_config()
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert m.fingerprint == hashlib.sha256(text.encode()).digest()  # in block file headers
    assert m.base_path == f"/r/org_model_{m.fingerprint.hex()[:12]}"
    assert m.get_config_file_path() == f"{m.base_path}/config.json"
    key = make_offload_key(bytes.fromhex("abcdef0123456789"), 7)
    assert m.get_file_name(key) == f"{m.base_path}_r5/abc/de_g7/abcdef0123456789.bin"
    # the run config is a copy
    fields["tp_size"] = 99
    assert m.get_run_config()["tp_size"] == 1


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "fp8"},
        {"tp_size": 2},
        {"tokens_per_hash": 32},
        {"blocks_per_file": 4},
        {"kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["a"]}]},
        {"replicated_layout": True},
        {"canonical_format": "v1-nhd"},
        {"inference_engine": "other"},
        {"model_name": "org/other"},
    ],
)
def test_every_byte_deciding_setting_changes_the_folder(change: dict) -> None:
    assert mapper(**change).base_path != mapper().base_path


def test_rank_is_outside_the_folder_digest_and_parallel_agnostic_collapses() -> None:
    assert mapper(rank=0).base_path == mapper(rank=3).base_path
    a = mapper(tp_size=4, pp_size=2, dcp_size=2, rank=6, parallel_agnostic=True)
    assert a.base_path == mapper(parallel_agnostic=True).base_path and a.rank == 0
    # v0.33: parallel-agnostic bytes live apart from layout-specific ones.
    assert a.base_path != mapper().base_path
    assert "parallel_agnostic" not in a.fields and mapper().fields["parallel_agnostic"] is False


def test_v022_argument_names_are_aliases() -> None:
    old = FileMapper("/r", "org/model", hash_block_size=16, gpu_blocks_per_file=1)
    assert old.base_path == FileMapper("/r", "org/model", 16, 1).base_path
    with pytest.raises(TypeError, match="tokens_per_hash: expected it once"):
        FileMapper("/r", "org/model", 16, 1, hash_block_size=16)
    with pytest.raises(TypeError, match="blocks_per_file: expected an int, got None"):
        FileMapper("/r", "org/model", 16)


def test_from_offloading_spec_reads_the_engine_config() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(size=4 * spec.page_size_bytes, shared_by=["l0", "l1"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(model="org/m"),
        cache_config=CacheConfig(block_size=16, cache_dtype="fp8_e4m3"),
        parallel_config=ParallelConfig(tensor_parallel_size=2, rank=1),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
    )
    m = FileMapper.from_offloading_spec("/x", StubSpec(vllm_config, kv_cache_config), 2)
    assert m.rank == 1
    page_format = KVPageFormat.from_kv_cache_config(
        kv_cache_config, model="org/m", kv_cache_dtype="fp8_e4m3", block_size_factor=2
    )
    assert m.get_run_config() == {
        "model_name": "org/m",
        "tokens_per_hash": 16,
        "blocks_per_file": 2,
        "tp_size": 2,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "fp8_e4m3",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}],
        "inference_engine": "vllm",
        "parallel_agnostic": False,
        "page_format": page_format.fingerprint,
    }
    assert m.base_path.startswith("/x/org_m_")


def test_the_folder_differs_whenever_the_pages_would() -> None:
    """Two runs share files only when their pages hold the same bytes: the layers' encodings
    (key options of one page size), NHD vs HND, head geometry and block size all change the
    folder, which a run of the same settings finds again."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model="org/m"),
        cache_config=CacheConfig(block_size=16, cache_dtype="fp8_e4m3"),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
    )

    def folder(encoding: str = "fp8", heads: int = 2, block: int = 16, layout: str = "NHD") -> str:
        enc = KVCacheEncoding.parse(encoding)
        spec = FullAttentionSpec(
            block_size=block, num_kv_heads=heads, head_size=64, dtype=torch.uint8,
            kv_quant_mode=enc.format.quant_mode, encoding=enc,
        )  # fmt: skip
        config = KVCacheConfig(
            num_blocks=4,
            kv_cache_tensors=[KVCacheTensor(size=4 * spec.page_size_bytes, shared_by=["l0"])],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        with kv_cache_layout(layout):
            return FileMapper.from_offloading_spec("/x", StubSpec(vllm_config, config)).base_path

    base = folder()
    assert folder() == base
    others = [
        folder("fp8+hadamard"),  # same page size, other bytes
        folder("fp8+offset"),
        folder("fp8+sink"),
        folder("fp8_e5m2"),
        folder(layout="HND"),
        folder(heads=4),
        folder(block=32),
    ]
    assert base not in others and len(set(others)) == len(others)


def test_parallel_config_rank_is_non_negative() -> None:
    assert ParallelConfig().rank == 0
    with pytest.raises(ValueError, match="rank: expected a non-negative int"):
        ParallelConfig(rank=-1)
