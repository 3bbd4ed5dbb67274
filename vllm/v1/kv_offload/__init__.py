"""KV-cache offloading: moving whole KV-cache pages between GPU memory and other media.

- :mod:`vllm.v1.kv_offload.spec`: :class:`OffloadingSpec`, block-size alignment and handlers.
- :mod:`vllm.v1.kv_offload.cpu`: :class:`CPUOffloadingSpec`, a CPU-memory offload target.
- :mod:`vllm.v1.kv_offload.mooncake`: :class:`MooncakeOffloadingSpec`, a Mooncake distributed
  store shared by engine instances (optional ``mooncake`` extra).
- :mod:`vllm.v1.kv_offload.page_format`: :class:`KVPageFormat`, what decides an offloaded
  block's bytes, its fingerprint and the header stored beside it.
- :mod:`vllm.v1.kv_offload.worker`: transfer handlers (:class:`OffloadingHandler`) and the
  page views they copy.
"""
