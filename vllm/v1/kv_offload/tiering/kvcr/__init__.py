"""The KVCR secondary tier (upstream v0.33's ``kv_offload.tiering.kvcr``); needs the ``kvcr``
package."""
