"""File names for offloaded chunks (upstream v0.33's ``kv_offload.file_mapper``).

Every setting that decides a chunk's bytes (model, tokens per hash, GPU blocks per file,
parallel sizes, cache dtype, KV-cache groups, engine, the parallel-agnostic / replicated /
canonical layouts, and, when the spec knows its KV cache, ours: the page format's fingerprint:
every layer's encoding, NHD / HND, block size, head geometry, scale layouts,
:class:`~vllm.v1.kv_offload.page_format.KVPageFormat`) goes into one folder name: the model
name with ``/`` as ``_``, then the first 12 hex digits of the SHA-256 of those settings as
compact sorted-key JSON. Runs that would write different bytes therefore never share files,
while workers of one run share the folder and its ``config.json``. A chunk's file is::

    <folder>_r<rank>/<hex[0:3]>/<hex[3:5]>_g<group>/<hex>.bin

with ``hex`` the block hash in hex; the two fan-out levels keep directories small.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_offload.base import (
    OffloadingSpec,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.page_format import KVPageFormat

_DIGEST_HEX_CHARS = 12
_CONFIG_FILENAME = "config.json"
CANONICAL_FORMAT_VERSION = 1
"""Version of the canonical (parallelism-free) page byte format, part of its identity."""
_LAYOUT_FAMILIES = {"LBNHC": "nhd", "LBHNC": "hnd"}
"""Cache layout names whose family keeps its historical NHD / HND spelling."""


def canonical_format_id(kv_cache_layout: str) -> str:
    """The identity of the canonical byte format of pages in ``kv_cache_layout``: the format
    version and the layout family, e.g. ``"v1-nhd"``."""
    if not isinstance(kv_cache_layout, str) or not kv_cache_layout:
        raise ValueError(f"kv_cache_layout: expected a layout name, got {kv_cache_layout!r}")
    family = _LAYOUT_FAMILIES.get(kv_cache_layout, kv_cache_layout.lower())
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


class FileMapper:
    """Maps an :data:`OffloadKey` to the path of the file that holds its chunk.

    With ``parallel_agnostic`` the parallel sizes count as 1 and the rank as 0, so runs with
    any parallel layout share one folder (for bytes that do not depend on it); otherwise the
    settings record ``"parallel_agnostic": False``. ``replicated_layout`` (one copy for every
    worker) and ``canonical_format`` (:func:`canonical_format_id`) are recorded only when set,
    so other folders keep their names. ``hash_block_size`` / ``gpu_blocks_per_file`` are
    v0.22's names of ``tokens_per_hash`` / ``blocks_per_file``.
    """

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        tokens_per_hash: int | None = None,
        blocks_per_file: int | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        dtype: str = "auto",
        kv_cache_groups: list[dict] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: str | None = None,
        page_format: str | None = None,
        *,
        hash_block_size: int | None = None,
        gpu_blocks_per_file: int | None = None,
    ):
        tokens_per_hash = _one_of("tokens_per_hash", tokens_per_hash, hash_block_size)
        blocks_per_file = _one_of("blocks_per_file", blocks_per_file, gpu_blocks_per_file)
        if parallel_agnostic:
            tp_size, pp_size, pcp_size, dcp_size, rank = 1, 1, 1, 1, 0
        self.rank: int = rank
        self.fields: dict[str, Any] = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": list(kv_cache_groups or []),
            "inference_engine": inference_engine,
        }
        if not parallel_agnostic:
            self.fields["parallel_agnostic"] = False
        if replicated_layout:
            self.fields["replicated_layout"] = True
        if canonical_format is not None:
            self.fields["canonical_format"] = canonical_format
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
        blocks_per_file: int | None = None,
        parallel_agnostic: bool = False,
        *,
        gpu_blocks_per_file: int | None = None,
    ) -> FileMapper:
        """The mapper for the run ``offloading_spec`` was built for.

        ``parallel_agnostic`` is an opt-in, honoured only when the spec's config says the bytes
        allow it (``is_parallelism_agnostic`` or ``replicated_layout``). A spec built from
        the engine's ``KVCacheConfig`` also puts its page format's fingerprint in the folder.
        """
        blocks = _one_of("blocks_per_file", blocks_per_file, gpu_blocks_per_file, default=1)
        config = offloading_spec.config
        parallel = config.parallel
        canonical_format = None
        if config.canonical_layout:
            if config.kv_cache_layout is None:
                raise ValueError(
                    "kv_cache_layout: expected a layout name with canonical_layout, got None"
                )
            canonical_format = canonical_format_id(config.kv_cache_layout)
        # Set by specs built the v0.22 way only (a class attribute would hide the absence);
        # anything else there (a test double's auto-attribute) names no page format.
        kv_cache_config = getattr(offloading_spec, "kv_cache_config", None)
        page_format = None
        if isinstance(kv_cache_config, (KVCacheConfig, KVCacheSpec)):
            page_format = KVPageFormat.from_kv_cache_config(
                kv_cache_config,
                model=config.model.name,
                kv_cache_dtype=config.model.dtype,
                block_size_factor=blocks,
            ).fingerprint
        return cls(
            root_dir=root_dir,
            model_name=config.model.name,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_file=blocks,
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            rank=parallel.rank,
            dtype=config.model.dtype,
            kv_cache_groups=[
                {"tokens_per_block": group.tokens_per_block, "layer_names": list(group.layer_names)}
                for group in config.groups
            ],
            parallel_agnostic=parallel_agnostic
            and (parallel.is_parallelism_agnostic or config.replicated_layout),
            replicated_layout=parallel_agnostic and config.replicated_layout,
            canonical_format=canonical_format,
            page_format=page_format,
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


def _one_of(
    name: str, value: int | None, v022_value: int | None, default: int | None = None
) -> int:
    """``value``, or its v0.22-named twin; exactly one may be given (else ``default``)."""
    if value is not None and v022_value is not None:
        raise TypeError(f"{name}: expected it once (or its v0.22 name), got both")
    chosen = value if value is not None else v022_value
    if chosen is None:
        if default is None:
            raise TypeError(f"{name}: expected an int, got None")
        chosen = default
    return chosen
