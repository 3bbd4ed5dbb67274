"""KV pages across engine instances through Mooncake.

- :mod:`.config`: :class:`~.config.MooncakeConfig`, connection settings from a config mapping
  and upstream-named environment variables.
- :mod:`.store`: :class:`~.store.MooncakeStoreClient`, a checked wrapper of
  ``mooncake.store.MooncakeDistributedStore`` (the Mooncake tier of
  :mod:`vllm.v1.kv_offload.tiering.mooncake` uses it).
- :mod:`.p2p`: :class:`~.p2p.MooncakeP2PConnectorWorker`, prefill → decode page transfer with
  ``mooncake.engine.TransferEngine``.
"""
