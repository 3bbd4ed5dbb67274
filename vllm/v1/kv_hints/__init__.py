"""Request-scoped KV hints (upstream v0.33's ``vllm.v1.kv_hints``); needs ``msgspec``."""

from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope

__all__ = ["KvHintAction", "KvHintsEnvelope"]
