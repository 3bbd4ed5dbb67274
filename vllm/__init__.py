"""vllm-kvcache: the KV-cache subsystem of a vLLM-style inference engine."""

__version__ = "0.1.0"
