"""KV-cache offloading: moving whole KV-cache pages between GPU memory and other media.

- :mod:`vllm.v1.kv_offload.base`: keys, load/store specs, the manager, worker and handler
  interfaces, :class:`~vllm.v1.kv_offload.base.CanonicalKVCaches` and
  :class:`~vllm.v1.kv_offload.base.OffloadingSpec` (upstream v0.33's names).
- :mod:`vllm.v1.kv_offload.config`: :class:`OffloadingConfig`, what a spec is built from;
  :mod:`vllm.v1.kv_offload.engine_config` derives it from an engine's configs (v0.22 way).
- :mod:`vllm.v1.kv_offload.metrics`: stats payloads and metric / config-info records.
- :mod:`vllm.v1.kv_offload.cpu`: offloading to CPU memory (spec, manager and eviction
  policies with their factory, CPU <-> GPU worker, shared region, host registration).
- :mod:`vllm.v1.kv_offload.factory`: specs by name (``extra_config["spec_name"]``).
- :mod:`vllm.v1.kv_offload.file_mapper`: :class:`FileMapper`, file names of offloaded blocks.
- :mod:`vllm.v1.kv_offload.tiering`: a CPU primary tier plus secondary tiers (the file system,
  a Mooncake distributed store shared by engine instances, an in-memory example), the tiering
  manager, the tier factory and ``TieringOffloadingSpec``.
- :mod:`vllm.v1.kv_offload.page_format`: :class:`KVPageFormat`, what decides an offloaded
  block's bytes, its fingerprint and the header stored beside it.
- :mod:`vllm.v1.kv_offload.worker`: the handler interface and worker, and the page views.
"""
