"""File names for offloaded blocks (upstream v0.22's ``kv_offload.file_mapper``).

Every setting that decides a block's bytes (model, hash block size, GPU blocks per file,
parallel sizes, cache dtype, KV-cache groups, engine, and from an offloading spec the page
format's fingerprint: every layer's encoding, NHD / HND, block size, head geometry, scale
layouts, :class:`~vllm.v1.kv_offload.page_format.KVPageFormat`) goes into one folder name: the
model name with ``/`` as ``_``, then the first 12 hex digits of the SHA-256 of those settings as
compact sorted-key JSON. Runs that would write different bytes therefore never share files, while
workers of one run share the folder and its ``config.json``. A block's file is::

    <folder>_r<rank>/<hex[0:3]>/<hex[3:5]>_g<group>/<hex>.bin

with ``hex`` the block hash in hex; the two fan-out levels keep directories small.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingSpec,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.page_format import KVPageFormat

_DIGEST_HEX_CHARS = 12
_CONFIG_FILENAME = "config.json"


class FileMapper:
    """Maps an :data:`OffloadKey` to the path of the file that holds its block.

    With ``parallel_agnostic`` the parallel sizes count as 1 and the rank as 0, so runs with
    any parallel layout share one folder (for data that does not depend on it).
    """

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        hash_block_size: int,
        gpu_blocks_per_file: int,
        tp_size: int,
        pp_size: int,
        pcp_size: int,
        dcp_size: int,
        rank: int,
        dtype: str,
        kv_cache_groups: list[dict] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        page_format: str | None = None,
    ):
        if parallel_agnostic:
            tp_size, pp_size, pcp_size, dcp_size, rank = 1, 1, 1, 1, 0
        self.rank: int = rank
        self.fields: dict[str, Any] = {
            "model_name": model_name,
            "hash_block_size": hash_block_size,
            "gpu_blocks_per_file": gpu_blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": list(kv_cache_groups or []),
            "inference_engine": inference_engine,
        }
        if page_format is not None:
            self.fields["page_format"] = page_format
        text = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        self.fingerprint: bytes = hashlib.sha256(text.encode()).digest()
        """SHA-256 of the settings: the folder name's digest, and in every block file's header."""
        digits = self.fingerprint.hex()[:_DIGEST_HEX_CHARS]
        self.base_path: str = f"{root_dir}/{model_name.replace('/', '_')}_{digits}"

    @classmethod
    def from_offloading_spec(
        cls,
        root_dir: str,
        offloading_spec: OffloadingSpec,
        gpu_blocks_per_file: int = 1,
        parallel_agnostic: bool = False,
    ) -> FileMapper:
        """The mapper for the run ``offloading_spec`` was built for (its page format's
        fingerprint in the folder name)."""
        config = offloading_spec.vllm_config
        parallel = config.parallel_config
        groups = [
            {"block_size": g.kv_cache_spec.block_size, "layer_names": list(g.layer_names)}
            for g in offloading_spec.kv_cache_config.kv_cache_groups
        ]
        return cls(
            root_dir=root_dir,
            model_name=config.model_config.model,
            hash_block_size=config.cache_config.block_size,
            gpu_blocks_per_file=gpu_blocks_per_file,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=parallel.prefill_context_parallel_size,
            dcp_size=parallel.decode_context_parallel_size,
            rank=parallel.rank,
            dtype=str(config.cache_config.cache_dtype).removeprefix("torch."),
            kv_cache_groups=groups,
            parallel_agnostic=parallel_agnostic,
            page_format=KVPageFormat.from_kv_cache_config(
                offloading_spec.kv_cache_config,
                model=config.model_config.model,
                kv_cache_dtype=str(config.cache_config.cache_dtype),
                block_size_factor=gpu_blocks_per_file,
            ).fingerprint,
        )

    def get_file_name(self, key: OffloadKey) -> str:
        """The path of ``key``'s file (see the module docstring)."""
        digits = get_offload_block_hash(key).hex()
        group = get_offload_group_idx(key)
        return f"{self.base_path}_r{self.rank}/{digits[:3]}/{digits[3:5]}_g{group}/{digits}.bin"

    def get_run_config(self) -> dict:
        """A copy of the settings the folder name is derived from (``config.json``'s content)."""
        return dict(self.fields)

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{_CONFIG_FILENAME}"
