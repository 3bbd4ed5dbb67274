"""The scheduler side of the HiSparse KV connector (upstream's
``vllm.distributed.kv_transfer.kv_connector.v1.hisparse``): it carries the HiSparse
coordinator's per-step work to the workers and their reports back. The worker side (device
transfers) is not part of this package."""
